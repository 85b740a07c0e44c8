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
  ``(tp placement, RowShard(d, rows))`` (``d``: the dim ``shard_placement_fn`` gives, 0 by
  default, the one TP splits included). DTensor applies placements left to right, so this says
  exactly what the buffers hold: TP splits the global tensor first, DP then splits the TP-local
  rows. (On a ``(dp, tp)`` ordering, a TP ``Shard(0)`` would be read as "DP first", which is FSDP2's
  reason for ``_StridedShard``.) That mesh is built with ``DeviceMesh.from_group`` over the
  existing TP and DP groups: no new process groups.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .placement import contiguous_stride, wrap_local

__all__ = ["TPSpec", "tp_spec_of", "tp_dp_mesh", "tp_dtensor", "local_grad", "is_expert_parallel"]

_meshes: dict = {}


@dataclass(frozen=True)
class TPSpec:
    """What the user's tensor-parallel DTensor was: its mesh, placements and global shape."""

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size

    def stride(self) -> tuple:
        return contiguous_stride(self.shape)


def is_expert_parallel(mesh: DeviceMesh) -> bool:
    """Whether a model-parallel mesh is an expert-parallel one, by its dimension's name (``"ep"``,
    torchtitan's; any name with ``expert`` in it): the advice for it differs from tensor
    parallelism's (experts get their own data-parallel mesh through ``shard_placement_fn``)."""
    names = mesh.mesh_dim_names or ()
    return any(n == "ep" or n.endswith("_ep") or n.startswith("ep_") or "expert" in n for n in names)


def tp_spec_of(p: DTensor, dp_mesh: DeviceMesh, fqn: str, where: str) -> TPSpec:
    """Validate a DTensor parameter met by ``fully_shard`` that shards it over ``dp_mesh`` (the
    unit's mesh, or the one ``shard_placement_fn`` gave this parameter); return its spec.

    Its own mesh (tensor or expert parallel) and ``dp_mesh`` must be two different dimensions of
    one parent mesh (any other dimensions of the parent are fixed at this rank's coordinates),
    each 1-D."""
    tp_mesh = p.device_mesh
    if tp_mesh == dp_mesh:
        raise ValueError(
            f"mfsdp2 E02: parameter {fqn!r} of {where} is already a DTensor on the data-parallel mesh "
            f"({p.placements}): fully_shard was applied to a parent before this module (wrap "
            "children first, root last)"
        )
    ep = is_expert_parallel(tp_mesh)
    if dp_mesh.ndim != 1:
        kind = "expert-parallel" if ep else "tensor-parallel"
        raise ValueError(
            f"mfsdp2 E72: parameter {fqn!r} of {where} is {'an' if ep else 'a'} {kind} DTensor "
            f"on mesh {_describe(tp_mesh)} with "
            f"placements {tuple(p.placements)}, and is sharded over the 2-D (replicate, shard) mesh "
            f"{_describe(dp_mesh)} (HSDP); mfsdp2 combines {kind} parameters with a 1-D data-parallel mesh "
            "only: shard them over the shard dimension alone (FSDP), or keep them plain tensors"
        )
    if dp_mesh.ndim != 1 or tp_mesh.ndim != 1 or _dims_in_root(tp_mesh, dp_mesh) is None:
        if ep:
            raise ValueError(
                f"mfsdp2 E71: parameter {fqn!r} of {where} is an expert-parallel DTensor on mesh {_describe(tp_mesh)} "
                f"with placements {tuple(p.placements)}, but fully_shard shards it over mesh {_describe(dp_mesh)}, "
                "which is not another dimension of the expert-parallel mesh's parent; shard the experts over "
                "their expert-data-parallel mesh (the dimension next to the expert-parallel one in the same "
                "parent mesh, torchtitan's 'efsdp'): give fully_shard a shard_placement_fn returning "
                "ShardPlacementResult(Shard(0), FSDPMeshInfo(edp_mesh, shard_mesh_dim=0)) for them and None for "
                "the other parameters, as torchtitan's apply_fsdp_to_decoder does"
            )
        raise ValueError(
            f"mfsdp2 E40: parameter {fqn!r} of {where} is a DTensor on mesh {_describe(tp_mesh)} with placements "
            f"{tuple(p.placements)} that is not the other dimension of the data-parallel mesh's 2-D parent "
            f"(fully_shard shards it over {_describe(dp_mesh)}); build one mesh "
            "init_device_mesh(..., (dp, tp), mesh_dim_names=('dp', 'tp')), parallelise with "
            "mesh['tp'] and call fully_shard with mesh=mesh['dp']"
        )
    for pl in p.placements:
        if not isinstance(pl, (Shard, Replicate)) or type(pl) not in (Shard, Replicate):
            raise ValueError(
                f"mfsdp2: parameter {fqn!r} of {where} has {'expert' if ep else 'tensor'}-parallel placement {pl!r}; "
                "only Shard(d) and Replicate() parameters can be data-parallel sharded"
            )
    return TPSpec(tp_mesh, tuple(p.placements), p.shape)


def _describe(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names
    dims = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape)) if names else "x".join(map(str, mesh.shape))
    return f"({dims})"


def _dims_in_root(tp_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> Optional[tuple[torch.Tensor, str, str]]:
    """(the (tp, dp) grid of ranks containing this rank, tp name, dp name) when the two 1-D meshes
    are distinct dimensions of one parent mesh; None otherwise.

    Two ways to see it: a 2-D parent mesh whose dimensions they are (``init_device_mesh(..., (dp,
    tp))``), or -- torch's unflattened meshes (``world._unflatten(0, (pp, dp_replicate, efsdp, ep),
    ...)``, torchtitan's), whose sub-meshes know only their root (the 1-D world) -- their layouts
    in that root: a dimension is a set of offsets, and the grid holds ``base + t + d`` for each
    offset pair. The grid is checked against the two process groups either way."""
    root = _root(dp_mesh)
    # equal, not the same object: torch may hand sub-meshes of one world mesh different root objects
    if root is None or root != _root(tp_mesh) or tp_mesh.mesh_dim_names is None or dp_mesh.mesh_dim_names is None:
        return None
    tn, dn = tp_mesh.mesh_dim_names[0], dp_mesh.mesh_dim_names[0]
    if tn == dn:
        return None
    names = root.mesh_dim_names or ()
    if root.ndim == 2 and tn in names and dn in names:
        grid = root.mesh.permute(names.index(tn), names.index(dn))
    else:
        grid = _grid_from_layouts(root, tp_mesh, dp_mesh)
        if grid is None:
            return None
    me = dist.get_rank()
    tp_ranks, dp_ranks = tp_mesh.mesh.flatten().tolist(), dp_mesh.mesh.flatten().tolist()
    where = (grid == me).nonzero()
    if where.shape[0] != 1 or grid.unique().numel() != grid.numel():
        return None
    i, j = where[0].tolist()
    if grid[:, j].tolist() != tp_ranks or grid[i, :].tolist() != dp_ranks:
        return None
    return grid.contiguous(), tn, dn


def _axis_offsets(mesh: DeviceMesh) -> Optional[list[int]]:
    """The offsets in its root of a 1-D mesh's members, in its own order (torch's ``_layout``:
    one axis, possibly a flattened one of several (size, stride) pairs); None without it."""
    axes = getattr(getattr(mesh, "_layout", None), "axes", None)
    if axes is None or len(axes) != 1:
        return None
    shape, stride = tuple(axes[0].shape), tuple(axes[0].stride)
    offsets = [0]
    for n, st in zip(shape, stride):
        offsets = [o + k * st for o in offsets for k in range(n)]
    return offsets


def _grid_from_layouts(root: DeviceMesh, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> Optional[torch.Tensor]:
    t_off, d_off = _axis_offsets(tp_mesh), _axis_offsets(dp_mesh)
    if t_off is None or d_off is None:
        return None
    ranks = root.mesh.flatten().tolist()
    me = dist.get_rank()
    if me not in ranks:
        return None
    base = ranks.index(me) - t_off[tp_mesh.get_local_rank()] - d_off[dp_mesh.get_local_rank()]
    try:
        return torch.tensor([[ranks[base + t + d] for d in d_off] for t in t_off], dtype=torch.int)
    except IndexError:
        return None


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
    """The (tp, dp)-ordered 2-D mesh over the existing groups (cached per pair): this rank's
    (tp, dp) slice of their parent (torchtitan's size-1 ``pp`` and ``dp_replicate`` around
    ``efsdp`` and ``ep`` fixed at this rank's coordinates)."""
    key = (id(tp_mesh), id(dp_mesh))
    if key not in _meshes:
        grid, tn, dn = _dims_in_root(tp_mesh, dp_mesh)
        _meshes[key] = DeviceMesh.from_group(
            [tp_mesh.get_group(), dp_mesh.get_group()], tp_mesh.device_type, mesh=grid, mesh_dim_names=(tn, dn)
        )
        # Keyed by the objects' ids, so the entry goes when either mesh does: a later mesh that
        # reuses an id (after a re-initialised process group, say) must not find this one's
        # groups; and the cache keeps no destroyed group alive.
        for m in (tp_mesh, dp_mesh):
            weakref.finalize(m, _meshes.pop, key, None)
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
