"""Allocators for the runtime's transient flat buffers (gathered weights, unsharded gradients,
reduce-scatter outputs and receive scratch, main gradients).

Why the runtime has its own: torch FSDP2 allocates these buffers fresh on every use. On CPU a
buffer above glibc's mmap threshold (32 MiB after adaptation) is returned to the OS on free, so
each step pays mmap plus page faults for every one of them. Our buffers have a handful of sizes
that repeat every step, so caching those by size removes the churn.

Interface: ``allocate(key, numel, dtype, device) -> Tensor`` and ``free(key)``; the key names the
buffer's role (e.g. ``("grad", unit, group)``) so a trace-based allocator can recognise a step's
pattern; ``mark_step(tag)`` tells it where a step begins and ``release_idle(next_phase)`` where a
phase of it ends (the root's training forward; a backward). Statistics: live bytes, peak live
bytes and the number of underlying allocations; ``idle_bytes()``: what it holds that no live
buffer uses.

Three implementations, chosen with ``fully_shard(root, allocator=...)``:

* ``"dynamic"`` (:class:`DynamicAllocator`): fresh memory per request, what torch FSDP2 does;
* ``"caching"`` (:class:`CachingAllocator`, default): reuses freed blocks of the same size;
* ``"trace_pool"`` (:class:`~mfsdp2.memory.trace_pool.TracePoolAllocator`): records a step, plans offsets in
  one pool per (device, dtype, phase of the step) (:mod:`mfsdp2.memory.pool_plan`) and serves the next
  steps from it.

What is held when (the caching allocator; the trace pool's fallback is one). Memory the runtime
holds idle is memory the step's activations, loss and optimizer cannot use, so a block is held
only where that costs nothing or giving it back would cost more:

* a freed block goes back to torch at once -- where torch caches it for the next request, an
  activation's included (CUDA's caching allocator; malloc's heap on the CPU) -- except on the
  CPU a block of :data:`MAP_FRESH_BYTES` or more, which glibc would map afresh with a page fault
  per 4 KiB every time (~16 ms per 32 MiB on the benchmark VM). Those are cached only while the
  step will ask for them again: after each free the cache keeps as many blocks of that size as
  the rest of the phase (forward, backward) and the next phase's opening requests will take, as
  the last run of that phase went (:class:`_Demand`), and at a phase's end as many as the next
  phase asks for before it frees one (``hold_between_steps=False``: none at the end of backward).
* main gradients, and the all-reduce buckets whose slices are main gradients
  (:data:`EXACT_ROLES`), follow the same rule: released at the next forward, dead until the
  next backward writes them, they go back to torch then -- except those big CPU blocks, which
  the backward asks for again: handing them back re-faulted a no_shard model's whole gradient
  memory every step (8 units of 33.5 MiB: ~0.3 s of a 0.87 s step), and DDP keeps its buckets
  for good.

So on CUDA the allocated peak is the step's schedule bound (:mod:`mfsdp2.memory.memory_bound`): nothing
is held idle. On the CPU big blocks wait idle only across a phase's end for the next phase's first
requests (the loss; the optimizer step): the bound on every benchmark case but one
(``reshard_after_forward=False``, whose forward asks for every unit's weights before freeing any:
``hold_between_steps=False`` gives them back, for page faults each step).

On CUDA no event bookkeeping is needed for reuse, by mfsdp2 or by torch: the runtime frees a block
in program order on the current stream, after the collective that used it was waited (the current
stream waits on the side stream's event), and every side-stream collective first waits on the
current stream. So a block's next user is always ordered after its last one, with no
``record_stream``.
"""

from __future__ import annotations

import enum

import logging
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Hashable, Optional, Protocol

import torch

from ..base.compat import RESIZE_IN_PLACE_DEVICES, storage_use_count

__all__ = [
    "AllocationObserver",
    "AllocatorStats",
    "BucketAllocator",
    "DynamicAllocator",
    "CachingAllocator",
]

logger = logging.getLogger(__name__)


@dataclass
class AllocatorStats:
    live_bytes: int = 0
    peak_bytes: int = 0
    live_buffers: int = 0
    peak_buffers: int = 0
    underlying_allocations: int = 0
    # Per role (the first element of a tuple key, e.g. "weight", "grad"): live and peak counts.
    live_by_role: dict = field(default_factory=dict)
    peak_by_role: dict = field(default_factory=dict)
    # Per role: live bytes (what a memory breakdown at one moment needs).
    live_bytes_by_role: dict = field(default_factory=dict)
    # Buffers dropped without reuse because a collective using them may still run (see leak).
    leaked_buffers: int = 0
    leaked_bytes: int = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_buffers = self.live_buffers
        self.peak_by_role = dict(self.live_by_role)

    def _add(self, key: Hashable, nbytes: int, sign: int) -> None:
        # Runs twice per buffer (allocate, free), several buffers per unit per step: every field
        # is read and written once, through locals.
        role = key[0] if isinstance(key, tuple) and key else key
        live = self.live_bytes + sign * nbytes
        self.live_bytes = live
        count = self.live_buffers + sign
        self.live_buffers = count
        by_role = self.live_by_role
        n = by_role[role] = by_role.get(role, 0) + sign
        bytes_by_role = self.live_bytes_by_role
        bytes_by_role[role] = bytes_by_role.get(role, 0) + sign * nbytes
        if sign > 0:
            if live > self.peak_bytes:
                self.peak_bytes = live
            if count > self.peak_buffers:
                self.peak_buffers = count
            peak_by_role = self.peak_by_role
            p = peak_by_role.get(role, 0)
            peak_by_role[role] = n if n > p else p


# Roles whose buffers outlive the backward that wrote them -- the main gradients, and the all-reduce
# buckets whose slices are main gradients -- until the next forward: a block cached after that
# would sit idle through the whole forward, so they go back to torch when freed.
class BufferRole(str, enum.Enum):
    """What a transient buffer holds: the first element of its allocator key (``(role, unit,
    group)``), by which allocators and the trace pool treat buffers of one kind alike. A ``str``
    enum, so keys compare and hash as the role's name (traces, logs and statistics read it)."""

    WEIGHT = "weight"  # a unit's gathered weights (the zero-copy storage's bytes)
    FP8 = "fp8"  # float8 bytes of one gather, freed after the dequantise
    GRAD = "grad"  # a group's flat unsharded gradient: the reduction's input
    RS_OUT = "rs_out"  # the reduce-scatter's output, when it does not write the main gradient itself
    RS_RECV = "rs_recv"  # gloo's point-to-point reduce-scatter: the chunks received
    PARTIAL = "partial"  # HSDP: shard-group sums waiting for the next all-reduce across replicas
    MAIN_GRAD = "main_grad"  # the reduced gradient the optimizer reads, until the next forward's release
    GRAD_BUCKET = "grad_bucket"  # several small groups' gradients in one all-reduce
    GATHER_BUCKET = "gather_bucket"  # several persistent groups' rows in one all-gather

    def __str__(self) -> str:
        return self.value


EXACT_ROLES = frozenset({BufferRole.MAIN_GRAD, BufferRole.GRAD_BUCKET})

# glibc serves allocations of 32 MiB and more (its mmap threshold's ceiling on 64-bit) with a fresh
# mapping each time: taking such a block back from torch costs a page fault per 4 KiB.
MAP_FRESH_BYTES = 32 * 2**20


def role_of(key: Hashable) -> str:
    """A buffer key's role: its first element (``("grad", unit, group)`` -> ``"grad"``)."""
    return key[0] if isinstance(key, tuple) and key else key


class AllocationObserver(Protocol):
    """What a memory tool registered in :attr:`BucketAllocator.observers` is told.

    ``allocating(key)`` comes before the allocator obtains ``key``'s block: the tensors created
    until ``allocated(key, block)`` (``block`` None when obtaining failed) hold that buffer's bytes
    -- a fresh block, or a trace pool's memory. ``allocated`` also comes for a block served from
    the allocator's cache or pool, where no tensor is created."""

    def allocating(self, key: Hashable) -> None: ...

    def allocated(self, key: Hashable, block: Optional[torch.Tensor]) -> None: ...


class BucketAllocator:
    """Base class: bookkeeping of live buffers and statistics; subclasses decide where bytes come from."""

    def __init__(self) -> None:
        self.stats = AllocatorStats()
        self._live: dict[Hashable, torch.Tensor] = {}
        # Buffers counted in ``stats`` whose bytes come from elsewhere (see :meth:`account`): key -> bytes.
        self._accounted: dict[Hashable, int] = {}
        self._leaked: list[torch.Tensor] = []  # referenced for the process's life, never reused
        self._warned: set = set()
        # Memory tools told about every buffer served (see :meth:`allocate`): the tensors a
        # block's bytes are made by are created inside it, so only the allocator can say which
        # buffer they are for.
        self.observers: list[AllocationObserver] = []

    def _obtain(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} must implement _obtain")

    def _release(self, key: Hashable, tensor: torch.Tensor) -> None:
        pass

    def allocate(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if key in self._live:
            raise RuntimeError(f"mfsdp2 E20: allocator: buffer {key!r} is already live; "
                               "free it before allocating it again")
        if type(device) is not torch.device:
            device = torch.device(device)
        observers = self.observers
        if observers:
            for o in observers:
                o.allocating(key)
            t = None
            try:
                t = self._obtain(key, numel, dtype, device)
            finally:
                for o in observers:
                    o.allocated(key, t)
        else:  # the common case: no memory tool listening (a unit's gather runs this per step)
            t = self._obtain(key, numel, dtype, device)
        self._live[key] = t
        self.stats._add(key, t.nbytes, +1)
        return t

    def standalone(self, key: Hashable, block: torch.Tensor) -> bool:
        """Whether ``block``, served under ``key``, is a tensor of its own that :meth:`free` hands
        straight back to torch (nothing of it is cached or pooled here): what
        :meth:`free_in_place` needs. A subclass that keeps freed blocks another way is caught
        there anyway (``free`` did not drop its reference)."""
        return False

    def free_in_place(self, key: Hashable, block: torch.Tensor, holders: int) -> Optional[bool]:
        """Free ``key``'s ``block`` by emptying its storage in place (``resize_(0)``): the same bytes
        go back to torch at the same moment as :meth:`free` gives them, while every tensor over
        that storage stays valid for :meth:`refill` to take them back under.

        ``holders``: the tensors over the storage its owner keeps, ``block`` included (views,
        gradient DTensors' local tensors); torch must count exactly those
        (:func:`~mfsdp2.base.compat.storage_use_count`), or some other tensor -- a view or
        ``detach()`` somebody kept -- would read freed memory. Returns None where it may not
        (nothing changed: free it as usual): another block is live under ``key``, a memory tool
        observes this allocator, the device's storages are not resized in place
        (:data:`~mfsdp2.base.compat.RESIZE_IN_PLACE_DEVICES`), the block is not
        :meth:`standalone`, or the count differs. True: emptied. False: freed, but this allocator
        kept the block after all (a subclass's cache): the owner must let go of its tensors over it."""
        if (self._live.get(key) is not block or self.observers or block.device.type not in RESIZE_IN_PLACE_DEVICES
                or block.storage_offset() != 0 or not self.standalone(key, block)):
            return None
        storage = block.untyped_storage()
        if storage.nbytes() != block.nbytes or storage_use_count(storage) != holders + 1:  # + ``storage``
            return None
        before = sys.getrefcount(block)
        self.free(key)
        if sys.getrefcount(block) != before - 1:
            return False
        storage.resize_(0)
        return True

    def refill(self, key: Hashable, block: torch.Tensor) -> bool:
        """Take back a block :meth:`free_in_place` emptied: its storage refilled from torch, live again
        under ``key`` and counted as :meth:`allocate` makes a block. False (nothing changed) where
        it may not: ``key`` is live, a memory tool observes this allocator, the block is no longer
        :meth:`standalone`, or its storage is not empty (somebody resized it)."""
        if (key in self._live or key in self._accounted or self.observers or not self.standalone(key, block)
                or block.untyped_storage().nbytes() != 0):
            return False
        block.untyped_storage().resize_(block.nbytes)
        self._live[key] = block
        self.stats.underlying_allocations += 1
        self.stats._add(key, block.nbytes, +1)
        return True

    def account(self, key: Hashable, nbytes: int) -> None:
        """Count a live buffer that this allocator does not serve: gathered weights on a torch
        without storage swapping take their bytes from torch's own allocator (``storage.resize_``,
        see :mod:`mfsdp2.memory.buffer`), but they are the step's largest transient buffers, so
        ``stats`` (live and peak bytes, per role) and ``memory_stats()`` must still see them, as
        they do where this allocator serves them. :meth:`free` / :meth:`leak` end the record; a
        trace pool never plans them."""
        if key in self._live or key in self._accounted:
            raise RuntimeError(f"allocator: buffer {key!r} is already live; free it before allocating it again")
        self._accounted[key] = nbytes
        self.stats._add(key, nbytes, +1)

    def free(self, key: Hashable) -> None:
        if key in self._accounted:
            self.stats._add(key, self._accounted.pop(key), -1)
            return
        t = self._live.pop(key)
        self.stats._add(key, t.nbytes, -1)
        self._release(key, t)

    def leak(self, key: Hashable, why: str = "") -> None:
        """Drop ``key``'s record without giving its memory back: a collective that failed (timed
        out, lost a peer) may still write it from the backend's thread, and a block handed out
        again would be corrupted by that late write -- or, on a pool, corrupt its new owner.
        The tensor stays referenced (and a pool slot stays occupied) for the process's life;
        counted in ``stats.leaked_buffers`` / ``leaked_bytes``, one warning per key. For a buffer
        only accounted (:meth:`account`) the owner keeps the bytes; the record ends the same way."""
        if key in self._accounted:
            nbytes = self._accounted.pop(key)
        else:
            t = self._live.pop(key)
            nbytes = t.numel() * t.element_size()
            self._leaked.append(t)
            self._forget(key, t)
        self.stats._add(key, nbytes, -1)
        self.stats.leaked_buffers += 1
        self.stats.leaked_bytes += nbytes
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(
                "mfsdp2: buffer %r (%d bytes) is leaked, not reused: %s. Its collective may still write it; "
                "the memory is lost until the process exits (restart the job if this repeats)",
                key, nbytes, why or "a collective using it did not provably finish",
            )

    def _forget(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Subclasses: drop ``key`` from their own bookkeeping without making its memory reusable."""

    def keeps(self, device: torch.device, nbytes: int) -> bool:
        """Whether this allocator keeps a freed block of ``nbytes`` on ``device`` for reuse
        (rather than giving it back to torch at once)."""
        return False

    def release_idle(self, next_phase: str = "forward") -> None:
        """A phase of the step ended (the root's training forward: ``next_phase="backward"``; a
        backward: ``"forward"``): give back to torch the blocks no live buffer uses."""

    def mark_step(self, tag: Hashable = None) -> None:
        """A step (the root's forward and what follows it) begins; ``tag`` says what kind
        (the runtime passes whether grad is enabled and whether gradients sync)."""

    def is_live(self, key: Hashable) -> bool:
        return key in self._live or key in self._accounted

    def idle_bytes(self) -> int:
        """Bytes this allocator holds that no live buffer uses (cached free blocks, unused pool
        bytes): memory nothing else can use meanwhile. :mod:`mfsdp2.memory.memory_bound` subtracts it
        to get the schedule's own bound."""
        return 0

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds memory of this allocator (live blocks, free blocks, pools),
        for memory trackers that must count what it holds."""
        return list(self._live.values()) + list(self._leaked)

    def live_buffers(self) -> list[tuple[Hashable, torch.Tensor]]:
        """``(key, block)`` of every live buffer this allocator serves (not those it only
        counts, :meth:`account`): what a memory tracker files by role."""
        return list(self._live.items())


class DynamicAllocator(BucketAllocator):
    """Fresh memory for every request (what torch FSDP2 does); the baseline for benchmarks."""

    def _obtain(self, key, numel, dtype, device):
        self.stats.underlying_allocations += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def standalone(self, key: Hashable, block: torch.Tensor) -> bool:
        return True


class _Demand:
    """Per size class, the sequence of requests (+1) and frees (-1) each phase of a step made the
    last time it ran, and the running phase's so far: how many cached blocks the rest of the phase,
    and the next phase's opening requests, will take (:meth:`CachingAllocator._trim`)."""

    __slots__ = ("last", "cur", "diverged")

    def __init__(self) -> None:
        self.last: dict[tuple, dict[tuple, list[int]]] = {}  # (step tag, phase) -> class -> events
        self.cur: dict[tuple, list[int]] = defaultdict(list)
        self.diverged: set = set()  # classes whose events left the last run's this phase

    def note(self, key: tuple, cls: tuple, event: int) -> None:
        seq = self.last.get(key, {}).get(cls)
        cur = self.cur[cls]
        if seq is None or len(cur) >= len(seq) or seq[len(cur)] != event:
            self.diverged.add(cls)
        cur.append(event)

    def end(self, key: tuple) -> None:
        if self.cur:
            self.last[key] = dict(self.cur)
        self.cur = defaultdict(list)
        self.diverged = set()

    def opening(self, key: tuple, cls: tuple) -> int:
        """Requests the phase made before its first free (what it needs before it can reuse)."""
        n = 0
        for e in self.last.get(key, {}).get(cls, ()):
            if e < 0:
                break
            n += 1
        return n

    def needed(self, key: tuple, next_key: Optional[tuple], cls: tuple) -> Optional[int]:
        """Cached blocks of ``cls`` the rest of the running phase and the next phase's opening
        (``next_key``; None: none) will take -- the highest the live count climbs above today's;
        None: unknown (first run, or the phase left its last run), keep them all until it ends."""
        if cls in self.diverged or key not in self.last:
            return None
        rest = self.last[key].get(cls, [])[len(self.cur[cls]):]
        climb = peak = 0
        for e in rest:
            climb += e
            peak = max(peak, climb)
        return max(peak, climb + (self.opening(next_key, cls) if next_key is not None else 0))


class CachingAllocator(BucketAllocator):
    """Reuses freed buffers of the exact same (numel, dtype, device) where torch cannot cache them
    cheaply, only while the step will ask for them again (see the module docstring, "What is held
    when").

    Exact-size classes are enough: the runtime's buffers come in one size per unit and group.
    """

    def __init__(self, hold_between_steps: bool = True) -> None:
        """``hold_between_steps=False``: at the end of a backward give back every cached block,
        the next forward's opening ones too, so nothing at all is held through the optimizer step
        -- at the price of page-faulting them in again each step (CPU blocks of
        :data:`MAP_FRESH_BYTES` and more only; elsewhere nothing is cached anyway)."""
        super().__init__()
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._cached = 0  # bytes in _free
        self._tag: Hashable = None  # the step's kind (mark_step)
        self._phase = "forward"  # what runs now: "forward" (from mark_step) or "backward"
        self._demand = _Demand()
        self.hold_between_steps = hold_between_steps

    def keeps(self, device: torch.device, nbytes: int) -> bool:
        """Whether a freed block of this size stays cached for reuse (else it goes back to torch
        at once, where the next request -- an activation's too -- can take it): only where torch
        cannot hold it cheaply for us, blocks of :data:`MAP_FRESH_BYTES` and more on the CPU
        (torch's CPU allocator is malloc, which maps those afresh each time). On CUDA torch's
        caching allocator keeps every block; on the CPU malloc keeps the smaller ones."""
        return nbytes >= MAP_FRESH_BYTES and device.type == "cpu"  # the size first: most blocks are small

    def _key(self, phase: Optional[str] = None) -> tuple:
        return (self._tag, phase or self._phase)

    def _next_key(self) -> tuple:
        return self._key("backward" if self._phase == "forward" else "forward")

    def _obtain(self, key, numel, dtype, device):
        cls = (numel, dtype, device)
        # Demand is only ever consulted for classes whose freed blocks are kept (``_release``,
        # ``release_idle`` trim what ``_free`` holds): a class ``keeps`` refuses (every CUDA
        # block, small CPU ones) never reaches ``_free``, so its requests need no record.
        kept = self.keeps(device, numel * dtype.itemsize)
        if kept:
            self._demand.note(self._key(), cls, +1)
        bucket = self._free.get(cls) if kept else None
        if bucket:
            t = bucket.pop()
            self._cached -= t.numel() * t.element_size()
            return t
        self.stats.underlying_allocations += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def standalone(self, key: Hashable, block: torch.Tensor) -> bool:
        # What _release gives back at once; a block taken from the cache is a tensor of its own too.
        return not self.keeps(block.device, block.nbytes)

    def _release(self, key, tensor):
        nbytes = tensor.nbytes
        if not self.keeps(tensor.device, nbytes):
            return  # back to torch now
        cls = (tensor.numel(), tensor.dtype, tensor.device)
        self._demand.note(self._key(), cls, -1)
        self._free[cls].append(tensor)
        self._cached += nbytes
        into_next = self.hold_between_steps or self._phase != "backward"  # else: none kept past backward
        self._trim(cls, self._demand.needed(self._key(), self._next_key() if into_next else None, cls))

    def _trim(self, cls: tuple, keep: Optional[int]) -> None:
        """Give back the cached blocks of ``cls`` beyond ``keep`` (None: keep them all)."""
        bucket = self._free.get(cls)
        if keep is None or not bucket:
            return
        while len(bucket) > keep:
            t = bucket.pop()
            self._cached -= t.numel() * t.element_size()
        if not bucket:
            del self._free[cls]

    def cached_bytes(self) -> int:
        return self._cached

    def idle_bytes(self) -> int:
        return self._cached

    def held_tensors(self) -> list[torch.Tensor]:
        return super().held_tensors() + [t for b in self._free.values() for t in b]

    def mark_step(self, tag: Hashable = None) -> None:
        self._demand.end(self._key())
        self._tag, self._phase = tag, "forward"

    def release_idle(self, next_phase: str = "forward") -> None:
        """The running phase ended and ``next_phase`` (``"forward"`` / ``"backward"``) comes next:
        give back every idle block but, of each class, as many as ``next_phase`` asked for before
        it freed one when it last ran (those would be obtained again at once -- on the CPU, for
        a block glibc maps afresh, ~16 ms per 32 MiB of page faults on a KVM guest)."""
        self._demand.end(self._key())
        self._phase = next_phase
        hold = self.hold_between_steps or next_phase != "forward"
        for cls in list(self._free):
            self._trim(cls, self._demand.opening(self._key(), cls) if hold else 0)

    def release_cached(self) -> None:
        """Drop the free blocks (live ones are untouched), e.g. once a pool has replaced them."""
        self._free.clear()
        self._cached = 0
