"""mfsdp2: per-module sharding for PyTorch with FSDP2's API (``fully_shard``).

See ``docs/design.md`` for the lifecycle, buffer layout, streams and allocator. The folders are
layers, listed bottom up; a folder imports only folders below it (each ``__init__`` names them
in ``MAY_IMPORT``; ``tests/project/test_layers.py`` reads every import and checks):

* ``base`` -- torch-version bridges, profiler ranges, strategy values, input/output walks;
* ``comm`` -- the communicator, backends, custom collectives;
* ``dtensors`` -- the ``RowShard`` placement, DTensor op handlers, row propagation, TP placements;
* ``memory`` -- buffer layout, flat buffers, allocators, offload;
* ``precision`` -- mixed precision, float8, Transformer Engine, native kernels;
* ``groups`` -- parameter groups, their gradient reduction and shared buckets;
* ``runtime`` -- the step lifecycle: hooks, schedule, per-step state, step guard;
* ``checkpoint`` -- state dicts and checkpoints;
* ``frontend`` -- ``fully_shard``, the ``FSDPModule`` mixin and FSDP2's API surface;
* ``integrations`` -- pipelining, gradient clipping; ``optim`` -- the flat AdamW;
* ``models`` -- plain model definitions; ``estimate`` -- the memory estimate before launch;
* this package's root (the public names), then ``examples`` -- runnable scripts.
"""

import importlib as _importlib
import sys as _sys

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
from .memory.fsdp_mem_tracker import FSDPMemTracker
from . import optim as optim  # mfsdp2.optim.AdamW

MAY_IMPORT: tuple[str, ...] = ("base", "comm", "dtensors", "memory", "precision", "groups", "runtime", "checkpoint",
                               "frontend", "integrations", "optim", "models", "estimate")

# Module paths of earlier releases, kept importable for one release: code that imports a module
# directly, and files written by ``torch.save`` that pickled an object by its module's name
# (a ``RowShard`` placement; DCP's write-nothing function stays at its own old path).
_MOVED = {
    "mfsdp2.placement": "mfsdp2.dtensors.placement",
    "mfsdp2.integrations.compat": "mfsdp2.base.compat",
    "mfsdp2.runtime.profiling": "mfsdp2.base.profiling",
    "mfsdp2.frontend.strategy": "mfsdp2.base.strategy",
    "mfsdp2.frontend.structures": "mfsdp2.base.structures",
    "mfsdp2.frontend.fsdp2_state": "mfsdp2.runtime.fsdp2_state",
    "mfsdp2.frontend.shared_params": "mfsdp2.runtime.shared_params",
    "mfsdp2.frontend.param_adoption": "mfsdp2.runtime.param_adoption",
    "mfsdp2.integrations.tensor_parallel": "mfsdp2.dtensors.tensor_parallel",
    "mfsdp2.memory.param_group": "mfsdp2.groups.param_group",
    "mfsdp2.memory.param_registration": "mfsdp2.groups.param_registration",
    "mfsdp2.memory.weight_changes": "mfsdp2.groups.weight_changes",
    "mfsdp2.memory.weight_watch": "mfsdp2.groups.weight_watch",
    "mfsdp2.memory.grad_views": "mfsdp2.groups.grad_views",
    "mfsdp2.comm.grad_reduction": "mfsdp2.groups.grad_reduction",
    "mfsdp2.comm.grad_buckets": "mfsdp2.groups.grad_buckets",
    "mfsdp2.comm.gather_buckets": "mfsdp2.groups.gather_buckets",
    "mfsdp2.comm.main_grad": "mfsdp2.groups.main_grad",
    "mfsdp2.examples.llama": "mfsdp2.models.llama",
}
for _old, _new in _MOVED.items():
    _sys.modules.setdefault(_old, _importlib.import_module(_new))
del _old, _new

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
    "FSDPMemTracker",
]
