"""The runtime's transient buffers over a training step, replayed on the trace's unit boundaries.

:func:`simulate` walks the marks of :mod:`mfsdp2.estimate.trace` (``fwd_begin``, ``fwd_end``,
``bwd_begin``, ``bwd_end``, ``final_reduce``, ``backward_end``) and does at each what mfsdp2's
hooks do to its allocator (see ``hooks.py``, ``grad_reduction.py``, ``grad_buckets.py``):

* **forward**: the root's forward releases the main gradients the last ``zero_grad`` cleared and
  begins a step (``mark_step``); each unit's pre-forward gathers it (one ``"weight"`` block per
  ZeRO-3 group, its full buffer in the compute dtype -- on a torch without storage swapping
  torch's own memory, which the allocator only counts (``account``): it is never cached, pooled
  or planned; FP8 groups also a float8 block freed at the wait) and prefetches the next
  ``prefetch_depth`` units of the recorded order (none in the first step, which records it);
  the post-forward frees them unless ``reshard_after_forward`` is False
  (the root's default) or keeps ``N/k`` shards for an int ``k`` (outside the allocator; the
  backward's gather inside the group writes the buffer itself and drops them at its wait). The
  root's post-forward ends the allocator's forward phase (``release_idle("backward")``).
* **backward**: the pre-backward gathers and prefetches in the reversed finishing order; the
  post-backward frees the weights, finishes the previous reduction (one in flight: FSDP2's
  default), allocates the flat gradient (reduce dtype) while autograd's gradients are still
  alive, then the main gradient (the first reduction after ``zero_grad`` writes straight into
  it) or a reduce-scatter output, and the gloo receive scratch (point-to-point or all-to-all). Groups whose
  reduction is a whole all-reduce (no_shard, ZeRO-1's small groups, ZeRO-2/3's below 256 KiB at
  two gloo ranks) pack into buckets instead: one bucket per group in the first backward, then the
  recorded order cut at the bucket cap, at most two in flight.
* **end of backward**: every reduction finished, every unit resharded, the allocator's backward
  phase ended (``release_idle("forward")``); then the optimizer step (its temporaries) with the
  main gradients alive.

What the allocator *holds* is not modelled here: the requests, frees and phase marks drive the
runtime's own allocator class of the chosen kind on meta tensors (:mod:`.held`), and each moment
records its live blocks by role and what it holds idle. The steps after the first are reported
(:func:`simulate`); :func:`transient_at_peak` picks the moment where the allocator, the memory
kept outside it and the trace's bytes are largest together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..base.strategy import ShardingStrategy
from .held import META, held_bytes, replay_allocator
from .plan import UnitPlan, _itemsize, keeps_full_weights
from .trace import Mark

__all__ = ["StepConfig", "Point", "ReplayedStep", "simulate", "transient_at_peak", "default_marks"]

SMALL_REDUCE_SCATTER_BYTES = 256 * 1024  # mfsdp2.comm.communicator's threshold (imported lazily to keep this pure)


@dataclass(frozen=True)
class StepConfig:
    strategy: ShardingStrategy
    shard_world: int
    replicate_world: int = 1
    prefetch_depth: int = 1
    reshard_after_forward: object = True  # bool or int, non-root units
    root_reshard_after_forward: bool = False
    backend: str = "gloo"  # "gloo" (CPU) or "nccl"
    offloaded: bool = False
    bucket_cap_bytes: int = 25 * 2**20
    max_reduce_in_flight: int = 1
    # Whether gathered weights are allocator blocks (``UntypedStorage._swap_data_ptr_``); else
    # torch's own memory (``storage.resize_``), which the allocator only counts (buffer.py).
    storage_swap: bool = True


@dataclass
class Point:
    """One moment of the step: the runtime's live blocks (bytes by role), what its allocator
    holds beyond them (``idle``: cached blocks, unused pool bytes), other memory the runtime holds
    outside its allocator (``extra``), and the trace's bytes (activations, gradients,
    temporaries); ``step``: which replayed step (1 is the first)."""

    label: str
    live: dict[str, int]
    extra: int
    act: int
    idle: int = 0
    step: int = 0

    @property
    def live_total(self) -> int:
        return sum(self.live.values())

    @property
    def held(self) -> int:
        """What the allocator holds: live blocks and idle bytes."""
        return self.live_total + self.idle

    @property
    def total(self) -> int:
        return self.held + self.extra + self.act


@dataclass
class ReplayedStep:
    points: list[Point]  # every recorded moment, of every step after the first
    steps: int  # steps replayed
    allocator: str
    first_step_peak: int = 0  # the first step's most (what a warm-up step would show)
    underlying_allocations: list = field(default_factory=list)  # per step: blocks obtained from torch


class _Sim:
    def __init__(self, plans: list[UnitPlan], cfg: StepConfig, allocator: str = "caching",
                 device_type: str = "cpu", hold_between_steps: bool = True):
        self.plans = plans
        self.cfg = cfg
        self.root = len(plans) - 1
        # The runtime's own allocator on meta tensors: it decides what is held (held.py).
        self.alloc_impl = replay_allocator(allocator, device_type, hold_between_steps)
        self.points: list[Point] = []
        self.recording = False
        self.step = 0
        self.step_peak = 0
        self.extra = 0
        self.unsharded = [False] * len(plans)
        self.partial = [False] * len(plans)
        self.pending_wait: set[int] = set()
        self.recorded: list[int] = []
        self.fwd_seen: list[int] = []
        self.bwd_record: list[int] = []
        self.bwd_seen: list[int] = []
        self.main_grad: dict[tuple, object] = {}  # (unit, group) -> key of its block, or ("bucket", id)
        self.queue: list[int] = []
        self.pending: dict[tuple, dict] = {}  # (unit, group) -> own reduction's buffers
        self.lane_record: dict[torch.dtype, list] = {}
        self.lane_plan: dict[torch.dtype, list] = {}
        self.lane_pos: dict[torch.dtype, tuple] = {}
        self.open_bucket: dict[torch.dtype, Optional[dict]] = {}
        self.in_flight: list[dict] = []
        self.act = 0

    # -- allocator ----------------------------------------------------------------------------
    def alloc(self, key: tuple, numel: int, dtype: torch.dtype) -> None:
        self.alloc_impl.allocate(key, numel, dtype, META)

    def free(self, key: tuple) -> None:
        if self.alloc_impl.is_live(key):
            self.alloc_impl.free(key)

    def point(self, label: str, act: Optional[int] = None) -> None:
        live_bytes, idle = held_bytes(self.alloc_impl)
        live = {r: n for r, n in self.alloc_impl.stats.live_bytes_by_role.items() if n}
        assert sum(live.values()) == live_bytes
        p = Point(label, live, self.extra, self.act if act is None else act, idle, self.step)
        self.step_peak = max(self.step_peak, p.total)
        if self.recording:
            self.points.append(p)

    # -- weights ------------------------------------------------------------------------------
    def _gathered(self, u: int) -> list:
        """The unit's groups that gather (the others keep their full weights)."""
        return [g for g in self.plans[u].groups
                if not keeps_full_weights(g, self.cfg.strategy, self.cfg.offloaded)]

    def unshard(self, u: int) -> None:
        gathered = self._gathered(u)
        if self.unsharded[u] or not gathered:
            return
        for g in gathered:
            if self.cfg.storage_swap:
                self.alloc(("weight", u, g.index), g.total, g.compute_dtype)
            else:  # torch's memory: counted as live, never cached, pooled or planned
                self.alloc_impl.account(("weight", u, g.index), g.total * _itemsize(g.compute_dtype))
            if g.fp8 is not None:
                self.alloc(("fp8", u, g.index), g.total, g.fp8)
        self.unsharded[u] = True
        self.pending_wait.add(u)

    def wait(self, u: int) -> None:
        if u in self.pending_wait:
            self.pending_wait.discard(u)
            for g in self.plans[u].groups:
                self.free(("fp8", u, g.index))
            if self.partial[u]:  # the in-group gather wrote the buffer: the kept piece is dropped
                self._drop_kept(u)

    def reshard(self, u: int, to_group: bool = False) -> None:
        if not self.unsharded[u]:
            if self.partial[u] and not to_group:
                self._drop_kept(u)
            return
        self.wait(u)
        for g in self._gathered(u):
            self.free(("weight", u, g.index))
        self.unsharded[u] = False
        if to_group:
            k = int(self.cfg.reshard_after_forward)
            self.partial[u] = True
            self.extra += sum(g.world // k * g.S * _itemsize(g.compute_dtype) for g in self.plans[u].groups)
        elif self.partial[u]:
            self._drop_kept(u)

    def _drop_kept(self, u: int) -> None:
        k = int(self.cfg.reshard_after_forward)
        self.extra -= sum(g.world // k * g.S * _itemsize(g.compute_dtype) for g in self.plans[u].groups)
        self.partial[u] = False

    def _raf(self, u: int):
        return self.cfg.root_reshard_after_forward if u == self.root else self.cfg.reshard_after_forward

    # -- gradients ----------------------------------------------------------------------------
    def _bucketed(self, g) -> bool:
        cfg = self.cfg
        full_grads = not cfg.strategy.shards_grads
        if cfg.bucket_cap_bytes <= 0:
            return False
        if g.world > 1:
            if cfg.replicate_world > 1 or not (full_grads or g.world == 2):
                return False
            nbytes = g.total * _itemsize(g.reduce_dtype)
            return cfg.backend == "gloo" and nbytes < SMALL_REDUCE_SCATTER_BYTES
        return full_grads and cfg.replicate_world > 1

    def _main_grad_numel(self, g) -> int:
        return g.S if self.cfg.strategy.shards_grads else g.total

    def ensure_main_grad(self, u: int, g) -> None:
        if (u, g.index) in self.main_grad:
            return
        if self.cfg.offloaded:  # host memory owned by the group: not the device's
            self.main_grad[(u, g.index)] = None
            return
        key = ("main_grad", u, g.index)
        self.alloc(key, self._main_grad_numel(g), g.grad_dtype)
        self.main_grad[(u, g.index)] = key

    def release_main_grads(self) -> None:
        for (u, gi), key in list(self.main_grad.items()):
            if isinstance(key, dict):  # a bucket's slice
                key["holders"].discard((u, gi))
                self._maybe_free_bucket(key)
            elif key is not None:
                self.free(key)
        self.main_grad.clear()

    def _direct(self, g) -> bool:
        return not self.cfg.offloaded and g.reduce_dtype == g.grad_dtype

    def finish(self, u: int) -> None:
        for g in self.plans[u].groups:
            p = self.pending.pop((u, g.index), None)
            if p is None:
                continue
            self.free(("grad", u, g.index))
            self.free(("rs_recv", u, g.index))
            if p["out"]:
                self.ensure_main_grad(u, g)
                self.point(f"reduced into main gradient {self.plans[u].name}")  # from rs_out, still alive
                self.free(("rs_out", u, g.index))

    def drain(self, keep: int) -> None:
        while len(self.queue) > keep:
            self.finish(self.queue.pop(0))

    def post_backward(self, u: int, grads: int) -> None:
        self.reshard(u)
        groups = [g for g in self.plans[u].groups if g.requires_grad]
        if not groups:
            self.act -= grads
            return
        own = [g for g in groups if not self._bucketed(g)]
        if own:
            self.drain(self.cfg.max_reduce_in_flight - 1)
        issued = False
        for g in groups:
            if self._bucketed(g):
                self.reserve(u, g)
            else:
                if g.world == 1 and self._direct(g) and (u, g.index) not in self.main_grad:
                    # A shard group of one rank: the main gradient is the buffer itself (no_shard,
                    # ZeRO-1: the all-reduce's; ZeRO-2/3: a reduce-scatter over one rank is the identity).
                    self.ensure_main_grad(u, g)
                    out = False
                else:
                    self.alloc(("grad", u, g.index), g.total, g.reduce_dtype)
                    out = None
                self.point(f"pack {self.plans[u].name}")  # autograd's gradients still alive
                if out is None:
                    direct = self._direct(g) and (u, g.index) not in self.main_grad
                    if direct:
                        self.ensure_main_grad(u, g)
                    elif g.world > 1 or self.cfg.strategy.shards_grads:
                        self.alloc(("rs_out", u, g.index), g.S, g.reduce_dtype)
                    out = not direct
                    nbytes = g.total * _itemsize(g.reduce_dtype)
                    if self.cfg.backend == "gloo" and g.world > 2:
                        # receive scratch: point-to-point (n - 2 chunks), all-to-all below the threshold (n)
                        n = g.world - 2 if nbytes >= SMALL_REDUCE_SCATTER_BYTES else g.world
                        self.alloc(("rs_recv", u, g.index), n * g.S, g.reduce_dtype)
                self.pending[(u, g.index)] = {"out": out}
                issued = True
        self.act -= grads
        if issued:
            if u in self.queue:
                self.queue.remove(u)
            self.queue.append(u)
            self.drain(self.cfg.max_reduce_in_flight)

    # -- buckets ------------------------------------------------------------------------------
    def reserve(self, u: int, g) -> None:
        lane = g.reduce_dtype
        self.lane_record.setdefault(lane, []).append((u, g.index, g.total))
        plan = self.lane_plan.get(lane) or []
        b, m = self.lane_pos.get(lane, (0, 0))
        expected = plan[b][m] if b < len(plan) else None
        bucket = None
        if expected is not None and expected[:2] == (u, g.index) and self.lane_pos.get(lane) is not None:
            if m == 0:
                bucket = self._new_bucket(lane, sum(n for *_, n in plan[b]), len(plan[b]), b)
                self.open_bucket[lane] = bucket
            bucket = self.open_bucket[lane]
            self.lane_pos[lane] = (b, m + 1) if m + 1 < len(plan[b]) else (b + 1, 0)
        else:
            if plan and self.lane_pos.get(lane) is not None:
                self.lane_pos[lane] = None  # off the plan: the rest of this backward is one per group
                if self.open_bucket.get(lane) is not None:
                    self._issue(self.open_bucket.pop(lane))
            bucket = self._new_bucket(lane, g.total, 1)
        self.point(f"pack {self.plans[u].name}")
        sharded = self.cfg.strategy.shards_grads
        direct = not sharded and self._direct(g) and (u, g.index) not in self.main_grad
        bucket["members"].append((u, g.index, direct))
        bucket["holders"].add((u, g.index))
        if direct:
            self.main_grad[(u, g.index)] = bucket
        if len(bucket["members"]) == bucket["planned"]:
            if self.open_bucket.get(lane) is bucket:
                self.open_bucket[lane] = None
            self._issue(bucket)

    def _new_bucket(self, lane, numel: int, planned: int, index: Optional[int] = None) -> dict:
        # The runtime's key (grad_buckets.py): lane, plan index ("single" off the plan), and the
        # lowest number no live block of an earlier step uses -- the same keys every step.
        base = ("grad_bucket", str(lane), "single" if index is None else index)
        k = 0
        while self.alloc_impl.is_live(base + (k,)):
            k += 1
        key = base + (k,)
        self.alloc(key, numel, lane)
        return {"key": key, "members": [], "holders": set(), "planned": planned, "done": False}

    def _issue(self, bucket: dict) -> None:
        self.in_flight.append(bucket)
        while len(self.in_flight) > 2:
            self._complete(self.in_flight.pop(0))

    def _complete(self, bucket: dict) -> None:
        if bucket["done"]:
            return
        bucket["done"] = True
        copied = False
        for u, gi, direct in bucket["members"]:
            if not direct:
                g = self.plans[u].groups[gi]
                self.ensure_main_grad(u, g)
                bucket["holders"].discard((u, gi))
                copied = True
        if copied:  # the members' main gradients are written from the bucket, still alive
            self.point("all-reduced bucket")
        self._maybe_free_bucket(bucket)

    def _maybe_free_bucket(self, bucket: dict) -> None:
        if not bucket["holders"] and bucket["done"]:
            self.free(bucket["key"])

    def end_backward(self) -> None:
        for lane, b in list(self.open_bucket.items()):
            if b is not None:
                self._issue(b)
        self.open_bucket.clear()
        while self.in_flight:
            self._complete(self.in_flight.pop(0))
        self.drain(0)
        cap = {lane: self.cfg.bucket_cap_bytes // _itemsize(lane) for lane in self.lane_record}
        for lane, record in self.lane_record.items():
            plan, cur, size = [], [], 0
            for u, gi, n in record:
                if cur and (size + n > cap[lane] or any((a, b) == (u, gi) for a, b, _ in cur)):
                    plan.append(cur)
                    cur, size = [], 0
                cur.append((u, gi, n))
                size += n
            if cur:
                plan.append(cur)
            self.lane_plan[lane] = plan
            self.lane_pos[lane] = (0, 0)
        self.lane_record = {}

    # -- the walk -----------------------------------------------------------------------------
    def run_step(self, marks: list[Mark]) -> None:
        d = self.cfg.prefetch_depth
        self.fwd_seen, self.bwd_seen = [], []
        for mk in marks:
            u = mk.unit
            # The trace's bytes between the previous mark and this one: the runtime's state is
            # what the previous mark left, so its peak meets that state.
            self.point("compute", act=mk.peak)
            self.act = mk.live
            name = self.plans[u].name
            if mk.kind == "fwd_begin":
                if u == self.root and not self.fwd_seen:
                    # hooks.pre_forward: main gradients back (zero_grad cleared them), then a step begins
                    self.release_main_grads()
                    self.alloc_impl.mark_step(("train", True))
                k = len(self.fwd_seen)
                self.fwd_seen.append(u)
                follows = self.recorded[:k + 1] == self.fwd_seen
                prefetch = self.recorded[k + 1:k + 1 + d] if follows else []
                self.unshard(u)
                for s in prefetch:
                    self.unshard(s)
                self.wait(u)
                self.point(f"forward {name}")
            elif mk.kind == "fwd_end":
                raf = self._raf(u)
                if raf is not False:
                    to_group = not isinstance(raf, bool) and 1 < int(raf) < self.cfg.shard_world
                    self.reshard(u, to_group=to_group)
                if u != self.root:
                    self.bwd_record.append(u)
                else:  # the root's training forward ended: the loss and backward come next
                    self.alloc_impl.release_idle("backward")
                self.point(f"forward end {name}")
            elif mk.kind == "bwd_begin":
                order = [s for s in reversed(self.bwd_record)]
                if u == self.root:
                    prefetch = order[:d] if not self.bwd_seen else []
                else:
                    k = len(self.bwd_seen)
                    self.bwd_seen.append(u)
                    prefetch = order[k + 1:k + 1 + d] if order[:k + 1] == self.bwd_seen else []
                self.unshard(u)
                for s in prefetch:
                    self.unshard(s)
                self.wait(u)
                self.point(f"backward {name}")
            elif mk.kind in ("bwd_end", "final_reduce"):
                self.post_backward(u, mk.grads)
                self.point(f"reduced {name}")
            elif mk.kind == "backward_end":
                self.end_backward()
                for s in range(len(self.plans)):
                    self.reshard(s)
                self.recorded = list(self.fwd_seen)
                self.bwd_record = []
                self.alloc_impl.release_idle("forward")  # the final callback's last act
                self.point("backward end", act=mk.live)


def default_marks(n_units: int) -> list[Mark]:
    """The marks of a step with no trace (no inputs given): the root's forward around the units in
    order, their backwards in reverse, the root reduced by the final callback; no activations."""
    root = n_units - 1
    marks = [Mark("fwd_begin", root, 0, 0)]
    for u in range(root):
        marks += [Mark("fwd_begin", u, 0, 0), Mark("fwd_end", u, 0, 0)]
    marks += [Mark("fwd_end", root, 0, 0), Mark("bwd_begin", root, 0, 0)]
    for u in reversed(range(root)):
        marks += [Mark("bwd_begin", u, 0, 0), Mark("bwd_end", u, 0, 0)]
    marks += [Mark("final_reduce", root, 0, 0), Mark("backward_end", root, 0, 0)]
    return marks


def simulate(plans: list[UnitPlan], marks: list[Mark], cfg: StepConfig, optimizer_temps: int = 0,
             allocator: str = "caching", device_type: str = "cpu", hold_between_steps: bool = True,
             steps: Optional[int] = None) -> ReplayedStep:
    """Replay ``steps`` training steps over ``marks``, each ending with the optimizer step
    (``optimizer_temps`` bytes of temporaries, the main gradients alive), with the runtime's own
    ``allocator`` deciding what is held (:mod:`.held`). Every step after the first is kept: the
    first runs without prefetch or bucket plans (it records them) and, like any warm-up, also
    does what the estimate does not model (lazy initialisation); the second may hold more than
    the later ones while the allocator's records settle (a caching allocator keeps a size class
    whose requests left last step's pattern until its phase ends; a trace pool diverges from the
    first step's plan twice before it re-plans). Default steps: 3, and 5 for ``"trace_pool"``
    (its plan is replayed from the fourth step on)."""
    if steps is None:
        steps = 5 if allocator == "trace_pool" else 3
    sim = _Sim(plans, cfg, allocator, device_type, hold_between_steps)
    first_peak = 0
    counts = []
    for s in range(steps):
        sim.step = s + 1
        sim.recording = s > 0
        sim.step_peak = 0
        sim.run_step(marks)
        sim.act = 0
        sim.point("optimizer step", act=optimizer_temps)
        counts.append(sim.alloc_impl.stats.underlying_allocations)
        if s == 0:
            first_peak = sim.step_peak
    per_step = [b - a for a, b in zip([0] + counts[:-1], counts)]
    return ReplayedStep(sim.points, steps, allocator, first_peak, per_step)


def transient_at_peak(step: ReplayedStep) -> tuple[int, Point, int]:
    """``(bytes, point, held)``: the most that the runtime's allocator (its live blocks and what
    it holds idle), the memory it keeps outside its allocator (``Point.extra``: shards kept by
    ``reshard_after_forward=<int>``) and the trace's memory take together at one moment of the
    replayed steps after the first, the moment, and what the allocator held there."""
    best = max(step.points, key=lambda p: p.total)
    return best.total, best, best.held
