"""Tensor placement: how a unit's shards look to torch, as DTensors.

Owns the ``RowShard`` placement and the wrapping of local rows (``placement``), the DTensor op
handlers (``dtensor_ops``), the propagation of ``RowShard`` through DTensor ops
(``row_propagation``), the rows a split means and the moves between splits (``row_splits``:
``distribute_tensor``, ``redistribute``), row views (``row_views``) and sharding on a dim other than 0
(``shard_dim``).

Imports: ``comm.devices`` and ``integrations.compat`` only; every other folder may import this
one.
"""
