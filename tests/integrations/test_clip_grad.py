"""``mfsdp2.clip_grad_norm_`` equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model:
the total norm and every clipped gradient, for norm orders 2, 1, 3 and inf, the whole model or a
subset of its parameters, ZeRO-3 / ZeRO-2 / ZeRO-1 / no_shard, world sizes 2 and 4 (the "tiny"
model at 4 leaves some ranks without rows of some parameters), and with a gradient the user
assigned (not a view of our flat shard: torch's path). Float64: the sharded norm only reorders
the sum of squares (relative change <= n * u ~ 1e-13), so REL_F64 holds.

Also: per-parameter norms on request, and ``error_if_nonfinite`` names the bad parameter on every
rank."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import mfsdp2
from mfsdp2 import fully_shard

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, build, loss_fn

GB = 8
NORMS = [2.0, 1.0, 3.0, math.inf]


def _backward(model, rank, ws):
    x, y = batch(0, GB, model.inp.in_features, dtype=F64)
    n = GB // ws
    loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()


def _reference(kind, norm_type, subset, assigned):
    model = build(kind, dtype=F64)
    x, y = batch(0, GB, model.inp.in_features, dtype=F64)
    loss_fn(model(x), y).backward()
    if assigned:
        model.head.weight.grad = model.head.weight.grad * 3.0
    params = list(model.blocks.parameters()) if subset else list(model.parameters())
    per = {n: torch.linalg.vector_norm(p.grad, norm_type) for n, p in model.named_parameters()}  # before clipping
    total = torch.nn.utils.clip_grad_norm_(params, 0.05, norm_type)
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}, per


def _sharded(rank, ws, kind, strategy, norm_type, subset, assigned):
    model = build(kind, dtype=F64)
    mesh = init_device_mesh("cpu", (ws,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, sharding_strategy=strategy)
    fully_shard(model, mesh=mesh, sharding_strategy=strategy)
    _backward(model, rank, ws)
    if assigned:
        model.head.weight.grad = model.head.weight.grad * 3.0
    target = list(model.blocks.parameters()) if subset else model
    total, norms = mfsdp2.clip_grad_norm_(target, 0.05, norm_type, param_norms=True)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return total, grads, norms


@pytest.mark.parametrize("norm_type", NORMS, ids=lambda n: f"p{n}")
@pytest.mark.parametrize(
    "kind,ws,strategy,subset,assigned",
    [
        ("net", 2, "optim_grads_params", False, False),
        ("net", 2, "optim_grads_params", True, False),
        ("net", 2, "optim_grads_params", False, True),
        ("net", 2, "optim_grads", False, False),
        ("net", 2, "optim", False, False),
        ("net", 2, "no_shard", False, False),
        ("tiny", 4, "optim_grads_params", False, False),
    ],
    ids=["zero3", "zero3-subset", "zero3-assigned-grad", "zero2", "zero1", "no_shard", "tiny-ws4"],
)
def test_clip_grad_norm_matches_torch_on_the_unsharded_model(kind, ws, strategy, subset, assigned, norm_type):
    ref_total, ref_grads, ref_norms = _reference(kind, norm_type, subset, assigned)
    ref_model = build(kind)
    names = [n for n, _ in (ref_model.blocks.named_parameters(prefix="blocks") if subset
                            else ref_model.named_parameters())]
    for total, grads, norms in run_ranks(_sharded, ws, kind, strategy, norm_type, subset, assigned):
        assert_close_rel(total.reshape(()), ref_total, "total norm", REL_F64)
        for n, g in ref_grads.items():
            assert_close_rel(grads[n], g, f"clipped grad {n}", REL_F64)
        assert sorted(norms) == sorted(names)
        for n in names:
            assert_close_rel(norms[n].reshape(()), ref_norms[n], f"norm of {n}", REL_F64)


def _nonfinite(rank, ws):
    model = build("net", dtype=F64)
    mesh = init_device_mesh("cpu", (ws,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _backward(model, rank, ws)
    w = model.blocks[1].fc1.weight
    holder = max(r for r, n in enumerate(w.placements[0].rows) if n > 0)
    if rank == holder:
        w.grad.to_local().view(-1)[0] = float("inf")  # on one rank only: every rank must still raise
    try:
        mfsdp2.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    except RuntimeError as e:
        return str(e)
    return None


def test_nonfinite_gradient_is_named_on_every_rank():
    for msg in run_ranks(_nonfinite, 2):
        assert msg is not None and "blocks.1.fc1.weight" in msg and "blocks.0" not in msg, msg
