"""The backward half of a unit's lifecycle: the pre-backward hook on a unit's outputs, the
identity function on its inputs whose backward marks the unit's backward as done, the
post-backward (reshard, pack, issue the reduction), the sliding drain of reductions in flight, and
the root's final callback.

Why these live apart from the forward hooks (:mod:`mfsdp2.runtime.hooks`): they run inside the
autograd engine, where the order of a unit's backward is only known from the graph, and they own
the reduction queue; the forward hooks only thread inputs through :class:`_PostBackward` and hook
the outputs."""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch
from torch.autograd import Variable

from ..base.profiling import event_log, trace_range
from ..precision.te import attach_main_grads
from .fsdp2_state import bind_runtime
from .state import FSDPState, RootContext, TrainingState
from . import grad_presence, graph_hold
from ..memory.offload import settle_host_reads
from .unshard import plan_bucketed_gathers, reshard, unshard_async, wait_unshard
from .step_plan import plan_of

__all__ = ["post_backward"]

logger = logging.getLogger(__name__)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1



# -- backward ---------------------------------------------------------------------------------
def _note_input_only_backward(state: FSDPState) -> None:
    """Note (E52) a backward through a unit that resharded after forward, while gradients
    accumulate with the unit kept gathered, that computes no gradient for any of its parameters
    (``_will_engine_execute_node`` of their accumulators): torch's pipeline stages run such input
    passes for split-backward schedules (zero bubble, DualPipeV), whose later weight pass cannot
    give such a unit its gradients (torch FSDP2 computes wrong ones). Whether the weight
    gradients were lost is known only later -- a user's input-only ``autograd.grad`` followed by a
    full backward loses nothing -- so the note is kept until a backward computes the unit's weight
    gradients, and the step guard refuses an optimizer step while it stands."""
    if torch.is_grad_enabled():  # create_graph=True: a gradient penalty's input gradients, not a pipeline's pass
        return
    trainable = _trainable(state)
    if not trainable:  # frozen: no weight gradient to lose (LoRA's base blocks)
        return
    state.weights_missed = not _computes_weight_grads(trainable)


def _trainable(state: FSDPState) -> list:
    return [p for g in state.groups if g.requires_grad for p in g.unsharded_params if p.requires_grad]


def _computes_weight_grads(trainable: list) -> bool:
    """Whether the running backward computes a gradient for any of ``trainable``."""
    return any(torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(p).node)
               for p in trainable)


def _pre_backward_hook(state: FSDPState, *unused: Any) -> None:
    # Here, not in _pre_backward: a reentrant checkpoint's recompute calls that from inside the
    # outer backward, whose graph does not hold the recomputed parameters' accumulators.
    if state.reshard_after_forward and not state.requires_gradient_sync and not state.reshard_after_backward:
        _note_input_only_backward(state)
    elif state.weights_missed and not torch.is_grad_enabled() and _computes_weight_grads(_trainable(state)):
        state.weights_missed = False  # a later backward computed the weight gradients after all
    view = state.patched_view()
    if view is not None:  # a tool wrapped FSDP2's pre_backward (torch's FSDPMemTracker): through it
        view.pre_backward()
    else:
        _pre_backward(state)


def _pre_backward(state: FSDPState, need_weights: Optional[bool] = None) -> None:
    """Queue the final callback once per backward, gather this unit, prefetch the next ones.

    ``set_unshard_in_backward(False)`` (an embedding: its backward reads the indices, never the
    weight) skips the gather: the unsharded parameters (views of a freed buffer) only receive
    gradients, which autograd never checks against the storage."""
    if need_weights is None:
        need_weights = state.unshard_in_backward
    ctx = state.ctx
    if not ctx.callback_queued:
        _queue_final_callback(ctx)
    state.training_state = TrainingState.PRE_BACKWARD
    prefetch = ctx.schedule.on_backward(state)
    if need_weights:
        unshard_async(state)
    for s in prefetch:
        # never gather a unit no backward will use
        if (s.forward_with_grad or s.expect_backward) and s.unshard_in_backward:
            unshard_async(s)
    if need_weights:
        wait_unshard(state)
    for i, g in enumerate(state.groups):
        if g.te_fused:  # TransformerEngine writes wgrads into param.main_grad: our buffer
            attach_main_grads(g, ctx.allocator, (state.name, i))
    event_log.record("backward_begin", state.name)


def _queue_final_callback(ctx: RootContext) -> None:
    """Once per backward, at the first unit it reaches: the root's final callback, and the
    backward's bucketed gathers."""
    ctx.callback_queued = True
    Variable._execution_engine.queue_callback(functools.partial(_final_callback, ctx))
    with torch._C._DisableFuncTorch():
        plan_bucketed_gathers(ctx, backward=True)


class _ForwardPass:
    """One grad-enabled forward pass of a unit: how many of its modules' ``_PostBackward`` are
    still to run, and whether the module that opened the pass threaded its inputs (if not, its
    backward is not observable: the final callback reduces the unit, as FSDP2's does). ``then``:
    the unit whose one output is this pass's input and whose pre-backward the pass's
    ``_PostBackward`` runs in place of an output hook (:mod:`mfsdp2.runtime.output_hooks`)."""

    __slots__ = ("pending", "opened", "then")

    def __init__(self, opened: bool):
        self.pending = 0
        self.opened = opened
        self.then = None


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once that module's backward is done; the
    last one of a forward pass runs the unit's post-backward.

    Written in the ``setup_context`` form, with a vmap rule and a ``jvp``, so that ``torch.func``
    transforms (``grad``, ``vjp``, ``jvp``, ``vmap``) can trace through a unit, as through FSDP2's
    own function: the forward is an identity, so every derivative passes through unchanged."""

    generate_vmap_rule = True

    @classmethod
    def apply(cls, *args):
        """``Function.apply`` without its per-call ``inspect.signature`` outside ``torch.func``.

        Why: with ``setup_context`` defined, torch binds the forward's default arguments through
        ``inspect.signature`` at every call, whether a transform is active or not -- about a
        fifth of a small unit's forward hook on the host. This forward has no defaults and takes
        no keywords, so the binding changes nothing; under a transform the full path runs."""
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*args)

    @staticmethod
    def forward(state: FSDPState, fwd_pass: _ForwardPass, *inputs: torch.Tensor):
        return inputs

    @staticmethod
    def setup_context(ctx, inputs: tuple, output) -> None:
        ctx.state, ctx.fwd_pass = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        fp = ctx.fwd_pass
        if not ctx.state.ctx.callback_queued:
            # A backward that reached no hooked output first (it started at an output a unit
            # left to the next unit's input function): its reductions still need the callback.
            _queue_final_callback(ctx.state.ctx)
        fp.pending -= 1
        if fp.pending == 0 and fp.opened:
            ctx.state.open_passes -= 1
            _run_post_backward(ctx.state)
        if fp.then is not None:  # the producing unit's pre-backward: its output's gradient is this one
            _pre_backward_hook(fp.then)
        return (None, None) + grads

    @staticmethod
    def jvp(ctx, state_tangent, pass_tangent, *tangents: torch.Tensor):
        return tangents


def _run_post_backward(state: FSDPState) -> None:
    """The unit's post-backward, through FSDP2's group object when a tool replaced its
    ``post_backward`` (torch's ``FSDPMemTracker``), so the tool sees it as on FSDP2."""
    view = state.patched_view()
    if view is not None:
        view.post_backward()
    else:
        post_backward(state)


def post_backward(state: FSDPState) -> None:
    ctx = state.ctx
    plan = plan_of(state)
    event_log.record("backward_end", state.name)
    # The gathered weights go back before the gradients are packed (FSDP2's order): the flat
    # gradient buffer never coexists with this unit's weights.
    if plan.reshard_after_backward and not (torch.is_grad_enabled() and graph_hold.hold(state)):
        reshard(state)
    if plan.requires_gradient_sync:
        with trace_range(plan.trace_reduce):
            reducing = [r for r in plan.reduce if r[1].has_unsharded_grads()]
            # The step's last reduction of these groups: no later backward of this step (the
            # root's is_last_backward) and no other forward pass of the unit awaiting its backward.
            final = ctx.root.is_last_backward and state.open_passes <= 0
            for _, g, _ in reducing:
                g.reduce_final = final
            if ((ctx.reduce_queue or ctx.allreduce_queue)
                    and any(not g.reduces_in_bucket(ctx.buckets) for _, g, _ in reducing)):
                # At most max_reduce_in_flight reduction inputs alive, this unit's included (FSDP2's
                # set_reduce_scatter_max_input_buffers; default 1): finish older ones first. (With
                # nothing in flight there is nothing to finish: the buckets' units skip the test.)
                _drain(ctx, keep=state.max_reduce_in_flight - 1, keep_allreduce=state.max_reduce_in_flight)
            issued = False
            for i, g, head in reducing:
                if not g.reduce_grads(ctx.allocator, (state.name, i), f"{head}{ctx.step})", ctx.buckets):
                    issued = True  # its own collective (a bucketed one is finished by the buckets)
            if state.subclass is not None and state.subclass.has_unsharded_grads():
                # One subclass reduction input alive at a time across units (FSDP2's default):
                # the previous unit's is finished before this one's is packed.
                for s in ctx.states:
                    if s.subclass is not None:
                        s.subclass.finish_reduce()
                state.subclass.reduce_grads(
                    f"reduce-scatter of unit {state.name!r} (subclass parameters, step {ctx.step})")
            if issued:
                event_log.record("rs_issue", state.name)
                if any(g.reduce_chained for _, g, _ in reducing):
                    event_log.record("ar_issue", state.name)  # chained behind the reduce-scatter
                for q in (ctx.reduce_queue, ctx.allreduce_queue):
                    if state in q:
                        q.remove(state)
                ctx.reduce_queue.append(state)
                _drain(ctx, keep=state.max_reduce_in_flight)
    else:
        for g in state.groups:
            if g.requires_grad:
                g.accumulate_unsynced()
        if state.subclass is not None:
            state.subclass.accumulate_unsynced()
    state.post_backward_done = True
    state.training_state = TrainingState.POST_BACKWARD


def _drain(ctx: RootContext, keep: int, keep_allreduce: Optional[int] = None) -> None:
    """Advance the oldest in-flight reductions until at most ``keep`` remain in the first stage
    (``keep_allreduce``, default ``keep``, in the second): a unit whose shard-group reduction
    finishes moves on to its all-reduce across replicas (HSDP), which is finished in turn when
    more than ``keep_allreduce`` of those are in flight. The second stage's buffers are the
    shard-size outputs, so it may keep more in flight than the first, whose inputs are full-size."""
    if keep_allreduce is None:
        keep_allreduce = keep
    while len(ctx.reduce_queue) > keep:
        s = ctx.reduce_queue.pop(0)
        with trace_range(f"mfsdp2.finish_reduce {s.name}"):
            # A group whose reduction waits in a bucket is the buckets' to finish: waiting here
            # would issue its bucket before the bucket's other members are packed.
            done = [g.advance_reduce(ctx.allocator) if g.reduce_bucket is None else True for g in s.groups]
        if all(done):
            event_log.record("rs_done", s.name)
        else:
            event_log.record("ar_issue", s.name)
            ctx.allreduce_queue.append(s)
    while len(ctx.allreduce_queue) > keep_allreduce:
        s = ctx.allreduce_queue.pop(0)
        with trace_range(f"mfsdp2.finish_all_reduce {s.name}"):
            for g in s.groups:
                if g.reduce_bucket is None:
                    g.finish_reduce(ctx.allocator)
        event_log.record("ar_done", s.name)


def _final_callback(ctx: RootContext) -> None:
    with trace_range("mfsdp2.final_callback"):
        try:
            ctx.gathers.finish_backward()  # this backward's buckets: issued ones waited, the rest dropped
            stuck = [s.name for s in ctx.states if s.training_state is TrainingState.FORWARD]
            if stuck:
                raise RuntimeError(
                    f"mfsdp2 E16: backward finished while units {stuck} never finished their forward "
                    "(an exception inside forward?); call model.reshard() and rerun the step"
                )
            # Every unit holding unsharded gradients is reduced, whichever forward (or earlier
            # backward() call of this step) they came from: a step may back-propagate in several
            # backward() calls (chunked loss, retain_graph, two losses), each with its own callback.
            for s in reversed(ctx.states):
                if s.requires_gradient_sync and (any(g.requires_grad and g.has_unsharded_grads() for g in s.groups)
                                                 or (s.subclass is not None and s.subclass.has_unsharded_grads())):
                    _run_post_backward(s)
                elif not s.requires_gradient_sync:  # e.g. the root, whose inputs need no grad
                    for g in s.groups:
                        if g.requires_grad:
                            g.accumulate_unsynced()
                    if s.subclass is not None:
                        s.subclass.accumulate_unsynced()
            ctx.buckets.flush()  # buckets whose last planned member never came are issued as they are
            ctx.buckets.end_backward()
            if ctx.root.is_last_backward:  # else (set_is_last_backward(False)) they stay in flight
                ctx.buckets.complete_all()
                _drain(ctx, keep=0)
                for s in ctx.states:
                    if s.subclass is not None:
                        s.subclass.finish_reduce()
                # CPU offload: the copies into host memory end before backward() returns (the
                # host reads the gradients next), the copies out of it before the host writes.
                for s in ctx.states:
                    for g in s.groups:
                        g.settle_copy_out()
                settle_host_reads()
                grad_presence.finish(ctx)
            pending = []
            for s in ctx.states:
                if s.reshard_after_backward and not (torch.is_grad_enabled() and graph_hold.hold(s)):
                    reshard(s)
                s.training_state = TrainingState.IDLE
                if (s.forward_with_grad or s.expect_backward) and not s.post_backward_done:
                    # Its forward's backward has not run yet: a later backward() call of this step
                    # will run it (its output hooks and _PostBackward are still in the graph).
                    pending.append(s)
                    continue
                if s.expect_backward and not s.forward_with_grad:
                    # Predicted to be recomputed by a reentrant checkpoint, but it was not (the
                    # model stopped checkpointing it): stop predicting its backward.
                    s.backward_via_recompute = False
                s.forward_with_grad = False
                s.post_backward_done = False
                s.expect_backward = False
                s.open_passes = 0
                # A quiet unit some of whose parameters got no gradient was reduced above: the
                # step's next backward() counts its accumulator hooks from the start.
                s.quiet_left = s.quiet_count
            ctx.schedule.end_backward(keep=pending)
            # What the step does next (the optimizer step, the next forward's activations) can
            # use every block no live buffer needs: the allocator holds nothing idle between steps.
            ctx.allocator.release_idle("forward")
            ctx.step += 1
        finally:
            ctx.callback_queued = False


bind_runtime(pre_backward=_pre_backward, post_backward=post_backward, in_backward=_in_backward)
