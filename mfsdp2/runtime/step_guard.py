"""Refuse optimizer steps that would silently not do what the user asked: one that ignores
gradients a gathered unit still holds unreduced, one of an optimizer built before
``fully_shard`` (E54, :func:`_check_replaced`), whose parameters no forward reads any more, and
one that would leave out micro-batches accumulated with gradient sync off (E55,
:func:`_check_unsynced`); and the step of an optimizer that cannot update row-sharded parameters
at all (E60, :func:`_check_supported`: ``torch.optim.Adafactor``), refused before it starts, with
the reason, instead of DTensor's error from inside it.

Why: mfsdp2 reduces the gradients autograd accumulates into a unit's gathered (unsharded)
parameters at the end of each backward. Gradients written there *outside* a backward -- torch
pipelining's zero-bubble weight pass assigns ``param.grad`` after its ``autograd.grad`` returns
(``stage_backward_weight``) when the stage is torch's own ``PipelineStage`` -- are seen by no
hook. With gradient sync on, nothing would ever reduce them before the step: the optimizer would
step on the gradients of the other micro-batches only, a silent wrong result. A process-wide
``register_optimizer_step_pre_hook`` (installed at the first root's lazy init) checks, before
each step, every gathered unit with gradient sync on under a live root, and raises naming the
unit and what to do. Steps taken inside a backward (optimizer-in-backward, from post-accumulate
hooks) are not checked: the backward's own callback has not run yet. The check reads host state
only (``.grad is None`` per gathered parameter): no collective, no device synchronisation, and
sharded units (the common state at a step) cost one comparison.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import local_step
from .optimizer_repair import restore_collapsed
from .shared_params import OWNER_ATTR, original_of
from .state import RootContext, ShardState

__all__ = [
    "watch",
    "UnreducedGradientsError",
    "StaleParameterError",
    "DuplicateParameterError",
    "UnsyncedGradientsError",
    "UnsupportedOptimizerError",
]

_contexts: "weakref.WeakSet[RootContext]" = weakref.WeakSet()
_hook_handle = None


class UnreducedGradientsError(RuntimeError):
    """An optimizer step while a unit's gathered parameters hold gradients no backward reduced."""


def _unreduced(ctx: RootContext) -> list:
    """``(unit, group)`` pairs of ``ctx`` whose gathered parameters hold gradients while gradient
    sync is on (host state only)."""
    found = []
    for s in ctx.states:
        if s.shard_state is not ShardState.UNSHARDED or not s.requires_gradient_sync:
            continue
        for g in s.groups:
            if g.requires_grad and any(p.grad is not None for p in g.unsharded_params):
                found.append((s, g))
    return found


class StaleParameterError(RuntimeError):
    """An optimizer holding a parameter object that ``fully_shard`` replaced (built before it)."""


# Optimizers already checked for replaced parameters, with their parameter count then: the check
# runs again only when the count changes (add_param_group), so a step costs one lookup.
_checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _check_replaced(optimizer) -> None:
    """Refuse an optimizer built before ``fully_shard``. ``fully_shard`` puts new DTensor
    parameters on the module; the user's original objects stay behind, and an optimizer holding
    them steps tensors no forward reads: the model never trains (torch FSDP2 too, silently).
    The originals carry their owner (``shared_params.mark_owned``), which names them."""
    n = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == n:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            owner = getattr(p, OWNER_ATTR, None)
            if owner is None:
                continue
            state, g = owner
            names = [g.infos[i][0].fqn for i, dp in enumerate(g.dist_params) if original_of(dp) is p]
            name = names[0] if names else f"of shape {tuple(p.shape)}"
            raise StaleParameterError(
                f"mfsdp2 E54: {type(optimizer).__name__} holds parameter {name!r} of unit {state.name!r} as it "
                "was before fully_shard replaced it with a sharded DTensor parameter; stepping it would "
                "never change the model (torch FSDP2 trains nothing then, silently). Build the "
                "optimizer after fully_shard, from model.parameters()"
            )
    _check_duplicates(optimizer)
    _checked[optimizer] = n


class DuplicateParameterError(RuntimeError):
    """An optimizer holding one of mfsdp2's parameters more than once."""


def _params_of_units(keep=None) -> dict:
    """``id(parameter) -> (unit state, fqn)`` of every live unit's parameters (those ``keep``
    accepts)."""
    return {
        id(dp): (s, g.infos[i][0].fqn)
        for ctx in list(_contexts)
        for s in ctx.states
        for g in s.groups
        for i, dp in enumerate(g.dist_params)
        if keep is None or keep(dp)
    }


def _model_order(optimizer) -> tuple[dict[int, int], dict]:
    """``(id -> index in its root model's parameter order, id -> parameter)`` of the parameters of
    the models ``optimizer`` steps: the order ``model.parameters()`` lists them in, which
    optimizers are built from. Other live models are left out (their parameters are not this
    optimizer's to be missing)."""
    order: dict[int, int] = {}
    params: dict = {}
    units = _params_of_units()
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for ctx in list(_contexts):
        if not any(id(dp) in stepped for s in ctx.states for g in s.groups for dp in g.dist_params):
            continue
        for module in ctx.root.modules:
            for p in module.parameters():
                if id(p) in units and id(p) not in order:
                    order[id(p)] = len(order)
                    params[id(p)] = p
    return order, params


def _check_duplicates(optimizer) -> None:
    """Refuse an optimizer that holds a unit's parameter twice. torch's ``add_param_group`` refuses
    that too, but code that rewrites ``param_groups`` itself bypasses it -- Accelerate's
    ``prepare`` re-points an optimizer at the model's parameters by ``_local_tensor.data_ptr()``,
    and a rank whose piece of a parameter is empty (mfsdp2 keeps whole parameters on one rank
    where a unit's row split allows) has ``data_ptr() == 0`` there, so every such parameter
    maps to one of them. That rank's optimizer then misses parameters the other ranks' hold:
    state dicts and checkpoints built from it are wrong (a resume diverges) and per-parameter
    collectives over its states desynchronise. Run with the optimizer-step check above (once
    per optimizer and parameter count)."""
    units = _params_of_units()
    seen: dict = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in units:
                seen[id(p)] = seen.get(id(p), 0) + 1
    twice = {units[k][1]: c for k, c in seen.items() if c > 1}
    if twice and restore_collapsed(optimizer, *_model_order(optimizer)) is not None:
        return
    if twice:
        name, count = next(iter(twice.items()))
        unit = next(units[k][0].name for k in seen if units[k][1] == name)
        raise DuplicateParameterError(
            f"mfsdp2 E61: {type(optimizer).__name__} holds parameter {name!r} of unit {unit!r} {count} times "
            f"(duplicates: {sorted(twice)}): its parameter lists were rewritten outside add_param_group. "
            "Accelerate's prepare() does that, matching parameters by data_ptr(), which is 0 for every "
            "parameter this rank holds no rows of, so they all become one and the others go missing from "
            "this rank's optimizer (its state dicts and checkpoints would be wrong); mfsdp2 puts such lists "
            "back when the model's parameter order proves the original, which it does not here. Restore the lists "
            "after prepare: groups = [list(g['params']) for g in optimizer.param_groups] before it, then "
            "for g, ps in zip(optimizer.param_groups, groups): g['params'] = ps"
        )


class UnsyncedGradientsError(RuntimeError):
    """An optimizer step while units hold micro-batch gradients accumulated with sync off."""


def _holds_pending(s) -> bool:
    """Whether unit ``s`` holds gradients a step would miss: micro-batches accumulated with sync
    off, HSDP shard-group sums awaiting the all-reduce across replicas, reductions in flight."""
    if any(g.partial is not None or g.reduce_pending for g in s.groups):
        return True
    return not s.requires_gradient_sync and any(g.requires_grad and g.has_unsharded_grads() for g in s.groups)


def _check_unsynced(optimizer) -> None:
    """Refuse a step while units whose parameters it steps hold gradients no backward completed:
    accumulated with ``set_requires_gradient_sync(False)``, kept for HSDP's all-reduce across
    replicas by ``set_requires_all_reduce(False)``, or left in flight by
    ``set_is_last_backward(False)``. The step would use none of them (``.grad`` holds the last
    *completed* gradient, or nothing), so those micro-batches would silently not count -- the
    usual cause is a flag never turned back on for the last micro-batch (torch FSDP2 steps
    without them, silently). A few attribute reads per group; no device work."""
    found = [(ctx, s) for ctx in list(_contexts) if not ctx.callback_queued for s in ctx.states if _holds_pending(s)]
    if not found:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = [s.name for _, s in found if any(id(p) in stepped for g in s.groups for p in g.dist_params)]
    if names:
        raise UnsyncedGradientsError(
            f"mfsdp2 E55: optimizer step while units {names} hold gradients accumulated with gradient sync off "
            "(set_requires_gradient_sync(False), HSDP's set_requires_all_reduce(False), or reductions left in "
            "flight by set_is_last_backward(False)) that no backward completed yet: this step would not use "
            "them. Turn sync back on for the last micro-batch, before its backward: "
            "model.set_requires_gradient_sync(True) (set_requires_all_reduce(True), set_is_last_backward(True))"
        )


class UnsupportedOptimizerError(RuntimeError):
    """An optimizer step that cannot be computed on row-sharded parameters."""


# Optimizers that reduce over the rows of a parameter inside in-place updates, with why.
_ROW_REDUCING = {
    "Adafactor": (
        "it factors the second moment of every matrix into row and column means, and the column mean "
        "sums over rows that other ranks hold: a partial sum, which DTensor cannot update in place "
        "(torch FSDP2 raises 'in-place operations that require placement changes are not supported' "
        "there)"
    ),
}
_supported: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _check_supported(optimizer) -> None:
    """Refuse, before it starts, the step of an optimizer that cannot update row-sharded matrices
    (``_ROW_REDUCING``): it would fail inside the step with DTensor's error about an aten op.
    Its vectors, and every parameter of ``no_shard`` units (whole on every rank), are fine.
    Checked once per optimizer and parameter count."""
    n = sum(len(group["params"]) for group in optimizer.param_groups)
    why = _ROW_REDUCING.get(type(optimizer).__name__) if type(optimizer).__module__.startswith("torch.optim") else None
    if why is None or _supported.get(optimizer) == n:
        return
    # RowShard: rows split
    sharded = _params_of_units(lambda dp: dp.dim() >= 2 and any(isinstance(pl, Shard) for pl in dp.placements))
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in sharded:
                s, fqn = sharded[id(p)]
                raise UnsupportedOptimizerError(
                    f"mfsdp2 E60: torch.optim.{type(optimizer).__name__} cannot step sharded parameter {fqn!r} of unit "
                    f"{s.name!r}: {why}. Shard that unit with sharding_strategy='no_shard' (every rank holds "
                    "whole parameters), pass such matrices as ignored_params, or step them with another "
                    "optimizer (its vectors are fine)"
                )
    _supported[optimizer] = n


def _check_missed_weights(optimizer) -> None:
    """Refuse (E52) a step over a unit whose weight gradients an input-only backward left to a
    pass that never computed them (a split-backward pipeline schedule under torch's stage)."""
    missed = [s for ctx in list(_contexts) for s in ctx.states if s.weights_missed]
    if not missed:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for s in missed:
        if any(id(dp) in stepped for g in s.groups for dp in g.dist_params):
            s.weights_missed = False
            raise ValueError(
                f"mfsdp2 E52: unit {s.name!r} reshards its weights after forward, but a backward computed only "
                "input gradients through it and no backward since computed its weight gradients (a pipeline "
                "schedule with a separate weight pass: zero bubble, DualPipeV, under torch's PipelineStage); "
                "this step would miss them. Shard the stage's modules with fully_shard(..., "
                "reshard_after_forward=False) (or call set_reshard_after_forward(False) on them), use "
                "mfsdp2.integrations.pipelining.PipelineStage, or a schedule without a separate weight pass "
                "(ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)"
            )


def _check(optimizer, args, kwargs) -> None:
    _check_replaced(optimizer)
    _check_supported(optimizer)
    _check_missed_weights(optimizer)
    if torch._C._current_graph_task_id() != -1:
        return  # a step inside backward (optimizer-in-backward)
    _check_unsynced(optimizer)
    found = [(ctx, s, g) for ctx in list(_contexts) if not ctx.callback_queued for s, g in _unreduced(ctx)]
    if not found:
        return  # the common case: nothing gathered holds a gradient, no per-parameter work
    # Only the units this optimizer steps (another model's state is not this step's business).
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for ctx, s, g in found:
        if any(id(p) in stepped for p in g.dist_params):
            raise UnreducedGradientsError(
                f"mfsdp2 E49: optimizer step while unit {s.name!r} (root {ctx.root.name!r}) holds gradients "
                "in its gathered parameters that no backward reduced: they were written after the "
                "last backward ended (e.g. by torch.distributed.pipelining's zero-bubble weight "
                "pass with torch's PipelineStage), so this step would ignore them. With pipeline "
                "schedules use mfsdp2.integrations.pipelining.PipelineStage (same arguments as torch's), which "
                "reduces them once per step; elsewhere, compute gradients with backward() "
                "through the model, not by assigning .grad"
            )


def watch(ctx: RootContext) -> None:
    """Check ``ctx``'s units before every optimizer step (held weakly; the hook is installed once)."""
    global _hook_handle
    _contexts.add(ctx)
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_pre_hook(_check)
        local_step.install()  # its pre-hook must come after this check
