"""TracePoolAllocator: record one step's buffer requests, plan them into pools, replay.

Why: a training step asks for the same buffers in the same order every time (each unit's
gathered weights, its flat gradient, reduce-scatter output and scratch). Knowing the whole
sequence, offsets in a preallocated pool can be planned so that buffers whose lifetimes do not
overlap share bytes (:mod:`mfsdp2.memory.pool_plan`): the pool is about the peak live bytes, and a
steady-state step asks torch for one block per pool instead of one per buffer.

Phases, per *step kind* (the ``tag`` passed to :meth:`mark_step`: the runtime passes
``(grad enabled, gradient sync)``, so eval passes and no-sync micro-batches get plans of their own
instead of breaking the training step's):

1. **trace**: a kind with no plan is served by the fallback allocator (caching) while its
   allocate/free events are recorded, and the ends of the step's own phases (``release_idle``:
   the root's training forward, the backward); at the next ``mark_step`` the trace is planned.
2. **plan**: each buffer allocated *and freed* inside one phase of the step becomes an interval
   of that phase's pool, one per (device, dtype, phase), sized to the largest plan of any kind
   (pools only grow). Not pooled, served by the fallback: buffers that outlive their phase (a pool
   would hold their bytes idle through the other phase), and main gradients and the buckets whose
   slices are main gradients (:data:`~mfsdp2.memory.allocator.EXACT_ROLES`, dead from the next forward on).
3. **replay**: a request that is the next event of the plan gets its planned slot. A pool's memory
   is obtained at its first slot handed out and given back at the end of its phase (on the CPU
   a pool glibc would map afresh is kept when its phase comes next, as the caching allocator
   keeps the next phase's blocks): outside its phase a pool holds nothing, inside it holds the
   phase's peak of planned buffers (the plan reaches the max-live lower bound, 1.00x on recorded
   transformer steps).

Divergence never crashes or corrupts (Megatron-FSDP2's pool asserts "no slot available" when an
eval pass runs between training steps): the first request that differs from the plan (another
key, size or order; a free that comes later; a phase that ends elsewhere) switches the rest of
that step to the fallback allocator, and the step's own sequence becomes a candidate; when the
same sequence comes again in the next step of that kind, it is re-planned. Independently of the
plan, a pool slot is handed out only if no live block of the pool overlaps it, so a block that
outlives its step (e.g. an unshard before a step began) can never be overwritten. ``debug=True``
(or ``MFSDP2_DEBUG_ALLOCATOR=1``) checks every plan and raises if a slot handed out while the step
matches its plan overlaps a live block (a planner bug, not a divergence).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Hashable, Optional

import torch

from .allocator import EXACT_ROLES, BucketAllocator, CachingAllocator, DynamicAllocator, role_of
from .pool_plan import Interval, check_plan, plan_pool

__all__ = ["TracePoolAllocator", "TraceStats", "make_allocator"]

logger = logging.getLogger(__name__)


@dataclass
class TraceStats:
    plans: int = 0  # plans made (the first per step kind, then re-plans)
    divergences: int = 0  # steps that left their plan
    pool_hits: int = 0  # requests served from a pool slot
    fallback_hits: int = 0  # requests served by the fallback allocator
    pool_bytes: int = 0  # bytes of all current pools


@dataclass
class _Pool:
    numel: int
    dtype: torch.dtype
    device: torch.device
    phase: int  # the phase of the step its buffers live in (0: forward, 1: backward, ...)
    tensor: Optional[torch.Tensor] = None  # its memory while it has some (obtained at its first use)
    live: dict = field(default_factory=dict)  # key -> (lo, hi, step id), element offsets
    live_numel: int = 0  # elements of ``live`` (leaked blocks included: their bytes are not free)

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()


@dataclass(frozen=True)
class _Plan:
    events: tuple  # ("a", key, numel, dtype, device) / ("f", key) / ("p", next phase)
    slots: dict  # event index of an allocation -> (pool key, element offset); absent: fallback
    pool_numel: dict  # pool key -> elements this plan needs


class TracePoolAllocator(BucketAllocator):
    """Trace a step, plan a pool per (device, dtype, phase), replay; falls back safely on divergence."""

    def __init__(self, fallback: Optional[BucketAllocator] = None, debug: Optional[bool] = None, align_bytes: int = 64):
        super().__init__()
        self.fallback = fallback if fallback is not None else CachingAllocator()
        self.debug = os.environ.get("MFSDP2_DEBUG_ALLOCATOR", "0") == "1" if debug is None else debug
        self.align_bytes = align_bytes
        self.trace_stats = TraceStats()
        self._plans: dict[Hashable, _Plan] = {}
        self._candidates: dict[Hashable, tuple] = {}
        self._pools: dict[tuple, _Pool] = {}
        self._source: dict[Hashable, Optional[_Pool]] = {}  # live key -> its pool (None: fallback)
        self._pool_allocations = 0
        self._step_id = 0
        self._tag: Hashable = None
        self._events: list = []
        self._plan: Optional[_Plan] = None
        self._diverged = False
        self._phase = 0  # phase marks (release_idle) since the step began

    # -- steps ----------------------------------------------------------------------------------
    def mark_step(self, tag: Hashable = None) -> None:
        self._end_step()
        self._step_id += 1
        self._tag = tag
        self._events = []
        self._phase = 0
        self._plan = self._plans.get(tag)
        self._diverged = False

    def release_idle(self, next_phase: str = "forward") -> None:
        """A phase of the step ended: the mark becomes part of the trace (a plan's pools are per
        phase), the pools with no live buffer go back to torch (but, on the CPU, the next phase's
        pools that glibc would map afresh: see ``CachingAllocator.release_idle``), and the fallback
        gives back what it holds idle."""
        ev = ("p", next_phase)
        plan, idx = self._plan, len(self._events)
        if plan is not None and not self._diverged and (idx >= len(plan.events) or plan.events[idx] != ev):
            self._note_divergence(f"phase {next_phase!r} began out of the planned order")
        self._events.append(ev)
        self._phase += 1
        # the pool asked for next: this step's next phase, or the next step's forward
        upcoming = 0 if next_phase == "forward" else self._phase
        hold = getattr(self.fallback, "hold_between_steps", True) or next_phase != "forward"
        for pool in self._pools.values():
            if pool.tensor is None or pool.live:
                continue
            if hold and pool.phase == upcoming and self.fallback.keeps(pool.device, pool.nbytes):
                continue
            pool.tensor = None
        self._sync_bytes()
        self.fallback.release_idle(next_phase)

    def _end_step(self) -> None:
        events, tag, plan = tuple(self._events), self._tag, self._plan
        if not events:
            return
        if plan is not None and not self._diverged and events == plan.events:
            return  # replayed exactly
        if plan is not None and not self._diverged:
            self._note_divergence("the step ended early")
        if plan is None or self._candidates.get(tag) == events:
            self._candidates.pop(tag, None)
            self._plans[tag] = self._make_plan(events)
        else:
            self._candidates[tag] = events

    def _note_divergence(self, why: str) -> None:
        self._diverged = True
        self.trace_stats.divergences += 1
        logger.debug("mfsdp2 trace pool: step %d (%r) left its plan: %s", self._step_id, self._tag, why)

    # -- planning -------------------------------------------------------------------------------
    @staticmethod
    def _pool_key(dtype: torch.dtype, device: torch.device, phase: int = 0) -> tuple:
        return (str(device), dtype, phase)

    def _make_plan(self, events: tuple) -> _Plan:
        """Intervals of the buffers allocated and freed inside one phase of the step, one pool per
        (device, dtype, phase). Not planned (the fallback serves them): a buffer that lives across a
        phase mark (a pool of either phase would hold its bytes idle through the other one), the
        roles of :data:`~mfsdp2.memory.allocator.EXACT_ROLES`, and a buffer still live at the step's end."""
        freed_at: dict = {}
        open_allocs: dict = {}
        phase_of: dict = {}
        phase = 0
        for i, ev in enumerate(events):
            if ev[0] == "p":
                phase += 1
            elif ev[0] == "a":
                open_allocs[ev[1]] = i
                phase_of[i] = phase
            elif ev[1] in open_allocs:  # a free of a buffer allocated in this step
                start = open_allocs.pop(ev[1])
                if phase_of[start] == phase and role_of(ev[1]) not in EXACT_ROLES:
                    freed_at[start] = i
        by_pool: dict[tuple, list[tuple[int, Interval]]] = {}
        for i, j in freed_at.items():
            _, _, numel, dtype, device = events[i]
            by_pool.setdefault(self._pool_key(dtype, device, phase_of[i]), []).append((i, Interval(i, j, numel)))
        slots, pool_numel = {}, {}
        for pk, items in sorted(by_pool.items(), key=lambda kv: str(kv[0])):
            itemsize = torch.empty((), dtype=pk[1]).element_size()
            align = max(self.align_bytes // itemsize, 1)
            ivs = [iv for _, iv in items]
            plan = plan_pool(ivs, align)
            if self.debug:
                check_plan(ivs, plan, align)
            for (i, _), off in zip(items, plan.offsets):
                slots[i] = (pk, off)
            pool_numel[pk] = plan.pool_size
            self._ensure_pool(pk, plan.pool_size)
        self.trace_stats.plans += 1
        if hasattr(self.fallback, "release_cached"):  # the pool now serves what it cached
            self.fallback.release_cached()
        logger.debug("mfsdp2 trace pool: planned %d of %d buffers into %s", len(slots),
                     sum(e[0] == "a" for e in events), pool_numel)
        return _Plan(events, slots, pool_numel)

    def _ensure_pool(self, pk: tuple, numel: int) -> None:
        """Pool ``pk`` will serve ``numel`` elements: its memory is obtained at its first use."""
        pool = self._pools.get(pk)
        if pool is not None and pool.numel >= numel:
            return
        # Pools only grow. Blocks still live in the old pool keep its memory (their tensors view
        # it) and are released into it; new slots come from the new one.
        self._pools[pk] = _Pool(numel, pk[1], torch.device(pk[0]), pk[2])
        self._sync_bytes()

    def _pool_memory(self, pool: _Pool) -> torch.Tensor:
        if pool.tensor is None:
            pool.tensor = torch.empty(pool.numel, dtype=pool.dtype, device=pool.device)
            self._pool_allocations += 1
            self._sync_bytes()
            self._sync_count()
        return pool.tensor

    def _sync_bytes(self) -> None:
        self.trace_stats.pool_bytes = sum(p.nbytes for p in self._pools.values())

    def _sync_count(self) -> None:
        self.stats.underlying_allocations = self._pool_allocations + self.fallback.stats.underlying_allocations

    # -- allocate / free ------------------------------------------------------------------------
    def _planned_slot(self, idx: int, ev: tuple) -> Optional[tuple]:
        plan = self._plan
        if plan is None or self._diverged:
            return None
        if idx >= len(plan.events) or plan.events[idx] != ev:
            self._note_divergence(f"request {ev[:3]} where the plan has "
                                  f"{plan.events[idx][:3] if idx < len(plan.events) else 'nothing'}")
            return None
        return plan.slots.get(idx)

    def _obtain(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        ev = ("a", key, numel, dtype, device)
        slot = self._planned_slot(len(self._events), ev)
        self._events.append(ev)
        if slot is not None:
            pk, off = slot
            pool = self._pools[pk]
            clash = next(((k, r) for k, r in pool.live.items() if r[0] < off + numel and off < r[1]), None)
            if clash is None:
                pool.live[key] = (off, off + numel, self._step_id)
                pool.live_numel += numel
                self._source[key] = pool
                self.trace_stats.pool_hits += 1
                return self._pool_memory(pool)[off : off + numel]
            if self.debug and clash[1][2] == self._step_id:
                raise AssertionError(
                    f"trace pool: planned slot [{off}, {off + numel}) for {key!r} overlaps live {clash[0]!r} "
                    f"{clash[1][:2]} of the same step: the plan is wrong"
                )
            # A block that outlived its step sits there: never hand out shared bytes.
            self._note_divergence(f"slot of {key!r} still holds {clash[0]!r}")
        t = self.fallback.allocate(key, numel, dtype, device)
        self._source[key] = None
        self.trace_stats.fallback_hits += 1
        self._sync_count()
        return t

    def _release(self, key: Hashable, tensor: torch.Tensor) -> None:
        ev = ("f", key)
        plan, idx = self._plan, len(self._events)
        if plan is not None and not self._diverged and (idx >= len(plan.events) or plan.events[idx] != ev):
            self._note_divergence(f"free of {key!r} out of the planned order")
        self._events.append(ev)
        src = self._source.pop(key)
        if src is None:
            self.fallback.free(key)
        else:
            lo, hi, _ = src.live.pop(key)
            src.live_numel -= hi - lo

    def _forget(self, key: Hashable, tensor: torch.Tensor) -> None:
        # A leaked block keeps its pool bytes: it stays in ``live`` under a key of its own, so no
        # slot overlapping it is ever handed out again (step id -1: not a planner error).
        src = self._source.pop(key)
        if src is None:
            self.fallback._warned.add(key)  # this allocator warns
            self.fallback.leak(key)
        else:
            lo, hi, _ = src.live.pop(key)
            src.live[("leaked", key, len(self._leaked))] = (lo, hi, -1)
        if self._plan is not None and not self._diverged:
            self._note_divergence(f"{key!r} was leaked")

    def cached_bytes(self) -> int:
        """Bytes held for reuse: the pools plus what the fallback caches."""
        fb = self.fallback.cached_bytes() if hasattr(self.fallback, "cached_bytes") else 0
        return self.trace_stats.pool_bytes + fb

    def idle_bytes(self) -> int:
        idle = sum(p.nbytes - p.live_numel * p.tensor.element_size() for p in self._pools.values()
                   if p.tensor is not None)
        return idle + self.fallback.idle_bytes()

    def keeps(self, device: torch.device, nbytes: int) -> bool:
        return self.fallback.keeps(device, nbytes)

    def held_tensors(self) -> list[torch.Tensor]:
        return [p.tensor for p in self._pools.values() if p.tensor is not None] + self.fallback.held_tensors() + [
            t for k, t in self._live.items() if self._source.get(k) is not None
        ] + list(self._leaked)


def make_allocator(spec) -> BucketAllocator:
    """``"caching"`` (default), ``"dynamic"``, ``"trace_pool"`` or a :class:`BucketAllocator` instance."""
    if isinstance(spec, BucketAllocator):
        return spec
    if spec in (None, "caching"):
        return CachingAllocator()
    if spec == "dynamic":
        return DynamicAllocator()
    if spec == "trace_pool":
        return TracePoolAllocator()
    raise ValueError(
        f"unknown allocator {spec!r}: use 'caching', 'dynamic', 'trace_pool' or a BucketAllocator instance"
    )
