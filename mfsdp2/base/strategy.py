"""Sharding strategies (ZeRO stages) and the data-parallel topology they run on.

What each strategy keeps per rank (``P`` = the unit's padded element count, ``N`` = shard-group
size; the optimizer's states always follow the parameters it is handed):

============================  =================  =============  ================  =============
``sharding_strategy``         model weights      main weights   main gradients    optimizer
============================  =================  =============  ================  =============
``"no_shard"`` (DDP)          ``P`` (= main)     ``P``          ``P``             ``P``
``"optim"`` (ZeRO-1)          ``P``              ``P/N``        ``P``             ``P/N``
``"optim_grads"`` (ZeRO-2)    ``P``              ``P/N``        ``P/N``           ``P/N``
``"optim_grads_params"``      ``P/N`` (+``P``    ``P/N``        ``P/N``           ``P/N``
(ZeRO-3, default)             while gathered)
============================  =================  =============  ================  =============

When the main and model dtypes match, the main weights *are* this rank's slice of the model
weights (no second copy). Strategies that keep full model weights gather them once per optimizer
step or other change of the weights (see :mod:`mfsdp2.groups.weight_watch`: step hook, version counters,
content fingerprint; the ranks agree with one small all-reduce per forward, read on the host)
instead of once per forward and once per backward.
no_shard all-reduces its gradients (as DDP does); the others reduce-scatter -- ZeRO-1 too, into
this rank's rows of its full-size gradient (the rows its optimizer steps; the full size is where
micro-batches accumulate without communication), as Megatron's distributed optimizer does.

Topology: a 1-D mesh is the shard group. A 2-D mesh ``(replicate, shard)`` is HSDP: gradients
are reduce-scattered inside the shard group and then all-reduced across the replicate group (the
shard-group's result is what crosses the slower links). ``no_shard`` on a 1-D mesh is the same
machinery with a shard group of one rank: every rank replicates everything and the all-reduce
runs over the mesh.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

__all__ = ["ShardingStrategy", "Topology"]


class ShardingStrategy(enum.Enum):
    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @classmethod
    def parse(cls, value: Union[str, "ShardingStrategy"], where: str) -> "ShardingStrategy":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(s.value) for s in cls)
            raise ValueError(f"mfsdp2 E34: unknown sharding_strategy {value!r} for {where}; "
                             f"use one of {names}") from None

    @property
    def shards_params(self) -> bool:
        """Model weights are freed after use and gathered again (ZeRO-3)."""
        return self is ShardingStrategy.OPTIM_GRADS_PARAMS

    @property
    def shards_grads(self) -> bool:
        """Gradients are reduce-scattered into a shard-size main gradient (ZeRO-2/3)."""
        return self in (ShardingStrategy.OPTIM_GRADS, ShardingStrategy.OPTIM_GRADS_PARAMS)

    @property
    def shards_optim(self) -> bool:
        """The optimizer sees only this rank's rows (every strategy but ``no_shard``)."""
        return self is not ShardingStrategy.NO_SHARD

    def keeps_full_weights(self, shard_world: int, shares_main: bool, fp8: bool) -> bool:
        """Whether a group keeps its full model weights between steps (persistent) instead of
        gathering them for each use: the strategies that do not shard parameters, and ZeRO-3 on
        a shard group of one rank whose main weights are its compute weights (``shares_main``:
        same dtype, not offloaded) and that no FP8 gather quantises -- there the one shard is
        the whole parameter, and a gather would only copy it into a second full-size buffer.
        The runtime's groups and the memory estimate both decide by this."""
        return not self.shards_params or (shard_world == 1 and shares_main and not fp8)


@dataclass(frozen=True)
class Topology:
    """Which mesh dimension shards and which replicates, for one ``fully_shard`` call.

    ``shard_dim``: the mesh dimension the layout splits over (None for ``no_shard``: the shard
    group is this rank alone); ``replicate_dim``: the mesh dimension whose ranks hold the same
    shards and all-reduce their gradients (None for plain FSDP)."""

    shard_dim: Optional[int]
    replicate_dim: Optional[int]

    @classmethod
    def of(cls, mesh_ndim: int, strategy: ShardingStrategy, where: str) -> "Topology":
        if mesh_ndim == 1:
            return cls(None, 0) if strategy is ShardingStrategy.NO_SHARD else cls(0, None)
        if mesh_ndim == 2:
            if strategy is ShardingStrategy.NO_SHARD:
                raise ValueError(
                    f"mfsdp2 E35: sharding_strategy='no_shard' for {where} replicates over every rank: pass a "
                    "1-D mesh over all data-parallel ranks, not a 2-D (replicate, shard) mesh"
                )
            return cls(1, 0)
        raise ValueError(
            f"mfsdp2 E05: {where} got a {mesh_ndim}-D mesh; pass a 1-D data-parallel mesh or a 2-D "
            "(replicate, shard) mesh for HSDP (for tensor parallelism, pass the data-parallel "
            "sub-mesh, e.g. mesh['dp'])"
        )
