"""Results computed from our ``RowShard`` DTensors keep ``RowShard``; ``distribute_tensor`` honours it.

Why: DTensor's sharding rules build their output placements afresh (``Shard(0)`` objects made by
the strategy, not the input's placement object). For our uneven, row-aligned shards that label is
a lie: ``(p * 2)``, ``p.clone()``, ``p.to(torch.float64)``, ``p.view(...)``, ``p.sum(1)`` or a
``_foreach`` result held our rows but claimed ``torch.chunk``'s, so its ``full_tensor()`` came back
wrong-sized or wrong (or, with a shape argument such as ``view``, the op failed), and DCP would
write it at the wrong offsets. Users compute such tensors all the time (EMA copies, a detached
clone for logging, a bf16 copy of the weights for export, an optimizer's temporary).

How: the propagator's uncached entry point is wrapped once per process; after DTensor has chosen
the strategy, every output placement that is a plain ``Shard(0)`` on a mesh dimension where an
input carried ``RowShard(0, rows)`` *with the same dim-0 size* is replaced by that ``RowShard``:
a sharding rule that keeps dim 0 sharded without redistributing the input computes each rank's
output rows from its own input rows, so the output holds exactly the input's rows. The rewrite is
refused when inputs disagree on that dimension (two different row splits, or a ``torch.chunk``
split that is not ours): DTensor would combine mismatched local rows there anyway, and we do not
guess. Shape arguments that DTensor rewrote from the global shape to the local one (``view``,
``new_empty``) are recomputed from the relabelled placement.

The caches. ``RowShard`` must compare equal to ``Shard(0)`` placement by placement (that is how
DTensor's rules accept it as a dim-0 shard without redistributing), but a cached decision made for
a ``torch.chunk``-sharded tensor must never serve ours, nor the reverse. The rewrite happens before
the result is cached; ``RowShard`` hashes with its row counts (see :mod:`mfsdp2.placement`); and
two DTensor *specs* compare unequal when one carries ``RowShard`` where the other has a plain
``Shard``. The last is needed because the C++ dispatch cache compares keys that merely share a
hash bucket by equality alone (it skips the hash check), so a same-shape FSDP2 or
``distribute_tensor`` DTensor could otherwise, by chance of the bucket, receive our decision.

``distribute_tensor(full, mesh, placements)`` with our parameter's placements (what torch's
``set_optimizer_state_dict(full_state_dict=True)`` does with every full optimizer state, and what
user init code does) split by ``torch.chunk`` whatever the placement said, and labelled the result
plain ``Shard(0)``: the optimizer then held states of other sizes than its parameters' shards.
It now gives each rank the rows its ``RowShard`` names (the data still comes from
``src_data_rank``, as torch's does).

``redistribute`` decides what to move by comparing placements, and ``RowShard`` equals
``Shard(0)``: ``p.redistribute(mesh, [Shard(0)])`` moved nothing and returned our rows where the
caller asked for ``torch.chunk``'s (and a chunk-split DTensor redistributed to our ``RowShard``
kept the chunk rows). Where the two splits differ, the mesh dimension now goes through
``Replicate`` (one gather) and then to the requested split, so the result holds the rows its
placement names; where they coincide nothing moves.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Optional

import sys

import torch
import torch.distributed.tensor as _dtensor_pkg
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .placement import RowShard, chunk_rows

__all__ = ["install"]

logger = logging.getLogger(__name__)

_CONFLICT = object()  # inputs disagree on the rows of this (mesh dim, dim-0 size)


def _specs(obj: Any):
    if isinstance(obj, DTensorSpec):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _specs(o)


def _input_row_splits(op_schema) -> dict[tuple[int, int], Any]:
    """``(mesh dim, dim-0 size) -> RowShard`` for the inputs sharded on dim 0 by our rows;
    ``_CONFLICT`` where another dim-0 split of the same size is there too."""
    found: dict[tuple[int, int], Any] = {}
    plain: set[tuple[int, int]] = set()
    for spec in _specs(tuple(op_schema.args_schema) + tuple(op_schema.kwargs_schema.values())):
        meta = spec.tensor_meta
        if meta is None or len(meta.shape) == 0 or type(meta.shape[0]) is not int:
            continue  # symbolic sizes (dynamic-shape tracing): no guard is added for us
        for d, pl in enumerate(spec.placements):
            if not isinstance(pl, Shard) or pl.dim != 0:
                continue
            key = (d, meta.shape[0])
            if isinstance(pl, RowShard):
                prev = found.get(key)
                found[key] = pl if prev is None or prev == pl else _CONFLICT
            else:
                plain.add(key)
    for key in plain & found.keys():
        rs = found[key]
        if rs is not _CONFLICT and tuple(rs.rows) != chunk_rows(key[1], len(rs.rows)):
            found[key] = _CONFLICT  # a torch.chunk split and ours meet: not ours to relabel
    return found


def _relabel(spec: Optional[DTensorSpec], splits) -> Optional[DTensorSpec]:
    """``spec`` with our RowShard where it says plain ``Shard(0)``; None when nothing changes."""
    if not isinstance(spec, DTensorSpec) or spec.tensor_meta is None or len(spec.tensor_meta.shape) == 0:
        return None
    n = spec.tensor_meta.shape[0]
    if type(n) is not int:
        return None
    new = list(spec.placements)
    changed = False
    for d, pl in enumerate(new):
        if type(pl) is Shard and pl.dim == 0:
            rs = splits.get((d, n))
            if isinstance(rs, RowShard):
                new[d] = rs
                changed = True
    if not changed:
        return None
    return dataclasses.replace(spec, placements=tuple(new))


def _rewrite(propagator, op_schema, out):
    splits = _input_row_splits(op_schema)
    if not splits or out is None:
        return out
    spec = out.output_spec
    if isinstance(spec, DTensorSpec):
        new = _relabel(spec, splits)
        if new is None:
            return out
        out.output_spec = new
        _fix_shape_args(propagator, op_schema, out, new)
    elif isinstance(spec, (list, tuple)):
        news = [_relabel(s, splits) for s in spec]
        if all(n is None for n in news):
            return out
        out.output_spec = type(spec)(n if n is not None else s for s, n in zip(spec, news))
    return out


def _fix_shape_args(propagator, op_schema, out, spec: DTensorSpec) -> None:
    """Ops with a shape argument (``view``, ``new_empty``...) had it rewritten to the local shape
    of the plain ``Shard(0)``; rewrite it again for our rows."""
    idx = getattr(propagator, "op_to_shape_and_stride_idx", {})
    if op_schema.op not in idx or out.redistribute_schema is None or not out.use_val_from_redistribute_schema:
        return
    adjust = getattr(propagator, "_adjust_shape_and_stride_args", None)
    if adjust is not None:
        out.redistribute_schema = adjust(spec.tensor_meta, out.redistribute_schema, spec)
        return
    # Older torch does the rewrite inline: redo it the same way (global -> local shape/stride).
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset, compute_local_stride

    where = idx[op_schema.op]
    shape_idx, stride_idx = where if isinstance(where, tuple) else (where, None)
    schema = out.redistribute_schema
    args = list(schema.args_schema)
    local_shape, _ = compute_local_shape_and_global_offset(spec.tensor_meta.shape, spec.mesh, spec.placements)
    args[shape_idx] = local_shape
    if stride_idx is not None:
        args[stride_idx] = compute_local_stride(spec.tensor_meta.stride, local_shape)
    out.redistribute_schema = OpSchema(schema.op, tuple(args), schema.kwargs_schema)


def _mixes_row_and_chunk(a, b) -> bool:
    if a is b:
        return False
    for x, y in zip(a, b):
        # Same type (the common case) or not both shards: nothing to tell apart.
        if type(x) is not type(y) and isinstance(x, Shard) and isinstance(y, Shard):
            if isinstance(x, RowShard) != isinstance(y, RowShard):
                return True
    return False


def _install_spec_eq() -> None:
    if getattr(DTensorSpec, "_mfsdp2_row_eq", False):
        return
    plain_eq = DTensorSpec.__eq__

    def __eq__(self, other):
        same = plain_eq(self, other)
        if same is True and _mixes_row_and_chunk(self.placements, other.placements):
            return False
        return same

    DTensorSpec.__eq__ = __eq__
    DTensorSpec._mfsdp2_row_eq = True


def _row_shard_distributable(placements) -> bool:
    """RowShard on some mesh dims, Replicate on the others (what our parameters carry)."""
    if placements is None:
        return False
    placements = tuple(placements)
    return any(isinstance(p, RowShard) for p in placements) and all(
        isinstance(p, (RowShard, Replicate)) for p in placements
    )


def _wrap_distribute_tensor(plain_distribute):
    def distribute_tensor(tensor, device_mesh=None, placements=None, **kwargs):
        # kwargs (``src_data_rank`` on the torch versions that have it) pass through untouched.
        if isinstance(tensor, DTensor) or device_mesh is None or not _row_shard_distributable(placements):
            return plain_distribute(tensor, device_mesh, placements, **kwargs)
        placements = tuple(placements)
        # Replicate first (torch moves the data from src_data_rank, or not at all for None),
        # then keep this rank's rows of every RowShard dimension.
        replicated = plain_distribute(tensor, device_mesh, [Replicate()] * len(placements), **kwargs)
        local = replicated.to_local()
        coord = device_mesh.get_coordinate()
        for d, p in enumerate(placements):
            if isinstance(p, RowShard) and coord is not None:
                local = p._replicate_to_shard(local, device_mesh, d, coord[d])
        out = DTensor.from_local(
            local.detach(), device_mesh, placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
        return out.requires_grad_(tensor.requires_grad)

    distribute_tensor.__doc__ = plain_distribute.__doc__
    distribute_tensor._mfsdp2_plain = plain_distribute
    return distribute_tensor


def _install_distribute_tensor() -> None:
    plain = _dtensor_pkg.distribute_tensor
    if getattr(plain, "_mfsdp2_plain", None) is not None:
        return
    wrapped = _wrap_distribute_tensor(plain)
    # Modules that imported the function by name (torch's state-dict utilities among them) hold
    # their own reference: replace it wherever torch.distributed has one.
    for name, mod in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(mod, "distribute_tensor", None) is plain:
            setattr(mod, "distribute_tensor", wrapped)


def _split(pl, n: int, k: int) -> Optional[tuple[int, ...]]:
    """The rows per rank a dim-0 placement means for ``n`` rows over ``k`` ranks (None: not one)."""
    if isinstance(pl, RowShard):
        return tuple(pl.rows)
    if isinstance(pl, Shard) and pl.dim == 0:
        return chunk_rows(n, k)
    return None


def _rows_move(cur, tgt, k: int) -> bool:
    """Whether going from placement ``cur`` to ``tgt`` on one mesh dimension (``k`` ranks) moves
    dim-0 rows between ranks although DTensor sees two equal ``Shard(0)`` and would move none."""
    if not (isinstance(cur, RowShard) or isinstance(tgt, RowShard)):
        return False
    if not (isinstance(cur, Shard) and isinstance(tgt, Shard)) or cur.dim != 0 or tgt.dim != 0:
        return False
    n = sum(cur.rows) if isinstance(cur, RowShard) else sum(tgt.rows)
    return _split(cur, n, k) != _split(tgt, n, k)


def _wrap_redistribute(plain_redistribute):
    def redistribute(self, device_mesh=None, placements=None, **kwargs):
        # DTensor compares placements to decide what to move, and RowShard equals Shard(0): asked
        # for a torch.chunk Shard(0), it kept our rows (or, from a chunk split to our RowShard,
        # the chunk rows) -- a DTensor whose rows are not the split the caller asked for. Those
        # mesh dimensions go through Replicate first (a gather), then to the requested split.
        if placements is not None and (device_mesh is None or device_mesh == self.device_mesh):
            mesh = self.device_mesh
            cur, tgt = tuple(self.placements), tuple(placements)
            if len(cur) == len(tgt):
                move = {d for d, (c, t) in enumerate(zip(cur, tgt)) if _rows_move(c, t, mesh.size(d))}
                if move:
                    mid = [Replicate() if d in move else c for d, c in enumerate(cur)]
                    via = plain_redistribute(self, mesh, mid, **kwargs)
                    return plain_redistribute(via, mesh, tgt, **kwargs)
        return plain_redistribute(self, device_mesh, placements, **kwargs)

    redistribute.__doc__ = plain_redistribute.__doc__
    redistribute._mfsdp2_plain = plain_redistribute
    return redistribute


def _install_redistribute() -> None:
    plain = DTensor.redistribute
    if getattr(plain, "_mfsdp2_plain", None) is None:
        DTensor.redistribute = _wrap_redistribute(plain)


def install() -> None:
    """Wrap DTensor's sharding propagator, spec equality, ``redistribute`` and
    ``distribute_tensor`` once per process (idempotent)."""
    _install_spec_eq()
    _install_distribute_tensor()
    _install_redistribute()
    prop = DTensor._op_dispatcher.sharding_propagator
    if getattr(prop, "_mfsdp2_row_propagation", False):
        return
    inner = prop.propagate_op_sharding_non_cached

    def propagate_op_sharding_non_cached(op_schema):
        return _rewrite(prop, op_schema, inner(op_schema))

    prop.propagate_op_sharding_non_cached = propagate_op_sharding_non_cached
    cache = prop.propagate_op_sharding
    # The cached entry point captured the unwrapped method when DTensor built it: rebuild it
    # around ours (same cache class), emptied, so nothing computed before is reused.
    try:
        prop.propagate_op_sharding = type(cache)(propagate_op_sharding_non_cached)
    except TypeError:  # a torch whose cache class is not built from the function alone
        prop.propagate_op_sharding = functools.lru_cache(maxsize=None)(propagate_op_sharding_non_cached)
    prop._mfsdp2_row_propagation = True
    logger.debug("mfsdp2: RowShard-preserving sharding propagation installed")


install()
