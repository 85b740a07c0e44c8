"""``torch.save(model.state_dict(), path)`` / ``torch.load(path)`` (``weights_only`` default) on an
mfsdp2 model, as FSDP2 users write rank-local checkpoints: every rank saves its DTensors, a fresh
model loads them and holds exactly the saved weights; optimizer state dicts too.

Before: saving failed ("Attempted to access the data pointer on an invalid python storage") for
every parameter but the first of each group, whose local tensor starts at a nonzero offset of
the flat shard. And ``copy.deepcopy`` of a sharded model is refused with FSDP2's error type and
what to do instead (before: an obscure storage error)."""

from __future__ import annotations

import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from mfsdp2 import RowShard

from .._dist import run_ranks
from ..models import F64, build, make_opt, sharded_train_step, shard_blocks

WS, GB = 2, 8


def _save_and_load(rank, ws, path):
    mesh = init_device_mesh("cpu", (ws,))
    model = shard_blocks(build("net", dtype=F64), mesh)
    opt = make_opt("adamw", model.parameters())
    sharded_train_step(model, opt, 0, rank, ws, GB)
    f = os.path.join(path, f"rank{rank}.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
    want = {k: p.full_tensor() for k, p in model.named_parameters()}
    want_loss = sharded_train_step(model, opt, 1, rank, ws, GB)

    loaded = torch.load(f)  # weights_only=True: DTensor, RowShard, DeviceMesh are allowed
    placements_ok = all(
        isinstance(v, DTensor) and isinstance(v.placements[0], RowShard) for v in loaded["model"].values()
    )
    fresh = shard_blocks(build("net", seed=1, dtype=F64), mesh)
    fresh_opt = make_opt("adamw", fresh.parameters())
    fresh.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optim"])
    got = {k: p.full_tensor() for k, p in fresh.named_parameters()}
    got_loss = sharded_train_step(fresh, fresh_opt, 1, rank, ws, GB)
    return placements_ok, want, got, want_loss, got_loss


def test_torch_save_and_load_of_a_sharded_state_dict(tmp_path):
    for placements_ok, want, got, want_loss, got_loss in run_ranks(_save_and_load, WS, str(tmp_path)):
        assert placements_ok
        for k, w in want.items():
            assert torch.equal(got[k], w), k
        assert got_loss == want_loss  # same weights, same optimizer state: the same next step


def _deepcopy(rank, ws):
    import copy

    model = shard_blocks(build("net", dtype=F64), init_device_mesh("cpu", (ws,)))
    try:
        copy.deepcopy(model)
    except AssertionError as e:  # FSDP2's error type
        return str(e)
    return None


def test_deepcopy_of_a_sharded_model_is_refused_like_fsdp2():
    for msg in run_ranks(_deepcopy, WS):
        assert msg is not None and "load_state_dict" in msg, msg
