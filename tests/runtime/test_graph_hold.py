"""Backwards that record a graph (``create_graph=True``): a gradient penalty trains like the
unsharded model under every strategy (:mod:`mfsdp2.runtime.graph_hold`).

The objective of each step is a WGAN-GP / R1-style penalty: ``gx = autograd.grad(loss, x,
create_graph=True)``, then ``(loss + |gx|^2).backward()``. The first backward records a graph
whose nodes save the units' gathered weights, and the second runs those nodes before any unit's
pre-backward gathers again. A unit that freed its gathered weights at the end of the first
backward made the second read freed memory: the rank died with SIGSEGV (torch FSDP2 does the same
on this script, so the reference here is the unsharded float64 model, not FSDP2). Each case is
float64, so the sharded run may differ from the reference only by the order of its sums
(``REL_F64``).

Cases: ZeRO-3 (resharding after forward or not, and with non-reentrant activation checkpointing
inside the blocks), ZeRO-2, ZeRO-1 and no_shard; a ``create_graph`` pass that no backward
follows before the optimizer steps (the held weights are released at the next forward, which
must gather the stepped weights: a stale gather moves the losses); and a backward through such a
graph after the next forward released the weights, which must raise autograd's error instead of
reading freed memory.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, build, checkpoint_blocks, loss_fn, shard_blocks

STEPS = 3
PER_RANK = 4
WS = 2
CASES = {
    "zero3": {},
    "zero3_kept": {"reshard_after_forward": False},
    "zero3_checkpoint": {},
    "zero2": {"sharding_strategy": "optim_grads"},
    "zero1": {"sharding_strategy": "optim"},
    "no_shard": {"sharding_strategy": "no_shard"},
}


def _objective(model, x, y):
    """The loss and the penalised objective: the loss plus the squared norm of its input gradient."""
    x = x.detach().requires_grad_(True)
    loss = loss_fn(model(x), y)
    (gx,) = torch.autograd.grad(loss, [x], create_graph=True)
    return loss, loss + gx.square().sum()


def _reference(ws: int, probe: bool) -> tuple:
    """Unsharded float64: each step's objective is the mean of the ranks' objectives on their
    rows of the global batch (the data-parallel average). ``probe``: a ``create_graph`` pass on
    the next batch before each optimizer step, whose graph nobody back-propagates (no effect on
    the training)."""
    model = build("net", dtype=F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, PER_RANK * ws, model.inp.in_features, dtype=F64)
        total, rank_losses = 0, []
        for r in range(ws):
            rows = slice(r * PER_RANK, (r + 1) * PER_RANK)
            loss, obj = _objective(model, x[rows], y[rows])
            total = total + obj / ws
            rank_losses.append(loss.item())
        total.backward()
        if probe:
            _objective(model, *batch(step + 100, PER_RANK, model.inp.in_features, dtype=F64))
        opt.step()
        opt.zero_grad()
        losses.append(rank_losses)
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}


def _train(rank, ws, case: str, probe: bool) -> tuple:
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=F64)
    if case == "zero3_checkpoint":
        checkpoint_blocks(model)
    shard_blocks(model, mesh, **CASES[case])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, PER_RANK * ws, model.inp.in_features, dtype=F64)
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss, obj = _objective(model, x[rows], y[rows])
        obj.backward()
        if probe:  # its graph holds the gathered weights; the optimizer steps before the next forward
            _objective(model, *batch(step + 100, PER_RANK, model.inp.in_features, dtype=F64))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # After a probe the units are held gathered; the modules show their DTensors all the same.
    return losses, {k: p.full_tensor() for k, p in model.named_parameters()}


def _check(results, ref) -> None:
    ref_losses, ref_params = ref
    for rank, (losses, params) in enumerate(results):
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b[rank]) <= REL_F64 * abs(b[rank]), (rank, step, a, b[rank])
        assert params.keys() == ref_params.keys()
        for k, p in params.items():
            assert_close_rel(p, ref_params[k], k, REL_F64)


def _run_cases(rank, ws):
    return {case: _train(rank, ws, case, probe=False) for case in CASES} | {
        "zero3_probe": _train(rank, ws, "zero3", probe=True)}


@pytest.fixture(scope="module")
def results():
    out = run_ranks(_run_cases, WS, timeout=300)
    return {k: [r[k] for r in out] for k in out[0]}


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_penalty_trains_like_the_unsharded_model(results, case):
    _check(results[case], _reference(WS, probe=False))


def test_weights_held_for_a_graph_are_gathered_anew_after_the_optimizer_step(results):
    """A ``create_graph`` pass left without its backward: the next forward must use the stepped weights."""
    _check(results["zero3_probe"], _reference(WS, probe=True))


def _dangling(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    model = shard_blocks(build("net", dtype=F64), mesh)
    x, y = batch(0, PER_RANK, model.inp.in_features, dtype=F64)
    _, obj = _objective(model, x, y)
    loss_fn(model(x), y).backward()  # the next forward released the weights obj's graph holds
    try:
        obj.backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_backward_through_a_graph_whose_weights_were_released_raises():
    for msg in run_ranks(_dangling, WS):
        assert msg is not None and "modified by an inplace operation" in msg, msg
