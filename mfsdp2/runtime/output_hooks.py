"""How a unit learns that backward reached its outputs (its pre-backward): a tensor hook on its one
output, a multi-grad hook on several, or -- for a unit whose output is the next unit's input and
whose backward gathers nothing -- no hook at all: the next unit's :class:`_PostBackward` runs it.

Why the chained form: in a stack of blocks, unit ``k``'s output is unit ``k+1``'s input, so the
backward of unit ``k+1``'s input function and unit ``k``'s output hook fire at the same point of
the graph, one after the other. One autograd node per unit then does both, and the output hook --
registered anew at every forward (a tensor hook dies with its tensor) and called by the engine in
every backward -- is not paid at all: about 6 us of a small unit's host time per step.

When it is safe: only where the pre-backward cannot decide the gradients. A unit qualifies when
its weights stay gathered and current from its forward into its backward with nothing to issue
(persistent weights in the compute dtype: no_shard, ZeRO-1/2 and one-rank ZeRO-3, without FP8,
subclass parameters or a rank-block reshard; none marked stale, no optimizer listening for
gathers), it is one module, it has no TransformerEngine buffers to attach and no
input-only-backward note to keep (E52), and no tool wraps its pre-backward; the fixed part is
planned (``UnitPlan.chains_output``). If the next unit's backward never runs while this one's
does (that unit's output was dropped from the loss, the tensor had another consumer), the
pre-backward is skipped: for such a unit that loses only the schedule's bookkeeping (the
prediction falls back to on-demand gathers), never a gather its backward needs. A unit that
gathers in backward (ZeRO-3 over several ranks) is always hooked, as in FSDP2.

The output is held in ``ctx.pending_output`` from the unit's post-forward to the next runtime
entry: the next unit's pre-forward takes it when its one input is that very tensor; any other
entry (another unit's forward, any post-forward, the root's included) hooks it as usual; an
exception's reset drops it with the pass's graph.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from ..base.structures import tensors_in
from .state import FSDPState, RootContext
from .step_plan import UnitPlan
from .unshard import nothing_to_gather
from .backward import _pre_backward_hook

__all__ = ["hook_outputs", "settle_pending", "take_pending"]


def hook_outputs(state: FSDPState, plan: UnitPlan, output: Any) -> bool:
    """Arrange the pre-backward of ``state`` for a grad-enabled forward's ``output``; returns
    whether a backward will reach it (any output requires grad)."""
    if type(output) is torch.Tensor:
        tensors = [output] if output.requires_grad else []
    else:
        tensors = [t for t in tensors_in(output) if t.requires_grad]
    if len(tensors) == 1:
        t = tensors[0]
        if _may_chain(state, plan, t):
            state.ctx.pending_output = (state, t)
        else:
            _hook(state, t)
        return True
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(
            tensors, functools.partial(_pre_backward_hook, state), mode="any"
        )
        return True
    return False


def _hook(state: FSDPState, t: torch.Tensor) -> None:
    # One output (the usual block): a tensor hook fires once per backward that reaches it, which
    # is what the multi-grad hook's "any" mode gives, at a third of its cost.
    hook = state.output_hook
    if hook is None:
        hook = state.output_hook = functools.partial(_pre_backward_hook, state)
    t.register_hook(hook)


def _may_chain(state: FSDPState, plan: UnitPlan, t: torch.Tensor) -> bool:
    """Whether ``state``'s pre-backward may ride on the next unit's input function (see the
    module docstring); the fixed part is planned (``UnitPlan.chains_output``), the rest is read
    here: the grad-enabled root forward still running, no transform, and nothing since the
    forward that would make the pre-backward gather or check anything."""
    if not plan.chains_output or type(t) is not torch.Tensor or t.grad_fn is None or state.is_root:
        return False
    if not state.ctx.schedule.in_training_forward or torch._C._are_functorch_transforms_active():
        return False
    return not state.weights_missed and state.patched_view() is None and nothing_to_gather(state)


def settle_pending(ctx: Optional[RootContext]) -> None:
    """Hook the output a unit left pending (no next unit took it)."""
    if ctx is None or ctx.pending_output is None:
        return
    state, t = ctx.pending_output
    ctx.pending_output = None
    _hook(state, t)


def take_pending(ctx: RootContext, state: FSDPState, args: tuple, kwargs: dict, chains: bool) -> Optional[FSDPState]:
    """At a unit's pre-forward: the unit whose pending output is this unit's one input, which
    this unit's ``_PostBackward`` then carries (``chains``: this pre-forward threads a
    grad-enabled input, outside a recompute); any other pending output is hooked here."""
    pending = ctx.pending_output
    if pending is None:
        return None
    ctx.pending_output = None
    if chains and not kwargs and len(args) == 1 and args[0] is pending[1] and len(state.modules) == 1:
        return pending[0]
    _hook(*pending)
    return None
