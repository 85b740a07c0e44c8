"""Allocators for the runtime's transient flat buffers (gathered weights, unsharded gradients,
reduce-scatter outputs and receive scratch).

Why the runtime has its own: torch FSDP2 allocates these buffers fresh on every use. On CPU a
buffer above glibc's mmap threshold (32 MiB after adaptation) is returned to the OS on free, so
each step pays mmap plus page faults for every one of them; on GPU the churn fragments the caching
allocator. Our buffers have a handful of sizes that repeat every step, so caching them by size
removes the churn.

Interface: ``allocate(key, numel, dtype, device) -> Tensor`` and ``free(key)``; the key names the
buffer's role (e.g. ``("grad", unit, group)``) so a trace-based allocator can recognise a step's
pattern; ``mark_step(tag)`` tells it where a step begins. Statistics: live bytes, peak live bytes
and the number of underlying allocations.

Three implementations, chosen with ``fully_shard(root, allocator=...)``:

* ``"dynamic"`` (:class:`DynamicAllocator`): fresh memory per request, what torch FSDP2 does;
* ``"caching"`` (:class:`CachingAllocator`, default): reuses freed blocks of the same size;
* ``"trace_pool"`` (:class:`~mfsdp2.trace_pool.TracePoolAllocator`): records a step, plans offsets in one pool per
  (device, dtype) (:mod:`mfsdp2.pool_plan`) and serves the next steps from it.

On CUDA no event bookkeeping is needed for reuse: the runtime frees a block in program order on
the current stream, after the collective that used it was waited (the current stream waits on
the side stream's event), and every side-stream collective first waits on the current stream.
So a block's next user is always ordered after its last one, with no ``record_stream``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Hashable

import torch

__all__ = [
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
    # Buffers dropped without reuse because a collective using them may still run (see leak).
    leaked_buffers: int = 0
    leaked_bytes: int = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_buffers = self.live_buffers
        self.peak_by_role = dict(self.live_by_role)

    def _add(self, key: Hashable, nbytes: int, sign: int) -> None:
        role = key[0] if isinstance(key, tuple) and key else key
        self.live_bytes += sign * nbytes
        self.live_buffers += sign
        self.live_by_role[role] = self.live_by_role.get(role, 0) + sign
        if sign > 0:
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.peak_buffers = max(self.peak_buffers, self.live_buffers)
            self.peak_by_role[role] = max(self.peak_by_role.get(role, 0), self.live_by_role[role])


class BucketAllocator:
    """Base class: bookkeeping of live buffers and statistics; subclasses decide where bytes come from."""

    def __init__(self) -> None:
        self.stats = AllocatorStats()
        self._live: dict[Hashable, torch.Tensor] = {}
        # Buffers counted in ``stats`` whose bytes come from elsewhere (see :meth:`account`): key -> bytes.
        self._accounted: dict[Hashable, int] = {}
        self._leaked: list[torch.Tensor] = []  # referenced for the process's life, never reused
        self._warned: set = set()

    def _obtain(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} must implement _obtain")

    def _release(self, key: Hashable, tensor: torch.Tensor) -> None:
        pass

    def allocate(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if key in self._live:
            raise RuntimeError(f"allocator: buffer {key!r} is already live; free it before allocating it again")
        t = self._obtain(key, numel, dtype, torch.device(device))
        self._live[key] = t
        self.stats._add(key, t.numel() * t.element_size(), +1)
        return t

    def account(self, key: Hashable, nbytes: int) -> None:
        """Count a live buffer that this allocator does not serve: gathered weights on a torch
        without storage swapping take their bytes from torch's own allocator (``storage.resize_``,
        see :mod:`mfsdp2.buffer`), but they are the step's largest transient buffers, so
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
        self.stats._add(key, t.numel() * t.element_size(), -1)
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

    def mark_step(self, tag: Hashable = None) -> None:
        """A step (the root's forward and what follows it) begins; ``tag`` says what kind
        (the runtime passes whether grad is enabled and whether gradients sync)."""

    def is_live(self, key: Hashable) -> bool:
        return key in self._live or key in self._accounted


class DynamicAllocator(BucketAllocator):
    """Fresh memory for every request (what torch FSDP2 does); the baseline for benchmarks."""

    def _obtain(self, key, numel, dtype, device):
        self.stats.underlying_allocations += 1
        return torch.empty(numel, dtype=dtype, device=device)


class CachingAllocator(BucketAllocator):
    """Reuses freed buffers of the exact same (numel, dtype, device); never returns memory mid-run.

    Exact-size classes are enough: the runtime's buffers come in one size per unit and group.
    """

    def __init__(self) -> None:
        super().__init__()
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)

    def _obtain(self, key, numel, dtype, device):
        bucket = self._free[(numel, dtype, device)]
        if bucket:
            return bucket.pop()
        self.stats.underlying_allocations += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def _release(self, key, tensor):
        self._free[(tensor.numel(), tensor.dtype, tensor.device)].append(tensor)

    def cached_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self._free.values() for t in b)

    def release_cached(self) -> None:
        """Drop the free blocks (live ones are untouched), e.g. once a pool has replaced them."""
        self._free.clear()
