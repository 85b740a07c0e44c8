"""Quiet passes: a training forward in which the root does every unit's forward-hook work at once
and the units run with no forward hooks at all, as DDP's modules do.

Why: a unit whose weights are persistent and in the compute dtype (``no_shard``; ZeRO-1/2, whose
rows after an optimizer step come in the gather bucket the root's forward issues) has nothing to
gather of its own, cast or free in its forward. What its hooks still do per call -- the hook
dispatch, an autograd function on the inputs, a hook on the outputs, the schedule's bookkeeping, a
registration -- cost several times a small block's compute on the host (64 blocks of
``Linear(64, 64)``: about 50 us per unit and step against DDP's 3). DDP pays nothing per module in
forward and learns that a module's gradients are ready from a hook on each parameter's gradient
accumulator; a quiet pass does the same.

What a quiet pass does instead, per unit:

* at the root's pre-forward: register the unit's unsharded parameters (with every check a
  registration makes: replaced parameters, assigned ``.data``, ``requires_grad`` flips), arm a
  countdown of its trainable parameters, and detach its two forward hooks from the module;
* at the root's post-forward (an ``always_call`` hook of the root: also when its forward raised):
  attach them again, so a call of the unit after the pass, and every activation-checkpoint
  recompute during backward, runs them. There they do nothing (:func:`in_quiet_pass`): the unit
  is registered already and its gradients are counted by accumulator hooks;
* in backward: a post-accumulate-grad hook on each trainable unsharded parameter counts down;
  the last one runs the unit's post-backward (reshard, pack, reduce), where its ``_PostBackward``
  would have. A parameter that gets no gradient in a backward leaves the count open: the root's
  final callback reduces what such a unit holds, as it does for a unit whose input function never
  ran, and re-arms the count for the step's next ``backward()``.

When it is safe (all of it, or the pass runs the hooks): a grad-enabled training forward of the
root, after its first backward (the first step records the schedule), outside ``torch.func``
transforms and with no event log recording; every non-root unit qualifies: one module, its plan's
``quiet`` (persistent compute-dtype weights, nothing to cast, no FP8, subclass parameters, rank
block reshard, TransformerEngine buffers or input-only-backward note), nothing to gather this step
but rows of the root's one gather bucket (with more than one bucket, the units' own waits let
compute overlap the later buckets: the pass stays hooked), no tool wrapping its backward hooks, no
gradient-presence agreement, and the module's forward hooks are exactly the unit's own two (a user's
hook, or a tool that took the unit's hooks over, keeps it hooked, so it sees every call) and it is
not compiled with ``module.compile()`` (its compiled code guards on those hooks). The gradients are
the hooked pass's to the bit: the same post-backward packs the same gradients into the same buckets,
in the same backward order.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..base.profiling import event_log
from .state import FSDPState, RootContext, ShardState
from .step_plan import plan_of
from .unshard import nothing_to_gather, unshard_async, wait_unshard
from .backward import _queue_final_callback, _run_post_backward

__all__ = ["begin", "end_forward", "in_quiet_pass"]

logger = logging.getLogger(__name__)

_GRAD_READY = "_mfsdp2_grad_ready"  # on an unsharded parameter: its accumulator hook is registered


def begin(ctx: RootContext, root: FSDPState, grad: bool) -> bool:
    """At the root's pre-forward, after the step began: make a grad-enabled pass quiet if every
    non-root unit qualifies (see the module docstring); returns whether it did."""
    end_forward(ctx)  # hooks left detached by a pass that raised before its post-forward
    units = [s for s in ctx.states if s is not root]
    quiet = grad and bool(units) and ctx.quiet_allowed and ctx.step > 0 and not event_log.enabled
    quiet = quiet and not torch._C._are_functorch_transforms_active()
    if quiet:
        # Rows still to come may come in the root's one gather bucket (ZeRO-1/2 after a step):
        # the first unit's wait would wait for all of it anyway. With more buckets the units'
        # waits overlap the later ones with compute: that pass stays hooked.
        quiet = ctx.gathers.planned <= 1 and all(_qualifies(s) for s in units)
    ctx.quiet = False
    for s in units:
        s.quiet_pass = False
    if not quiet:
        return False
    if ctx.quiet_guard is None:  # once per root: attach the hooks again even if the forward raises
        ctx.quiet_guard = root.module.register_forward_hook(_ATTACH_AGAIN, always_call=True)
    for s in units:
        # The full parameters, with their checks (or the bucket's rows). First, for every unit:
        # a check that raises (a replaced parameter) leaves every unit hooked.
        unshard_async(s)
        wait_unshard(s)
    for s in units:
        _arm(s)
        _detach(s)
        ctx.quiet_detached.append(s)
        s.quiet_pass = True
    ctx.quiet = True
    ctx.schedule.replay()
    return True


def _qualifies(s: FSDPState) -> bool:
    # Nothing to gather of its own: current persistent weights, or rows from the root's bucket.
    if not plan_of(s).quiet or s.shard_state is not ShardState.SHARDED or not nothing_to_gather(s, bucket_rows=True):
        return False
    if s.weights_missed or s.reduce_unused_params or s.patched_view() is not None:
        return False
    m = s.module
    if s.hooks_taken_over or getattr(m, "_compiled_call_impl", None) is not None:
        return False
    pre, post = s.forward_hook_handles[0]  # one module (plan.quiet): one pair
    hooks_pre, hooks_post = m._forward_pre_hooks, m._forward_hooks
    return (len(hooks_pre) == 1 and pre.id in hooks_pre and len(hooks_post) == 1 and post.id in hooks_post)


def _arm(s: FSDPState) -> None:
    """Count the unit's trainable unsharded parameters and hook the accumulators of those not
    hooked yet (once per parameter object: the hook stays, and counts only in a quiet pass)."""
    n = 0
    for _, g, _ in plan_of(s).reduce:
        for up in g.unsharded_params:
            if not up.requires_grad:
                continue
            n += 1
            if _GRAD_READY not in up.__dict__:
                up.register_post_accumulate_grad_hook(functools.partial(_grad_ready, s))
                up.__dict__[_GRAD_READY] = True
    s.quiet_count = s.quiet_left = n


def _detach(s: FSDPState) -> None:
    pre, post = s.forward_hook_handles[0]
    m = s.module
    s.quiet_hooks = (m._forward_pre_hooks.pop(pre.id), m._forward_hooks.pop(post.id))


def end_forward(ctx: RootContext) -> None:
    """Attach the detached units' forward hooks again (the root's post-forward; an exception's
    reset; the next root pre-forward, after a pass that raised)."""
    units, ctx.quiet_detached = ctx.quiet_detached, []
    for s in units:
        pre, post = s.forward_hook_handles[0]
        fn_pre, fn_post = s.quiet_hooks
        s.quiet_hooks = None
        m = s.module
        m._forward_pre_hooks[pre.id] = fn_pre
        m._forward_pre_hooks.move_to_end(pre.id, last=False)  # fully_shard prepends it
        m._forward_hooks[post.id] = fn_post


def _attach_again(module, args, output) -> None:
    end_forward(module._mfsdp2_state.ctx)


# An ``always_call`` forward hook of the root runs after an exception in its forward too: a unit
# called on its own after that then runs its hooks. Eager like the units' hooks (it edits hook
# dicts, which a compiled root's forward must not trace).
_ATTACH_AGAIN = torch._dynamo.disable(_attach_again, recursive=True)


def in_quiet_pass(state: FSDPState, in_backward: bool) -> bool:
    """Whether a call of ``state``'s forward hooks belongs to a quiet pass (a recompute in its
    backward, or a forward method run through the hooks inside it): then they have nothing to do
    but make sure the full parameters are registered. A call after the pass (the unit called on
    its own) ends the unit's quiet pass and runs the hooks' full work."""
    if not state.quiet_pass:
        return False
    if in_backward or state.ctx.schedule.in_forward:
        if state.shard_state is not ShardState.UNSHARDED:
            unshard_async(state)
            wait_unshard(state)
        return True
    state.quiet_pass = False
    return False


def _grad_ready(state: FSDPState, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a quiet unit's trainable parameter: the last one of the unit
    in this backward runs its post-backward."""
    if not state.quiet_pass:  # a hooked pass: the unit's _PostBackward runs it
        return
    ctx = state.ctx
    if not ctx.callback_queued:
        # A backward that reached no hooked output first (a loss taken inside the model): the
        # callback reduces what no countdown finished.
        _queue_final_callback(ctx)
    state.quiet_left -= 1
    if state.quiet_left:
        return
    state.quiet_left = state.quiet_count
    _run_post_backward(state)
