"""``set_gradient_divide_factor`` on one module sets that module's reduction only, as in FSDP2:
a script that calls it on the root alone sums the root's gradients and averages the blocks'.

Checked against the unsharded float64 model's gradient ``g`` of the mean loss over the global
batch: each rank's loss is the mean over its slice, so an averaging reduction gives ``g`` and a
summing one (factor 1) gives ``ws * g`` (exact up to float64 rounding, 1e-10 relative)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks
from ..models import REL_F64, assert_close_rel, batch, build, loss_fn

WS, GB = 2, 8


def _grads(rank, ws, runtime):
    if runtime == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from mfsdp2 import fully_shard
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=torch.float64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_gradient_divide_factor(1.0)  # the root only
    n = GB // ws
    x, y = batch(0, GB, 12, dtype=torch.float64)
    loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
    return {k: p.grad.full_tensor() for k, p in model.named_parameters()}


def _reference():
    model = build("net", dtype=torch.float64)
    x, y = batch(0, GB, 12, dtype=torch.float64)
    loss_fn(model(x), y).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def test_divide_factor_on_the_root_leaves_the_blocks_averaged_like_fsdp2():
    ref = _reference()
    for runtime in ("torch", "mfsdp2"):
        got = run_ranks(_grads, WS, runtime)[0]
        for k, g in ref.items():
            expect = g if k.startswith("blocks.") else WS * g
            assert_close_rel(got[k], expect, f"{runtime} {k}", rel=REL_F64)
