"""Per-parameter meshes: where each parameter of a unit is sharded, from ``shard_placement_fn``.

torch 2.13's ``shard_placement_fn`` may return, per parameter, ``None`` (``Shard(0)`` on the
unit's mesh), ``Shard(d)`` (dimension ``d`` on the unit's mesh), or a ``ShardPlacementResult``
``(placement, mesh_info)``: the placement on the mesh of ``mesh_info`` (torch's ``FSDPMeshInfo``
for a 1-D shard mesh, ``HSDPMeshInfo`` for a 2-D (replicate, shard) one). torchtitan's MoE
models use the last form with expert parallelism: the routed experts -- already DTensors on the
``ep`` mesh -- are sharded over the expert-data-parallel mesh (``efsdp``), everything else over
the data-parallel one (``fsdp``).

:func:`resolve` turns the answers into one :class:`ParamPlacement` per parameter: the
placement (what :func:`mfsdp2.dtensors.shard_dim.shard_dims` reads) and the data-parallel mesh.
The unit then groups its parameters by that mesh (with the dtype policy,
:mod:`mfsdp2.frontend.param_grouping`): each group has its own flat buffers and communicators,
and is gathered and reduced in the unit's recorded order like any other group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParamPlacement", "resolve", "answers", "is_placement_result"]


@dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter is sharded: ``placement`` (``None`` or a ``Shard``, validated later by
    ``shard_dims``) over ``mesh`` (1-D, or 2-D (replicate, shard) for HSDP); ``own_mesh``: the
    mesh came from a ``ShardPlacementResult`` rather than the unit's ``mesh``."""

    placement: Any
    mesh: DeviceMesh
    own_mesh: bool = False


def is_placement_result(answer: Any) -> bool:
    """torch's ``ShardPlacementResult`` (duck-typed: a torch without it never returns one)."""
    return type(answer).__name__ == "ShardPlacementResult" and hasattr(answer, "mesh_info")


def _mesh_of(mesh_info: Any, fqn: str, where: str) -> DeviceMesh:
    """The data-parallel mesh a ``ShardPlacementResult``'s mesh info names, in mfsdp2's
    convention (1-D shard mesh, or 2-D with the replicate dimension first)."""
    kind = type(mesh_info).__name__
    mesh = getattr(mesh_info, "mesh", None)
    shard_dim = getattr(mesh_info, "shard_mesh_dim", None)
    replicate_dim = getattr(mesh_info, "replicate_mesh_dim", None)
    advice = (
        "return ShardPlacementResult(Shard(d), FSDPMeshInfo(mesh, shard_mesh_dim=0)) with a 1-D mesh, or "
        "HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0) with a 2-D (replicate, shard) mesh"
    )
    if not isinstance(mesh, DeviceMesh) or shard_dim is None:
        raise ValueError(
            f"mfsdp2 E70: shard_placement_fn returned a ShardPlacementResult with mesh info {kind} for parameter "
            f"{fqn!r} of {where}; a per-parameter mesh must shard (FSDP or HSDP, as torch FSDP2 requires): {advice}"
        )
    if getattr(mesh_info, "is_spmd_mesh", False):
        raise ValueError(
            f"mfsdp2 E70: shard_placement_fn returned a ShardPlacementResult for parameter {fqn!r} of {where} whose "
            f"mesh info {kind} was built from dp_mesh_dims over a whole SPMD mesh "
            f"{tuple(mesh_info.spmd_mesh.mesh_dim_names or ())}; "
            "mfsdp2 takes per-parameter meshes as data-parallel sub-meshes: build the mesh info from the sub-mesh "
            "itself (torchtitan: --parallelism.spmd-backend partial_dtensor, where _get_mesh_info gets no "
            f"dp_mesh_dims); {advice}"
        )
    ok = (mesh.ndim == 1 and shard_dim == 0 and replicate_dim is None) or (
        mesh.ndim == 2 and shard_dim == 1 and replicate_dim == 0
    )
    if not ok:
        raise ValueError(
            f"mfsdp2 E70: shard_placement_fn returned a ShardPlacementResult for parameter {fqn!r} of {where} with a "
            f"{mesh.ndim}-D mesh {tuple(mesh.mesh_dim_names or ())}, shard_mesh_dim={shard_dim}, "
            f"replicate_mesh_dim={replicate_dim}; {advice}"
        )
    return mesh


def answers(params: Sequence[torch.Tensor], placements: Sequence[ParamPlacement]) -> Callable:
    """A ``shard_placement_fn`` answering each parameter's resolved placement (what
    :func:`mfsdp2.dtensors.shard_dim.shard_dims` validates), without calling the user's again."""
    by_id = {id(p): pl.placement for p, pl in zip(params, placements)}
    return lambda p: by_id[id(p)]


def resolve(
    shard_placement_fn: Optional[Callable], params: Sequence[torch.Tensor], fqns: Sequence[str], where: str,
    mesh: DeviceMesh
) -> list[ParamPlacement]:
    """Each parameter's placement and data-parallel mesh (``mesh``: the unit's, the default).
    ``shard_placement_fn`` is called once per parameter, as FSDP2 calls it."""
    if shard_placement_fn is None:
        return [ParamPlacement(None, mesh) for _ in params]
    out = []
    for p, fqn in zip(params, fqns):
        answer = shard_placement_fn(p)
        if is_placement_result(answer):
            own = _mesh_of(answer.mesh_info, fqn, where)
            out.append(ParamPlacement(answer.placement, own, own_mesh=own is not mesh))
        else:
            out.append(ParamPlacement(answer, mesh))
    return out
