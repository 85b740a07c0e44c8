"""A step's peak tensor memory against the schedule's own lower bound, on one event clock.

Two numbers, measured together by :class:`StepMemoryTracker` (torch's ``MemTracker``, which sees
every tensor an op creates and every storage freed, plus what the model, the optimizer and
mfsdp2 hold from before):

* **peak**: the most bytes held at once -- parameters, optimizer states, activations, autograd's
  gradients and temporaries, mfsdp2's shards and main weights, and *all* memory mfsdp2's
  allocator holds (its live buffers, cached free blocks and pools), whether a buffer uses it or not;
* **bound**: the same count at the same moments, with the allocator's memory counted only where
  a live buffer uses it -- each gathered weight, flat gradient, reduction output and main gradient
  from its allocation (just before its first write) to its free (just after its last read; for a
  main gradient, the next root forward after ``zero_grad(set_to_none=True)``). Everything else is
  torch's and counted as it is.

Why this is the schedule's lower bound: at every moment the bound counts only bytes that hold
data the step still reads (or the persistent state), so no allocator serving the same sequence of
operations and buffers can hold less at that moment; its maximum over the step is therefore a
lower bound on any peak of this schedule. ``peak / bound`` is what holding memory idle costs: 1.0
means nothing is held idle at the peak. (Changing the schedule -- what is gathered when, what is
packed where -- changes the bound; this measures one schedule as it ran.)

The breakdown at the bound's moment (tracker categories, the allocator's live bytes by role and
what it held idle then) says what the schedule needs there, e.g. why a case's bound lies above
another framework's peak.

Use::

    tracker = StepMemoryTracker(model, optimizer, x, y)   # after one warm-up step
    with tracker:
        train_step(...)
    r = tracker.result()        # MemoryPeaks: peak_bytes, bound_bytes, ratio, breakdowns

``torch.distributed._tools.mem_tracker`` is torch's (private, stable since 2.5); it is imported
only here, when a tracker is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from .allocator import role_of

__all__ = ["MemoryPeaks", "StepMemoryTracker", "gathered_storages", "mfsdp2_held", "mfsdp2_held_tensors"]


@dataclass
class MemoryPeaks:
    """What :class:`StepMemoryTracker` measured (bytes; per device, the device of the peak)."""

    peak_bytes: int
    bound_bytes: int
    peak_breakdown: dict = field(default_factory=dict)  # tracker category -> bytes at the peak
    bound_breakdown: dict = field(default_factory=dict)  # tracker category -> bytes at the bound's moment
    bound_allocator_live_by_role: dict = field(default_factory=dict)  # role -> live bytes then
    bound_allocator_idle_bytes: int = 0  # what the allocator held idle at the bound's moment
    peak_allocator_idle_bytes: int = 0  # ... and at the peak

    @property
    def peak_over_bound(self) -> Optional[float]:
        return self.peak_bytes / self.bound_bytes if self.bound_bytes else None

    def as_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "bound_bytes": self.bound_bytes,
            "peak_over_bound": self.peak_over_bound,
            "peak_breakdown": dict(self.peak_breakdown),
            "peak_allocator_idle_bytes": self.peak_allocator_idle_bytes,
            "bound_breakdown": dict(self.bound_breakdown),
            "bound_allocator_live_by_role": dict(self.bound_allocator_live_by_role),
            "bound_allocator_idle_bytes": self.bound_allocator_idle_bytes,
        }


def _groups(model: nn.Module) -> list:
    out = []
    for m in model.modules():
        st = getattr(m, "_mfsdp2_state", None)
        if st is not None:
            out.extend(st.groups)
    return out


def gathered_storages(model: nn.Module) -> set:
    """``_cdata`` of every unit's gathered-weight storage: while unsharded it is a non-owning alias
    of an allocator block, which is counted through the block (a tracker counting the alias too
    would count those bytes twice, for as long as the alias lives)."""
    return {g.weights._storage._cdata for g in _groups(model) if g.weights._swap and not g.weights.persistent}


def mfsdp2_held(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(what, tensor)`` for every tensor holding memory mfsdp2 owns outside the module's
    parameters. ``what`` is ``"main_weight"``, ``"shard"`` (the model-dtype shard, the main
    weights' own storage where the dtypes agree), ``"main_grad"``, ``"main_grad_full"``,
    ``"partial"``, ``"unsynced_grad"``, ``"persistent_weights"`` (the full weights kept by
    ZeRO-1/2 and no_shard), an allocator role (:class:`~mfsdp2.memory.allocator.BufferRole`) for
    its live buffers, or ``"idle"`` for what else the allocator holds (cached blocks, pools). A
    storage appears once per tensor viewing it; trackers count it once."""
    out: list[tuple[str, torch.Tensor]] = []
    for g in _groups(model):
        out += [("main_weight", g.main_weight), ("shard", g.weights.shard)]
        for what in ("main_grad", "main_grad_full", "partial", "unsynced_grad"):
            t = getattr(g, what)
            if t is not None:
                out.append((what, t))
        if g.weights.persistent:
            out.append(("persistent_weights", g.weights.unsharded))
    alloc = model.allocator
    live = alloc.live_buffers()
    out += [(str(role_of(k)), t) for k, t in live]
    seen = {id(t) for _, t in live}
    out += [("idle", t) for t in alloc.held_tensors() if id(t) not in seen]
    return out


def mfsdp2_held_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Tensors holding memory mfsdp2 owns outside the module's parameters: main weights, model
    weight shards, main gradients, and everything its allocator holds (:func:`mfsdp2_held`)."""
    return [t for _, t in mfsdp2_held(model)]


def _label(k: Any) -> str:
    return k.value if hasattr(k, "value") else str(k)


def StepMemoryTracker(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *inputs: Any):
    """A ``MemTracker`` over ``model`` (an mfsdp2 root after its first forward), ``optimizer`` and
    ``inputs`` that also follows the root's allocator: see the module docstring. Use as a context
    manager around whole steps, then :meth:`result`."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker

    _TOTAL = "Total"

    class _Tracker(MemTracker):
        def __init__(self) -> None:
            super().__init__()
            self._alloc = model.allocator
            self._skip = gathered_storages(model)
            self._bound: dict = {}  # device -> (bytes, snapshot, live by role, idle)
            self._peak_idle: dict = {}

        # -- gathered-weight aliases are counted through their blocks -----------------------
        def _aliased(self, t) -> bool:
            return any(st._cdata in self._skip for st in get_untyped_storages(t))

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
            return set() if self._aliased(t) else super()._update_and_maybe_create_winfos(t, reftype, update_existing)

        def _track(self, reftype, t):
            if not self._aliased(t):
                super()._track(reftype, t)

        # -- the bound: the same moments, the allocator's idle bytes not counted ------------
        def _update_peak_stats(self, peak_state) -> None:
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            idle = self._alloc.idle_bytes()
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) != before.get(dev, 0):
                    self._peak_idle[dev] = idle
                b = snap[_TOTAL] - idle
                if b > self._bound.get(dev, (0,))[0]:
                    self._bound[dev] = (b, dict(snap), dict(self._alloc.stats.live_bytes_by_role), idle)

        def __enter__(self):
            out = super().__enter__()
            # The state at entry is a moment of the step too (the tracker's own peak starts there).
            for dev, snap in self._curr_mem_snap.items():
                idle = self._alloc.idle_bytes()
                self._bound[dev] = (snap[_TOTAL] - idle, dict(snap), dict(self._alloc.stats.live_bytes_by_role), idle)
                self._peak_idle[dev] = idle
            return out

        def result(self) -> MemoryPeaks:
            snap = self.get_tracker_snapshot("peak")
            if not snap:
                return MemoryPeaks(0, 0)
            dev = max(snap, key=lambda d: snap[d].get(_TOTAL, 0))
            peak = {_label(k): int(v) for k, v in snap[dev].items() if v}
            b, bsnap, roles, idle = self._bound.get(dev, (0, {}, {}, 0))
            return MemoryPeaks(
                peak_bytes=int(peak.get(_TOTAL, 0)),
                bound_bytes=int(b),
                peak_breakdown=peak,
                bound_breakdown={_label(k): int(v) for k, v in bsnap.items() if v},
                bound_allocator_live_by_role={r: int(v) for r, v in roles.items() if v},
                bound_allocator_idle_bytes=int(idle),
                peak_allocator_idle_bytes=int(self._peak_idle.get(dev, 0)),
            )

    tracker = _Tracker()
    extern: list = [model]
    if optimizer is not None:
        extern.append(optimizer)
    extern += mfsdp2_held_tensors(model)
    extern += [t for t in inputs if isinstance(t, torch.Tensor)]
    tracker.track_external(*extern)
    return tracker
