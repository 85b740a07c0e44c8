"""Backward work driven from outside autograd: what a pipeline schedule's REDUCE_GRAD action asks
of the units after its micro-batches' backwards (full, input-only and weight passes) ran with
gradient sync off.

A zero-bubble weight pass (``stage_backward_weight``) computes weight gradients with
``autograd.grad`` and assigns them to the gathered parameters after it returns, so no hook of
:mod:`mfsdp2.runtime.backward` sees them; torch's stages call FSDP2's group ``post_backward()`` and
the root's final callback for that, mfsdp2's stage calls :func:`finish_backward`. Both functions
reuse the hooks' own post-backward and final callback, so what is reduced, drained, exposed and
resharded is what a backward's end does.
"""

from __future__ import annotations

from .backward import _final_callback, _in_backward, post_backward
from .state import FSDPState, RootContext

__all__ = ["finish_backward", "reduce_accumulated"]


def finish_backward(ctx: RootContext) -> None:
    """Outside autograd, do what the final callback of a backward does: reduce every unit holding
    unsharded gradients (those accumulated without gradient sync, or written into the gathered
    parameters outside any backward hook), finish the reductions, expose the gradients and
    reshard (per each unit's flags).

    Why: a pipeline schedule's zero-bubble weight pass (``stage_backward_weight``) computes weight
    gradients with ``autograd.grad`` and assigns them to the gathered parameters after it returns,
    so no hook of ours sees them; torch reduces FSDP2's at the schedule's REDUCE_GRAD action by
    calling its private post-backward, ``mfsdp2.integrations.pipelining.PipelineStage`` calls this. Every rank
    of the data-parallel group must call it (it issues the reductions)."""
    if _in_backward():
        raise RuntimeError(f"mfsdp2: finish_backward on {ctx.root.name!r} called inside a backward pass; "
                           "the backward's own final callback reduces the gradients")
    ctx.callback_queued = True  # the callback clears it; a forward meanwhile would be refused
    _final_callback(ctx)


def reduce_accumulated(state: FSDPState) -> None:
    """Outside autograd, reduce the unit's unsharded gradients now if its gradient sync is on
    (FSDP2's ``FSDPParamGroup.post_backward()``, which torch's pipeline stages call on each unit
    at the schedule's REDUCE_GRAD action, before the root's final callback, :func:`finish_backward`,
    finishes what this issued). Nothing to do before the first forward or without such gradients."""
    if _in_backward():
        raise RuntimeError(f"mfsdp2: post_backward() of unit {state.name!r} called inside a backward pass; "
                           "the backward's own hooks reduce the gradients")
    if state.ctx is None or not state.requires_gradient_sync:
        return
    if any(g.requires_grad and g.has_unsharded_grads() for g in state.groups):
        post_backward(state)
