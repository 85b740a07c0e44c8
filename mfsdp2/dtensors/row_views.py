"""Views that merge or split dim 0 of our row-sharded DTensors: ``p.view(-1)``, ``g.flatten()``,
``flat.view(rows, cols)``.

Why: ``torch.cat([p.grad.view(-1) for p in params])`` is how ``torch.optim.LBFGS`` (and much user
code: flat gradient vectors, old-style norms) sees a model. DTensor's view rule treats our
``RowShard(0, rows)`` as a ``torch.chunk`` ``Shard(0)``: flattening a parameter whose row count does
not divide by the ranks raises "Cannot flatten unevenly sharded tensor" (torch FSDP2 raises the
same for its parameters), and where it does divide, the local view is sized by ``torch.chunk``'s
split, not ours -- a shape error on the ranks whose row counts differ.

What a rank holds is a contiguous block of whole rows, so merging dim 0 with the dims after it
keeps one contiguous block per rank: the flat view of a ``(rows, cols)`` piece is ``RowShard(0,
rows * cols)``, exactly. Splitting dim 0 (``flat.view(n, cols)``) is the inverse, possible when
every rank's count is a multiple of ``cols``; otherwise a rank's block would start inside a row,
which no placement can describe, and the view is refused with the counts named.

How: :func:`view_sharding` answers the sharding propagation for ``aten.view`` /
``aten._unsafe_view`` of such a DTensor (called first by :mod:`mfsdp2.dtensors.row_propagation`'s wrapper,
and cached with everything else): the input stays as it is, the output carries the merged or split
``RowShard``, and the shape argument becomes this rank's local shape. Views that keep dim 0 (or
that DTensor handles without sharding dim 0) are left to DTensor's rule and the relabelling.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .placement import RowShard

__all__ = ["view_sharding"]

_aten = torch.ops.aten
_VIEWS = (_aten.view.default, _aten._unsafe_view.default)


def _out_shape(size, numel: int) -> Optional[tuple[int, ...]]:
    """``size`` with a ``-1`` resolved (None: not a plain size list)."""
    if not isinstance(size, (list, tuple)) or not all(type(n) is int for n in size):
        return None
    known = math.prod(n for n in size if n != -1)
    if list(size).count(-1) == 1:
        if known == 0 or numel % known:
            return None
        return tuple(numel // known if n == -1 else n for n in size)
    return tuple(size)


def _dim0_change(shape_in, stride_in, shape_out):
    """``("merge", m, j)``: dim 0 of the output is input dims ``0..j-1`` (mergeable in memory), the
    other dims equal; ``("split", m, j)``: the reverse; ``m`` is the product of the inner dims
    merged or split off. None: dim 0 kept, or a view of another kind."""
    if not shape_in or not shape_out or shape_in[0] == shape_out[0] or 0 in shape_in:
        return None
    for j in range(2, len(shape_in) + 1):
        if math.prod(shape_in[:j]) == shape_out[0] and tuple(shape_in[j:]) == tuple(shape_out[1:]):
            contiguous = all(stride_in[i] == stride_in[i + 1] * shape_in[i + 1] for i in range(j - 1))
            return ("merge", math.prod(shape_in[1:j]), j) if contiguous else None
    for j in range(2, len(shape_out) + 1):
        if math.prod(shape_out[:j]) == shape_in[0] and tuple(shape_out[j:]) == tuple(shape_in[1:]):
            return "split", math.prod(shape_out[1:j]), j
    return None


def view_sharding(op_schema: OpSchema) -> Optional[OutputSharding]:
    """The sharding of a view merging or splitting dim 0 of a ``RowShard`` DTensor (see the module
    docstring); None for every other op or case."""
    if op_schema.op not in _VIEWS or len(op_schema.args_schema) < 2:
        return None
    spec, size = op_schema.args_schema[0], op_schema.args_schema[1]
    if not isinstance(spec, DTensorSpec) or spec.tensor_meta is None:
        return None
    pls = spec.placements
    if not any(isinstance(p, RowShard) for p in pls) or not all(
        (isinstance(p, RowShard) and p.dim == 0) or isinstance(p, Replicate) for p in pls
    ):
        return None
    meta = spec.tensor_meta
    shape_in, stride_in = tuple(meta.shape), tuple(meta.stride)
    if not all(type(n) is int for n in shape_in + stride_in):
        return None  # symbolic sizes (tracing): DTensor's rule
    shape_out = _out_shape(size, math.prod(shape_in))
    if shape_out is None or math.prod(shape_out) != math.prod(shape_in):
        return None
    change = _dim0_change(shape_in, stride_in, shape_out)
    if change is None:
        return None
    kind, m, j = change
    new = []
    for p in pls:
        if not isinstance(p, RowShard):
            new.append(p)
        elif kind == "merge":
            new.append(RowShard(0, [r * m for r in p.rows]))
        elif any(r % m for r in p.rows):
            raise RuntimeError(
                f"mfsdp2: cannot view a row-sharded tensor of shape {shape_in} as {shape_out}: its ranks hold "
                f"{p.rows} rows of {shape_in[0]}, not all multiples of {m}, so a rank's block would start "
                "inside a row of the result. Take .full_tensor() first, or view it as it was built."
            )
        else:
            new.append(RowShard(0, [r // m for r in p.rows]))
    if kind == "merge":
        stride_out = (stride_in[j - 1],) + stride_in[j:]
    else:
        stride_out = tuple(stride_in[0] * math.prod(shape_out[i + 1 : j]) for i in range(j)) + stride_in[1:]
    out_spec = DTensorSpec(spec.mesh, tuple(new), tensor_meta=TensorMeta(torch.Size(shape_out), stride_out, meta.dtype))
    local_shape, _ = compute_local_shape_and_global_offset(shape_out, spec.mesh, tuple(new))
    args = (spec, list(local_shape)) + tuple(op_schema.args_schema[2:])
    return OutputSharding(
        output_spec=out_spec,
        redistribute_schema=OpSchema(op_schema.op, args, op_schema.kwargs_schema, schema_info=op_schema.schema_info),
        needs_redistribute=True,  # no input moves (same spec); the local shape replaces the global one
        use_val_from_redistribute_schema=True,
    )
