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
reduce-scatter splits by ``torch.chunk``). So ``p + q`` holds ``p``'s rows, ``q + p`` ``q``'s.

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
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema

from .placement import RowShard, chunk_rows, wrap_local
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


def _shard_dim(pl) -> Optional[int]:
    """The tensor dim a placement splits into plain slices: ``Shard(t)`` (torch.chunk) or ours
    (``RowShard(t)``: dim 0 on a parameter, another dim on a transpose of one). None: not one."""
    return pl.dim if type(pl) is Shard or isinstance(pl, RowShard) else None


def _size(spec, t: Optional[int]) -> Optional[int]:
    """``spec``'s size along tensor dim ``t`` (None: no such dim, or a symbolic size)."""
    meta = spec.tensor_meta
    if t is None or meta is None or not 0 <= t < len(meta.shape) or type(meta.shape[t]) is not int:
        return None  # symbolic sizes (dynamic-shape tracing): no guard is added for us
    return meta.shape[t]


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


def _moves(cur: DTensorSpec, tgt: DTensorSpec) -> bool:
    """Whether going from ``cur`` to ``tgt`` changes the local tensor (DTensor redistributes)."""
    if cur.mesh != tgt.mesh or len(cur.placements) != len(tgt.placements):
        return True
    for d, (c, t) in enumerate(zip(cur.placements, tgt.placements)):
        if c != t or _mixes_row_and_chunk((c,), (t,)):
            return True
        n = _size(cur, _shard_dim(c))
        if n is not None and _split(c, n, cur.mesh.size(d)) != _split(t, n, cur.mesh.size(d)):
            return True
    return False


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
        for d in range(mesh.ndim if mesh is not None else 0):
            k = mesh.size(d)
            for n, members in _shard_classes(want, positions, d).items():
                # The split of the first input already sharded here along the dim it is wanted
                # sharded on does not move (written inputs come first: an in-place op's self,
                # whose rows the result keeps, an optimizer's parameter). None: every such input
                # is gathered, reduced or re-split first, DTensor's own plan.
                ref = next(
                    (_get(args, p).placements[d] for p in members if _current_split(args, want, p, d, n, k) is not None),
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


def _same_slices(spec: DTensorSpec, c, t, k: int) -> bool:
    """Whether placements ``c`` and ``t`` of one mesh dimension (``k`` ranks) leave every rank the
    same piece of ``spec``'s tensor."""
    if c == t and not _mixes_row_and_chunk((c,), (t,)):
        return True
    dim = _shard_dim(c)
    n = _size(spec, dim)
    return n is not None and dim == _shard_dim(t) and _split(c, n, k) == _split(t, n, k)


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
        out = wrap_local(local.detach(), device_mesh, placements, tensor.shape, tensor.stride())
        return out.requires_grad_(tensor.requires_grad)

    distribute_tensor.__doc__ = plain_distribute.__doc__
    distribute_tensor._mfsdp2_plain = plain_distribute
    return distribute_tensor


def _install_distribute_tensor() -> None:
    plain = _dtensor_pkg.distribute_tensor
    if getattr(plain, "_mfsdp2_plain", None) is not None:
        return
    _replace_everywhere("distribute_tensor", plain, _wrap_distribute_tensor(plain))


def _replace_everywhere(attr: str, plain, wrapped) -> None:
    """Modules that imported a function by name (torch's state-dict utilities, DTensor's op
    dispatcher) hold their own reference: replace it wherever torch.distributed has one."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(mod, attr, None) is plain:
            setattr(mod, attr, wrapped)


def _split(pl, n: int, k: int) -> Optional[tuple[int, ...]]:
    """The rows per rank a row placement means for ``n`` rows (slices along its dim) over ``k``
    ranks (None: not one)."""
    if isinstance(pl, RowShard):
        return tuple(pl.rows)
    if type(pl) is Shard:
        return chunk_rows(n, k)
    return None


def _rows_move(cur, tgt, k: int) -> bool:
    """Whether going from placement ``cur`` to ``tgt`` on one mesh dimension (``k`` ranks) must go
    through ``Replicate`` because one of them is ours: the same tensor dim split differently
    (DTensor sees two equal ``Shard(t)`` and would move nothing), or another tensor dim (DTensor
    would re-split by ``torch.chunk`` whatever split the target names)."""
    if not (isinstance(cur, RowShard) or isinstance(tgt, RowShard)):
        return False
    if not (isinstance(cur, Shard) and isinstance(tgt, Shard)):
        return False
    if cur.dim != tgt.dim:
        return True
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


def _via_replicate(cur, tgt, k: int) -> bool:
    """Whether ``cur -> tgt`` on one mesh dimension must go through ``Replicate``: a change of
    split DTensor cannot see (:func:`_rows_move`), or a ``Partial`` reduced into our rows
    (DTensor's reduce-scatter splits by ``torch.chunk``)."""
    if _rows_move(cur, tgt, k):
        return True
    # Into our rows from a sum, or from torch.chunk slices of another dim (DTensor's own
    # shard-dim change, an all-to-all, splits the new dim by torch.chunk too).
    return isinstance(tgt, RowShard) and (cur.is_partial() or (type(cur) is Shard and cur.dim != tgt.dim))


def _wrap_redistribute_local_tensor(plain):
    def redistribute_local_tensor(local_tensor, current_spec, target_spec, **kwargs):
        # The op dispatcher calls this to bring an argument to the spec a sharding decision asks
        # for; with mixed splits (see _align) that is a change of rows DTensor cannot see.
        mesh = current_spec.mesh
        cur, tgt = current_spec.placements, target_spec.placements
        move = [d for d, (c, t) in enumerate(zip(cur, tgt)) if _via_replicate(c, t, mesh.size(d))]
        if move and mesh == target_spec.mesh:
            mid = tuple(Replicate() if d in move else c for d, c in enumerate(cur))
            mid = DTensorSpec(mesh, mid, tensor_meta=current_spec.tensor_meta)
            local_tensor = plain(local_tensor, current_spec, mid, **kwargs)
            current_spec = mid
        return plain(local_tensor, current_spec, target_spec, **kwargs)

    redistribute_local_tensor.__doc__ = plain.__doc__
    redistribute_local_tensor._mfsdp2_plain = plain
    return redistribute_local_tensor


def _install_redistribute_local_tensor() -> None:
    from torch.distributed.tensor import _redistribute

    plain = _redistribute.redistribute_local_tensor
    if getattr(plain, "_mfsdp2_plain", None) is None:
        _replace_everywhere("redistribute_local_tensor", plain, _wrap_redistribute_local_tensor(plain))


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
    _install_redistribute_local_tensor()
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
