"""The lifecycle hooks: unshard -> forward -> reshard -> (pre-)backward -> reduce, and the root's
final backward callback.

* **pre-forward** (module forward pre-hook): issue this unit's all-gather, then the prefetches the
  schedule predicts, then wait for this unit's own gather; register the unsharded parameters; in a
  grad-enabled forward, thread the inputs through :class:`_PostBackward` so the unit learns when
  its backward is done.
* **post-forward** (module forward hook): reshard (unless ``reshard_after_forward=False``, the
  root's default: backward needs it first); hook the outputs so the unit unshards before its
  backward runs, and tell the schedule a backward will come. A forward that runs *inside*
  backward is an activation-checkpoint recompute: it neither reshards nor re-registers hooks, and
  is not recorded in the schedule. One exception: a unit whose forward ran under ``no_grad`` (a
  *reentrant* checkpoint around the whole unit runs it so) has no hooked outputs; its grad-enabled
  recompute in backward is where its backward starts, so that recompute does the pre-backward
  work and threads its inputs through :class:`_PostBackward` (the checkpoint's inner backward then
  runs the post-backward).
* **pre-backward** (multi-grad hook on the outputs, mode "any"): queue the root's final callback
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
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.autograd import Variable

from ..base.profiling import event_log, trace_range
from .schedule import Schedule
from ..base.structures import map_tensors, tensors_in
from ..precision.te import attach_main_grads
from .fsdp2_state import bind_runtime
from .state import FSDPState, RootContext, ShardState, TrainingState, unit_state
from . import grad_presence, step_guard
from ..memory.offload import settle_host_reads
from ..groups.weight_watch import agree_on_gathers
from ..precision.fp8 import gather_riders
from ..groups.subclass_gather import riders_of
from . import param_adoption
from ..memory.allocator import BufferRole

__all__ = ["pre_forward", "post_forward", "unshard_async", "wait_unshard", "reshard", "lazy_init", "reset"]

logger = logging.getLogger(__name__)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# -- unshard / reshard ------------------------------------------------------------------------
def unshard_async(state: FSDPState) -> None:
    """Issue the unit's all-gathers (idempotent; re-gathers weights the optimizer has changed).

    Stale covers a gather still in flight too: ``unshard(async_op=True)`` issued before
    ``optimizer.step()`` gathered the old shards.
    """
    for g in state.groups:  # an optimizer stepping in backward refuses a gather of weights it stepped
        for listener in g.grad_listeners:
            listener.before_gather(g)
    if state.ctx is None or state.unsettled:
        # unshard() before the first forward (FSDP2 runs its groups' lazy init there), or a
        # conversion of part of the unit since: the parameters must be ready to gather.
        param_adoption.prepare(state)
    if state.shard_state is not ShardState.SHARDED and any(g.stale for g in state.groups):
        reshard(state)
    if state.shard_state not in (ShardState.SHARDED, ShardState.PARTIAL):
        return
    partial = state.shard_state is ShardState.PARTIAL
    with torch._C._DisableFuncTorch(), trace_range(f"mfsdp2.unshard {state.name}"):
        event_log.record("ag_issue", state.name)
        # Before the root context exists (an explicit unshard() ahead of the first forward) there
        # is no allocator yet: the buffer takes plain memory; each buffer remembers where its
        # block came from and gives it back there at reshard.
        alloc = state.ctx.allocator if state.ctx is not None else None
        state.pending_unshard = []
        step = state.ctx.step if state.ctx is not None else 0
        # An FP8 group carries the unit's compute-dtype group in its all-gather (one collective).
        riders = {} if partial else gather_riders(state.groups)
        # Parameters with FSDP2's all-gather extension: one all-gather with the unit's other
        # ZeRO-3 groups riding along (mfsdp2.groups.subclass_gather).
        sub_riders = []
        if state.subclass is not None:
            sub_riders = riders_of(state.groups, set(riders) | set(riders.values()), state.comm)
            rl = [(state.groups[j], ("weight", state.name, j)) for j in sub_riders]
            names = ", ".join(["subclass parameters"] + [g.name for g, _ in rl])
            h = state.subclass.all_gather(alloc, ("weight", state.name, "subclass"),
                                          f"all-gather of unit {state.name!r} ({names}, step {step})", rl)
            state.pending_unshard.append((state.subclass, h))
            state.pending_unshard.extend((g, h) for g, _ in rl)
        for i, g in enumerate(state.groups):
            if i in riders.values() or i in sub_riders:
                continue
            key = (BufferRole.WEIGHT, state.name, i)
            j = riders.get(i)
            rider = (state.groups[j], (BufferRole.WEIGHT, state.name, j)) if j is not None else (None, None)
            # From a partial reshard only the rank block gathers (e.g. inside a node).
            names = g.name + ("" if j is None else f" + {rider[0].name}")
            label = f"all-gather of unit {state.name!r} ({names}, step {step})"
            h = (g.unshard_from_group(state.post_forward_comm, alloc, key, label) if partial
                 else g.unshard(alloc, key, label, *rider))
            if h is not None:  # None: persistent weights, already current on every rank
                state.pending_unshard.append((g, h))
        state.shard_state = ShardState.UNSHARDING


def wait_unshard(state: FSDPState) -> None:
    if state.shard_state is not ShardState.UNSHARDING:
        return
    with trace_range(f"mfsdp2.wait_unshard {state.name}"):
        for _, h in state.pending_unshard:
            h.wait()
        state.pending_unshard = []
        for g in state.groups:
            g.register(unsharded=True)
        if state.subclass is not None:
            state.subclass.register(unsharded=True)
        state.shard_state = ShardState.UNSHARDED


def reshard(state: FSDPState, to_group: bool = False) -> None:
    """Free the gathered parameters; ``to_group`` keeps what a gather inside the unit's rank
    block needs (``reshard_after_forward=<int>``)."""
    if state.shard_state is ShardState.SHARDED:
        return
    if state.shard_state is ShardState.PARTIAL:
        if not to_group:
            for g in state.groups:
                g.reshard()
            state.shard_state = ShardState.SHARDED
        return
    with trace_range(f"mfsdp2.reshard {state.name}"):
        for _, h in state.pending_unshard:  # never free memory a collective is still writing
            h.wait()
        state.pending_unshard = []
        for g in state.groups:
            g.register(unsharded=False)
            if to_group:
                g.reshard_to_group(state.post_forward_comm)
            else:
                g.reshard()
        if state.subclass is not None:
            state.subclass.register(unsharded=False)
            state.subclass.reshard()
        state.shard_state = ShardState.PARTIAL if to_group else ShardState.SHARDED
        event_log.record("reshard_to_group" if to_group else "reshard", state.name)


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
    grad = torch.is_grad_enabled()
    # A grad-enabled recompute of a unit that ran no grad-enabled forward this iteration: a
    # reentrant checkpoint around the unit ran its forward under no_grad, and this recompute
    # followed by the checkpoint's inner backward *is* the unit's backward.
    backward_recompute = recompute and grad and not state.forward_with_grad
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
            # Main grads whose parameters all had their grads cleared (zero_grad(set_to_none=True))
            # go back to the allocator: they take no memory through forward, as in FSDP2.
            for s in ctx.states:
                for g in s.groups:
                    g.release_main_grad()
            # A step begins: the trace-pool allocator keeps one plan per kind of step.
            ctx.allocator.mark_step(("train" if grad else "eval", state.requires_gradient_sync))
            _wait_post_optim_event(ctx)
            for s in ctx.states:
                if len(s.modules) > 1:  # only units of several modules track their forwards
                    s.forward_to_run = {id(m) for m in s.modules}
            agree_on_gathers(ctx)
            # Stale small persistent groups gather in buckets across units (same cap as the
            # gradient all-reduce buckets), planned from the recorded order and agreed flags.
            ctx.gathers.start(ctx.schedule.recorded, ctx.buckets.cap_bytes, ctx.step)
        state.training_state = TrainingState.FORWARD
        prefetch = ctx.schedule.on_forward(state)
        unshard_async(state)
        for s in prefetch:
            unshard_async(s)
        wait_unshard(state)
    event_log.record("forward_begin", state.name)
    if grad and (not recompute or backward_recompute):
        state.forward_with_grad = True
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
            outs = _PostBackward.apply(state, state.forward_pass, *needing.values())
            routed = dict(zip(needing, outs))
            args, kwargs = map_tensors(lambda t: routed.get(id(t), t), (args, kwargs))
    if state.mp.param_dtype is not None and state.mp.cast_forward_inputs:
        args, kwargs = map_tensors(functools.partial(_cast, dtype=state.mp.param_dtype), (args, kwargs))
    return args, kwargs


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
    event_log.record("forward_end", state.name)
    if _in_backward():  # activation-checkpoint recompute: its backward runs next, stay unsharded
        # Same output dtype as the original forward: the checkpoint compares what it recomputes.
        return _cast_output(state, output)
    ctx = state.ctx
    grad = torch.is_grad_enabled()
    last = _last_of_group(state, module)
    if (state.reshard_after_forward or not grad) and last:
        reshard(state, to_group=grad and state.post_forward_comm is not None)
    state.training_state = TrainingState.IDLE
    backward_follows = False
    if grad:
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(_pre_backward_hook, state), mode="any"
            )
            backward_follows = True
    elif state.backward_via_recompute and ctx.schedule.in_training_forward:
        backward_follows = True  # a reentrant checkpoint will recompute it in backward, as last step
    if backward_follows and not state.is_root:
        state.expect_backward = True
        ctx.schedule.expect_backward(state)
    if state.is_root:
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
            # Eval passes keep nothing gathered; training passes drop mispredicted prefetches.
            if s.shard_state is not ShardState.SHARDED and (not grad or not s.forward_with_grad):
                reshard(s)
        if grad:
            # The loss and the start of backward (the step's activation peak, usually) come next:
            # blocks the forward freed are theirs until backward asks for weights again.
            ctx.allocator.release_idle("backward")
    return _cast_output(state, output)


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


def _cast_output(state: FSDPState, output: Any) -> Any:
    if state.mp.output_dtype is not None:
        output = map_tensors(functools.partial(_cast, dtype=state.mp.output_dtype), output)
    return output


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
        ctx.callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(_final_callback, ctx))
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


class _ForwardPass:
    """One grad-enabled forward pass of a unit: how many of its modules' ``_PostBackward`` are
    still to run, and whether the module that opened the pass threaded its inputs (if not, its
    backward is not observable: the final callback reduces the unit, as FSDP2's does)."""

    __slots__ = ("pending", "opened")

    def __init__(self, opened: bool):
        self.pending = 0
        self.opened = opened


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once that module's backward is done; the
    last one of a forward pass runs the unit's post-backward.

    Written in the ``setup_context`` form, with a vmap rule and a ``jvp``, so that ``torch.func``
    transforms (``grad``, ``vjp``, ``jvp``, ``vmap``) can trace through a unit, as through FSDP2's
    own function: the forward is an identity, so every derivative passes through unchanged."""

    generate_vmap_rule = True

    @staticmethod
    def forward(state: FSDPState, fwd_pass: _ForwardPass, *inputs: torch.Tensor):
        return inputs

    @staticmethod
    def setup_context(ctx, inputs: tuple, output) -> None:
        ctx.state, ctx.fwd_pass = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        fp = ctx.fwd_pass
        fp.pending -= 1
        if fp.pending == 0 and fp.opened:
            ctx.state.open_passes -= 1
            _run_post_backward(ctx.state)
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
    event_log.record("backward_end", state.name)
    # The gathered weights go back before the gradients are packed (FSDP2's order): the flat
    # gradient buffer never coexists with this unit's weights.
    if state.reshard_after_backward:
        reshard(state)
    if state.requires_gradient_sync:
        with trace_range(f"mfsdp2.reduce_grad {state.name}"):
            reducing = [(i, g) for i, g in enumerate(state.groups) if g.requires_grad and g.has_unsharded_grads()]
            # The step's last reduction of these groups: no later backward of this step (the
            # root's is_last_backward) and no other forward pass of the unit awaiting its backward.
            final = ctx.root.is_last_backward and state.open_passes <= 0
            for _, g in reducing:
                g.reduce_final = final
            if any(not g.reduces_in_bucket(ctx.buckets) for _, g in reducing):
                # At most max_reduce_in_flight reduction inputs alive, this unit's included (FSDP2's
                # set_reduce_scatter_max_input_buffers; default 1): finish older ones first.
                _drain(ctx, keep=state.max_reduce_in_flight - 1, keep_allreduce=state.max_reduce_in_flight)
            issued = False
            for i, g in reducing:
                label = f"reduce-scatter of unit {state.name!r} ({g.name}, step {ctx.step})"
                if not g.reduce_grads(ctx.allocator, (state.name, i), label, ctx.buckets):
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
                if any(g.reduce_chained for _, g in reducing):
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
                if s.reshard_after_backward:
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
            ctx.schedule.end_backward(keep=pending)
            # What the step does next (the optimizer step, the next forward's activations) can
            # use every block no live buffer needs: the allocator holds nothing idle between steps.
            ctx.allocator.release_idle("forward")
            ctx.step += 1
        finally:
            ctx.callback_queued = False


def reset(ctx: RootContext) -> None:
    """Return every unit under the root to a clean sharded state after an exception in forward or
    backward, so training can continue: in-flight collectives are waited for (never freed under),
    this step's partial gradients are dropped, the pass in progress is forgotten. A collective
    that failed and may still run has its buffers leaked instead (see ``CommHandle.settle``)."""
    ctx.gathers.abort()  # first: settling a member's handle below must not issue another bucket
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
    ctx.reduce_queue.clear()
    ctx.allreduce_queue.clear()
    ctx.buckets.abort()
    ctx.callback_queued = False
    ctx.schedule.abandon_pass()
    event_log.record("reset", ctx.root.name)


bind_runtime(pre_backward=_pre_backward, post_backward=post_backward, in_backward=_in_backward)
