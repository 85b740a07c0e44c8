"""Gradient accumulation and frozen parameters as torch FSDP2's suite exercises them, run by FSDP2
and by mfsdp2 on the same float64 model and data in the same process.

Accumulation: gradient sync turned off for micro-batches on every unit, on the root only
(``recurse=False``) or on some units, with and without resharding after backward, and
``zero_grad(set_to_none=False)`` on alternate steps (accumulating onto reduced gradients). The
all-gathers and reduce-scatters issued per step are FSDP2's contract here and must equal its
counts; accumulated gradients and stepped weights must equal its values.

Frozen parameters: bias-only training (BitFit) frozen before ``fully_shard`` and after it, with
``reshard_after_forward`` True / False / 1 and non-reentrant activation checkpointing; frozen and
trainable units interleaved with a ``no_grad`` step between training steps; a frozen layer and a
trainable one each called several times in one forward, once under ``no_grad``.

Tolerance: REL_F64, see test_training_variants.py (same argument: float64, reduction order only).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from mfsdp2.comm.communicator import comm_stats

from . import assert_same_snapshots, mean_loss, runtimes, snapshot
from .._dist import run_ranks
from ..models import REL_F64
from .test_comm_counts import _counting
from .test_training_variants import MLP, D, _seq, _x

WS, MICRO = 2, 3


def _accum_model(shard, mesh, raf):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), MLP(), MLP(), MLP()).double()
    for m in model[1:]:
        shard(m, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)  # the root owns the first Linear
    return model


def accumulation(shard, mesh, rank, lib, mode, raf, rab):
    model = _accum_model(shard, mesh, raf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def flags(last):
        targets = {"all": [(model, True)], "root_only": [(model, False)],
                   "some": [(m, False) for m in model[1:3]]}[mode]
        for m, recurse in targets:
            m.set_requires_gradient_sync(last, recurse=recurse)
            if not rab:
                m.set_reshard_after_backward(last, recurse=recurse)

    out = {"losses": [], "counts": [], "grads": []}
    for step in range(2):
        comm_stats.reset()
        with _counting() as c:
            for i in range(MICRO):
                flags(i == MICRO - 1)
                loss = model(_x(10 * step + i, rank)).pow(2).sum()
                loss.backward()
                out["losses"].append(mean_loss(loss))
        if lib == "fsdp2":
            out["counts"].append((c[_counting.NAMES[0]], c[_counting.NAMES[1]]))
        else:
            # Small units on gloo reduce in a shared all-reduce bucket: one reduction each still.
            out["counts"].append((comm_stats.all_gather_calls,
                                  comm_stats.reduce_scatter_calls + comm_stats.reduce_scatters_in_buckets))
        out["grads"].append(snapshot(model))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 1)  # step 0 keeps zeroed gradients to accumulate onto
    out["final"] = snapshot(model)
    return out


ACCUM = [
    (mode, raf, rab)
    for mode in ("all", "root_only", "some")
    for raf in (True, False)
    for rab in (True, False)
    if rab or (raf is False and mode != "some")  # FSDP2's suite skips the others as uncommon
]


def _bitfit(shard, mesh, raf, freeze_after, ac):
    torch.manual_seed(0)
    model = _seq()

    def freeze(m):
        for name, p in m.named_parameters():
            if "bias" not in name:
                p.requires_grad_(False)

    if not freeze_after:
        freeze(model)
    if ac:
        for i, block in enumerate(model):
            model[i] = _Checkpointed(block)
    for block in model:
        shard(block, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    if freeze_after:
        freeze(model)
    return model


class _Checkpointed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def _train(model, rank, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=step % 2 == 0)
        loss = model(_x(step, rank)).pow(2).sum()
        loss.backward()
        losses.append(mean_loss(loss))
        grads = snapshot(model)
        opt.step()
    return {"losses": losses, "grads": grads, "final": snapshot(model)}


def bias_only(shard, mesh, rank, raf, freeze_after, ac):
    return _train(_bitfit(shard, mesh, raf, freeze_after, ac), rank)


def frozen_across_units(shard, mesh, rank, raf):
    """Linear units alternately frozen (before ``fully_shard``); step 1 runs under ``no_grad``."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(D, D), nn.ReLU())]).double()
    for i in range(0, 12, 4):
        model[i].requires_grad_(False)
    for m in model:
        if isinstance(m, nn.Linear):
            shard(m, mesh=mesh, reshard_after_forward=raf)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                losses.append(mean_loss(model(_x(step, rank)).sum()))
            continue
        loss = model(_x(step, rank)).sum()
        loss.backward()
        losses.append(mean_loss(loss))
        grads = snapshot(model)
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return {"losses": losses, "grads": grads, "final": snapshot(model)}


class MultiForwardFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_0 = nn.Linear(5, 5)
        self.layer_no_grad = nn.Linear(5, 5)
        self.layer_with_grad = nn.Linear(5, 5)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x):
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            with torch.no_grad():
                x += F.relu(self.layer_with_grad(x))
        return x


def multi_forward_frozen(shard, mesh, rank, raf):
    torch.manual_seed(0)
    model = MultiForwardFrozen().double()
    for m in (model.layer_0, model.layer_no_grad, model.layer_with_grad):
        shard(m, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        opt.zero_grad(set_to_none=step % 2 == 0)
        loss = model(_x(step, rank, d=5)).sum()
        loss.backward()
        losses.append(mean_loss(loss))
        grads = snapshot(model)
        opt.step()
    return {"losses": losses, "grads": grads, "final": snapshot(model)}


CASES = (
    [("accumulation", c) for c in ACCUM]
    + [("bias_only", (raf, after, ac)) for raf in (True, False, 1) for after in (False, True) for ac in (False, True)
       if raf is True or not ac]
    + [("frozen_across_units", (raf,)) for raf in (True, False)]
    + [("multi_forward_frozen", (raf,)) for raf in (True, False, 1)]
)


def _rank(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for kind, args in CASES:
        for lib, shard in runtimes().items():
            if kind == "accumulation":
                out[(kind, args, lib)] = accumulation(shard, mesh, rank, lib, *args)
            else:
                out[(kind, args, lib)] = globals()[kind](shard, mesh, rank, *args)
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(_rank, WS, timeout=300)


@pytest.mark.parametrize("kind,args", CASES, ids=[f"{k}-{'-'.join(map(str, a))}" for k, a in CASES])
def test_matches_fsdp2(kind, args):
    for rank, res in enumerate(_results()):
        ours, theirs = res[(kind, args, "mfsdp2")], res[(kind, args, "fsdp2")]
        where = f"{kind}{args} rank {rank}"
        assert len(ours["losses"]) == len(theirs["losses"])
        for i, (a, b) in enumerate(zip(ours["losses"], theirs["losses"])):
            assert abs(a - b) <= REL_F64 * abs(b), f"{where} loss {i}: mfsdp2 {a}, FSDP2 {b}"
        if kind == "accumulation":
            assert ours["counts"] == theirs["counts"], (
                f"{where}: (all-gathers, reduce-scatters) per step {ours['counts']}, FSDP2 {theirs['counts']}")
            for s, (go, gt) in enumerate(zip(ours["grads"], theirs["grads"])):
                assert_same_snapshots(go, gt, f"{where} step {s}", REL_F64)
        else:
            assert_same_snapshots(ours["grads"], theirs["grads"], f"{where} last backward", REL_F64)
        assert_same_snapshots(ours["final"], theirs["final"], f"{where} after the steps", REL_F64)
