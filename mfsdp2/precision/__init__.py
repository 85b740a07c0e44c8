"""Precision: the dtypes parameters are gathered, computed and reduced in.

Owns the mixed-precision policy (``mixed_precision``), float8 gathers with per-parameter scales
and their tiled dequantise (``fp8``, ``fp8_tiles``), Transformer Engine's main-gradient protocol
(``te``) and the loader of the optional native kernels (``native``).

Imports: ``mixed_precision``, ``fp8_tiles`` and ``native`` import nothing outside this folder; ``fp8``
uses ``comm.communicator`` and ``memory.buffer`` (``te`` names ``memory.allocator`` in type hints only). Never
``runtime`` or ``frontend``.
"""
