"""Tests of FSDP2's behaviours, each against torch FSDP2 run in the same process (or against the
unsharded model where FSDP2's result is that model's)."""

from __future__ import annotations

import torch

from ..models import F64, assert_close_rel, build, shard_blocks


def sharded_pair(mesh, kind: str = "net", dtype=F64, **kwargs) -> dict:
    """``{"fsdp2": model, "mfsdp2": model}``: the same ``build(kind)`` sharded per block and at the
    root by each runtime's ``fully_shard`` (``kwargs`` passed to every call)."""
    from torch.distributed.fsdp import fully_shard as torch_shard

    from mfsdp2 import fully_shard as mfsdp2_shard

    return {
        name: shard_blocks(build(kind, dtype=dtype), mesh, shard, **kwargs)
        for name, shard in (("fsdp2", torch_shard), ("mfsdp2", mfsdp2_shard))
    }


def runtimes() -> dict:
    """``{"fsdp2": fully_shard, "mfsdp2": fully_shard}``, in that order (FSDP2 first)."""
    from torch.distributed.fsdp import fully_shard as torch_shard

    from mfsdp2 import fully_shard as mfsdp2_shard

    return {"fsdp2": torch_shard, "mfsdp2": mfsdp2_shard}


def full(t):
    """A detached full copy of a parameter or gradient (DTensor of either runtime, or a plain
    tensor); ``None`` stays ``None``."""
    if t is None:
        return None
    if hasattr(t, "full_tensor"):
        return t.full_tensor().detach().clone()
    return t.detach().clone()


def snapshot(model) -> dict:
    """``{name: (full parameter, full gradient or None)}`` of every parameter."""
    return {k: (full(p), full(p.grad)) for k, p in model.named_parameters()}


def assert_same_snapshots(ours: dict, theirs: dict, where: str, rel: float) -> None:
    """Same names, the same gradients present (``None`` on both sides or neither), every full
    parameter and gradient within ``rel`` (relative, :func:`tests.models.assert_close_rel`)."""
    assert list(ours) == list(theirs), (where, list(ours), list(theirs))
    for k, (p, g) in theirs.items():
        po, go = ours[k]
        assert_close_rel(po, p, f"{where} param {k}", rel)
        assert (go is None) == (g is None), (f"{where} grad {k}: mfsdp2 {'None' if go is None else 'set'}, "
                                             f"FSDP2 {'None' if g is None else 'set'}")
        if g is not None:
            assert_close_rel(go, g, f"{where} grad {k}", rel)


def mean_loss(loss: torch.Tensor) -> float:
    """The mean of a per-rank loss over the ranks (a scalar every rank agrees on)."""
    t = loss.detach().clone()
    torch.distributed.all_reduce(t)
    return t.item() / torch.distributed.get_world_size()
