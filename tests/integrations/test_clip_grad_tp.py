"""Gradient clipping on FSDP x TP, a (dp=2, tp=2) mesh of 4 ranks (FSDP2's ``test_clip_grad_norm_2d``).

* Every parameter tensor-parallel (a stack of colwise / rowwise MLPs): ``torch.nn.utils.clip_grad_norm_``
  runs on mfsdp2's parameters as on FSDP2's, and both, and ``mfsdp2.clip_grad_norm_``, give the
  unsharded model's total norm and clipped gradients for norm orders 2, 1, 3 and inf.
* Parameters on two meshes (tensor-parallel blocks between plain layers, sharded over ``dp``
  only): torch's function refuses to stack norms of DTensors on different meshes, for FSDP2's
  parameters and for ours alike; ``mfsdp2.clip_grad_norm_`` clips them as the unsharded model.

Float64: the sharded norms only reorder sums (relative change <= n * u), so REL_F64 holds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, loss_fn
from ._dp_tp import input_dim, model_of, shard_dp_tp

GB, MAX_NORM = 8, 0.05
NORMS = [2.0, 1.0, 3.0, math.inf]


def _step_grads(model: nn.Module, dp_rank: int = 0, dp_size: int = 1) -> None:
    x, y = batch(0, GB, input_dim(model), dtype=F64)
    n = GB // dp_size
    loss_fn(model(x[dp_rank * n : (dp_rank + 1) * n]), y[dp_rank * n : (dp_rank + 1) * n]).backward()


def _reference(kind: str) -> dict:
    out = {}
    for p in NORMS:
        model = model_of(kind)
        _step_grads(model)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, p)
        out[p] = (total, {k: q.grad.clone() for k, q in model.named_parameters()})
    return out


def _clip_2d(rank: int, ws: int, kind: str) -> dict:
    import mfsdp2
    from torch.distributed.fsdp import fully_shard as torch_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank(0)
    runs = [("fsdp2", torch_shard, torch.nn.utils.clip_grad_norm_),
            ("mfsdp2", mfsdp2.fully_shard, torch.nn.utils.clip_grad_norm_),
            ("mfsdp2.clip_grad_norm_", mfsdp2.fully_shard, mfsdp2.clip_grad_norm_)]
    out = {}
    for name, shard, clip in runs:
        for p in NORMS:
            model = shard_dp_tp(model_of(kind), mesh, shard)
            _step_grads(model, dp_rank, 2)
            try:
                total = clip(model.parameters(), MAX_NORM, p)
            except RuntimeError as e:
                out[(name, p)] = ("error", str(e))
                continue
            total = total.full_tensor() if hasattr(total, "full_tensor") else total
            out[(name, p)] = (total, {k: q.grad.full_tensor() for k, q in model.named_parameters()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tp_stack", "mixed_meshes"])
def test_clip_grad_norm_on_fsdp_x_tp_matches_the_unsharded_model(kind):
    ref = _reference(kind)
    for res in run_ranks(_clip_2d, 4, kind):
        for (name, p), (total, grads) in res.items():
            if kind == "mixed_meshes" and name != "mfsdp2.clip_grad_norm_":
                # torch's function on parameters of two meshes: refused for FSDP2's and ours alike.
                assert total == "error" and "same mesh" in grads, (name, p, total)
                continue
            assert total != "error", (name, p, grads)
            ref_total, ref_grads = ref[p]
            assert_close_rel(total.reshape(()), ref_total, f"{name} p={p} total norm", REL_F64)
            for k, g in ref_grads.items():
                assert_close_rel(grads[k], g, f"{name} p={p} clipped grad {k}", REL_F64)
