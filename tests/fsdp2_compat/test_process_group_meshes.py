"""Meshes a trainer builds from its own process groups (``DeviceMesh.from_group``), as FSDP2's
``test_1d_process_group_init`` / ``test_2d_process_group_init`` do, at 4 ranks:

* 1-D: the data-parallel group of a (dp=2, tp=2) layout, wrapped with ``from_group``;
* 2-D (HSDP): a (replicate=2, shard=2) mesh rebuilt from its two groups and mesh tensor.

A model sharded over such a mesh trains exactly as over the ``init_device_mesh`` mesh it mirrors,
and as FSDP2 over the same ``from_group`` mesh (float64, a few steps, bit for bit: the same
reductions over the same ranks)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import runtimes
from .._dist import run_ranks
from ..models import F64, build, make_opt, shard_blocks, sharded_train_step

STEPS, GB = 3, 8


def _meshes(kind: str) -> tuple:
    """``(mesh from init_device_mesh, the same mesh from its process groups, dp rank, dp size)``."""
    if kind == "1d":
        ref = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"]
        made = DeviceMesh.from_group(ref.get_group(0), "cpu", mesh_dim_names=("dp",))
        return ref, made, ref.get_local_rank(0), 2
    ref = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    made = DeviceMesh.from_group([ref.get_group(0), ref.get_group(1)], "cpu", mesh=ref.mesh.clone(),
                                 mesh_dim_names=("replicate", "shard"))
    return ref, made, torch.distributed.get_rank(), 4


def _train(rank: int, ws: int, kind: str) -> dict:
    ref_mesh, made_mesh, dp_rank, dp_size = _meshes(kind)
    assert torch.equal(made_mesh.mesh, ref_mesh.mesh)
    out = {}
    for name, shard in runtimes().items():
        for which, mesh in (("from_group", made_mesh), ("init_device_mesh", ref_mesh)):
            if name == "fsdp2" and which == "init_device_mesh":
                continue
            model = shard_blocks(build("net", dtype=F64), mesh, shard)
            opt = make_opt("adamw", model.parameters())
            losses = [sharded_train_step(model, opt, s, rank, ws, GB, dp=(dp_rank, dp_size)) for s in range(STEPS)]
            out[(name, which)] = (losses, {k: p.full_tensor() for k, p in model.named_parameters()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_meshes_from_process_groups_train_like_fsdp2_and_init_device_mesh(kind):
    for rank, out in enumerate(run_ranks(_train, 4, kind)):
        (l_made, p_made), (l_ref, p_ref) = out[("mfsdp2", "from_group")], out[("mfsdp2", "init_device_mesh")]
        l_t, p_t = out[("fsdp2", "from_group")]
        assert l_made == l_ref == l_t, (rank, l_made, l_ref, l_t)
        assert list(p_made) == list(p_ref) == list(p_t)
        for k in p_ref:
            assert torch.equal(p_made[k], p_ref[k]) and torch.equal(p_made[k], p_t[k]), (rank, k)
