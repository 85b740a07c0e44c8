"""mfsdp2: per-module sharding for PyTorch with FSDP2's API (``fully_shard``).

See ``docs/design.md`` for the lifecycle, buffer layout, streams and allocator.
"""

from .allocator import BucketAllocator, CachingAllocator, DynamicAllocator
from .clip_grad import clip_grad_norm_
from .comm import CollectiveError, comm_stats, set_collective_checks, set_collective_timeout
from .diagnostics import check_buffers, check_finite_grads, describe, grad_norms, weight_norms
from .estimate import MemoryEstimate, estimate_memory
from .layout import BufferLayout, plan_layout
from .meta_init import materialize
from .mixed_precision import MixedPrecisionPolicy
from .module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from .fully_shard import fully_shard
from . import module as _module

_module.fully_shard = fully_shard  # ``mfsdp2.module.fully_shard`` (where it used to live) keeps working
from .placement import RowShard
from .trace_pool import TracePoolAllocator
from . import optim  # mfsdp2.optim.AdamW

__all__ = [
    "fully_shard",
    "materialize",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "MixedPrecisionPolicy",
    "RowShard",
    "BufferLayout",
    "plan_layout",
    "BucketAllocator",
    "CachingAllocator",
    "DynamicAllocator",
    "TracePoolAllocator",
    "comm_stats",
    "CollectiveError",
    "set_collective_timeout",
    "set_collective_checks",
    "describe",
    "check_buffers",
    "grad_norms",
    "weight_norms",
    "check_finite_grads",
    "clip_grad_norm_",
    "estimate_memory",
    "MemoryEstimate",
]
