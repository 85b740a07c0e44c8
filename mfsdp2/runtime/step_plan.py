"""A unit's step plan: what its hooks do in the steady state, decided once.

Without a plan, every call of a unit's hooks would re-derive the same decisions: which of its groups gather
and which ride in whose all-gather (FP8, subclass parameters), the buffer keys and names of
those gathers, which groups reduce and under which label, whether the unit reshards after
forward or after backward, whether its gradients are synchronised, and whether its inputs are cast.
None of them changes from one step to the next unless
something the user does changes it, so a :class:`UnitPlan` holds them, built from the unit's
state at its first use after a change, and the hooks read the plan.

What may change a decision, and how the plan learns it, at O(1) per call:

* a setting of the unit (``set_reshard_after_forward``, ``set_requires_gradient_sync`` -- what
  ``no_sync`` does --, ``set_reshard_after_backward``, the mixed-precision policy, its
  groups being replaced): :class:`~mfsdp2.runtime.state.FSDPState` counts writes
  to those attributes in ``flags_version``; a plan built at another count is rebuilt;
* events that concern every unit (:class:`~mfsdp2.base.plan_epoch.PlanChange`): groups were
  rebuilt (parameters adopted or converted, shapes included), a parameter was frozen or
  unfrozen: they bump the global epoch and every plan is rebuilt at its next use.

The module order is not in a plan: it is the schedule's record
(:mod:`mfsdp2.runtime.schedule`), replaced by every training forward, from which prefetches are
predicted per call.

What stays per call: facts that change every step by design (which persistent weights are
stale, which gradients exist, whether a gather is in flight, the grad mode, the pass's position
in the recorded order), and the silent-misuse checks of the registration, which compare each
parameter with what was registered (a replaced parameter, an assigned ``.data``, a
``requires_grad`` flip: the flag has no version counter, so it is compared per parameter, and
a flip bumps the epoch).

Nothing in a plan depends on ``train()`` / ``eval()`` or the grad mode: a grad-disabled forward
(evaluation) uses the same plan, and what differs there (reshard after every forward, no hooks on
the outputs, no recorded order) is decided by the grad mode of the call, read per call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ..base import plan_epoch
from ..groups.subclass_gather import riders_of
from ..memory.allocator import BufferRole
from ..precision.fp8 import gather_riders
from .state import FSDPState

__all__ = ["GatherOp", "UnitPlan", "plan_of", "invalidate_all"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GatherOp:
    """One all-gather of a unit from its sharded state: the group, its buffer key, the group
    riding along (FP8: the unit's compute-dtype group) and the label text before the step."""

    group: object
    key: tuple
    rider: object
    rider_key: Optional[tuple]
    label_head: str


@dataclass(frozen=True, slots=True)
class UnitPlan:
    """A unit's decisions, valid while ``epoch`` and ``flags_version`` are current."""

    epoch: int
    flags_version: int
    gathers: tuple  # GatherOp per group gathered on its own (riders excluded)
    subclass_riders: tuple  # (group, key) riding in the subclass parameters' all-gather
    subclass_label: str
    reshard_after_forward: bool
    keep_after_forward: bool  # a reshard would free nothing: stay gathered until backward
    chains_output: bool  # the next unit's input function may run its pre-backward (runtime.output_hooks)
    quiet: bool  # may run a training forward with no forward hooks (runtime.quiet_units)
    reshard_after_backward: bool
    requires_gradient_sync: bool
    reduce: tuple  # (index, group, label head) of each group with trainable parameters
    cast_dtype: Optional[torch.dtype]  # inputs cast to this dtype in forward, or None
    output_dtype: Optional[torch.dtype]
    trace_unshard: str
    trace_wait: str
    trace_reshard: str
    trace_reduce: str


def plan_of(state: FSDPState) -> UnitPlan:
    """The unit's current plan, rebuilt first if anything it assumed has changed."""
    p = state.plan
    if p is not None and p.epoch == plan_epoch.current() and p.flags_version == state.flags_version:
        return p
    p = state.plan = _build(state)
    return p


def invalidate_all(change: plan_epoch.PlanChange) -> None:
    plan_epoch.bump(change)


def _build(state: FSDPState) -> UnitPlan:
    name = state.name
    groups = state.groups
    riders = gather_riders(groups)
    ridden = set(riders.values())
    sub = []
    if state.subclass is not None:
        sub = riders_of(groups, set(riders) | ridden, state.comm)
    gathers = []
    for i, g in enumerate(groups):
        if i in ridden or i in sub:
            continue
        j = riders.get(i)
        rider = groups[j] if j is not None else None
        names = g.name + ("" if rider is None else f" + {rider.name}")
        gathers.append(GatherOp(g, (BufferRole.WEIGHT, name, i), rider,
                                (BufferRole.WEIGHT, name, j) if j is not None else None,
                                f"all-gather of unit {name!r} ({names}, step "))
    sub_names = ", ".join(["subclass parameters"] + [groups[j].name for j in sub])
    reduce = tuple(
        (i, g, f"reduce-scatter of unit {name!r} ({g.name}, step ")
        for i, g in enumerate(groups)
        # What autograd gives gradients to: the unsharded parameters, whose flags follow the
        # DTensors' at every registration (a flip there bumps the epoch).
        if g.requires_grad and any(p.requires_grad for p in g.unsharded_params)
    )
    mp = state.mp
    cast_dtype = mp.param_dtype if mp.param_dtype is not None and mp.cast_forward_inputs else None
    chains = _may_chain_output(state)
    plan = UnitPlan(
        epoch=plan_epoch.current(),
        flags_version=state.flags_version,
        gathers=tuple(gathers),
        subclass_riders=tuple((groups[j], ("weight", name, j)) for j in sub),
        subclass_label=f"all-gather of unit {name!r} ({sub_names}, step ",
        reshard_after_forward=bool(state.reshard_after_forward),
        keep_after_forward=_reshard_frees_nothing(state),
        chains_output=chains,
        # Nothing for its forward hooks to do but register: no cast of inputs or outputs either.
        quiet=chains and cast_dtype is None and mp.output_dtype is None,
        reshard_after_backward=state.reshard_after_backward,
        requires_gradient_sync=state.requires_gradient_sync,
        reduce=reduce,
        cast_dtype=cast_dtype,
        output_dtype=mp.output_dtype,
        trace_unshard=f"mfsdp2.unshard {name}",
        trace_wait=f"mfsdp2.wait_unshard {name}",
        trace_reshard=f"mfsdp2.reshard {name}",
        trace_reduce=f"mfsdp2.reduce_grad {name}",
    )
    logger.debug("mfsdp2: plan of unit %s built (epoch %d)", name, plan.epoch)
    return plan


def _reshard_frees_nothing(state: FSDPState) -> bool:
    """Whether resharding the unit after a grad-enabled forward would free no memory: every group
    keeps persistent weights in the compute dtype (``no_shard``, ZeRO-1/2), with no FP8 copy,
    subclass parameters or rank-block reshard.

    Why it is planned: such a unit's reshard only swaps the sharded parameters back onto the
    module, and its backward swaps the same gathered tensors in again -- two registrations, an
    unshard and its wait per unit and step, for nothing. The unit stays gathered until its
    backward instead, as an FSDP2 unit with ``reshard_after_forward=False`` does (FSDP2 swaps
    its sharded parameters in for ``state_dict()``; mfsdp2's state-dict hook reports them for a
    gathered unit too). A grad-disabled forward still reshards: no backward follows."""
    return (state.subclass is None and state.post_forward_comm is None
            and all(g.persistent and g.fp8 is None for g in state.groups))


def _may_chain_output(state: FSDPState) -> bool:
    """What of :func:`mfsdp2.runtime.output_hooks.hook_outputs`' choice is fixed between
    changes: a unit of one module whose weights stay gathered from forward to backward with
    nothing to issue (see :func:`_reshard_frees_nothing`), no TransformerEngine buffers to attach
    in its pre-backward and no input-only-backward note to keep (E52: resharding after forward
    while accumulating unsynchronised gradients kept gathered)."""
    return (len(state.modules) == 1 and _reshard_frees_nothing(state)
            and not any(g.te_fused for g in state.groups)
            and not (state.reshard_after_forward and not state.requires_gradient_sync
                     and not state.reshard_after_backward))
