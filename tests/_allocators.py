"""Allocators the tests build models with, beyond mfsdp2's own."""

from __future__ import annotations

from mfsdp2.memory.allocator import CachingAllocator


class KeepEverything(CachingAllocator):
    """The caching allocator keeping every freed block for good, main gradients and buckets too,
    and handing them out again by size: a subclass that caches what ``CachingAllocator`` gives
    back to torch (a block mfsdp2 emptied in place must never get into such a cache)."""

    def keeps(self, device, nbytes):
        return True

    def _release(self, key, tensor):
        self._free[(tensor.numel(), tensor.dtype, tensor.device)].append(tensor)
        self._cached += tensor.numel() * tensor.element_size()

    def release_idle(self, next_phase="forward"):
        pass
