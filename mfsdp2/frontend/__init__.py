"""The public entry points and the module mixin: what a user calls and what a sharded module is.

Owns ``fully_shard`` (argument checks, conversion of a module into a unit), the
:class:`~mfsdp2.frontend.module.FSDPModule` mixin and FSDP2's API surface on it
(``fsdp2_state``: FSDP2's private state names; ``torch_identity``: units as torch
``FSDPModule`` instances, no torch FSDP2 method run on them), the conversion of parameters into row-sharded
DTensors and their later replacement (``conversion``, ``param_adoption``), meta-device
initialisation (``meta_init``), parameters shared between units (``shared_params``), the sharding
strategies (``strategy``) and the walk over nested inputs and outputs (``structures``).

Imports: this is the top of the package; it may import every other folder. Modules of other
folders import only its leaf modules, which import nothing of mfsdp2 (``strategy``,
``structures``, ``torch_identity``), and, where the lifecycle must reach back into the entry points, ``fsdp2_state``,
``param_adoption`` and ``shared_params`` (from ``runtime``) and ``module`` (from
``integrations.pipelining``). Nothing imports ``fully_shard`` but the package root.
"""
