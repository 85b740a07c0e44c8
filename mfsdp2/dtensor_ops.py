"""In-place ``copy_`` into our ``RowShard`` parameters, from any full-tensor description.

Why: initialising or loading a sharded parameter in place (``p.copy_(distribute_tensor(full,
mesh, [Replicate()]))``, a model's own ``load_state_dict`` pre-hook that merges q/k/v and copies
into the fused weight, ``p.copy_(full)``) goes through DTensor's sharding propagation for
``aten.copy_``, which rebuilds the destination's placement as a plain ``Shard(0)``: the source is
then split by ``torch.chunk`` (20 rows) while our shard holds its layout's rows (40, or 0), and
the copy fails with a size mismatch -- or, where the counts happen to agree on one rank, copies
the wrong rows. ``RowShard``'s own redistribute hooks are never asked.

So ``copy_`` whose destination carries a :class:`~mfsdp2.placement.RowShard` is handled here (a
DTensor custom op handler, consulted before sharding propagation): the source's rows for this rank
are taken directly --

* a plain tensor of the parameter's global shape (or broadcastable to it): sliced, no
  communication (DTensor itself refuses mixing plain tensors and DTensors here; for our
  parameters the meaning is unambiguous: the full value);
* a DTensor on the same mesh, ``Replicate`` on every dimension: its local tensor, sliced;
* a DTensor with the destination's placements (our rows; results computed from our parameters
  carry them too, see :mod:`mfsdp2.row_propagation`): a local copy;
* a DTensor ``Shard(0)`` (``torch.chunk`` rows, e.g. from torch FSDP2 or ``distribute_tensor``):
  gathered with plain collectives on the chunk row counts, then sliced.

Traced code (dynamo's fake tensors) is left to DTensor: it runs no collectives, and what a compiled
optimizer step copies into a parameter is computed from our parameters.

Anything else (other meshes, partial sums, tensor-parallel layouts) goes to DTensor's default
handling. Every other destination is untouched: the handler hands the call back to DTensor.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Replicate, Shard

from .placement import RowShard, chunk_rows

__all__ = ["install"]

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
_previous = None  # a handler someone registered before us (chained, not replaced)


def _row_shard_dim(placements) -> Optional[int]:
    """The mesh dimension of the only RowShard when every other placement is Replicate."""
    found = None
    for d, pl in enumerate(placements):
        if isinstance(pl, RowShard) and pl.dim == 0 and found is None:
            found = d
        elif not isinstance(pl, Replicate):
            return None
    return found


def _source_rows(dst: DTensor, src, mesh_dim: int, lo: int, n: int) -> Optional[torch.Tensor]:
    """This rank's rows ``[lo, lo + n)`` of ``src`` as a plain tensor; None: not a case we handle."""
    shape = dst.shape
    if not isinstance(src, DTensor):
        if not isinstance(src, torch.Tensor):
            return None
        return torch.broadcast_to(src, shape).narrow(0, lo, n)
    if src.device_mesh != dst.device_mesh or src.shape != shape:
        return None
    pls = src.placements
    if all(isinstance(p, Replicate) for p in pls):
        return src._local_tensor.narrow(0, lo, n)
    if tuple(pls) == tuple(dst.placements) and all(
        isinstance(a, RowShard) == isinstance(b, RowShard) and getattr(a, "rows", None) == getattr(b, "rows", None)
        for a, b in zip(pls, dst.placements)
    ):
        return src._local_tensor
    if type(pls[mesh_dim]) is Shard and pls[mesh_dim].dim == 0 and all(
        isinstance(p, Replicate) for d, p in enumerate(pls) if d != mesh_dim
    ):
        mesh = dst.device_mesh
        rows = chunk_rows(shape[0], mesh.size(mesh_dim))
        if tuple(rows) == dst.placements[mesh_dim].rows:
            return src._local_tensor  # the same split: nothing to move
        full = RowShard(0, rows)._to_replicate_tensor(src._local_tensor, mesh, mesh_dim, shape)
        return full.narrow(0, lo, n)
    return None


def _copy_handler(op_call, args, kwargs):
    dst, src = args[0], args[1]
    if torch.compiler.is_compiling() or is_fake(getattr(dst, "_local_tensor", None)):
        # Traced code (a compiled optimizer step) copies results of ops on our parameters, which
        # hold our rows; tracing runs no collectives. DTensor's own path copies locally.
        return _default(op_call, args, kwargs)
    mesh_dim = _row_shard_dim(dst.placements) if isinstance(dst, DTensor) else None
    rows = None
    if mesh_dim is not None:
        pl = dst.placements[mesh_dim]
        coord = dst.device_mesh.get_coordinate()
        c = coord[mesh_dim]
        rows = _source_rows(dst, src, mesh_dim, pl.starts[c], pl.rows[c])
    if rows is None:
        return _default(op_call, args, kwargs)
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    dst._local_tensor.copy_(rows, non_blocking)
    return dst


def _default(op_call, args, kwargs):
    if _previous is not None:
        return _previous(op_call, args, kwargs)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    mine = handlers.pop(op_call)  # DTensor's own path, then ours again
    try:
        return op_call(*args, **kwargs)
    finally:
        handlers[op_call] = mine


def install() -> None:
    """Register the ``copy_`` handler once per process (idempotent)."""
    global _previous
    handlers = DTensor._op_dispatcher._custom_op_handlers
    current = handlers.get(_aten.copy_.default)
    if current is _copy_handler:
        return
    _previous = current
    handlers[_aten.copy_.default] = _copy_handler
    logger.debug("mfsdp2: DTensor copy_ handler for RowShard destinations installed")


install()
