"""What the runtime's allocator holds over a replayed step, decided by the allocator itself.

Why not a model of its rules: what the runtime's allocators keep is a policy with state -- freed
blocks (main gradients at the next forward) go back at once except, on the CPU, blocks glibc
would map afresh, which the caching allocator keeps only while its record of the last run of
each phase says the step will ask for them again; the trace pool plans one pool per phase from a
recorded step, re-plans after a divergence and gives each pool back at its phase's end
(``mfsdp2/allocator.py``, "What is held when"; ``mfsdp2/trace_pool.py``). A copy of those rules
here would drift from them. So the replay drives the runtime's own allocator classes with the
step's requests and phase marks, on the meta device: every decision is theirs, no byte is
allocated, and what they hold at a moment is their own count -- live blocks
(``stats.live_bytes``) plus what they hold idle (``idle_bytes()``), the same two numbers
:mod:`mfsdp2.memory.memory_bound` measures a real step with.

The one thing the meta device changes is where a block would live: the caching allocator asks
``keeps(device, nbytes)`` of the freed block's device, so the replay's allocator answers for the
device the step will train on (:class:`_ReplayCaching`).
"""

from __future__ import annotations

import torch

from ..memory.allocator import BucketAllocator, CachingAllocator, DynamicAllocator
from ..memory.trace_pool import TracePoolAllocator

__all__ = ["ALLOCATORS", "META", "replay_allocator", "held_bytes"]

META = torch.device("meta")
ALLOCATORS = ("caching", "trace_pool", "dynamic")


class _ReplayCaching(CachingAllocator):
    """The caching allocator, deciding for blocks on ``device_type`` while serving meta tensors."""

    def __init__(self, device_type: str, hold_between_steps: bool = True) -> None:
        super().__init__(hold_between_steps=hold_between_steps)
        self._target = torch.device(device_type)

    def keeps(self, device: torch.device, nbytes: int) -> bool:
        return super().keeps(self._target if device.type == "meta" else device, nbytes)


def replay_allocator(kind: str, device_type: str, hold_between_steps: bool = True) -> BucketAllocator:
    """The allocator ``fully_shard(root, allocator=kind)`` would make, serving meta tensors and
    deciding what it keeps for ``device_type`` (``"cpu"`` / ``"cuda"``)."""
    if kind == "caching":
        return _ReplayCaching(device_type, hold_between_steps)
    if kind == "trace_pool":
        return TracePoolAllocator(fallback=_ReplayCaching(device_type, hold_between_steps))
    if kind == "dynamic":
        return DynamicAllocator()
    raise ValueError(f"mfsdp2.estimate_memory: unknown allocator {kind!r}; use one of {list(ALLOCATORS)}")


def held_bytes(alloc: BucketAllocator) -> tuple[int, int]:
    """``(live, idle)``: bytes of live blocks, and bytes the allocator holds that no live block uses."""
    return alloc.stats.live_bytes, alloc.idle_bytes()
