"""Results computed from our ``RowShard`` DTensors keep ``RowShard``; ops mixing row splits line them up;
``distribute_tensor`` honours ``RowShard``.

Why: DTensor's sharding rules build their output placements afresh (``Shard(0)`` objects made by
the strategy, not the input's placement object). For our uneven, row-aligned shards that label is
a lie: ``(p * 2)``, ``p.clone()``, ``p.to(torch.float64)``, ``p.view(...)``, ``p.sum(1)`` or a
``_foreach`` result held our rows but claimed ``torch.chunk``'s, so its ``full_tensor()`` came back
wrong-sized or wrong (or, with a shape argument such as ``view``, the op failed), and DCP would
write it at the wrong offsets. Users compute such tensors all the time (EMA copies, a detached
clone for logging, a bf16 copy of the weights for export, an optimizer's temporary).

How: the propagator's uncached entry point is wrapped once per process; after DTensor has chosen
the strategy, every output placement that is a plain ``Shard(0)`` on a mesh dimension where the
inputs it is computed from carry ``RowShard(0, rows)`` *with the same dim-0 size* is replaced by
that ``RowShard``: a sharding rule that keeps dim 0 sharded computes each rank's output rows from
its own input rows, so the output holds exactly the input's rows. Shape arguments that DTensor
rewrote from the global shape to the local one (``view``, ``new_empty``) are recomputed from the
relabelled placement.

Any dim. "Rows" are slices along the dim a placement splits: dim 0 for most of our parameters,
``d`` for one ``shard_placement_fn`` shards on ``d`` (``RowShard(d)``, :mod:`mfsdp2.dtensors.shard_dim`).
Inputs are grouped by the size of the dim they are split on (two operands of a pointwise op, a
matmul's contraction dim), and an output split on a dim of that size carries the rows on that dim
(``p.t()`` of a dim-0 parameter is ``RowShard(1)``). A ``torch.chunk`` split of another dim is
brought to our rows through ``Replicate``: DTensor's own change of shard dim splits the new dim by
``torch.chunk``.

Mixed splits. An op combining DTensors whose dim-0 rows are split differently -- our parameter
and a same-shape ``torch.chunk`` ``Shard(0)`` tensor (``p + q``, ``p.grad.add_(q)``,
``torch.lerp``, ``_foreach_add_``), two of our parameters with other rows (another offset or unit),
or ours with a ``Replicate`` / ``Partial`` tensor that DTensor splits by ``torch.chunk`` -- used to
combine rank r's rows of one with other rows of the other: a shape error, or, where a piece held
one row, a silent broadcast. DTensor cannot see it (``RowShard == Shard(0)``). Now, for each set
of inputs the op combines row by row (every tensor argument; for ``_foreach`` ops the i-th of
each list), the inputs the chosen strategy keeps sharded on dim 0 with one size are all asked for
the split of the first of them that already is (for an in-place op: ``self``, whose rows the
result keeps), and the outputs carry it. DTensor then redistributes the others; the wrapped
``redistribute_local_tensor`` (what its dispatcher calls) moves the rows through ``Replicate``
where two dim-0 splits differ, and reduces a ``Partial`` into our rows the same way (its own
reduce-scatter splits by ``torch.chunk``; :mod:`mfsdp2.dtensors.row_splits`). So ``p + q`` holds
``p``'s rows, ``q + p`` ``q``'s.

Transposes. ``p.T`` (Muon's Newton-Schulz iteration works on it, so does user code) holds our rows
along tensor dim 1; DTensor labelled it a plain ``Shard(1)``, and the next op that moved it --
``full_tensor()``, or Muon's ``p.add_(update)`` -- split by ``torch.chunk``: gloo aborted on a size
mismatch, or one rank raised while the other waited. The rules above apply to every tensor dim:
an output ``Shard(t)`` whose size matches a class of inputs holding our split becomes
``RowShard(t, rows)``, and inputs sharded along dims of one size on a mesh dim are aligned whatever
dims they are (``x @ x.T`` contracts dim 1 of one with dim 0 of the other; each rank's pieces hold
the same rows of both). Moving ours to another tensor dim (or a chunk split to ours on another
dim) goes through ``Replicate``, as a change of rows does.

The caches. ``RowShard`` must compare equal to ``Shard(0)`` placement by placement (that is how
DTensor's rules accept it as a dim-0 shard without redistributing), but a cached decision made for
a ``torch.chunk``-sharded tensor must never serve ours, nor the reverse. The rewrite happens before
the result is cached; ``RowShard`` hashes with its row counts (see :mod:`mfsdp2.dtensors.placement`); and
two DTensor *specs* compare unequal when one carries ``RowShard`` where the other has a plain
``Shard``. The last is needed because the C++ dispatch cache compares keys that merely share a
hash bucket by equality alone (it skips the hash check), so a same-shape FSDP2 or
``distribute_tensor`` DTensor could otherwise, by chance of the bucket, receive our decision.

Moving rows between splits (``distribute_tensor``, ``redistribute`` and the dispatcher's
``redistribute_local_tensor``) is :mod:`mfsdp2.dtensors.row_splits`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Optional

import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema

from .placement import RowShard
from .row_splits import _mixes_row_and_chunk, _moves, _same_slices, _shard_dim, _size, _split
from .row_splits import install as _install_row_moves
from .row_views import view_sharding

try:
    from torch.distributed._functional_collectives import _are_we_tracing
except ImportError:  # pragma: no cover - torch without it never traces DTensor ops
    def _are_we_tracing() -> bool:
        return False

__all__ = ["install"]

logger = logging.getLogger(__name__)

def _specs(obj: Any):
    if isinstance(obj, DTensorSpec):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _specs(o)


def _get(args, pos):
    i, j = pos
    return args[i] if j is None else args[i][j]


def _put(args: list, pos, spec) -> None:
    i, j = pos
    if j is None:
        args[i] = spec
    else:
        args[i][j] = spec


def _with(spec: DTensorSpec, d: int, pl) -> DTensorSpec:
    """``spec`` with placement ``pl`` on mesh dim ``d`` (a shard of the same tensor dim as the one
    it replaces: the shard order stays valid)."""
    new = list(spec.placements)
    new[d] = pl
    return dataclasses.replace(spec, placements=tuple(new))


@functools.lru_cache(maxsize=None)
def _op_signature(op) -> tuple[bool, tuple[int, ...], tuple[str, ...]]:
    """``(multi_tensor, written positional args, written keyword args)`` of an ATen op, from its
    schema. Multi-tensor: it takes a tensor list and returns lists or nothing (``_foreach_*``,
    ``_fused_adam(w)_``, ``_fused_sgd_``, ``_amp_foreach_...``), so its i-th output (or in-place
    update) is computed from the i-th tensor of each list alone -- unlike ``cat`` / ``stack``
    (one ``Tensor`` out of the whole list). Written: the arguments the schema marks ``(a!)``
    (in-place ``self``, ``out=``, an optimizer's states)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False, (), ()
    lists = any(str(a.type) == "List[Tensor]" for a in schema.arguments)
    multi = lists and all(str(r.type).startswith("List[") for r in schema.returns)
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    pos = tuple(i for i, a in enumerate(schema.arguments) if a in written and not a.kwarg_only)
    kw = tuple(a.name for a in written if a.kwarg_only)
    return multi, pos, kw


def _groups(op_schema) -> list[tuple[list[tuple[int, Optional[int]]], Optional[int]]]:
    """``(positions of DTensorSpecs in args_schema, output index)`` for each set of inputs the op
    combines row by row into one output: for multi-tensor ops (see :func:`_op_signature`) the i-th
    tensor of every list (and any single tensor argument) into output i, for other ops every
    tensor argument into every output (``None``). Written arguments come first in each set: the
    split they hold is the one the set is aligned to (they are never moved, see
    :func:`_refuse_written_moves`)."""
    args = op_schema.args_schema
    multi, written, _ = _op_signature(op_schema.op)
    singles = [(i, None) for i, a in enumerate(args) if isinstance(a, DTensorSpec)]
    lists = [
        i for i, a in enumerate(args) if isinstance(a, (list, tuple)) and any(isinstance(x, DTensorSpec) for x in a)
    ]

    def first_written(positions):
        return sorted(positions, key=lambda p: p[0] not in written)

    if lists and multi:
        n = max(len(args[i]) for i in lists)
        return [(first_written([(i, k) for i in lists if k < len(args[i])] + singles), k) for k in range(n)]
    return [(first_written(singles + [(i, k) for i in lists for k in range(len(args[i]))]), None)]


def _refuse_written_moves(op_schema, want) -> None:
    """An op's written arguments (see :func:`_op_signature`) must be used as they are: DTensor's
    dispatcher would bring a written argument whose wanted spec differs to it in a *new* local
    tensor, the kernel would update that temporary, and the real parameter, gradient or optimizer
    state would keep its old value -- a silent wrong step. So such a plan is an error naming the
    op and the argument (there is no correct way to run it row by row)."""
    _, written, _ = _op_signature(op_schema.op)
    args = op_schema.args_schema
    for i in written:
        if i >= len(args):
            continue
        cur, tgt = args[i], want[i]
        pairs = zip(cur, tgt) if isinstance(cur, (list, tuple)) else [(cur, tgt)]
        for k, (c, t) in enumerate(pairs):
            if isinstance(c, DTensorSpec) and isinstance(t, DTensorSpec) and _moves(c, t):
                name = op_schema.op._schema.arguments[i].name
                where = f"{name}[{k}]" if isinstance(cur, (list, tuple)) else name
                raise RuntimeError(
                    f"mfsdp2: {op_schema.op} writes into its argument '{where}' ({_describe(c)}), but its "
                    f"other inputs would need it as {_describe(t)}: DTensor would redistribute it into a "
                    "temporary copy and the update would be lost. Give the tensors the op updates together "
                    "the same placements (e.g. optimizer states created from their parameters, "
                    "torch.zeros_like(p)), or redistribute them explicitly first."
                )


def _describe(spec: DTensorSpec) -> str:
    shape = tuple(spec.tensor_meta.shape) if spec.tensor_meta is not None else "?"
    return f"shape {shape}, placements {tuple(spec.placements)}"


def _output_specs(out) -> list:
    spec = out.output_spec
    return [spec] if isinstance(spec, DTensorSpec) else list(spec) if isinstance(spec, (list, tuple)) else []


def _shard_classes(want, positions, d: int) -> dict[int, list]:
    """The inputs the chosen strategy wants sharded (on any tensor dim) over mesh dim ``d``, by
    the size of that tensor dim: on one mesh dim the kernel combines each rank's pieces as they
    are, so inputs sharded there along dims of one size are combined slice by slice -- element
    by element (``p + q``) or in a contraction (``x @ x.T``: dim 1 of one with dim 0 of the
    other)."""
    classes: dict[int, list] = {}
    for p in positions:
        w = _get(want, p)
        n = _size(w, _shard_dim(w.placements[d]))
        if n is not None:
            classes.setdefault(n, []).append(p)
    return classes


def _current_split(args, want, p, d: int, n: int, k: int) -> Optional[tuple[int, ...]]:
    """The split input ``p`` holds now along the tensor dim it is wanted sharded on (None: it is
    not sharded along that dim now: replicated, partial, or sharded along another dim)."""
    cur, w = _get(args, p).placements[d], _get(want, p).placements[d]
    return _split(cur, n, k) if _shard_dim(cur) == _shard_dim(w) else None


def _as(ref, t: int):
    """``ref``'s split (ours or torch.chunk's) as a placement of tensor dim ``t``."""
    if ref.dim == t:
        return ref
    return RowShard(t, ref.rows) if isinstance(ref, RowShard) else Shard(t)


def _nested_like(args, base):
    """``base`` (a suggested schema's arguments) nested as ``args`` are: for ops taking a tensor
    list (``cat``, ``stack``) DTensor's suggestion holds the list's specs flattened into the
    arguments (its dispatcher flattens both sides anyway)."""
    def spec_lists(xs):
        return any(isinstance(x, (list, tuple)) and any(isinstance(y, DTensorSpec) for y in x) for x in xs)

    if not spec_lists(args) or spec_lists(base):
        return base  # nothing flattened (other differences, e.g. squeeze's rewritten dims, are meant)
    leaves = pytree.tree_leaves(base)
    structure = pytree.tree_structure(tuple(args))
    if structure.num_leaves != len(leaves):
        return base
    return pytree.tree_unflatten(leaves, structure)


def _align(op_schema, out, move: bool) -> bool:
    """Make every set of inputs the op combines row by row hold the same rows (see the module
    docstring, "Mixed splits") and relabel the outputs with that split. Returns whether an output
    spec changed. ``move=False`` (while dynamo / make_fx trace): only relabel where the inputs
    already agree -- a traced graph may hold intermediates labelled ``Shard(0)`` that carry our rows
    (symbolic sizes are not relabelled, to add no guard), and moving rows by that label would
    break what the graph computes correctly."""
    args = op_schema.args_schema
    base = out.redistribute_schema.args_schema if out.redistribute_schema is not None else args
    base = _nested_like(args, base)
    want = [list(a) if isinstance(a, (list, tuple)) else a for a in base]  # desired input specs
    outs = _output_specs(out)
    new_outs = list(outs)
    moved = False
    for positions, out_idx in _groups(op_schema):
        positions = [
            p for p in positions if isinstance(_get(args, p), DTensorSpec) and isinstance(_get(want, p), DTensorSpec)
        ]
        mesh = _get(args, positions[0]).mesh if positions else None
        # Only inputs on the first one's mesh are aligned with it: DTensor dispatch turns plain
        # scalar arguments (an optimizer's step counts) into Replicate DTensors on one mesh of
        # the call, which for a parameter on a mesh of its own (shard_placement_fn) is another one.
        positions = [p for p in positions if _get(args, p).mesh == mesh]
        for d in range(mesh.ndim if mesh is not None else 0):
            k = mesh.size(d)
            for n, members in _shard_classes(want, positions, d).items():
                # The split of the first input already sharded here along the dim it is wanted
                # sharded on does not move (written inputs come first: an in-place op's self,
                # whose rows the result keeps, an optimizer's parameter). None: every such input
                # is gathered, reduced or re-split first, DTensor's own plan.
                ref = next(
                    (_get(args, p).placements[d] for p in members
                     if _current_split(args, want, p, d, n, k) is not None),
                    None,
                )
                if ref is None:
                    continue
                rows = _split(ref, n, k)
                if not move and any(_current_split(args, want, p, d, n, k) != rows for p in members):
                    continue
                for p in members:
                    w = _get(want, p)
                    target = _as(ref, _shard_dim(w.placements[d]))
                    if type(w.placements[d]) is not type(target) or _split(w.placements[d], n, k) != rows:
                        _put(want, p, _with(w, d, target))
                        moved = moved or _current_split(args, want, p, d, n, k) != rows
                if not isinstance(ref, RowShard):
                    continue
                for o in range(len(new_outs)) if out_idx is None else [out_idx]:
                    spec = new_outs[o] if o < len(new_outs) else None
                    if isinstance(spec, DTensorSpec) and type(spec.placements[d]) is Shard:
                        t = spec.placements[d].dim
                        if _size(spec, t) == n:
                            new_outs[o] = _with(spec, d, _as(ref, t))
    if move and (moved or out.needs_redistribute):
        _refuse_written_moves(op_schema, want)
    if moved or out.redistribute_schema is not None:
        schema = out.redistribute_schema or op_schema
        new_args = tuple(type(b)(w) if isinstance(b, (list, tuple)) else w for b, w in zip(base, want))
        out.redistribute_schema = OpSchema(schema.op, new_args, schema.kwargs_schema, schema_info=schema.schema_info)
        out.needs_redistribute = out.needs_redistribute or moved
    changed = any(a is not b for a, b in zip(outs, new_outs))
    if changed:
        spec = out.output_spec
        out.output_spec = new_outs[0] if isinstance(spec, DTensorSpec) else type(spec)(new_outs)
    return changed


def _rewrite(propagator, op_schema, out):
    if out is None or not _has_row_shard(op_schema):
        return out
    move = not _are_we_tracing()
    if _align(op_schema, out, move=move) and isinstance(out.output_spec, DTensorSpec):
        _fix_shape_args(propagator, op_schema, out, out.output_spec)
    if move:
        _refuse_out_mismatch(op_schema, out)
    return out


def _refuse_out_mismatch(op_schema, out) -> None:
    """``out=`` tensors are never redistributed by DTensor: it relabels them with the result's
    spec, and the local kernel resizes their local tensor to the result's. A result holding the
    ``out`` tensor's rows keeps the ``out`` tensor's label (a plain ``Shard(0)`` result of the same
    split would otherwise strip our parameter's ``RowShard``); a result of other rows or another
    placement would shrink or reallocate a parameter's piece, or land at other rows: refused."""
    _, _, written_kw = _op_signature(op_schema.op)
    results = _output_specs(out)
    new = list(results)
    for j, (name, res) in enumerate(zip(written_kw, results)):
        dst = op_schema.kwargs_schema.get(name)
        if not (isinstance(dst, DTensorSpec) and isinstance(res, DTensorSpec)):
            continue
        if not any(isinstance(pl, RowShard) for pl in tuple(dst.placements) + tuple(res.placements)):
            continue
        same = dst.mesh == res.mesh and len(dst.placements) == len(res.placements) and all(
            _same_slices(dst, c, t, dst.mesh.size(d)) for d, (c, t) in enumerate(zip(dst.placements, res.placements))
        )
        if not same:
            raise RuntimeError(
                f"mfsdp2: {op_schema.op} would write a result with {_describe(res)} into its '{name}=' "
                f"tensor ({_describe(dst)}), whose rows differ: compute the result first and copy_ it "
                "into the tensor (copy_ lines the rows up)."
            )
        new[j] = dataclasses.replace(res, placements=dst.placements)
    if any(a is not b for a, b in zip(results, new)):
        spec = out.output_spec
        out.output_spec = new[0] if isinstance(spec, DTensorSpec) else type(spec)(new)


def _has_row_shard(op_schema) -> bool:
    for spec in _specs(tuple(op_schema.args_schema) + tuple(op_schema.kwargs_schema.values())):
        if any(isinstance(pl, RowShard) for pl in spec.placements):
            return True
    return False


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


def install() -> None:
    """Wrap DTensor's sharding propagator, spec equality, ``redistribute`` and
    ``distribute_tensor`` once per process (idempotent)."""
    _install_spec_eq()
    _install_row_moves()
    prop = DTensor._op_dispatcher.sharding_propagator
    if getattr(prop, "_mfsdp2_row_propagation", False):
        return
    inner = prop.propagate_op_sharding_non_cached

    def propagate_op_sharding_non_cached(op_schema):
        flat = view_sharding(op_schema)  # views merging / splitting our dim 0 (row_views.py)
        if flat is not None:
            return flat
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
