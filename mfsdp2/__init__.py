"""mfsdp2: per-module sharding for PyTorch with FSDP2's API (``fully_shard``).

See ``docs/design.md`` for the lifecycle, buffer layout, streams and allocator. The folders
follow its parts (each ``__init__`` says what it owns and what it may import):

* ``frontend`` -- ``fully_shard``, the ``FSDPModule`` mixin and FSDP2's API surface;
* ``runtime`` -- the step lifecycle: hooks, schedule, per-step state, step guard;
* ``memory`` -- buffer layout, flat buffers, parameter groups, allocators, offload;
* ``comm`` -- the communicator, backends, custom collectives, gradient reduction, buckets;
* ``dtensors`` -- the ``RowShard`` placement, DTensor op handlers, row propagation;
* ``precision`` -- mixed precision, float8, Transformer Engine, native kernels;
* ``checkpoint`` -- state dicts and checkpoints; ``optim`` -- the flat AdamW;
* ``integrations`` -- pipelining, tensor parallel, gradient clipping, torch-version bridges;
* ``estimate`` -- the memory estimate before launch; ``examples`` -- runnable examples.
"""

from .memory.allocator import BucketAllocator, CachingAllocator, DynamicAllocator
from .integrations.clip_grad import clip_grad_norm_
from .comm.communicator import CollectiveError, comm_stats, set_collective_checks, set_collective_timeout
from .runtime.diagnostics import check_buffers, check_finite_grads, describe, grad_norms, weight_norms
from .estimate import MemoryEstimate, estimate_memory
from .memory.layout import BufferLayout, plan_layout
from .frontend.meta_init import materialize
from .precision.mixed_precision import MixedPrecisionPolicy
from .frontend.module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from .frontend.fully_shard import fully_shard
from .frontend import module as _module

_module.fully_shard = fully_shard  # ``mfsdp2.frontend.module.fully_shard`` (where it used to live) keeps working
from .dtensors.placement import RowShard
from .memory.trace_pool import TracePoolAllocator
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
