"""FSDP x TP: parameters that are already tensor-parallel DTensors when ``fully_shard`` runs.

The user parallelises a module over the TP dimension of a 2-D mesh (``parallelize_module(block,
mesh["tp"], ...)``), then calls ``fully_shard(block, mesh=mesh["dp"])``, as with FSDP2. The runtime
shards each parameter's **TP-local** tensor over the DP dimension: the layout, the flat buffers
and the collectives only ever see local shapes. Global shapes come from the DTensor (its
``shape``), never from the local tensor -- confusing the two is the classic FSDP x TP checkpoint
bug.

* The gathered (unsharded) parameter registered for forward is a DTensor on the TP mesh with the
  user's TP placements over the gathered local view, so the TP module's forward runs unchanged.
  Its gradient arrives as a TP DTensor; its local tensor (a ``Partial`` one reduced first) is what
  the data-parallel reduction packs.
* The optimizer-facing parameter is a DTensor on a 2-D mesh ordered **(tp, dp)** with placements
  ``(tp placement, RowShard(0, rows))``. DTensor applies placements left to right, so this says
  exactly what the buffers hold: TP splits the global tensor first, DP then splits the TP-local
  rows. (On a ``(dp, tp)`` ordering, a TP ``Shard(0)`` would be read as "DP first", which is FSDP2's
  reason for ``_StridedShard``.) That mesh is built with ``DeviceMesh.from_group`` over the
  existing TP and DP groups: no new process groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .placement import contiguous_stride, wrap_local

__all__ = ["TPSpec", "tp_spec_of", "tp_dp_mesh", "tp_dtensor", "local_grad"]

_meshes: dict = {}


@dataclass(frozen=True)
class TPSpec:
    """What the user's tensor-parallel DTensor was: its mesh, placements and global shape."""

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size

    def stride(self) -> tuple:
        return contiguous_stride(self.shape)


def tp_spec_of(p: DTensor, dp_mesh: DeviceMesh, fqn: str, where: str) -> TPSpec:
    """Validate a DTensor parameter met by ``fully_shard(..., mesh=dp_mesh)``; return its spec."""
    tp_mesh = p.device_mesh
    if tp_mesh == dp_mesh:
        raise ValueError(
            f"mfsdp2: parameter {fqn!r} of {where} is already a DTensor on the data-parallel mesh "
            f"({p.placements}): fully_shard was applied to a parent before this module (wrap "
            "children first, root last)"
        )
    root = _root(dp_mesh)
    if dp_mesh.ndim != 1 or tp_mesh.ndim != 1 or root is None or root is not _root(tp_mesh) or root.ndim != 2:
        raise ValueError(
            f"mfsdp2: parameter {fqn!r} of {where} is a DTensor on mesh {tp_mesh} that is not the other "
            "dimension of the data-parallel mesh's 2-D parent; build one mesh "
            "init_device_mesh(..., (dp, tp), mesh_dim_names=('dp', 'tp')), parallelise with "
            "mesh['tp'] and call fully_shard with mesh=mesh['dp']"
        )
    for pl in p.placements:
        if not isinstance(pl, (Shard, Replicate)) or type(pl) not in (Shard, Replicate):
            raise ValueError(
                f"mfsdp2: parameter {fqn!r} of {where} has tensor-parallel placement {pl!r}; "
                "only Shard(d) and Replicate() parameters can be data-parallel sharded"
            )
    return TPSpec(tp_mesh, tuple(p.placements), p.shape)


def _root(mesh: DeviceMesh) -> Optional[DeviceMesh]:
    """The mesh ``mesh`` was sliced from (itself when it has no parent), or None when this
    torch's ``DeviceMesh`` cannot say (no ``_get_root_mesh``): the callers then refuse the TP
    parameter with advice. Any other failure is a real error and surfaces as itself, not as a
    misleading "not the other dimension" message or a later ``AttributeError`` on None."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is None:
        return None
    return get_root()


def tp_dp_mesh(tp_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> DeviceMesh:
    """The (tp, dp)-ordered 2-D mesh over the existing groups (cached per pair)."""
    key = (id(tp_mesh), id(dp_mesh))
    if key not in _meshes:
        root = _root(dp_mesh)
        names = root.mesh_dim_names
        t, d = names.index(tp_mesh.mesh_dim_names[0]), names.index(dp_mesh.mesh_dim_names[0])
        grid = root.mesh.permute(t, d).contiguous()
        _meshes[key] = DeviceMesh.from_group(
            [tp_mesh.get_group(), dp_mesh.get_group()],
            root.device_type,
            mesh=grid,
            mesh_dim_names=(names[t], names[d]),
        )
    return _meshes[key]


def tp_dtensor(local: torch.Tensor, spec: TPSpec) -> DTensor:
    """``local`` (a gathered TP-local view) as the TP DTensor the module's forward expects."""
    return wrap_local(local, spec.mesh, spec.placements, spec.shape, spec.stride())


def local_grad(grad: torch.Tensor, spec: Optional[TPSpec]) -> torch.Tensor:
    """The TP-local gradient to reduce over DP: a DTensor's local tensor, after reducing any
    ``Partial`` placement to the parameter's own placement."""
    if spec is None or not isinstance(grad, DTensor):
        return grad
    if any(isinstance(pl, Partial) for pl in grad.placements) or tuple(grad.placements) != spec.placements:
        grad = grad.redistribute(spec.mesh, spec.placements)
    return grad.to_local()
