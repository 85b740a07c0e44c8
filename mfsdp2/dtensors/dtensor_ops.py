"""DTensor op handlers for our ``RowShard`` DTensors: in-place ``copy_`` into our parameters from any
full-tensor description, and whole-tensor max / min / infinity norms over empty pieces.

Why: initialising or loading a sharded parameter in place (``p.copy_(distribute_tensor(full,
mesh, [Replicate()]))``, a model's own ``load_state_dict`` pre-hook that merges q/k/v and copies
into the fused weight, ``p.copy_(full)``) goes through DTensor's sharding propagation for
``aten.copy_``, which rebuilds the destination's placement as a plain ``Shard(0)``: the source is
then split by ``torch.chunk`` (20 rows) while our shard holds its layout's rows (40, or 0), and
the copy fails with a size mismatch -- or, where the counts happen to agree on one rank, copies
the wrong rows. ``RowShard``'s own redistribute hooks are never asked.

So ``copy_`` whose destination carries a :class:`~mfsdp2.dtensors.placement.RowShard` is handled here (a
DTensor custom op handler, consulted before sharding propagation): the source's rows for this rank
are taken directly --

* a plain tensor of the parameter's global shape (or broadcastable to it): sliced, no
  communication (DTensor itself refuses mixing plain tensors and DTensors here; for our
  parameters the meaning is unambiguous: the full value);
* a DTensor on the same mesh, ``Replicate`` on every dimension: its local tensor, sliced;
* a DTensor with the destination's placements (our rows; results computed from our parameters
  carry them too, see :mod:`mfsdp2.dtensors.row_propagation`): a local copy;
* a DTensor ``Shard(0)`` (``torch.chunk`` rows, e.g. from torch FSDP2 or ``distribute_tensor``):
  gathered with plain collectives on the chunk row counts, then sliced.

Traced code (dynamo's fake tensors) is left to DTensor: it runs no collectives, and what a compiled
optimizer step copies into a parameter is computed from our parameters.

Anything else (other meshes, partial sums, tensor-parallel layouts) goes to DTensor's default
handling. Every other destination is untouched: the handler hands the call back to DTensor.

Whole-tensor reductions without an identity for an empty input -- ``max()``, ``min()``,
``amax()``, ``amin()`` and infinity norms (``torch.linalg.vector_norm(g, inf)``,
``torch._foreach_norm(grads, inf)``: what ``clip_grad_norm_(..., norm_type=inf)`` computes) -- run
the local kernel on each rank's piece and combine across ranks. Our layout leaves a rank without
rows of many parameters (a bias lives on one rank), and the local kernel refuses an empty tensor:
``p.grad.abs().max()`` raised on the ranks without rows while the others waited in the combine,
and torch's ``clip_grad_norm_`` with ``inf`` failed on every mfsdp2 model. An empty piece's
contribution is the combine's identity (``-inf`` for a max, ``+inf`` for a min, 0 for an infinity
norm), so such a piece is handed to DTensor as a one-element stand-in holding it, under the same
spec; the result is the whole tensor's, as for FSDP2.

Fused optimizer kernels DTensor has no sharding rule for -- ``_fused_sgd_`` and
``_fused_adagrad_`` (``torch.optim.SGD`` / ``Adagrad(fused=True)``; FSDP2 raises "does not have a
sharding strategy" for them) -- run on the local pieces when our parameters are among their
arguments (``RowShard`` pieces, or whole replicated parameters under ``no_shard``):
each updates parameter i from gradient i and state i alone, element by element, so the
kernel on this rank's rows is the full kernel restricted to them. Every DTensor of index i must
hold the same rows (mesh and placements equal, row counts included), else the call is refused
naming the argument: nothing is redistributed into a temporary the kernel would update instead.

``torch.optim.Rprop`` uses two more ops DTensor cannot run on a sharded tensor in place:
``_foreach_copy_`` (no rule at all) becomes one ``copy_`` per index when a destination is ours, and
``t[mask] = value`` (``index_put_`` with a boolean mask of ``t``'s shape and rows, and a
one-element value) runs on the local pieces -- element-wise writes, so each rank's rows are the
whole write restricted to them. Other ``index_put_`` forms are left to DTensor.

Element-wise ``_foreach`` ops DTensor has no rule for on the running torch
(:func:`~mfsdp2.base.compat.dtensor_has_rule`; torch 2.11 lacks ``_foreach_sign_`` of ``Rprop``,
``_foreach_lerp_.ScalarList`` and ``_foreach_rsqrt_`` of ``Adafactor`` and some 80 more) run on
the local pieces when our DTensors are among their arguments: each result element depends on the
same element of each input, so when every DTensor of index i holds the same rows (the first one's:
mesh, placements and row counts equal; replicated 0-dim tensors broadcast), the local kernel is
the whole op restricted to this rank's rows, and out-of-place results carry those rows. Anything
else -- another split, a partial sum, no tensor of ours -- is left to DTensor, which raises.
Only ops whose single-tensor form is tagged ``pointwise`` qualify; the handler is registered
for an op only while DTensor lacks a rule for it, so where DTensor has one it decides.

``torch.amp.GradScaler``'s inf check over gradients on two meshes (FSDP x TP with layers that are
not tensor-parallel) agrees across every rank of both (:func:`_found_inf_handler`): DTensor's own
reduces the flag over the first gradient's mesh only.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..base import compat
from .placement import RowShard, chunk_rows, wrap_local

__all__ = ["install"]

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
_previous: dict = {}  # op -> a handler someone registered before us (chained, not replaced)


def _row_shard_dim(placements) -> Optional[int]:
    """The mesh dimension of the only RowShard when every other placement is Replicate."""
    found = None
    for d, pl in enumerate(placements):
        if isinstance(pl, RowShard) and found is None:
            found = d
        elif not isinstance(pl, Replicate):
            return None
    return found


def _source_rows(dst: DTensor, src, mesh_dim: int, lo: int, n: int) -> Optional[torch.Tensor]:
    """This rank's rows ``[lo, lo + n)`` (slices along the destination's row dim: 0, or the dim a
    parameter is sharded on, :mod:`mfsdp2.dtensors.shard_dim`) of ``src`` as a plain tensor; None: not a
    case we handle."""
    shape = dst.shape
    dim = dst.placements[mesh_dim].dim
    if not isinstance(src, DTensor):
        if not isinstance(src, torch.Tensor):
            return None
        return torch.broadcast_to(src, shape).narrow(dim, lo, n)
    if src.device_mesh != dst.device_mesh or src.shape != shape:
        return None
    pls = src.placements
    if all(isinstance(p, Replicate) for p in pls):
        return src._local_tensor.narrow(dim, lo, n)
    if tuple(pls) == tuple(dst.placements) and all(
        isinstance(a, RowShard) == isinstance(b, RowShard) and getattr(a, "rows", None) == getattr(b, "rows", None)
        for a, b in zip(pls, dst.placements)
    ):
        return src._local_tensor
    if type(pls[mesh_dim]) is Shard and pls[mesh_dim].dim == dim and all(
        isinstance(p, Replicate) for d, p in enumerate(pls) if d != mesh_dim
    ):
        mesh = dst.device_mesh
        rows = chunk_rows(shape[dim], mesh.size(mesh_dim))
        if tuple(rows) == dst.placements[mesh_dim].rows:
            return src._local_tensor  # the same split: nothing to move
        full = RowShard(dim, rows)._to_replicate_tensor(src._local_tensor, mesh, mesh_dim, shape)
        return full.narrow(dim, lo, n)
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


def _empty_row_piece(t) -> bool:
    return (
        isinstance(t, DTensor)
        and t._local_tensor.numel() == 0
        and any(isinstance(p, RowShard) for p in t.placements)
        and not is_fake(t._local_tensor)
    )


def _stand_in(t: DTensor, value: float) -> DTensor:
    """``t``'s spec over a one-element local piece holding ``value``."""
    local = torch.full((1,) * t.dim(), value, dtype=t.dtype, device=t._local_tensor.device)
    return wrap_local(local, t.device_mesh, t.placements, t.shape, t.stride())  # beside t's own piece


def _identity(op_call, args, kwargs, dtype) -> Optional[float]:
    """What an empty piece contributes to the whole-tensor reduction ``op_call`` (None: not one we
    complete, or one whose empty pieces already work)."""
    if op_call in (_aten.linalg_vector_norm.default, _aten._foreach_norm.Scalar):
        order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dim = None if op_call is _aten._foreach_norm.Scalar else (args[2] if len(args) > 2 else kwargs.get("dim"))
        if dim is None and order in (float("inf"), float("-inf")):
            return 0.0 if order > 0 else float("inf")
        return None
    if op_call in (_aten.amax.default, _aten.amin.default) and tuple(
        args[1] if len(args) > 1 else kwargs.get("dim", ())
    ):
        return None  # a reduction along given dims keeps every rank's (possibly empty) rows
    lowest = op_call in (_aten.max.default, _aten.amax.default)
    if dtype.is_floating_point:
        return float("-inf") if lowest else float("inf")
    info = torch.iinfo(dtype) if dtype != torch.bool else None
    return None if info is None else (info.min if lowest else info.max)


def _reduction_handler(op_call, args, kwargs):
    foreach = op_call is _aten._foreach_norm.Scalar
    first = args[0]
    if not torch.compiler.is_compiling() and any(_empty_row_piece(t) for t in (first if foreach else [first])):
        identity = _identity(op_call, args, kwargs, (first[0] if foreach else first).dtype)
        if identity is not None:

            def swap(t):
                return _stand_in(t, identity) if _empty_row_piece(t) else t

            args = ([swap(t) for t in first] if foreach else swap(first),) + tuple(args[1:])
    return _default(op_call, args, kwargs)


def _local_of(t, i: int, name: str, spec):
    """``t``'s local tensor, checked against the index's reference ``spec`` (mesh, placements)."""
    if not isinstance(t, DTensor):
        return t  # 0-dim step counters, grad_scale / found_inf: plain tensors
    same = t.device_mesh == spec.device_mesh and len(t.placements) == len(spec.placements) and all(
        a == b and getattr(a, "rows", None) == getattr(b, "rows", None) for a, b in zip(t.placements, spec.placements)
    )
    if not same:
        raise RuntimeError(
            f"mfsdp2: a fused optimizer kernel got {name}[{i}] with placements {tuple(t.placements)} for a "
            f"parameter with {tuple(spec.placements)}: the kernel updates each parameter's state in place, "
            "so they must hold the same rows (create states from their parameters, e.g. torch.zeros_like(p))."
        )
    return t._local_tensor


def _ours(t) -> bool:
    """A DTensor laid out as our parameters are: ``RowShard`` on some mesh dims and ``Replicate``
    on the others, or ``Replicate`` on all (``no_shard``: every rank holds the whole parameter).
    torch FSDP2's ``Shard(0)`` parameters never are."""
    return isinstance(t, DTensor) and all(isinstance(pl, (RowShard, Replicate)) for pl in t.placements)


def _found_inf_handler(op_call, args, kwargs):
    """``torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``
    (``torch.amp.GradScaler.unscale_``) over gradients on more than one mesh, ours among them.

    DTensor's own handler reduces ``found_inf`` over the mesh and placements of the *first*
    gradient only. Under FSDP x TP with some layers not tensor-parallel, the list holds gradients
    on the ``dp`` mesh and on the (tp, dp) mesh: a non-finite gradient on one tensor-parallel
    coordinate is then seen by the ranks of that coordinate alone, which skip the step while the
    others take it -- replicas that diverge without a word (torch FSDP2's parameters too). Here the
    kernel runs on the local pieces and ``found_inf`` is reduced with MAX over every dimension of
    every distinct mesh in the list, in the order they first appear (the same on every rank), so
    every rank of any of them agrees. Lists on one mesh keep DTensor's handling."""
    grads = args[0]
    meshes: list = []
    ours = False
    for g in grads:
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            if not any(mesh is m or mesh == m for m in meshes):  # most share one object: no compare
                meshes.append(mesh)
            ours = ours or _ours(g) or any(isinstance(pl, RowShard) for pl in g.placements)  # TP ones too
    if len(meshes) < 2 or not ours or torch.compiler.is_compiling():
        return _default(op_call, args, kwargs)
    found_inf = args[1]
    op_call([g._local_tensor if isinstance(g, DTensor) else g for g in grads], *args[1:], **kwargs)
    for mesh in meshes:
        for dim in range(mesh.ndim):
            torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group(dim))


def _fused_elementwise_handler(op_call, args, kwargs):
    lists = [a for a in args if isinstance(a, (list, tuple))]
    params = lists[0] if lists else []
    ours = any(_ours(p) for p in params)
    if not ours or torch.compiler.is_compiling():
        return _default(op_call, args, kwargs)  # DTensor's own verdict (torch has no rule: it raises)
    names = [a.name for a in op_call._schema.arguments]
    local_args = []
    for j, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            a = [_local_of(t, i, names[j], params[i]) if i < len(params) else t for i, t in enumerate(a)]
        elif isinstance(a, DTensor):
            a = a._local_tensor
        local_args.append(a)
    local_kwargs = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in kwargs.items()}
    return op_call(*local_args, **local_kwargs)


def _foreach_copy_handler(op_call, args, kwargs):
    """``_foreach_copy_(dsts, srcs)`` (``torch.optim.Rprop(foreach=True)``), which DTensor has no
    rule for, as one ``copy_`` per index when a destination is ours: each copy lines the source's
    rows up with its destination's (see :func:`_copy_handler`), nothing is written into a
    temporary."""
    dsts, srcs = args[0], args[1]
    if torch.compiler.is_compiling() or not any(_ours(d) for d in dsts):
        return _default(op_call, args, kwargs)
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    for d, src in zip(dsts, srcs, strict=True):
        d.copy_(src, non_blocking=non_blocking)


def _masked_put_handler(op_call, args, kwargs):
    """``t[mask] = value`` (``index_put_`` with one boolean index of ``t``'s shape and a
    one-element value: ``torch.optim.Rprop`` writes its step-size factors so) on one of our
    DTensors, run on the local pieces when the mask holds the same rows: element by element, the
    local write is the global one restricted to this rank's rows. DTensor refuses it in place
    ("in-place operations that require placement changes"); anything else is left to it."""
    self, indices = args[0], args[1]
    values = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    mask = indices[0] if len(indices) == 1 else None
    if isinstance(values, DTensor) and all(p.is_replicate() for p in values.placements):
        values = values.to_local()
    if (
        torch.compiler.is_compiling()
        or not _ours(self)
        or not (isinstance(mask, DTensor) and mask.dtype == torch.bool and mask.shape == self.shape)
        or not (isinstance(values, torch.Tensor) and not isinstance(values, DTensor) and values.numel() == 1)
        or mask.device_mesh != self.device_mesh
        or not all(a == b and getattr(a, "rows", None) == getattr(b, "rows", None)
                   for a, b in zip(mask.placements, self.placements))
    ):
        return _default(op_call, args, kwargs)
    self._local_tensor.index_put_([mask._local_tensor], values, accumulate)
    return self


class _NotElementwise(Exception):
    """An argument the local kernel cannot take as it is (see :func:`_foreach_elementwise_handler`)."""


def _same_rows(t: DTensor, ref: DTensor) -> bool:
    return (
        t.device_mesh == ref.device_mesh and t.shape == ref.shape and len(t.placements) == len(ref.placements)
        and all(a == b and getattr(a, "rows", None) == getattr(b, "rows", None)
                for a, b in zip(t.placements, ref.placements))
    )


def _foreach_elementwise_handler(op_call, args, kwargs):
    """An element-wise ``_foreach`` op DTensor has no rule for, on the local pieces (see the module
    docstring); DTensor's own verdict where it is not ours or the rows differ."""
    is_list = [isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a) for a in args]
    lists = [a for a, lst in zip(args, is_list) if lst]
    if torch.compiler.is_compiling() or not lists or any(isinstance(v, DTensor) for v in kwargs.values()):
        return _default(op_call, args, kwargs)
    refs = [next((a[i] for a in lists if i < len(a) and isinstance(a[i], DTensor)), None) for i in range(len(lists[0]))]
    if not any(_ours(r) for r in refs) or any(r is not None and not _ours(r) for r in refs):
        return _default(op_call, args, kwargs)

    def local(t, ref):
        """``t`` as the local kernel takes it at an index whose first DTensor is ``ref`` (None: a
        lone argument, e.g. ``_foreach_add.Tensor``'s scalar or ``_foreach_addcdiv``'s per-index
        scalars)."""
        if isinstance(t, DTensor):
            if all(pl.is_replicate() for pl in t.placements) and t.dim() == 0:
                return t._local_tensor  # a replicated scalar broadcasts
            if ref is not None and _same_rows(t, ref):
                return t._local_tensor
            raise _NotElementwise
        if ref is not None and isinstance(t, torch.Tensor) and t.dim() > 0:
            raise _NotElementwise  # a plain tensor beside our rows: which rows would it mean?
        return t

    try:
        local_args = [
            [local(t, refs[i] if i < len(refs) else None) for i, t in enumerate(a)] if lst else local(a, None)
            for a, lst in zip(args, is_list)
        ]
    except _NotElementwise:
        return _default(op_call, args, kwargs)
    out = op_call(*local_args, **kwargs)
    if out is None:  # in place: the pieces were updated where they live
        return None
    return [wrap_local(o, r.device_mesh, r.placements, r.shape, r.stride()) for o, r in zip(out, refs, strict=True)]


def _elementwise_foreach_ops_without_rule() -> list:
    """The ``_foreach`` overloads (not ``out=``) whose single-tensor op is tagged pointwise and
    that DTensor cannot propagate on this torch."""
    names = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("aten::_foreach_")}
    ops = []
    for name in sorted(names):
        single = getattr(_aten, name[len("_foreach_"):].rstrip("_"), None)
        if single is None or not any(torch.Tag.pointwise in getattr(single, o).tags for o in single.overloads()):
            continue
        packet = getattr(_aten, name)
        for o in packet.overloads():
            op = getattr(packet, o)
            if not o.endswith("out") and op not in _HANDLERS and not compat.dtensor_has_rule(op):
                ops.append(op)
    return ops


def _default(op_call, args, kwargs):
    previous = _previous.get(op_call)
    if previous is not None:
        return previous(op_call, args, kwargs)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    mine = handlers.pop(op_call)  # DTensor's own path, then ours again
    try:
        return op_call(*args, **kwargs)
    finally:
        handlers[op_call] = mine


_HANDLERS = {
    _aten.copy_.default: _copy_handler,
    _aten.linalg_vector_norm.default: _reduction_handler,
    _aten._foreach_norm.Scalar: _reduction_handler,
    _aten.max.default: _reduction_handler,
    _aten.min.default: _reduction_handler,
    _aten.amax.default: _reduction_handler,
    _aten.amin.default: _reduction_handler,
    _aten._fused_sgd_.default: _fused_elementwise_handler,
    _aten._fused_sgd_.tensor_lr: _fused_elementwise_handler,
    _aten._fused_adagrad_.default: _fused_elementwise_handler,
    _aten._fused_adagrad_.tensor_lr: _fused_elementwise_handler,
    _aten._foreach_copy_.default: _foreach_copy_handler,
    _aten.index_put_.default: _masked_put_handler,
    _aten._amp_foreach_non_finite_check_and_unscale_.default: _found_inf_handler,
}


def install() -> None:
    """Register the handlers once per process (idempotent)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    todo = dict(_HANDLERS)
    todo.update((op, _foreach_elementwise_handler) for op in _elementwise_foreach_ops_without_rule())
    for op, handler in todo.items():
        current = handlers.get(op)
        if current is handler:
            continue
        if current is not None:
            _previous[op] = current
        handlers[op] = handler
    logger.debug("mfsdp2: DTensor copy_ / infinity-norm / fused-optimizer / foreach / GradScaler handlers "
                 "for RowShard DTensors installed")


install()
