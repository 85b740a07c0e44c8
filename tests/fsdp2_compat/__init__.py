"""Tests of FSDP2's behaviours, each against torch FSDP2 run in the same process (or against the
unsharded model where FSDP2's result is that model's)."""

from __future__ import annotations

from ..models import F64, build, shard_blocks


def sharded_pair(mesh, kind: str = "net", dtype=F64, **kwargs) -> dict:
    """``{"fsdp2": model, "mfsdp2": model}``: the same ``build(kind)`` sharded per block and at the
    root by each runtime's ``fully_shard`` (``kwargs`` passed to every call)."""
    from torch.distributed.fsdp import fully_shard as torch_shard

    from mfsdp2 import fully_shard as mfsdp2_shard

    return {
        name: shard_blocks(build(kind, dtype=dtype), mesh, shard, **kwargs)
        for name, shard in (("fsdp2", torch_shard), ("mfsdp2", mfsdp2_shard))
    }
