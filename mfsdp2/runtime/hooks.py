"""The lifecycle hooks: unshard -> forward -> reshard -> (pre-)backward -> reduce, and the root's
final backward callback. The forward half and the root's set-up live here; the gathers in
:mod:`mfsdp2.runtime.unshard`, the backward half in :mod:`mfsdp2.runtime.backward`.

* **pre-forward** (module forward pre-hook): issue this unit's all-gather, then the prefetches the
  schedule predicts, then wait for this unit's own gather; register the unsharded parameters; in a
  grad-enabled forward, thread the inputs through :class:`_PostBackward` so the unit learns when
  its backward is done.
* **post-forward** (module forward hook): reshard (unless ``reshard_after_forward=False``, the
  root's default: backward needs it first); hook the outputs so the unit unshards before its
  backward runs (:mod:`mfsdp2.runtime.output_hooks`: a unit whose backward gathers nothing and
  whose one output the next unit takes as its input has that unit's input function run its
  pre-backward instead), and tell the schedule a backward will come. A forward that runs *inside*
  backward is an activation-checkpoint recompute: it neither reshards nor re-registers hooks, and
  is not recorded in the schedule. One exception: a unit whose forward ran under ``no_grad`` (a
  *reentrant* checkpoint around the whole unit runs it so) has no hooked outputs; its grad-enabled
  recompute in backward is where its backward starts, so that recompute does the pre-backward
  work and threads its inputs through :class:`_PostBackward` (the checkpoint's inner backward then
  runs the post-backward).
* **pre-backward** (a tensor hook on the one output, a multi-grad hook in mode "any" on several,
  or the next unit's :class:`_PostBackward`): queue the root's final callback
  once per backward, unshard this unit and prefetch the next units of the predicted backward
  order (see :mod:`mfsdp2.runtime.schedule`).
* **root's pre-forward** additionally releases cleared main grads and, when some groups keep
  persistent weights or gather in FP8, agrees across ranks on which must be regathered and on the
  FP8 scales (one small all-reduce for the whole model).
* **post-backward** (backward of :class:`_PostBackward`): reshard, finish the previous unit's
  reduction (one reduction input alive at a time, FSDP2's default; HSDP's all-reduce across
  replicas is a second stage with its own queue), pack gradients, issue the async reduction. Full-gradient strategies
  (no_shard, ZeRO-1) pack into a shared bucket instead (:mod:`mfsdp2.groups.grad_buckets`), issued when
  full and finished by the buckets, never by the sliding drain (which would issue every bucket
  after one unit).
* **final callback** (queued on the autograd engine): reduce what no hook reduced (units whose
  inputs need no grad, like the root; unused outputs), issue the open buckets, drain every
  reduction, reshard everything, and fail loudly if a unit is still mid-forward.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn as nn

from ..base.profiling import event_log
from .schedule import Schedule
from ..base.structures import map_tensors, tensors_in
from .state import FSDPState, RootContext, ShardState, TrainingState, unit_state
from . import step_guard
from ..groups.weight_watch import agree_on_gathers
from . import param_adoption
from .unshard import plan_bucketed_gathers, reshard, unshard_async, wait_unshard
from .step_plan import UnitPlan, plan_of
from .backward import _ForwardPass, _PostBackward, _in_backward, _pre_backward
from .output_hooks import hook_outputs, settle_pending, take_pending
from . import quiet_units

__all__ = ["pre_forward", "post_forward", "lazy_init", "reset"]

logger = logging.getLogger(__name__)


# -- root -------------------------------------------------------------------------------------
def lazy_init(state: FSDPState) -> None:
    """Make ``state`` the root of every unit in its subtree unless it is already under a root, and
    prepare each unit's parameters (:func:`mfsdp2.runtime.param_adoption.prepare`)."""
    if state.ctx is not None:
        return
    states = []
    for path, m in state.module.named_modules():
        s = unit_state(m)
        if s is not None and s not in states:  # fully_shard([a, b]): one unit, several modules
            s.name = path or "root"  # names in traces, allocator keys and errors
            for g in s.groups:
                g.unit_name = s.name
            states.append(s)
    for s in states:
        # Gathered by an explicit unshard() before any forward (a pipeline schedule unshards its
        # stages first): kept, as FSDP2 keeps it; its forward waits for that gather. A unit that
        # already ran as a root of its own and kept its parameters gathered is another matter.
        if s.shard_state is not ShardState.SHARDED and s is not state and s.ctx is not None:
            raise RuntimeError(
                f"mfsdp2 E13: unit {s.name!r} is unsharded while {state.name!r} becomes its root; "
                "reshard it (module.reshard()) before running the parent's forward"
            )
    for s in states:
        # Parameters replaced since fully_shard are taken, pending values folded in; parameters
        # still on the meta device, or of two dtypes in one group, are refused.
        param_adoption.prepare(s)
        if s is not state and s.allocator_spec is not None and s.allocator_spec is not state.allocator_spec:
            raise ValueError(
                f"mfsdp2 E09: allocator={s.allocator_spec!r} was given to {s.name!r}, which is not the root; "
                "every unit under a root shares the root's allocator: "
                f"pass it to fully_shard of the root ({state.name!r})"
            )
    if not state.reshard_after_forward_given:
        # FSDP2's default (None): the root keeps its parameters from forward to backward, which
        # needs them first (the output layer) -- one all-gather saved. Passed explicitly, True
        # reshards the root like any unit (memory over one gather), as in FSDP2.
        state.reshard_after_forward = False
    step_guard.watch(RootContext.create(state, states, Schedule(states)))


# -- forward ----------------------------------------------------------------------------------
def _cast(x: Any, dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


def outside_inference_mode(fn):
    """Run a runtime entry point (forward hooks, explicit ``unshard()``) with inference mode off
    and the caller's grad mode. Why: under ``torch.inference_mode()`` (an eval before the first
    training step: Lightning's sanity check) the allocator's blocks and lazily built buffers would
    be *inference tensors*, which the next training step may not write or save for backward
    (torch FSDP2 fails there). The module's own computation stays in inference mode."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        grad = torch.is_grad_enabled()
        with torch.inference_mode(False), torch.set_grad_enabled(grad):
            return fn(*args, **kwargs)

    return wrapper


@outside_inference_mode
def pre_forward(module: nn.Module, args: tuple, kwargs: dict):
    state: FSDPState = module._mfsdp2_state
    lazy_init(state)
    ctx = state.ctx
    recompute = _in_backward()
    if state.quiet_pass and quiet_units.in_quiet_pass(state, recompute):
        return args, kwargs
    grad = torch.is_grad_enabled()
    # A grad-enabled recompute of a unit that ran no grad-enabled forward this iteration: a
    # reentrant checkpoint around the unit ran its forward under no_grad, and this recompute
    # followed by the checkpoint's inner backward *is* the unit's backward.
    backward_recompute = recompute and grad and not state.forward_with_grad
    # The previous unit's output, if this unit's input function will run its pre-backward.
    chained = take_pending(ctx, state, args, kwargs, grad and not recompute)
    if backward_recompute:
        state.backward_via_recompute = True  # learned: predict this unit's backward from now on
        _pre_backward(state, need_weights=True)  # the recompute itself computes with them
    elif recompute:  # its pre-backward hook already gathered it; this only covers odd orders
        unshard_async(state)
        wait_unshard(state)
    else:
        if state.is_root:
            if ctx.callback_queued:
                raise RuntimeError(
                    f"mfsdp2 E15: forward of {state.name!r} started while its backward is still running "
                    "(or a previous backward raised before finishing)"
                )
            ctx.schedule.begin_forward(grad)
            # The runtime's own tensors (main gradients, gradient views, buckets) are changed
            # here, outside any torch.func transform the forward runs under.
            with torch._C._DisableFuncTorch():
                _begin_step(ctx, state, grad)
            quiet_units.begin(ctx, state, grad)  # the other units' forward-hook work, if it can
        state.training_state = TrainingState.FORWARD
        prefetch = ctx.schedule.on_forward(state)
        unshard_async(state)
        for s in prefetch:
            unshard_async(s)
        wait_unshard(state)
    event_log.record("forward_begin", state.name)
    if grad and (not recompute or backward_recompute):
        state.forward_with_grad = True
        single = not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor  # the usual block
        if single:
            needing = {id(args[0]): args[0]} if args[0].requires_grad else {}
        else:
            needing = {id(t): t for t in tensors_in((args, kwargs)) if t.requires_grad}
        # A unit of several modules: the module that opens its forward pass decides, as in FSDP2
        # (which threads that module's inputs only), and each module's inputs count, so the unit
        # reduces and reshards once, when every one of them finished its backward (it reduced,
        # resharded and gathered again once per module).
        opens = len(state.modules) == 1 or backward_recompute or len(state.forward_to_run) == len(state.modules)
        if opens or state.forward_pass is None:
            state.forward_pass = _ForwardPass(opened=bool(needing))
            state.open_passes += state.forward_pass.opened
        if needing:
            state.forward_pass.pending += 1
            if chained is not None:
                state.forward_pass.then = chained
            outs = _PostBackward.apply(state, state.forward_pass, *needing.values())
            if single:  # its one input is the one tensor threaded through
                args = outs
            else:
                routed = dict(zip(needing, outs))
                args, kwargs = map_tensors(lambda t: routed.get(id(t), t), (args, kwargs))
    dtype = plan_of(state).cast_dtype
    if dtype is not None:
        args, kwargs = map_tensors(functools.partial(_cast, dtype=dtype), (args, kwargs))
    return args, kwargs


def _begin_step(ctx: RootContext, root: FSDPState, grad: bool) -> None:
    """What the root's forward does first: give back the main gradients nobody exposes, start
    the allocator's step, agree on and start the bucketed gathers."""
    if ctx.graph_held:  # weights kept for a graph recorded in backward: this forward gathers anew
        ctx.graph_held = False
        for s in ctx.states:
            if s.held_for_graph:
                reshard(s)
    # Main grads whose parameters all had their grads cleared (zero_grad(set_to_none=True))
    # go back to the allocator: they take no memory through forward, as in FSDP2.
    for s in ctx.states:
        for g in s.groups:
            g.release_main_grad()
    # A step begins: the trace-pool allocator keeps one plan per kind of step.
    ctx.allocator.mark_step(("train" if grad else "eval", root.requires_gradient_sync))
    _wait_post_optim_event(ctx)
    for s in ctx.states:
        if len(s.modules) > 1:  # only units of several modules track their forwards
            s.forward_to_run = {id(m) for m in s.modules}
    agree_on_gathers(ctx)
    # Stale small persistent groups gather in buckets across units (same cap as the gradient
    # all-reduce buckets), planned from the recorded order and agreed flags; small ZeRO-3 groups
    # too, under their own cap (set_all_gather_bucket_cap_mb).
    plan_bucketed_gathers(ctx, backward=False)


def _wait_post_optim_event(ctx: RootContext) -> None:
    """``set_post_optim_event``: order this step's first gathers after the user's event (used
    once, then dropped, as in FSDP2). On CUDA the current stream waits on it; the side streams keep
    waiting on the current stream too (our buffer reuse rule relies on that wait), so the event
    adds a dependency but cannot remove the current-stream one. CPU collectives are issued in
    program order after the optimizer step already, so there it is only dropped."""
    event, ctx.post_optim_event = ctx.post_optim_event, None
    if event is not None and ctx.root.comm.device.type != "cpu":
        event.wait()


@outside_inference_mode
def post_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    state: FSDPState = module._mfsdp2_state
    if state.quiet_pass and quiet_units.in_quiet_pass(state, _in_backward()):
        return output
    event_log.record("forward_end", state.name)
    settle_pending(state.ctx)  # a unit's output no other unit took as its input
    if _in_backward():  # activation-checkpoint recompute: its backward runs next, stay unsharded
        # Same output dtype as the original forward: the checkpoint compares what it recomputes.
        return _cast_output(plan_of(state), output)
    ctx = state.ctx
    plan = plan_of(state)
    grad = torch.is_grad_enabled()
    last = _last_of_group(state, module)
    if last and (not grad or (plan.reshard_after_forward and not plan.keep_after_forward)):
        reshard(state, to_group=grad and state.post_forward_comm is not None)
    state.training_state = TrainingState.IDLE
    backward_follows = False
    if grad:
        backward_follows = hook_outputs(state, plan, output)
    elif state.backward_via_recompute and ctx.schedule.in_training_forward:
        backward_follows = True  # a reentrant checkpoint will recompute it in backward, as last step
    if backward_follows and not state.is_root:
        state.expect_backward = True
        ctx.schedule.expect_backward(state)
    if state.is_root:
        quiet_units.end_forward(ctx)  # calls of a unit after the pass run its hooks again
        ctx.gathers.finish()  # units that did not run get their rows; unissued buckets are dropped
        ctx.schedule.end_forward(record=grad)
        for s in ctx.states:
            if len(s.modules) > 1 and len(s.forward_to_run) != len(s.modules):
                # A grouped unit some of whose modules did not run in this forward (chunked loss:
                # the head runs later, per chunk): its forward ends with the root's, as in FSDP2.
                s.forward_to_run = {id(m) for m in s.modules}
                if s.reshard_after_forward and s.shard_state is not ShardState.SHARDED:
                    reshard(s)
        for s in ctx.states:
            # Eval passes keep nothing gathered; training passes drop mispredicted prefetches
            # (a quiet pass's units stay gathered for their backward).
            if s.shard_state is not ShardState.SHARDED and (not grad or not (s.forward_with_grad or s.quiet_pass)):
                reshard(s)
        if grad:
            # The loss and the start of backward (the step's activation peak, usually) come next:
            # blocks the forward freed are theirs until backward asks for weights again.
            ctx.allocator.release_idle("backward")
    return _cast_output(plan, output)


def _last_of_group(state: FSDPState, module: nn.Module) -> bool:
    """Whether ``module``'s forward completes its unit's forwards of this pass. A unit of several
    modules (``fully_shard([a, b])``) stays gathered until each has run (or the root's forward
    ends), so running them in a row costs one all-gather, as in FSDP2."""
    if len(state.modules) == 1:
        return True
    state.forward_to_run.discard(id(module))
    if state.forward_to_run:
        return False
    state.forward_to_run = {id(m) for m in state.modules}
    return True


def _cast_output(plan: UnitPlan, output: Any) -> Any:
    if plan.output_dtype is not None:
        output = map_tensors(functools.partial(_cast, dtype=plan.output_dtype), output)
    return output


def reset(ctx: RootContext) -> None:
    """Return every unit under the root to a clean sharded state after an exception in forward or
    backward, so training can continue: in-flight collectives are waited for (never freed under),
    this step's partial gradients are dropped, the pass in progress is forgotten. A collective
    that failed and may still run has its buffers leaked instead (see ``CommHandle.settle``)."""
    ctx.gathers.abort()  # first: settling a member's handle below must not issue another bucket
    ctx.pending_output = None  # the pass's graph is abandoned with it
    quiet_units.end_forward(ctx)
    ctx.quiet = False
    for s in ctx.states:
        for g in s.groups:
            g.abort(ctx.allocator)
            if g.persistent:
                # Which rows arrived is a local fact; a common one makes every rank re-gather
                # (weight_watch: nothing is agreed for a group marked changed).
                g.mark_changed()
        if s.subclass is not None:
            s.subclass.abort_reduce()
            s.subclass.drop_unsharded_grads()
        for g, h in s.pending_unshard:
            if not h.settle():
                g.abandon_gather(f"the {h.label or 'all-gather'} failed and may still be running")
        s.pending_unshard = []
        reshard(s)
        s.training_state = TrainingState.IDLE
        s.forward_with_grad = False
        s.post_backward_done = False
        s.expect_backward = False
        s.open_passes = 0
        s.quiet_pass = False
    ctx.reduce_queue.clear()
    ctx.allreduce_queue.clear()
    ctx.buckets.abort()
    ctx.callback_queued = False
    ctx.schedule.abandon_pass()
    event_log.record("reset", ctx.root.name)
