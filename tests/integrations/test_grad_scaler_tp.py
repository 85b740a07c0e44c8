"""Loss scaling on FSDP x TP, a (dp=2, tp=2) mesh of 4 ranks: a non-finite gradient on one rank's
piece must make every rank skip the step and back off the scale (FSDP2's gradient-scaler test in
2-D). Each case runs FSDP2 and mfsdp2 in the same processes on the same model and data.

* Every parameter tensor-parallel: ``torch.amp.GradScaler`` skips on every rank, for both.
* Parameters on two meshes (tensor-parallel blocks between plain layers): torch's
  ``ShardedGradScaler`` (which all-reduces its inf flag over every rank) skips on every rank, for
  both. So does ``torch.amp.GradScaler`` over mfsdp2's parameters (the inf check is reduced over
  every mesh in the list, ``mfsdp2.dtensors.dtensor_ops``); over FSDP2's, DTensor reduces the
  flag over the first gradient's mesh only and the ranks of the other tensor-parallel coordinate
  may step while the rest skip, so that case compares the first step only."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, loss_fn, make_opt
from ._dp_tp import input_dim, model_of, shard_dp_tp

GB = 8


def _scaler(name: str):
    if name == "sharded":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cpu", init_scale=1024.0)
    return torch.amp.GradScaler("cpu", init_scale=1024.0)


def _run(rank: int, ws: int, kind: str, scaler_name: str) -> dict:
    import mfsdp2
    from torch.distributed.fsdp import fully_shard as torch_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank(0)
    out = {}
    for name, shard in (("fsdp2", torch_shard), ("mfsdp2", mfsdp2.fully_shard)):
        model = shard_dp_tp(model_of(kind), mesh, shard)
        opt = make_opt("sgd", model.parameters())
        scaler = _scaler(scaler_name)
        d = input_dim(model)
        record = []
        for step in range(2):
            x, y = batch(step, GB, d, dtype=F64)
            n = GB // 2
            rows = slice(dp_rank * n, (dp_rank + 1) * n)
            scaler.scale(loss_fn(model(x[rows]), y[rows])).backward()
            piece = model.blocks[1].fc1.weight.grad.to_local()
            sizes = [None] * ws
            torch.distributed.all_gather_object(sizes, piece.numel())
            if step == 1 and rank == max(r for r, k in enumerate(sizes) if k > 0):
                piece.view(-1)[0] = float("inf")  # on one rank's piece only
            before = [p.to_local().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            stepped = any(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
            record.append((scaler.get_scale(), stepped, {k: p.full_tensor() for k, p in model.named_parameters()}))
        out[name] = record
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind,scaler_name", [("tp_stack", "amp"), ("mixed_meshes", "sharded"),
                                              ("mixed_meshes", "amp")])
def test_grad_scaler_on_fsdp_x_tp_behaves_as_on_fsdp2(kind, scaler_name):
    for rank, out in enumerate(run_ranks(_run, 4, kind, scaler_name)):
        (s0_t, st0_t, w0_t), (s1_t, st1_t, _) = out["fsdp2"]
        (s0_m, st0_m, w0_m), (s1_m, st1_m, _) = out["mfsdp2"]
        assert st0_t and st0_m and s0_t == s0_m == 1024.0
        for k, w in w0_t.items():
            assert_close_rel(w0_m[k], w, f"rank {rank} step 0 {k}", REL_F64)
        assert not st1_m and s1_m == 512.0, f"rank {rank} stepped past a non-finite gradient on another rank"
        if (kind, scaler_name) != ("mixed_meshes", "amp"):
            assert (s1_m, st1_m) == (s1_t, st1_t), (rank, (s1_m, st1_m), (s1_t, st1_t))
