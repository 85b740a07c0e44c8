"""The (tp, dp) meshes ``tp_dp_mesh`` builds are cached per pair of mesh objects, and an entry
lives no longer than either of its meshes: the cache is keyed by object ids, which Python reuses
once an object is gone, so a stale entry would hand a later pair of meshes the groups of earlier
ones (after ``destroy_process_group`` and a new ``init_process_group``, destroyed ones)."""

from __future__ import annotations

import gc

from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks


def _cache(rank: int, ws: int) -> dict:
    from mfsdp2.dtensors import tensor_parallel as tp

    root = init_device_mesh("cpu", (ws, 1), mesh_dim_names=("tp", "dp"))
    tp_mesh, dp_mesh = root["tp"], root["dp"]
    before = len(tp._meshes)
    both = tp.tp_dp_mesh(tp_mesh, dp_mesh)
    out = {
        "cached": tp.tp_dp_mesh(tp_mesh, dp_mesh) is both,
        "entries": len(tp._meshes) - before,
        "dims": (both.mesh_dim_names, tuple(both.shape)),
    }
    del dp_mesh
    gc.collect()
    out["after_dp_freed"] = len(tp._meshes) - before
    return out


def test_an_entry_goes_with_either_of_its_meshes():
    out = run_ranks(_cache, 2)[0]
    assert out == {"cached": True, "entries": 1, "dims": (("tp", "dp"), (2, 1)), "after_dp_freed": 0}, out
