"""The public entry points and the module mixin: what a user calls and what a sharded module is.

Owns ``fully_shard`` (argument checks, conversion of a module into a unit), the
:class:`~mfsdp2.frontend.module.FSDPModule` mixin and FSDP2's API surface on it
(``torch_identity``: units as torch ``FSDPModule`` instances, no torch FSDP2 method run on them),
the conversions after ``fully_shard`` (``conversion``) and meta-device initialisation
(``meta_init``). Nothing imports ``fully_shard`` but the package root and the folders above.
"""

MAY_IMPORT: tuple[str, ...] = ("base", "comm", "dtensors", "memory", "precision", "groups", "runtime", "checkpoint")
