"""``model.load_state_dict(fsdp2_model.state_dict())`` on layouts that take the generic load path
(HSDP here: ``(Replicate, RowShard)`` parameters): FSDP2's ``(Replicate, Shard(0))`` DTensors hold
``torch.chunk`` rows, which ``RowShard`` *compares equal to* (for DTensor's sharding rules) but
does not share. Taking the two as the same placements copied FSDP2's local rows into ours: a size
mismatch, or a silent broadcast where a piece had one row. The values must be FSDP2's, full tensor
for full tensor (world size 4, mesh (2, 2); float64, exact)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from . import full
from .._dist import run_ranks
from ..models import F64, build, shard_blocks


def _rank(rank, ws):
    from torch.distributed.fsdp import fully_shard as torch_shard

    import mfsdp2

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    theirs = shard_blocks(build("net", seed=0, dtype=F64), mesh, torch_shard)
    ours = shard_blocks(build("net", seed=1, dtype=F64), mesh, mfsdp2.fully_shard)
    ours.load_state_dict(theirs.state_dict())
    want = dict(theirs.named_parameters())
    return {k: torch.equal(full(p), full(want[k])) for k, p in ours.named_parameters()}


@pytest.mark.slow
def test_hsdp_loads_fsdp2_dtensors():
    for r in run_ranks(_rank, 4):
        assert all(r.values()), r
