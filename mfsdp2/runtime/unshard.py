"""Gathering a unit's parameters and giving them back: the all-gathers a unit issues (its own and
the prefetches of others), the wait at first use, and the reshard.

Why a module of its own: the forward hooks (:mod:`mfsdp2.runtime.hooks`), the backward hooks
(:mod:`mfsdp2.runtime.backward`) and the explicit ``unshard()`` / ``reshard()`` of a unit all run
these three steps, and each must see the same state transitions
(``SHARDED -> UNSHARDING -> UNSHARDED -> SHARDED``, or ``PARTIAL`` for a reshard inside the rank
block of ``reshard_after_forward=<int>``)."""

from __future__ import annotations

import logging

import torch

from ..base.profiling import event_log, trace_range
from .state import FSDPState, ShardState
from ..precision.fp8 import gather_riders
from ..groups.subclass_gather import riders_of
from . import graph_hold, param_adoption
from .step_plan import plan_of
from ..memory.allocator import BufferRole

__all__ = ["unshard_async", "wait_unshard", "reshard", "nothing_to_gather", "plan_bucketed_gathers"]

logger = logging.getLogger(__name__)


# -- unshard / reshard ------------------------------------------------------------------------
def nothing_to_gather(state: FSDPState, bucket_rows: bool = False) -> bool:
    """Whether every group of the unit keeps persistent weights that are current on every rank
    (ZeRO-1/2 between optimizer steps, or after the root's forward re-gathered them; ``no_shard``
    groups whose module computes with the main weights' memory always), so an unshard has nothing
    to issue, wait for or prepare: it only registers the full parameters. ``bucket_rows``: a
    stale group whose rows come in a gather bucket the root's forward planned counts too (its
    unshard takes the bucket's handle: no gather of its own).

    Why a test of its own: on a model of many small units the general gather path (listeners,
    labels, FP8 and subclass riders, a profiler range and an event per unit, four times per step)
    cost more host time than the module's compute. ``stale`` is the root forward's agreed
    decision (:func:`mfsdp2.groups.weight_watch.agree_on_gathers`) or a common fact, so every rank
    takes this path for the same units. A unit with an optimizer stepping in backward (gather
    listeners), FP8 or subclass parameters, a partial reshard or values to adopt takes the general
    path."""
    if state.ctx is None or state.unsettled or state.subclass is not None:
        return False
    for g in state.groups:
        if not g.persistent or g.grad_listeners or g.fp8 is not None:
            return False
        if g.stale and not (bucket_rows and g.pending_gather is not None):
            return False
    return True


def unshard_async(state: FSDPState) -> None:
    """Issue the unit's all-gathers (idempotent; re-gathers weights the optimizer has changed).

    Stale covers a gather still in flight too: ``unshard(async_op=True)`` issued before
    ``optimizer.step()`` gathered the old shards.
    """
    if state.shard_state is not ShardState.PARTIAL and nothing_to_gather(state):
        if state.shard_state is ShardState.SHARDED:  # nothing in flight: the wait only registers
            state.pending_unshard = []
            state.shard_state = ShardState.UNSHARDING
        return
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
    if state.shard_state is ShardState.PARTIAL or state.ctx is None:
        _unshard_general(state)
        return
    plan = plan_of(state)
    with torch._C._DisableFuncTorch(), trace_range(plan.trace_unshard):
        event_log.record("ag_issue", state.name)
        alloc = state.ctx.allocator
        step = state.ctx.step
        state.pending_unshard = pending = []
        if state.subclass is not None:
            h = state.subclass.all_gather(alloc, ("weight", state.name, "subclass"),
                                          f"{plan.subclass_label}{step})", list(plan.subclass_riders))
            pending.append((state.subclass, h))
            pending.extend((g, h) for g, _ in plan.subclass_riders)
        for op in plan.gathers:
            h = op.group.unshard(alloc, op.key, f"{op.label_head}{step})", op.rider, op.rider_key)
            if h is not None:  # None: persistent weights, already current on every rank
                pending.append((op.group, h))
        state.shard_state = ShardState.UNSHARDING


def _unshard_general(state: FSDPState) -> None:
    """The unit's gathers without a plan: before it has a root (an explicit ``unshard()`` ahead
    of the first forward), or from a partial reshard (``reshard_after_forward=<int>``: only the
    rank block gathers)."""
    partial = state.shard_state is ShardState.PARTIAL
    with torch._C._DisableFuncTorch(), trace_range(f"mfsdp2.unshard {state.name}"):
        event_log.record("ag_issue", state.name)
        # Before the root context exists there is no allocator yet: the buffer takes plain
        # memory; each buffer remembers where its block came from and gives it back there.
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
            names = g.name + ("" if j is None else f" + {rider[0].name}")
            label = f"all-gather of unit {state.name!r} ({names}, step {step})"
            h = (g.unshard_from_group(state.post_forward_comm, alloc, key, label) if partial
                 else g.unshard(alloc, key, label, *rider))
            if h is not None:  # None: persistent weights, already current on every rank
                state.pending_unshard.append((g, h))
        state.shard_state = ShardState.UNSHARDING


def wait_unshard(state: FSDPState) -> None:
    if state.shard_state is not ShardState.UNSHARDING:
        if state.held_for_graph and state.shard_state is ShardState.UNSHARDED:
            graph_hold.register_held(state)  # gathered, but its DTensors registered since its hold
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
    if state.held_for_graph:
        graph_hold.unhold(state)
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


# -- gathers bucketed across units ------------------------------------------------------------
def plan_bucketed_gathers(ctx, backward: bool) -> None:
    """Plan the all-gathers that small groups of several units share
    (:mod:`mfsdp2.groups.gather_buckets`) and issue the first buckets.

    At the root's forward (``backward=False``): the stale small persistent groups (ZeRO-1/2,
    re-gathered after a step) and, with ``set_all_gather_bucket_cap_mb`` above 0, the small
    sharded groups of every ZeRO-3 unit of the recorded order that will gather. At a backward's
    first pre-backward: the sharded groups of the units whose backward will gather them again,
    in the reversed record. Why: a unit of a few KiB pays the backend's fixed latency per
    collective (about 0.6 ms on gloo, tens of microseconds across NCCL nodes), twice per step;
    one collective per bucket pays it once. Every input is a fact every rank shares (the
    recorded order, strategy flags, the units' gather states), so every rank plans the same
    collectives."""
    gathers = ctx.gathers
    cap = gathers.transient_cap_bytes
    if backward:
        if cap <= 0:
            return
        order = list(reversed(ctx.schedule.recorded))
        units = {id(s) for s in order if _gathers_in_bucket(s, ctx) and s.unshard_in_backward
                 and (s.forward_with_grad or s.expect_backward) and not s.post_backward_done}
        if units:
            gathers.start(order, 0, ctx.step, units, persistent=False)
        return
    units = {id(s) for s in ctx.schedule.recorded if _gathers_in_bucket(s, ctx)} if cap > 0 else None
    gathers.start(ctx.schedule.recorded, ctx.buckets.cap_bytes, ctx.step, units)


def _gathers_in_bucket(state: FSDPState, ctx) -> bool:
    """A unit whose sharded groups may gather in a shared bucket: sharded now, under this root,
    with no subclass parameters, FP8 group (its riders gather with it), rank-block reshard or
    values to adopt -- the units whose gather is one plain all-gather per group."""
    return (state.ctx is ctx and state.shard_state is ShardState.SHARDED and state.subclass is None
            and not state.unsettled and state.post_forward_comm is None
            and all(g.fp8 is None for g in state.groups))
