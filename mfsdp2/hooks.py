"""The lifecycle hooks: unshard -> forward -> reshard -> (pre-)backward -> reduce, and the root's
final backward callback.

* **pre-forward** (module forward pre-hook): issue this unit's all-gather, then the prefetches the
  schedule predicts, then wait for this unit's own gather; register the unsharded parameters; in a
  grad-enabled forward, thread the inputs through :class:`_PostBackward` so the unit learns when
  its backward is done.
* **post-forward** (module forward hook): reshard (unless ``reshard_after_forward=False`` or this
  is the root, which backward needs first); hook the outputs so the unit unshards before its
  backward runs. A forward that runs *inside* backward is an activation-checkpoint recompute: it
  neither reshards nor re-registers hooks, and is not recorded in the schedule.
* **pre-backward** (multi-grad hook on the outputs, mode "any"): queue the root's final callback
  once per backward, unshard this unit and prefetch the next unit in reversed forward order.
* **post-backward** (backward of :class:`_PostBackward`): pack gradients, issue the async
  reduce-scatter, keep at most two units' reductions in flight (sliding drain), reshard.
* **final callback** (queued on the autograd engine): reduce what no hook reduced (units whose
  inputs need no grad, like the root; unused outputs), drain every reduction, reshard everything,
  and fail loudly if a unit is still mid-forward.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .profiling import event_log, trace_range
from .state import FSDPState, RootContext, ShardState, TrainingState

__all__ = ["pre_forward", "post_forward", "unshard_async", "wait_unshard", "reshard", "lazy_init"]

logger = logging.getLogger(__name__)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# -- unshard / reshard ------------------------------------------------------------------------
def unshard_async(state: FSDPState) -> None:
    """Issue the unit's all-gathers (idempotent; re-gathers weights the optimizer has changed)."""
    if state.shard_state is ShardState.UNSHARDED and any(g.stale for g in state.groups):
        reshard(state)
    if state.shard_state is not ShardState.SHARDED:
        return
    with trace_range(f"mfsdp2.unshard {state.name}"):
        event_log.record("ag_issue", state.name)
        alloc = state.ctx.allocator if state.ctx is not None else None
        state.pending_unshard = []
        for i, g in enumerate(state.groups):
            state.pending_unshard.append(g.unshard())
            if alloc is not None:
                alloc.track(("weight", state.name, i), g.weights.nbytes)
        state.shard_state = ShardState.UNSHARDING


def wait_unshard(state: FSDPState) -> None:
    if state.shard_state is not ShardState.UNSHARDING:
        return
    with trace_range(f"mfsdp2.wait_unshard {state.name}"):
        for h in state.pending_unshard:
            h.wait()
        state.pending_unshard = []
        for g in state.groups:
            g.register(unsharded=True)
        state.shard_state = ShardState.UNSHARDED


def reshard(state: FSDPState) -> None:
    if state.shard_state is ShardState.SHARDED:
        return
    with trace_range(f"mfsdp2.reshard {state.name}"):
        for h in state.pending_unshard:  # never free memory a collective is still writing
            h.wait()
        state.pending_unshard = []
        alloc = state.ctx.allocator if state.ctx is not None else None
        for i, g in enumerate(state.groups):
            g.register(unsharded=False)
            g.reshard()
            if alloc is not None:
                alloc.untrack(("weight", state.name, i), g.weights.nbytes)
        state.shard_state = ShardState.SHARDED
        event_log.record("reshard", state.name)


# -- root -------------------------------------------------------------------------------------
def lazy_init(state: FSDPState) -> None:
    """Make ``state`` the root of every unit in its subtree unless it is already under a root."""
    if state.ctx is not None:
        return
    from .module import FSDPModule

    states = []
    for path, m in state.module.named_modules():
        if isinstance(m, FSDPModule):
            s = m._mfsdp2_state
            s.name = path or "root"  # names in traces, allocator keys and errors
            for g in s.groups:
                g.unit_name = s.name
            states.append(s)
    for s in states:
        if s.shard_state is not ShardState.SHARDED and s is not state:
            raise RuntimeError(
                f"mfsdp2: unit {s.name!r} is unsharded while {state.name!r} becomes its root; "
                "reshard it (module.reshard()) before running the parent's forward"
            )
    RootContext.create(state, states)


# -- forward ----------------------------------------------------------------------------------
def _cast(x: Any, dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


def pre_forward(module: nn.Module, args: tuple, kwargs: dict):
    state: FSDPState = module._mfsdp2_state
    lazy_init(state)
    ctx = state.ctx
    recompute = _in_backward()
    if state.is_root and not recompute:
        if ctx.callback_queued:
            raise RuntimeError(f"mfsdp2: forward of {state.name!r} started while its backward is still running")
        ctx.schedule.begin_forward()
    if not recompute:
        state.training_state = TrainingState.FORWARD
    prefetch = ctx.schedule.on_forward(state) if not recompute else []
    unshard_async(state)
    for s in prefetch:
        unshard_async(s)
    wait_unshard(state)
    event_log.record("forward_begin", state.name)
    if torch.is_grad_enabled() and not recompute:
        state.forward_with_grad = True
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if idx:
            outs = _PostBackward.apply(state, *[flat[i] for i in idx])
            for i, o in zip(idx, outs):
                flat[i] = o
            args, kwargs = tree_unflatten(flat, spec)
    if state.mp.param_dtype is not None and state.mp.cast_forward_inputs:
        args, kwargs = tree_map(functools.partial(_cast, dtype=state.mp.param_dtype), (args, kwargs))
    return args, kwargs


def post_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    state: FSDPState = module._mfsdp2_state
    event_log.record("forward_end", state.name)
    if _in_backward():  # activation-checkpoint recompute: its backward runs next, stay unsharded
        return output
    ctx = state.ctx
    grad = torch.is_grad_enabled()
    if not state.is_root and (state.reshard_after_forward or not grad):
        reshard(state)
    state.training_state = TrainingState.IDLE
    if grad:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(_pre_backward_hook, state), mode="any"
            )
    if state.is_root:
        ctx.schedule.end_forward(record=grad)
        for s in ctx.states:
            # Eval passes keep nothing gathered; training passes drop mispredicted prefetches.
            if s.shard_state is not ShardState.SHARDED and (not grad or not s.forward_with_grad):
                reshard(s)
    if state.mp.output_dtype is not None:
        output = tree_map(functools.partial(_cast, dtype=state.mp.output_dtype), output)
    return output


# -- backward ---------------------------------------------------------------------------------
def _pre_backward_hook(state: FSDPState, *unused: Any) -> None:
    ctx = state.ctx
    if not ctx.callback_queued:
        ctx.callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(_final_callback, ctx))
    state.training_state = TrainingState.PRE_BACKWARD
    prefetch = ctx.schedule.on_backward(state)
    unshard_async(state)
    for s in prefetch:
        if s.forward_with_grad:
            unshard_async(s)
    wait_unshard(state)
    event_log.record("backward_begin", state.name)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, state: FSDPState, *inputs: torch.Tensor):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        post_backward(ctx.state)
        return (None,) + grads


def post_backward(state: FSDPState) -> None:
    ctx = state.ctx
    event_log.record("backward_end", state.name)
    if state.requires_gradient_sync:
        with trace_range(f"mfsdp2.reduce_grad {state.name}"):
            issued = False
            for i, g in enumerate(state.groups):
                if g.requires_grad and g.has_unsharded_grads():
                    g.reduce_grads(ctx.allocator, (state.name, i))
                    issued = True
            if issued:
                event_log.record("rs_issue", state.name)
                if state in ctx.reduce_queue:
                    ctx.reduce_queue.remove(state)
                ctx.reduce_queue.append(state)
                _drain(ctx, keep=1)
    if state.reshard_after_backward:
        reshard(state)
    state.post_backward_done = True
    state.training_state = TrainingState.POST_BACKWARD


def _drain(ctx: RootContext, keep: int) -> None:
    """Finish the oldest in-flight reductions until at most ``keep`` remain."""
    while len(ctx.reduce_queue) > keep:
        s = ctx.reduce_queue.pop(0)
        with trace_range(f"mfsdp2.finish_reduce {s.name}"):
            for g in s.groups:
                g.finish_reduce(ctx.allocator)
        event_log.record("rs_done", s.name)


def _final_callback(ctx: RootContext) -> None:
    with trace_range("mfsdp2.final_callback"):
        try:
            stuck = [s.name for s in ctx.states if s.training_state is TrainingState.FORWARD]
            if stuck:
                raise RuntimeError(
                    f"mfsdp2: backward finished while units {stuck} never finished their forward "
                    "(an exception inside forward?); call model.reshard() and rerun the step"
                )
            for s in reversed(ctx.states):
                if s.forward_with_grad and s.requires_gradient_sync and any(
                    g.requires_grad and g.has_unsharded_grads() for g in s.groups
                ):
                    post_backward(s)
            _drain(ctx, keep=0)
            for s in ctx.states:
                if s.reshard_after_backward:
                    reshard(s)
                s.training_state = TrainingState.IDLE
                s.forward_with_grad = False
                s.post_backward_done = False
            ctx.schedule.end_backward()
            ctx.step += 1
        finally:
            ctx.callback_queued = False
