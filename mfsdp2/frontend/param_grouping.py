"""A unit's parameter groups: one per (data-parallel mesh, dtype policy).

Each group is one flat buffer with its own communicators (:class:`~mfsdp2.groups.param_group.ParameterGroup`),
so parameters are grouped by what their collectives need to agree on:

* the **mesh** a parameter is sharded over (the unit's, or its own from ``shard_placement_fn``,
  :mod:`mfsdp2.frontend.param_meshes`) -- keyed by its process groups (shard, replicate), as
  torch FSDP2 keys its ``FSDPParamGroup`` s, so two mesh objects over the same groups share one;
* the **dtype policy**: dtype, ``requires_grad``, and the FP8 gather dtype for parameters of two
  or more dimensions.

The dimension a parameter is sharded on (``Shard(d)``) is not part of the key: a buffer holds
parameters of any shard dimension (:mod:`mfsdp2.dtensors.shard_dim`), as one FSDP2 group holds
``Shard(0)`` and ``Shard(1)`` parameters in one all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..base.strategy import ShardingStrategy, Topology
from ..comm.communicator import Communicator
from .param_meshes import ParamPlacement

__all__ = ["MeshComms", "mesh_comms", "group_indices", "refuse_partial_reshard"]


@dataclass(frozen=True)
class MeshComms:
    """One data-parallel mesh of a unit, with its topology and communicators."""

    mesh: DeviceMesh
    topology: Topology
    comm: Communicator  # the shard group's (this rank alone for no_shard)
    replicate: Optional[Communicator]  # HSDP / no_shard's replicate group; None for FSDP

    @property
    def tag(self) -> str:
        """The mesh's dimension names (e.g. ``efsdp``), telling its groups from the unit mesh's."""
        names = self.mesh.mesh_dim_names
        return "mesh=" + ("x".join(names) if names else "x".join(map(str, self.mesh.shape)))

    @property
    def key(self) -> tuple:
        """The process groups, as FSDP2 keys its parameter groups."""
        return (id(self.comm.group), id(self.replicate.group) if self.replicate is not None else None)

    def tag_within(self, unit: "MeshComms") -> str:
        """The tag of a group on this mesh in a unit whose own mesh is ``unit`` ("" there)."""
        return "" if self.key == unit.key else self.tag


def mesh_comms(
    placements: Sequence[ParamPlacement],
    unit: MeshComms,
    strategy: ShardingStrategy,
    where: str,
    communicator: Callable[[DeviceMesh, Optional[int]], Communicator],
) -> list[MeshComms]:
    """Each parameter's mesh with its communicators (``unit``: the unit's own mesh's; the others
    are made once per distinct mesh, ``communicator(mesh, dim)`` caching per process group)."""
    made: dict[int, MeshComms] = {id(unit.mesh): unit}
    out = []
    for pl in placements:
        mc = made.get(id(pl.mesh))
        if mc is None:
            topology = Topology.of(pl.mesh.ndim, strategy, where)
            if pl.mesh.get_coordinate() is None:
                raise ValueError("mfsdp2 E06: this rank is not part of the mesh shard_placement_fn gave "
                                 f"a parameter of {where}")
            rep = communicator(pl.mesh, topology.replicate_dim) if topology.replicate_dim is not None else None
            mc = MeshComms(pl.mesh, topology, communicator(pl.mesh, topology.shard_dim), rep)
            made[id(pl.mesh)] = mc
        out.append(mc)
    return out


def refuse_partial_reshard(k: int, meshes: Sequence[MeshComms], where: str) -> None:
    """``reshard_after_forward=<int>`` keeps blocks of ``k`` of one mesh's ranks: a unit sharded
    over several meshes (other groups, other ranks) cannot (E73)."""
    n = len({m.key for m in meshes})
    if n > 1:
        raise ValueError(
            f"mfsdp2 E73: reshard_after_forward={k} (an int) for {where}, whose parameters are sharded over {n} "
            "meshes (shard_placement_fn); a partial reshard keeps blocks of one mesh's ranks, which the other "
            "meshes do not have: pass reshard_after_forward=True or False"
        )


def group_indices(
    params: Sequence[torch.Tensor], meshes: Sequence[MeshComms], fqns: Sequence[str], where: str,
    all_gather_dtype: Optional[torch.dtype],
) -> dict[tuple, list[int]]:
    """The parameters' indices per group key ``(mesh key, dtype, requires_grad, fp8 dtype)``, in
    registration order (groups in the order their first parameter appears)."""
    by_key: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if p.dim() == 0:
            raise ValueError(
                f"mfsdp2 E03: parameter {fqns[i]!r} of {where} is 0-dimensional; FSDP shards dim 0, "
                "so store it with shape (1,)"
            )
        fp8 = all_gather_dtype if p.dim() >= 2 and p.dtype.is_floating_point else None
        by_key.setdefault((meshes[i].key, p.dtype, p.requires_grad, fp8), []).append(i)
    return by_key
