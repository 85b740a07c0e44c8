"""``model.load_state_dict(fsdp2_model.state_dict())`` on layouts that take the generic load path
(HSDP here: ``(Replicate, RowShard)`` parameters): FSDP2's ``(Replicate, Shard(0))`` DTensors hold
``torch.chunk`` rows, which ``RowShard`` *compares equal to* (for DTensor's sharding rules) but
does not share. Taking the two as the same placements copied FSDP2's local rows into ours: a size
mismatch, or a silent broadcast where a piece had one row. The values must be FSDP2's, full tensor
for full tensor (world size 4, mesh (2, 2); float64, exact).

The same mesh trains with ``shard_placement_fn`` sharding every matrix on dim 1
(mfsdp2.dtensors.shard_dim: ``(Replicate, RowShard(1))``) as FSDP2 does with the same function: losses,
parameters and AdamW states after two steps (``REL_F64``)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from . import full
from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, build, make_opt, shard_blocks, sharded_train_step


def _rank(rank, ws):
    from torch.distributed.fsdp import fully_shard as torch_shard

    import mfsdp2

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    theirs = shard_blocks(build("net", seed=0, dtype=F64), mesh, torch_shard)
    ours = shard_blocks(build("net", seed=1, dtype=F64), mesh, mfsdp2.fully_shard)
    ours.load_state_dict(theirs.state_dict())
    want = dict(theirs.named_parameters())
    out = {"load": {k: torch.equal(full(p), full(want[k])) for k, p in ours.named_parameters()}}

    def dim1(p):
        from torch.distributed.tensor import Shard

        return Shard(1) if p.dim() == 2 else None

    for lib, shard in (("fsdp2", torch_shard), ("mfsdp2", mfsdp2.fully_shard)):
        model = shard_blocks(build("net", dtype=F64), mesh, shard, shard_placement_fn=dim1)
        opt = make_opt("adamw", model.parameters())
        losses = [sharded_train_step(model, opt, s, rank, ws, 8) for s in range(2)]
        out[lib] = (
            losses,
            {k: full(p) for k, p in model.named_parameters()},
            {k: full(opt.state[p]["exp_avg"]) for k, p in model.named_parameters()},
            repr(model.inp.weight.placements),
        )
    return out


@pytest.mark.slow
def test_hsdp_loads_fsdp2_dtensors_and_trains_on_dim1():
    for r in run_ranks(_rank, 4):
        assert all(r["load"].values()), r["load"]
        (la, pa, sa, pl_a), (lb, pb, sb, _) = r["mfsdp2"], r["fsdp2"]
        assert pl_a.startswith("(Replicate(), RowShard(dim=1"), pl_a
        for a, b in zip(la, lb):
            assert abs(a - b) <= REL_F64 * abs(b), (a, b)
        for k in pb:
            assert_close_rel(pa[k], pb[k], f"param {k}", REL_F64)
            assert_close_rel(sa[k], sb[k], f"exp_avg {k}", REL_F64)
