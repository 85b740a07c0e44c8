"""``torch.save(model.state_dict(), path)`` / ``torch.load(path)`` (``weights_only`` default) on an
mfsdp2 model, as FSDP2 users write rank-local checkpoints: every rank saves its DTensors, a fresh
model loads them and holds exactly the saved weights; optimizer state dicts too. A list of the
parameters themselves saves and loads as on FSDP2 (parameters again, the same values).

What can go wrong: a parameter's local tensor starts at a nonzero offset of the flat shard (all
but the first of a group), and its DTensor wrapper takes that offset, so torch's pickler would
take the wrapper for a plain tensor ("Attempted to access the data pointer on an invalid python
storage"); and a parameter carries a weak reference of ours, which cannot be pickled
(mfsdp2/checkpoint/serialization.py). ``copy.deepcopy`` of a sharded model is refused with
FSDP2's error type and what to do instead."""

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


def _save_parameters(rank, ws, path):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, shard in (("mfsdp2", None), ("fsdp2", torch_fully_shard)):
        model = shard_blocks(build("net", dtype=F64), mesh, fully_shard=shard)
        opt = make_opt("adamw", model.parameters())
        sharded_train_step(model, opt, 0, rank, ws, GB)
        f = os.path.join(path, f"{name}_params_rank{rank}.pt")
        torch.save(list(model.parameters()), f)
        loaded = torch.load(f)
        out[name] = [(isinstance(q, torch.nn.Parameter) and isinstance(q, DTensor),
                      torch.equal(q.full_tensor(), p.full_tensor()))
                     for q, p in zip(loaded, model.parameters(), strict=True)]
    return out


def test_torch_save_of_the_parameters_loads_them_as_on_fsdp2(tmp_path):
    for res in run_ranks(_save_parameters, WS, str(tmp_path)):
        assert res["fsdp2"] and res["mfsdp2"] == res["fsdp2"], res
        assert all(a and b for a, b in res["mfsdp2"]), res["mfsdp2"]


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
