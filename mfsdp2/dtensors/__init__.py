"""Tensor placement: how a unit's shards look to torch, as DTensors.

Owns the ``RowShard`` placement, the wrapping of local rows and DCP's write-nothing mark of
empty pieces (``placement``), the DTensor op handlers (``dtensor_ops``), the propagation of
``RowShard`` through DTensor ops (``row_propagation``), the rows a split means and the moves
between splits (``row_splits``: ``distribute_tensor``, ``redistribute``), row views
(``row_views``), sharding on a dim other than 0 (``shard_dim``) and a tensor-parallel parameter's
placements under ``fully_shard`` (``tensor_parallel``).
"""

MAY_IMPORT: tuple[str, ...] = ("base", "comm")
