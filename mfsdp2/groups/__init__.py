"""Parameter groups: one unit's parameters of one dtype policy, sharded in flat buffers.

Owns the ``ParameterGroup`` (``param_group``), its parameters as modules and optimizers see them
(``param_registration``, ``grad_views``), the staleness of persistent gathered weights
(``weight_changes``, ``weight_watch``), the gradient reduction of a group and the main gradient
it accumulates into (``grad_reduction``, ``main_grad``) and the buckets that several groups
share (``grad_buckets``, ``gather_buckets``). The lifecycle that drives groups is ``runtime``'s.
"""

MAY_IMPORT: tuple[str, ...] = ("base", "comm", "dtensors", "memory", "precision")
