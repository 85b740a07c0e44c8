"""Values that reach a unit's parameters outside its flat shards, and how its groups take them in.

Why: a :class:`~mfsdp2.groups.param_group.ParameterGroup` keeps one flat main-weight shard for all its
parameters, but torch changes parameters one module -- or one parameter -- at a time:

* ``nn.Module._apply`` (``to_empty``, ``.to(dtype)``, ``.half()``) visits modules one by one. A
  unit made of several modules (``fully_shard([model.norm, model.output])``) is met once per
  module, so ``model.to_empty(device)`` converts the norm's parameters before the output's, and
  ``model.norm.to_empty(device)`` alone converts only the norm's (torch FSDP2 converts each
  parameter on its own and refuses, at the first forward, whatever is still on the meta device).
* A parameter may be *replaced* between ``fully_shard`` and the first forward
  (``model.w = nn.Parameter(dtensor)``, e.g. computed from other sharded parameters); FSDP2 adopts
  such a DTensor at its lazy init (``reset_sharded_param``).

Such a value is **pending**: the parameter object registered on the module (whose identity an
optimizer or user code may hold) carries it as a standalone DTensor, and its index is in
``ParameterGroup.pending``. Nothing is copied into the group while the group cannot hold the value
-- a group still on the meta device some of whose parameters are still meta, or a dtype only some
of its parameters have. :func:`settle` folds the pending values in as soon as the group's
parameters agree again: all real (or all meta), all of one dtype. A new dtype rebuilds the group
on the *same* layout, so every rank keeps its rows and converted values need no collective. What
cannot agree is refused before anything gathers it (:func:`prepare`, at the first forward, at
``unshard()`` and at any unshard after a conversion left values pending), naming the parameters:
parameters still on the meta device (FSDP2 refuses them too) or dtypes that differ within one group
(FSDP2: "FSDP expects uniform original parameter dtype").

Replaced parameters (:func:`adopt_replaced`) are taken until the unit's first forward, as FSDP2
does: a DTensor of the parameter's global shape on its mesh, with any placement our ``copy_``
reads (our rows, another parameter's rows, ``torch.chunk``'s ``Shard(0)``, ``Replicate``); the new
object becomes the parameter. A plain tensor (FSDP2 fails on it with an ``AttributeError``), another
shape or mesh, another unit's parameter or a deletion is refused, saying what to do instead (E56).
After the first forward a replacement is refused (E14), where FSDP2 silently keeps the old one.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..base.markers import ORIGINAL_PARAM
from ..base import plan_epoch
from ..groups.param_group import ParameterGroup, live_groups, mark_empty_pieces, swap_param
from .shared_params import OWNER_ATTR, original_of

__all__ = [
    "stage", "adopt_replaced", "settle", "settle_all", "prepare", "rebuilt", "put_grads", "asked_dtype", "probe_dtype",
    "same_memory", "check_device",
]

logger = logging.getLogger(__name__)

_MISSING = object()


# -- values of converted parameters -----------------------------------------------------------
def asked_dtype(g: ParameterGroup, dtype: torch.dtype) -> torch.dtype:
    """The original dtype a value of ``dtype`` asks ``g`` for when nothing else says (a replaced
    parameter, a conversion whose function cannot be probed): the group's own when ``dtype`` is
    the original one or the main-weight dtype the optimizer-facing parameters show (a bf16
    model's fp32 main weights: ``to_empty`` keeps fp32, which must not make it an fp32 model)."""
    return g.orig_dtype if dtype in (g.orig_dtype, g.main_dtype) else dtype


def probe_dtype(fn, dtype: torch.dtype) -> Optional[torch.dtype]:
    """What ``_apply``'s ``fn`` makes of a tensor of ``dtype`` (an empty CPU one): ``.float()`` of
    a bf16 model asks for float32 although its parameters show float32 main weights already, and
    ``to_empty`` keeps bf16. None when ``fn`` does not take such a tensor."""
    try:
        out = fn(torch.empty(0, dtype=dtype, device="cpu"))
    except Exception:  # noqa: BLE001 - any failure only means "unknown"
        return None
    return out.dtype if isinstance(out, torch.Tensor) else None


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == 0 or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype)


def check_device(state, g: ParameterGroup, device: torch.device) -> None:
    """Converted values are copied into the main shards wherever they live: the mesh's device, or
    the CPU under CPUOffloadPolicy, which also accepts the mesh's device (FSDP2's pinned offload
    moves such parameters back to the CPU too)."""
    if not any(device == d or device.type == d.type == "cpu" for d in (g.device, g.main.device)):
        raise ValueError(
            f"mfsdp2: unit {state.name!r} keeps its shards on {g.main.device} (computes on {g.device}); "
            f"converting it to {device} after fully_shard is not supported: move the module (or build it) "
            f"on {g.device} before fully_shard, or use model.to_empty(device=<the mesh's device>)"
        )


def _meta_refused(g: ParameterGroup) -> ValueError:
    return ValueError(f"mfsdp2: cannot move the shards of {g.name} to the meta device after fully_shard")


@torch.no_grad()
def stage(state, g: ParameterGroup, i: int, value: torch.Tensor, grad: Optional[torch.Tensor],
          dtype: torch.dtype) -> None:
    """Parameter ``i`` of ``g`` was converted to ``value`` (this rank's rows, a plain tensor), its
    gradient to ``grad``, and asks for original dtype ``dtype``: written into the group when it
    fits there, else left pending."""
    dp = g.dist_params[i]
    if value.is_meta and g.allocated:
        raise _meta_refused(g)
    if not value.is_meta:
        check_device(state, g, value.device)
    if i not in g.pending and dtype == g.orig_dtype and value.is_meta != g.allocated:
        if value.is_meta:
            return  # still on meta, as the rest of its group
        piece = g.weights.piece_view(g.main_weight, i)
        if not same_memory(piece, value):
            piece.copy_(value.reshape(piece.shape))
        if grad is not None and dp.grad is not None and not same_memory(dp.grad._local_tensor, grad):
            dp.grad._local_tensor.copy_(grad.reshape(dp.grad._local_tensor.shape))
        g.mark_changed()  # written behind the version counters: re-gather
        return
    swap_param(dp, nn.Parameter(g.as_dtensor(value, i, dp.shape), requires_grad=dp.requires_grad))
    if grad is not None:
        dp.grad = g.as_dtensor(grad.to(value.dtype), i, dp.shape)  # the user's kind of gradient
    g.pending[i] = dtype
    state.unsettled = True


# -- replaced parameter objects ---------------------------------------------------------------
def _replacement_refused(state, fqn: str, what: str, advice: str) -> RuntimeError:
    return RuntimeError(
        f"mfsdp2 E56: parameter {fqn!r} of unit {state.name!r} was replaced after fully_shard by {what}; "
        f"{advice}. A replacement made before the first forward is taken when it is a DTensor like the "
        "parameter it replaces, as FSDP2 takes it (nn.Parameter(distribute_tensor(value, p.device_mesh, "
        "p.placements))); or write the values in place (with torch.no_grad(): p.copy_(value), or "
        "load_state_dict), or assign before fully_shard"
    )


def _same_placements(a: DTensor, b: DTensor) -> bool:
    """Same mesh and the same rows on every rank (``Shard(0) == RowShard(0, rows)`` in DTensor's
    eyes: ``RowShard`` is a ``Shard``)."""
    return a.device_mesh == b.device_mesh and len(a.placements) == len(b.placements) and all(
        type(x) is type(y) and x == y and getattr(x, "rows", None) == getattr(y, "rows", None)
        for x, y in zip(a.placements, b.placements)
    )


def _is_sharded_param(p) -> bool:
    return any(p is dp for g in live_groups() for dp in g.dist_params)


def _check_replacement(state, g: ParameterGroup, i: int, fqn: str, new) -> None:
    dp = g.dist_params[i]
    if new is _MISSING or new is None:
        raise _replacement_refused(state, fqn, "nothing (deleted)", "a sharded parameter cannot be removed")
    if not isinstance(new, DTensor):
        raise _replacement_refused(
            state, fqn, f"a plain {type(new).__name__} of shape {tuple(new.shape)}",
            "a plain tensor does not say which rows each rank holds (FSDP2 fails on it too)",
        )
    if tuple(new.shape) != tuple(dp.shape):
        raise _replacement_refused(state, fqn, f"a DTensor of shape {tuple(new.shape)}",
                                   f"the parameter's shape {tuple(dp.shape)} is what its shards were planned for")
    if new.device_mesh != dp.device_mesh:
        raise _replacement_refused(state, fqn, f"a DTensor on another mesh ({new.device_mesh})",
                                   f"use the parameter's mesh ({dp.device_mesh})")
    if g.tp_specs[i] is not None and not _same_placements(new, dp):
        raise _replacement_refused(state, fqn, f"a DTensor placed {new.placements}",
                                   f"a tensor-parallel parameter is taken with its own placements {dp.placements} only")
    if new.grad is not None:
        raise _replacement_refused(state, fqn, "a DTensor holding a .grad",
                                   "assign it without one (its gradient is the unit's to reduce)")
    if new.is_meta and g.allocated:
        raise _replacement_refused(state, fqn, "a DTensor on the meta device", "its shards already have memory")
    if _is_sharded_param(new):
        raise _replacement_refused(state, fqn, "another sharded parameter (a tie made after fully_shard)",
                                   "tie the modules before fully_shard (the unit holding both then owns the tie)")
    if not new.is_meta:
        check_device(state, g, new.device)


def adopt_replaced(state) -> None:
    """Take the parameter objects the user assigned on this unit's modules since ``fully_shard``
    (before the unit's first forward; after it they are refused, E14). Each becomes the
    parameter -- registered on every module that shares it -- and its value is pending until
    :func:`settle` copies it into the group's rows."""
    for g in state.groups:
        for i, owners in enumerate(g.infos):
            dp, up = g.dist_params[i], g.unsharded_params[i]
            found: dict[int, tuple] = {}
            for info in owners:
                cur = info.owner._parameters.get(info.attr, _MISSING)
                if cur is not dp and cur is not up:
                    found[id(cur)] = (info, cur)
            if not found:
                if i not in g.pending and g.converted_elsewhere(i):
                    _take_converted(state, g, i)
                continue
            info, new = next(iter(found.values()))
            if state.ctx is not None:
                raise RuntimeError(
                    f"mfsdp2 E14: parameter {info.fqn!r} of unit {state.name!r} was replaced (or deleted) after "
                    "fully_shard and the first forward; the runtime owns it now. Change its values in place "
                    "(with torch.no_grad(): param.copy_(...), or load_state_dict) instead of assigning a new "
                    "Parameter, or assign it before the first forward (a DTensor like the parameter, as FSDP2 "
                    "takes it)"
                )
            if len(found) > 1:
                raise _replacement_refused(state, info.fqn, "different objects in the modules that share it",
                                           "a shared parameter is replaced in all its modules at once, by one object")
            _check_replacement(state, g, i, info.fqn, new)
            original = getattr(dp, ORIGINAL_PARAM, None)
            if original is not None:
                setattr(new, ORIGINAL_PARAM, original)  # shared_params finds the tie through it
            g.dist_params[i] = new
            for o in owners:
                o.owner._parameters[o.attr] = new
            g.pending[i] = asked_dtype(g, new.dtype)
            state.unsettled = True
            logger.debug("mfsdp2: %s takes the parameter assigned to %r", g.name, info.fqn)


def _take_converted(state, g: ParameterGroup, i: int) -> None:
    """Parameter ``i`` was converted by ``_apply`` of a module inside the unit that is not one of
    its modules (``model.layers[0].attention.to_empty(...)`` when the unit is ``layers[0]``):
    torch swapped a new DTensor into the object. Before the first forward its value is taken like
    a conversion's; after it, it is refused (as at the next gather, ``_refuse_assigned``)."""
    dp = g.dist_params[i]
    fqn = g.infos[i][0].fqn
    if state.ctx is not None:
        raise RuntimeError(
            f"mfsdp2 E58: parameter {fqn!r} of unit {state.name!r} was converted (.to / to_empty / .half ...) after "
            "the first forward through a module inside the unit that is not one of the modules passed to "
            "fully_shard; its shard keeps the old values. Convert the unit's module (or the whole model), "
            "which converts its shards"
        )
    if tuple(dp.shape) != g.layout.slots[i].shape and g.tp_specs[i] is None:
        raise _replacement_refused(state, fqn, f"a conversion to shape {tuple(dp.shape)}", "convert it as a whole")
    if dp.is_meta and g.allocated:
        raise _meta_refused(g)
    if not dp.is_meta:
        check_device(state, g, dp.device)
    g.pending[i] = asked_dtype(g, dp.dtype)
    state.unsettled = True
    logger.debug("mfsdp2: %s takes %r, converted through a module that is no unit", g.name, fqn)


# -- folding pending values in ----------------------------------------------------------------
@torch.no_grad()
def _copy_in(target: ParameterGroup, i: int, value: DTensor) -> None:
    """``value`` (parameter ``i``'s pending value, any placement ``copy_`` reads) into ``target``'s rows."""
    piece = target.weights.piece_view(target.main_weight, i)
    view = target.as_dtensor(piece, i, value.shape)
    if _same_placements(value, view):
        if not same_memory(piece, value._local_tensor):
            piece.copy_(value._local_tensor.reshape(piece.shape))
    else:
        view.copy_(value)  # other rows (a replacement): redistributed by our copy_ (mfsdp2.dtensors.dtensor_ops)


@torch.no_grad()
def put_grads(g: ParameterGroup, grads: dict, alloc) -> None:
    """Gradients (this rank's rows: plain, or DTensors of the group's placement) of parameters
    ``g`` took in: into the main gradient when the group has one (or had one before a rebuild,
    whose allocator ``alloc`` serves the new one), else kept on the parameter as a gradient of
    its own, which the next reduction adds to (as a user-assigned one)."""
    if not grads:
        return
    if g.main_grad is None and alloc is not None:
        g._ensure_main_grad(alloc, zero=True)
    for i, gr in grads.items():
        dp = g.dist_params[i]
        local = gr._local_tensor if isinstance(gr, DTensor) else gr
        if g.main_grad is not None:
            piece = g.weights.piece_view(g.main_grad, i)
            piece.copy_(local.reshape(piece.shape))
            dp.grad = g.grad_view(piece, i, dp.shape)
        else:
            dp.grad = g.as_dtensor(local.to(dp.dtype), i, dp.shape)


def settle(state, g: ParameterGroup) -> ParameterGroup:
    """Fold ``g``'s pending values in when its parameters agree on device kind and dtype; returns
    the group to keep (a rebuilt one for a new dtype). Otherwise ``g`` stays as it is."""
    if not g.pending:
        return g
    idx = sorted(g.pending)
    kinds = {(g.pending[i], g.dist_params[i].is_meta) for i in idx}
    if len(idx) < len(g.dist_params):
        kinds.add((g.orig_dtype, not g.allocated))
    if len(kinds) != 1:
        return g
    dtype, meta = kinds.pop()
    values = {i: g.dist_params[i].detach() for i in idx}  # aliases survive the swaps below
    grads = {i: g.dist_params[i].grad for i in idx if g.dist_params[i].grad is not None}
    for i in idx:
        g.dist_params[i].grad = None
    was_allocated = g.allocated
    alloc = None
    if dtype == g.orig_dtype:
        target = g
        g.pending.clear()
    else:
        alloc = g.drop_main_grad()  # every parameter of g is pending: none keeps a view of it
        g.pending.clear()
        target = rebuilt(state, g, dtype)
    if not meta:
        target.allocate()  # a meta-built group gets its memory here; its parameters view it
    if target is g and (was_allocated or meta):
        for i in idx:  # the pending objects become views of the group's rows again
            dp = g.dist_params[i]
            local = g.weights.piece_view(g.main_weight, i)
            swap_param(dp, nn.Parameter(g.as_dtensor(local, i, dp.shape), requires_grad=dp.requires_grad))
    if not meta:
        for i in idx:
            _copy_in(target, i, values[i])
        target.needs_init = False
        target.mark_changed()
        put_grads(target, grads, alloc)
    mark_empty_pieces(target)
    logger.debug("mfsdp2: %s took %d pending parameter values (%s%s)", target.name, len(idx), dtype,
                 ", meta" if meta else "")
    return target


def settle_all(state) -> None:
    """:func:`settle` every group of the unit and register the results."""
    for gi, g in enumerate(list(state.groups)):
        if not g.pending:
            continue
        new = settle(state, g)
        if new is not g:
            state.groups[gi] = new
            plan_epoch.bump(plan_epoch.PlanChange.PARAMETERS)
        new.register(unsharded=False, check=False)
    state.unsettled = any(g.pending for g in state.groups)


def prepare(state) -> None:
    """Before the unit's parameters are gathered: take replaced parameters (first forward or
    ``unshard()`` before it), fold pending values in, and refuse what would gather parameters
    without values (meta) or of different dtypes within one group."""
    if state.ctx is None:
        adopt_replaced(state)
    if state.unsettled:
        settle_all(state)
    meta = [info[0].fqn for g in state.groups for i, info in enumerate(g.infos) if g.dist_params[i].is_meta]
    if meta:
        raise RuntimeError(
            f"mfsdp2 E04: the parameters {meta} of unit {state.name!r} are still on the meta device (the model was "
            "built under torch.device('meta')); call mfsdp2.materialize(model) after fully_shard and before the "
            "first forward (or FSDP2's recipe: model.to_empty(device=...), then reset_parameters() on each module)"
        )
    for g in state.groups:
        if g.pending:
            asked = [g.pending.get(i, g.orig_dtype) for i in range(len(g.dist_params))]
            dtypes = {info[0].fqn: str(d).replace("torch.", "") for info, d in zip(g.infos, asked)}
            raise RuntimeError(
                f"mfsdp2 E57: the parameters of {g.name} have different dtypes after some of them were converted or "
                f"replaced ({dtypes}); a group of a unit's parameters keeps one dtype (FSDP2 refuses this too: "
                "one original dtype per unit). Convert every module of the unit alike (model.to(dtype), or each "
                "module of fully_shard([...])), or shard the modules that differ as units of their own"
            )


# -- a group for a new dtype ------------------------------------------------------------------
def rebuilt(state, g: ParameterGroup, dtype: torch.dtype) -> ParameterGroup:
    """A new group like ``g`` for parameters of ``dtype``, on ``g``'s layout, whose DTensor
    parameter objects are ``g``'s (contents swapped in, identity and user attributes kept). Its
    buffers are on the meta device until :meth:`ParameterGroup.allocate`."""
    shapes = [g.layout.slots[i].shape for i in range(len(g.dist_params))]
    metas = [nn.Parameter(torch.empty(s, dtype=dtype, device="meta"), requires_grad=g.requires_grad) for s in shapes]
    new = ParameterGroup(
        g.unit_name, g.infos, metas, g.mesh, g.comm, g.device, state.mp, g.config, tp_specs=g.tp_specs, layout=g.layout
    )
    new.divide_factor = g.divide_factor
    new.requires_all_reduce = g.requires_all_reduce
    for i, (old_dp, new_dp) in enumerate(zip(g.dist_params, new.dist_params)):
        swap_param(old_dp, new_dp)  # drops old_dp.grad: grads are moved after
        new.dist_params[i] = old_dp
        orig = original_of(old_dp)
        if orig is not None and getattr(orig, OWNER_ATTR, None) is not None:
            setattr(orig, OWNER_ATTR, (state, new))  # a parent unit taking a tie finds the new group
    return new
