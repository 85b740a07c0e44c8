"""The parts of torch a training script touches besides ``fully_shard`` and the optimizer, run by
torch FSDP2 and by mfsdp2 on the same float64 model and data in the same process, compared step by
step: losses, the values the script reads (gradient norms, EMA weights, eval outputs, the
scaler's scale) and every full parameter and gradient.

Surfaces: ``torch.nn.utils.clip_grad_norm_`` with ``foreach`` on and off and norms 2 / inf /
1, and ``clip_grad_value_``; ``torch.amp.GradScaler`` in front of SGD (foreach), AdamW (fused:
the scale and the skip flag go *into* the kernel) and AdamW (for-loop), with a non-finite
gradient on one rank's piece; EMA copies of the weights updated with ``torch._foreach_lerp_``
and with per-tensor ``lerp_``, swapped in for an eval forward and back (the two forwards'
outputs are checked against an unsharded copy built from the full tensors: torch FSDP2 gets the
second one wrong -- its root stays gathered after a forward under ``no_grad`` and the next
forward reuses those weights, not the ones just copied into the sharded parameters -- while
mfsdp2 sees the write); a weight under
``torch.nn.utils.parametrize`` (a parametrization registered before sharding: the sharded
parameter is its ``original``); ``requires_grad_`` toggled on a unit between steps (frozen,
then trainable again).

Tolerance: float64; the two runtimes sum the per-rank gradients in another order (a few
roundings per gradient, amplified by at most lr/eps of AdamW over a few steps): REL_F64
(tests/models.py) bounds it with orders of margin; a real difference (a skipped clip, a step
past an inf, an EMA that read stale rows) moves values by >= 1e-4.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.utils import parametrize

from . import assert_same_snapshots, mean_loss, runtimes, snapshot
from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, build, loss_fn, shard_blocks

WS, GB, STEPS = 2, 8, 3


def _loss(model, step, rank):
    x, y = batch(step, GB, model.inp.in_features, dtype=F64)
    n = GB // WS
    return loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])


def _model(shard, mesh, prepare=None):
    model = build("net", dtype=F64)
    if prepare is not None:
        prepare(model)
    return shard_blocks(model, mesh, shard)


def clip(shard, mesh, rank):
    out = {}
    for foreach in (False, True):
        for norm_type in (2.0, float("inf"), 1.0):
            model = _model(shard, mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
            losses, norms = [], []
            for step in range(STEPS):
                loss = _loss(model, step, rank)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type=norm_type, foreach=foreach)
                norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
                losses.append(mean_loss(loss))
                grads = snapshot(model)
                opt.step()
                opt.zero_grad()
            out[f"norm {norm_type} foreach={foreach}"] = {"losses": losses, "values": norms, "grads": grads,
                                                          "final": snapshot(model)}
        model = _model(shard, mesh)
        _loss(model, 0, rank).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01, foreach=foreach)
        out[f"value foreach={foreach}"] = {"losses": [], "grads": snapshot(model), "final": snapshot(model)}
    return out


def _inf_on_one_rank(p):
    """A non-finite gradient element on the last rank holding rows of ``p``."""
    counts = [None] * p.device_mesh.size()
    torch.distributed.all_gather_object(counts, p.to_local().shape[0])
    holder = max(r for r, k in enumerate(counts) if k > 0)
    if torch.distributed.get_rank() == holder:
        p.grad.to_local().view(-1)[0] = float("inf")


def grad_scaler(shard, mesh, rank):
    makers = {
        "sgd foreach": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
        "adamw fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        "adamw for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    }
    out = {}
    for name, make in makers.items():
        model = _model(shard, mesh)
        opt = make(model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        losses, scales = [], []
        for step in range(STEPS):
            loss = _loss(model, step, rank)
            scaler.scale(loss).backward()
            if step == 1:
                _inf_on_one_rank(model.blocks[1].fc1.weight)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(mean_loss(loss))
            scales.append(scaler.get_scale())
        out[name] = {"losses": losses, "values": scales, "final": snapshot(model)}
    return out


def ema(shard, mesh, rank):
    out = {}
    for style in ("foreach", "per-tensor"):
        model = _model(shard, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        params = list(model.parameters())
        with torch.no_grad():
            shadow = [p.detach().clone() for p in params]
        losses = []
        for step in range(STEPS):
            loss = _loss(model, step, rank)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_loss(loss))
            with torch.no_grad():
                if style == "foreach":
                    torch._foreach_lerp_(shadow, params, 0.25)
                else:
                    for e, p in zip(shadow, params):
                        e.lerp_(p, 0.25)
        # Swap the EMA in for an eval forward, then the trained weights back.
        x, _ = batch(99, GB, model.inp.in_features, dtype=F64)
        reference = _unsharded_outputs(model, shadow, x)
        trained = snapshot(model)
        with torch.no_grad():
            backup = [p.detach().clone() for p in params]
            for p, e in zip(params, shadow):
                p.copy_(e)
            model.eval()
            eval_out = model(x).sum()
            model.train()
            for p, b in zip(params, backup):
                p.copy_(b)
            train_out = model(x).sum()
        shadows = [e.full_tensor() if hasattr(e, "full_tensor") else e for e in shadow]
        out[style] = {
            "losses": losses,
            "values": [eval_out.item(), train_out.item()],
            "reference": reference,
            "tensors": shadows,
            "final": trained,
        }
    return out


def _unsharded_outputs(model, shadow, x) -> list[float]:
    """The eval forward's output with the EMA weights and the train forward's with the trained
    ones, computed by an unsharded copy of the model from the full tensors (the independent
    reference of the swap)."""
    full = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for k, p in model.named_parameters()}
    ema_full = dict(zip(full, (e.full_tensor() if hasattr(e, "full_tensor") else e for e in shadow)))
    plain = build("net", dtype=F64)
    with torch.no_grad():
        plain.load_state_dict(ema_full)
        at_ema = plain(x).sum().item()
        plain.load_state_dict(full)
        at_trained = plain(x).sum().item()
    return [at_ema, at_trained]


class _Scaled(nn.Module):
    """A parametrization: the weight the module sees is ``2 * original + 0.1``."""

    def forward(self, w):
        return 2 * w + 0.1


def _train(model, rank, steps, before_step=lambda step: None):
    """``steps`` AdamW steps; losses, the gradients of the last backward, the final snapshot."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        before_step(step)
        loss = _loss(model, step, rank)
        loss.backward()
        losses.append(mean_loss(loss))
        grads = snapshot(model)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "final": snapshot(model)}


def parametrized(shard, mesh, rank):
    def prepare(model):
        for b in model.blocks:
            parametrize.register_parametrization(b.fc1, "weight", _Scaled())

    return _train(_model(shard, mesh, prepare), rank, STEPS)


def requires_grad_toggle(shard, mesh, rank):
    model = _model(shard, mesh)

    def toggle(step):
        if step in (1, 3):  # frozen for steps 1-2, trainable again from step 3
            model.blocks[1].requires_grad_(step == 3)

    return _train(model, rank, 2 * STEPS, toggle)


SCENARIOS = {f.__name__: f for f in (clip, grad_scaler, ema, parametrized, requires_grad_toggle)}


def _rank(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, fn in SCENARIOS.items():
        for lib, shard in runtimes().items():
            try:
                out[(name, lib)] = fn(shard, mesh, rank)
            except Exception as e:  # noqa: BLE001 (reported per scenario, the others still run)
                out[(name, lib)] = {"error": f"{type(e).__name__}: {e}"}
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(_rank, WS, timeout=400)


def _compare(ours, theirs, where):
    if "error" in theirs or "error" in ours:
        assert ours.get("error") is None, (f"{where}: mfsdp2 raised {ours['error']} "
                                           f"(FSDP2: {theirs.get('error', 'ran')})")
        raise AssertionError(f"{where}: FSDP2 raised {theirs['error']} where mfsdp2 ran")
    if "final" not in theirs:
        assert set(ours) == set(theirs), where
        for k in theirs:
            _compare(ours[k], theirs[k], f"{where}[{k}]")
        return
    assert len(ours["losses"]) == len(theirs["losses"]), where
    for i, (a, b) in enumerate(zip(ours["losses"], theirs["losses"])):
        assert abs(a - b) <= REL_F64 * abs(b), f"{where} loss {i}: mfsdp2 {a}, FSDP2 {b}"
    # Values with an unsharded reference are checked against it, not against FSDP2 (see ``ema``).
    expected = ours.get("reference", theirs.get("values", []))
    for i, (a, b) in enumerate(zip(ours.get("values", []), expected)):
        assert abs(a - b) <= REL_F64 * max(abs(b), 1e-3), f"{where} value {i}: mfsdp2 {a}, expected {b}"
    for i, (a, b) in enumerate(zip(ours.get("tensors", []), theirs.get("tensors", []))):
        assert_close_rel(a, b, f"{where} tensor {i}", REL_F64)
    if "grads" in theirs:
        assert_same_snapshots(ours["grads"], theirs["grads"], f"{where} last backward", REL_F64)
    assert_same_snapshots(ours["final"], theirs["final"], f"{where} after the steps", REL_F64)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_trainer_surface_matches_fsdp2(scenario):
    for rank, res in enumerate(_results()):
        _compare(res[(scenario, "mfsdp2")], res[(scenario, "fsdp2")], f"{scenario} rank {rank}")
