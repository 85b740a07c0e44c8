"""Communication: every collective mfsdp2 issues, and how.

Owns the communicator (``communicator``: the one place that issues collectives, with its
streams, async handles, timeouts and checks), the backend of each device type (``devices``),
the custom collectives of ``set_custom_all_gather`` / ``set_custom_reduce_scatter``
(``custom``), the gradient reduction of a parameter group and its shared buckets
(``grad_reduction``, ``grad_buckets``), the main gradient the reductions accumulate into and its
exposure as ``.grad`` (``main_grad``) and the bucketed gathers of persistent weights
(``gather_buckets``).

Imports: ``communicator``, ``devices`` and ``custom`` import only ``integrations.compat`` (and
each other), so every folder may use them. The reduction, the main gradient and the buckets sit above ``memory``
(allocators, offload, weight watch) and use ``dtensors.shard_dim``, ``precision.te``,
``integrations.tensor_parallel`` and ``runtime.profiling``; never ``frontend`` or the rest of
``runtime``. This package re-exports nothing: import from its modules.
"""
