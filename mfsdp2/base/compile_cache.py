"""Keep ``torch.compile``'s on-disk caches from handing a rank a graph compiled for other shards.

torch's AOTAutograd cache keys a compiled graph by its inputs' metadata, and for a DTensor input
that is the DTensor's own (global) shape, dtype and placements: neither the local tensor's shape
nor its type (a torchao low-bit optimizer state, a quantised weight) is in the key. Ranks of one
machine share the cache directory by default (``/tmp/torchinductor_<user>``), so a rank whose row
shard of a parameter has 1 row loads the graph another rank compiled for its 127 rows
(``AssertionError: expected size 1==127``), and a run of torchao's 4-bit AdamW loads the 8-bit
AdamW's graph of an earlier run (``'OptimState4bit' object has no attribute 'qmap'``), on one
rank as on many. FSDP2 meets the first only where a dim does not split evenly; mfsdp2's
row-aligned shards meet it on most parameters.

Inductor's FX-graph cache, one level down, keys the graph after subclasses were unwrapped, by
the local tensors themselves (shapes, strides, dtypes): it cannot mix them up. So mfsdp2 turns
the AOTAutograd cache off (``torch._functorch.config.enable_autograd_cache = False``) the first
time ``fully_shard`` runs over more than one rank, and logs it once: the warm cache still skips
inductor's code generation and compilation (the expensive part); only the AOTAutograd tracing
runs again. A user who set ``TORCHINDUCTOR_AUTOGRAD_CACHE`` keeps their choice, and
``MFSDP2_KEEP_AUTOGRAD_CACHE=1`` keeps torch's default.
"""

from __future__ import annotations

import logging
import os

__all__ = ["protect_compile_caches"]

logger = logging.getLogger(__name__)

_done = False


def protect_compile_caches(world_size: int) -> bool:
    """Turn off torch's AOTAutograd cache for this process (see the module docstring); True when
    this call turned it off."""
    global _done
    if _done or world_size <= 1:
        return False
    _done = True
    if "TORCHINDUCTOR_AUTOGRAD_CACHE" in os.environ or os.environ.get("MFSDP2_KEEP_AUTOGRAD_CACHE") == "1":
        return False
    import torch._functorch.config as functorch_config

    if not functorch_config.enable_autograd_cache:
        return False
    functorch_config.enable_autograd_cache = False
    logger.info(
        "mfsdp2: torch.compile's AOTAutograd cache is off in this process: its keys leave out a DTensor's "
        "local shape and type, so ranks sharing an inductor cache would load each other's graphs for "
        "differently sized shards; inductor's FX-graph cache (keyed by the local tensors) stays on. "
        "MFSDP2_KEEP_AUTOGRAD_CACHE=1 keeps it"
    )
    return True
