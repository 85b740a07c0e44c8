"""Older torch (``mfsdp2/base/compat.py``): training parity without ``_swap_data_ptr_`` and without
``dist.all_gather_single`` / ``reduce_scatter_single``, simulated on the installed torch.

Inside each spawned rank the two collectives are deleted from ``torch.distributed``, the storage
swap is switched off the way a user would (``MFSDP2_NO_STORAGE_SWAP=1``, then ``compat`` is
re-read) and ``UntypedStorage._swap_data_ptr_`` is made to raise, so any use of the newer APIs
fails the test. The gloo point-to-point reduce-scatter is turned off so gradients go through
``compat.reduce_scatter_single`` too; every call of the older collectives is counted.
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist

from .._dist import run_ranks
from ..models import (
    F64, REL_F64, assert_close_rel, assert_losses_close, build, make_opt, reference_run, sharded_train_step,
)

STEPS = 6
GLOBAL_BATCH = 8


def _as_older_torch() -> dict:
    """Make this process look like torch < 2.13 to mfsdp2; returns the fallback call counters."""
    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):
            delattr(dist, name)

    def no_swap(*args, **kwargs):
        raise AssertionError("UntypedStorage._swap_data_ptr_ called with the storage swap off")

    torch.UntypedStorage._swap_data_ptr_ = no_swap
    os.environ["MFSDP2_NO_STORAGE_SWAP"] = "1"
    os.environ["MFSDP2_GLOO_P2P_REDUCE_SCATTER"] = "0"
    import mfsdp2.base.compat

    importlib.reload(mfsdp2.base.compat)  # re-reads the environment, in place (buffer.py holds the module)
    assert not mfsdp2.base.compat.HAS_STORAGE_SWAP
    assert mfsdp2.base.compat.all_gather_name() == "all_gather_into_tensor"
    assert mfsdp2.base.compat.reduce_scatter_name() == "reduce_scatter_tensor"

    calls = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0, "served": set()}
    from mfsdp2.memory.allocator import BucketAllocator

    allocate = BucketAllocator.allocate

    def spy_allocate(self, key, *args, **kwargs):
        calls["served"].add(key[0] if isinstance(key, tuple) else key)
        return allocate(self, key, *args, **kwargs)

    BucketAllocator.allocate = spy_allocate
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        orig = getattr(dist, name)

        def spy(*args, _orig=orig, _name=name, **kwargs):
            calls[_name] += 1
            return _orig(*args, **kwargs)

        setattr(dist, name, spy)
    return calls


def _train(rank, ws):
    calls = _as_older_torch()
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp2 import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=F64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_opt("adamw", model.parameters())
    losses = [sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH) for step in range(STEPS)]
    roles = sorted(str(r) for r in model.allocator.stats.peak_by_role)
    full = {k: p.full_tensor() for k, p in model.named_parameters()}  # RowShard gathers via compat
    return losses, full, calls, roles


def test_training_parity_without_storage_swap_and_single_collectives():
    ref_losses, ref_params = reference_run("net", "adamw", STEPS, GLOBAL_BATCH, dtype=F64)
    units = 4  # 3 blocks + root
    for rank, (losses, full, calls, roles) in enumerate(run_ranks(_train, 2)):
        assert_losses_close(losses, ref_losses, f"rank {rank}", REL_F64)  # float64: see tests/models.py
        assert set(full) == set(ref_params)
        for name, ref in ref_params.items():
            assert_close_rel(full[name], ref, f"rank {rank} {name}", REL_F64)
        # every step gathers the blocks for forward and backward (the root once) and
        # reduce-scatters every unit's gradients
        assert calls["all_gather_into_tensor"] >= (2 * (units - 1) + 1) * STEPS, (rank, calls)
        assert calls["reduce_scatter_tensor"] >= units * STEPS, (rank, calls)
        # gathered weights came from resize_, not from the runtime's allocator, which counts them
        assert "weight" not in calls["served"] and "grad" in calls["served"], calls
        assert "weight" in roles and "grad" in roles, roles
    assert ref_losses[-1] < ref_losses[0], "the reference did not train: the comparison proves nothing"
