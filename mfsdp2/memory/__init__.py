"""Memory: where the bytes of a unit live and when they are freed.

Owns the flat-buffer layout (``layout``), the flat buffers (``buffer``), the allocators
(``allocator``) and the trace-then-plan pool with its planner (``trace_pool``, ``pool_plan``), the
step's memory bound (``memory_bound``), torch's FSDP2 memory tracker counting mfsdp2's buffers
(``fsdp_mem_tracker``) and host main memory under CPU offload (``offload``).
The parameter groups that fill these buffers are ``groups``'s: memory knows bytes and
lifetimes, not parameters.
"""

MAY_IMPORT: tuple[str, ...] = ("base", "comm", "dtensors")
