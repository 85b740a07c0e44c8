"""Other torch features mfsdp2 plugs into: pipelining and gradient clipping.

Owns ``clip_grad`` (``clip_grad_norm_`` over the flat gradients) and ``pipelining`` (a
``PipelineStage`` that drives mfsdp2 units). The torch-version bridge and the tensor-parallel
placements they once held are in ``base`` and ``dtensors``.
"""

MAY_IMPORT: tuple[str, ...] = ("base", "comm", "dtensors", "memory", "precision", "groups", "runtime", "checkpoint",
                               "frontend")
