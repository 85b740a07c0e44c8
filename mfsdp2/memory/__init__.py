"""Parameters and memory: where every byte of a unit lives and when it is freed.

Owns the flat-buffer layout (``layout``), the flat buffers (``buffer``), the parameter groups
that hold a unit's shards, gathered weights and gradients (``param_group``, with its parameters
as the modules and the optimizer see them in ``param_registration`` and the staleness of its
gathered weights in ``weight_changes``), the allocators
(``allocator``) and the trace-then-plan pool with its planner (``trace_pool``, ``pool_plan``), the
step's memory bound (``memory_bound``), the change detection of persistent weights
(``weight_watch``), the gradient views (``grad_views``) and host main memory under CPU offload
(``offload``).

Imports: ``comm`` (the communicator; ``param_group`` mixes in ``comm.grad_reduction``),
``dtensors``, ``precision`` and ``integrations.compat`` / ``integrations.tensor_parallel``;
from ``frontend`` only the leaf ``strategy``. Never ``runtime`` or the rest of ``frontend``:
the lifecycle drives memory, not the other way round.
"""
