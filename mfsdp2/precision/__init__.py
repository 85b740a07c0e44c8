"""Precision: the dtypes parameters are gathered, computed and reduced in.

Owns the mixed-precision policy (``mixed_precision``), float8 gathers with per-parameter scales
and their tiled dequantise (``fp8``, ``fp8_tiles``), Transformer Engine's main-gradient protocol
(``te``) and the loader of the optional native kernels (``native``). ``fp8`` and ``te`` take
the parameter group they serve untyped: groups sit above this folder.
"""

MAY_IMPORT: tuple[str, ...] = ("base", "comm", "dtensors", "memory")
