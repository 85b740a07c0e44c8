"""Sharding a parameter on a dimension other than 0: ``shard_placement_fn`` returning ``Shard(d)``.

Why: FSDP2 lets ``shard_placement_fn`` pick the sharded dimension per parameter. torchtitan uses
it for MoE expert weights ``(experts, dim, hidden)``: with fewer experts than shard ranks a
dim-0 split leaves ranks without rows (and with expert parallelism dim 0 is already split), so
it shards them on dim 1.

How (the "transposed rows" layout). mfsdp2 stores a unit's parameters as whole rows of one flat
buffer per group (:mod:`mfsdp2.memory.layout`): rank ``r`` owns a contiguous slice, and every
parameter's piece there is a run of dim-0 rows. A ``Shard(d)`` parameter is stored with dim ``d``
moved to the front: its slot holds ``p.movedim(d, 0)`` contiguously, so a run of *storage* rows
is a run of slices along ``d`` of the parameter -- exactly a dim-``d`` shard. Nothing else in the
buffer machinery changes: the layout plans the storage shape (its rows are the slices along
``d``), the collectives move flat bytes, and the views are the only place that knows:

* the gathered parameter the module computes with is ``storage.movedim(0, d)``: a
  *non-contiguous* view of the gathered buffer, so the all-gather still writes the parameters in
  place (zero copy; FSDP2 copies a ``Shard(d)`` parameter out of its gather output into a
  contiguous tensor, and copies the gradient back before the reduce-scatter);
* the optimizer-facing DTensor's local tensor is this rank's storage rows moved back
  (``piece.movedim(0, d)``), placed ``RowShard(d, rows)``: ``rows[r]`` slices along ``d`` on rank
  ``r``. ``full_tensor()``, ``redistribute``, DCP chunk offsets and ``distribute_tensor`` read the
  split from it, as for dim 0 (:mod:`mfsdp2.dtensors.placement`); results of ops on such tensors keep it
  (:mod:`mfsdp2.dtensors.row_propagation`, which lines up row splits along any dimension);
* gradients are packed in storage order (:func:`storage_flat`: the gradient autograd gives the
  strided parameter has the parameter's strides, so this is a plain copy).

The split along ``d`` is the layout's (it need not be ``torch.chunk``'s, and ``d``'s size need not
divide by the world size; FSDP2 requires it to): checkpoints move between the two by offsets.

What differs from FSDP2: the gathered parameter is not contiguous (``weight.view(...)`` in a
module's forward raises; ``reshape`` works), which is what makes the gather copy-free. What it
costs is measured in docs/design.md ("Shard(dim != 0)").

Tensor- and expert-parallel parameters (:mod:`mfsdp2.dtensors.tensor_parallel`) take any ``d``,
including the dim their own placement splits (a row-wise parallel weight, ``Shard(1)`` on tp,
sharded ``Shard(1)``): the layout holds the TP-local tensor dim-``d`` first as any other, and the
optimizer-facing DTensor lives on the ``(tp, dp)`` mesh as ``(Shard(d), RowShard(d, rows))``.
DTensor applies placements in mesh order, so that reads "TP splits dim ``d`` of the global
tensor, dp splits dim ``d`` of the TP piece" -- the truth, with ``rows`` counted within the TP
piece (``compute_local_shape_and_global_offset`` composes the two offsets; ``full_tensor()``
gathers dp, then tp). FSDP2 orders its mesh ``(dp, tp)``, where the same layout needs
``_StridedShard(d, split_factor=tp)``; checkpoints move between the two by offsets. TP pieces of
unequal sizes (41 columns over tp 2) work too: each TP rank's layout has its own rows, and only
ranks of one TP coordinate (one dp group) compare them.

Where it cannot apply: ``no_shard`` keeps every parameter whole (the placement is ignored, as
FSDP2 ignores it on a mesh without a shard dimension).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch
from torch.distributed.tensor import Shard

__all__ = [
    "InvalidShardDimError",
    "storage_shape",
    "to_storage",
    "from_storage",
    "storage_flat",
    "rows_along",
    "shard_dims",
]

logger = logging.getLogger(__name__)


class InvalidShardDimError(ValueError, AssertionError):
    """``shard_placement_fn`` named a dimension the parameter does not have (FSDP2: AssertionError)."""


def storage_shape(shape: Sequence[int], dim: int) -> tuple[int, ...]:
    """The shape a parameter sharded on ``dim`` is stored with: ``dim`` first."""
    shape = tuple(int(s) for s in shape)
    if dim == 0 or not shape:
        return shape
    return (shape[dim],) + shape[:dim] + shape[dim + 1 :]


def to_storage(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` (parameter order) as a view in storage order (``dim`` first)."""
    return t if dim == 0 else t.movedim(dim, 0)


def from_storage(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` (storage order) as a view in the parameter's order."""
    return t if dim == 0 else t.movedim(0, dim)


def storage_flat(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` (parameter order) flattened in storage order: what its slot of a flat buffer holds.
    A view when ``t`` has the strided parameter's layout (its gradients do), else a copy."""
    return to_storage(t, dim).reshape(-1)


def rows_along(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """Slices ``[start, stop)`` of ``t`` along ``dim`` (a view): one rank's piece of a full tensor."""
    return t.narrow(dim, start, stop - start) if t.dim() else t


def shard_dims(
    shard_placement_fn: Optional[Callable],
    fqns: list[str],
    params: list[torch.Tensor],
    where: str,
    shards: bool,
) -> list[int]:
    """The dimension each parameter is sharded on, from FSDP2's ``shard_placement_fn``: ``None``
    and ``Shard(0)`` give 0, ``Shard(d)`` (``d`` may be negative) gives ``d``. Refused, naming the
    parameter: a dimension the parameter does not have (FSDP2's ``AssertionError`` type, reported
    first, as FSDP2 checks it first) and any other placement (``_StridedShard``, ``Replicate``).
    A model-parallel parameter's ``d`` is a dim of its TP-local tensor, split or not by its own
    placement (see the module docstring). A ``ShardPlacementResult``'s mesh is
    resolved before (:mod:`mfsdp2.frontend.param_meshes`): ``shard_placement_fn`` here answers its
    placement. ``shards``: False
    for ``no_shard``, where every parameter stays whole and the answers are not used."""
    if shard_placement_fn is None:
        return [0] * len(params)
    answers = [shard_placement_fn(p) for p in params]
    plain = [r is None or type(r) is Shard for r in answers]
    invalid = [
        i for i, (p, r) in enumerate(zip(params, answers))
        if plain[i] and r is not None and not -p.dim() <= r.dim < max(p.dim(), 1)
    ]
    if invalid:
        i = invalid[0]
        raise InvalidShardDimError(
            f"mfsdp2 E47: shard_placement_fn returned {answers[i]!r} for parameter {fqns[i]!r} of {where}, which has "
            f"{params[i].dim()} dims; return Shard(d) with -{params[i].dim()} <= d < {params[i].dim()}, or None"
        )
    for i, r in enumerate(answers):
        if not plain[i]:
            raise ValueError(
                f"mfsdp2 E46: shard_placement_fn returned {r!r} for parameter {fqns[i]!r} of {where}; mfsdp2 "
                "shards each parameter over a mesh on one dimension: return Shard(d) or None "
                "(on the unit's mesh), or ShardPlacementResult(Shard(d), mesh_info) for a mesh of its own "
                "(strided and replicated placements are not supported)"
            )
    dims = [0 if r is None else r.dim % max(p.dim(), 1) for p, r in zip(params, answers)]
    if not shards:
        if any(dims):
            logger.debug("mfsdp2: %s is not sharded (no_shard): shard_placement_fn's dims are not used", where)
        return [0] * len(params)
    return dims
