"""HSDP by hand (FSDP2's ``test_custom_hsdp_all_reduce_hook``): each unit is sharded over a 1-D
mesh of two ranks made from the trainer's own group, and an all-reduce hook sums the reduced
shard across the other pair of ranks (the trainer's replica group) and halves it. At 4 ranks the
gradients are then the average over all four ranks' batches: equal to FSDP2 running the same
script and to the float64 unsharded model on the four batches together. gloo has no AVG, so the
hook sums and divides (every division by two is exact)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import runtimes
from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, build, loss_fn, shard_blocks

GB = 8


def _groups():
    """``(shard group, replica group)`` of this rank: shards {0, 1} / {2, 3}, replicas {0, 2} / {1, 3}
    (every rank creates every group, in one order)."""
    rank = dist.get_rank()
    shard = [dist.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
    replica = [dist.new_group(r) for r in ([0, 2], [1, 3])][rank % 2]
    return shard, replica


def _run(rank: int, ws: int) -> dict:
    shard_pg, replica_pg = _groups()
    mesh = DeviceMesh.from_group(shard_pg, "cpu", mesh_dim_names=("shard",))
    calls = []

    def hook(reduced: torch.Tensor) -> None:
        calls.append(reduced.numel())
        dist.all_reduce(reduced, group=replica_pg)
        reduced.div_(2)

    out = {}
    for name, shard in runtimes().items():
        model = shard_blocks(build("net", dtype=F64), mesh, shard)
        for unit in [*model.blocks, model]:
            unit.set_all_reduce_hook(hook)
        x, y = batch(0, GB, model.inp.in_features, dtype=F64)
        n = GB // ws
        loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        out[name] = ({k: p.grad.full_tensor() for k, p in model.named_parameters()}, len(calls))
        calls.clear()
    return out


@pytest.mark.slow
def test_all_reduce_hook_across_replicas_equals_fsdp2_and_the_unsharded_model():
    ref = build("net", dtype=F64)
    x, y = batch(0, GB, ref.inp.in_features, dtype=F64)
    loss_fn(ref(x), y).backward()
    for rank, out in enumerate(run_ranks(_run, 4)):
        (g_t, n_t), (g_m, n_m) = out["fsdp2"], out["mfsdp2"]
        assert n_m == n_t > 0, (rank, n_m, n_t)  # the hook runs once per reduction, as FSDP2's
        for k, p in ref.named_parameters():
            assert torch.equal(g_m[k], g_t[k]), (rank, k)
            assert_close_rel(g_m[k], p.grad, f"rank {rank} {k}", REL_F64)
