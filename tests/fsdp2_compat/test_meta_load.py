"""A model built on the meta device and initialised by *loading* (no ``to_empty``, no
``materialize``): the values land in the meta shards, as FSDP2 does with ``assign=True``.

* torch DSD's ``set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True,
  broadcast_from_rank0=True))`` with the full state dict on rank 0 only (``{}`` elsewhere) -- the
  path of models too large to build on every rank, and of Hugging Face Accelerate's
  ``cpu_ram_efficient_loading`` -- and with the full dict on every rank (``full_state_dict=True``
  alone); both end in ``load_state_dict(sd, assign=True)`` of pieces DSD cut from the meta
  parameters' placements;
* Accelerate's own loop (``fsdp2_load_full_state_dict``): ``distribute_tensor`` of each broadcast
  full tensor with the meta parameter's placements, cast and made contiguous, then
  ``load_state_dict(sharded_sd, assign=True)``;
* plain ``load_state_dict(sharded_sd, assign=True)`` of another sharded model's ``state_dict()``
  (DTensors): torch FSDP2's (``torch.chunk`` rows) and mfsdp2's (row-aligned rows of another unit
  structure, so other rows than the target's);
* the same through mfsdp2's own ``mfsdp2.checkpoint.state_dict.set_model_state_dict`` (broadcast from rank 0).

Each for ZeRO-3 and ZeRO-2 (and ``no_shard`` for the DSD path, whose entries are ``Replicate``):
the optimizer is created after the load (as FSDP2 needs: its load replaces the parameter objects)
and three AdamW steps give the losses and weights of torch FSDP2 loaded the same way in the same
process, and of the unsharded model (float64, ``REL_F64``). mfsdp2 keeps its parameter objects,
so an optimizer created *before* the load trains the same. A load of some keys leaves the model
refusing a forward until the others are loaded; a state dict without values (taken from a meta
model) is refused, naming the key.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from . import full
from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, build, make_opt, reference_run, shard_blocks, sharded_train_step

WS, STEPS, GB = 2, 3, 8
STRATEGIES = ("optim_grads_params", "optim_grads")


def _meta(shard, mesh, **kw):
    with torch.device("meta"):
        model = build("net", dtype=F64)
    return shard_blocks(model, mesh, shard, **kw)


def _train(model, rank, opt=None):
    opt = opt or make_opt("adamw", model.parameters())
    losses = [sharded_train_step(model, opt, s, rank, WS, GB) for s in range(STEPS)]
    return losses, {k: full(p) for k, p in model.named_parameters()}


def _dsd(model, full_sd, rank, broadcast: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    sd = {k: v.clone() for k, v in full_sd.items()} if (rank == 0 or not broadcast) else {}
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast))


def _accelerate(model, full_sd, rank):
    """Accelerate's ``fsdp2_load_full_state_dict``, step by step."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    sharded = {}
    for name, meta in model.state_dict().items():
        t = full_sd[name].clone() if rank == 0 else torch.empty(meta.size(), dtype=meta.dtype)
        dist.broadcast(t, src=0)
        sharded[name] = distribute_tensor(t, meta.device_mesh, meta.placements).to(dtype=meta.dtype).contiguous()
    model.load_state_dict(sharded, assign=True)


def _ours(model, full_sd, rank):
    from mfsdp2.checkpoint import state_dict as msd

    sd = {k: v.clone() for k, v in full_sd.items()} if rank == 0 else {}
    msd.set_model_state_dict(model, sd, options=msd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _rank(rank, ws):
    from torch.distributed.fsdp import fully_shard as torch_shard

    import mfsdp2

    mesh = init_device_mesh("cpu", (ws,))
    full_sd = build("net", dtype=F64).state_dict()
    out = {}
    fsdp2 = _meta(torch_shard, mesh)
    _dsd(fsdp2, full_sd, rank, broadcast=True)
    out["fsdp2"] = _train(fsdp2, rank)
    # Sharded sources: FSDP2's torch.chunk rows, and mfsdp2's rows of another unit structure.
    torch_src = shard_blocks(build("net", dtype=F64), mesh, torch_shard).state_dict()
    ours_src = mfsdp2.fully_shard(build("net", dtype=F64), mesh=mesh).state_dict()
    loads = {
        "dsd_broadcast": lambda m: _dsd(m, full_sd, rank, broadcast=True),
        "dsd_full": lambda m: _dsd(m, full_sd, rank, broadcast=False),
        "accelerate": lambda m: _accelerate(m, full_sd, rank),
        "assign_fsdp2_sd": lambda m: m.load_state_dict(torch_src, assign=True),
        "assign_mfsdp2_sd": lambda m: m.load_state_dict(ours_src, assign=True),
        "mfsdp2_helper": lambda m: _ours(m, full_sd, rank),
    }
    for strategy in STRATEGIES:
        for how, load in loads.items():
            model = _meta(mfsdp2.fully_shard, mesh, sharding_strategy=strategy)
            load(model)
            out[(strategy, how)] = _train(model, rank)
    model = _meta(mfsdp2.fully_shard, mesh, sharding_strategy="no_shard")
    _dsd(model, full_sd, rank, broadcast=True)
    out[("no_shard", "dsd_broadcast")] = _train(model, rank)

    # An optimizer built before the load: mfsdp2's parameter objects survive it.
    model = _meta(mfsdp2.fully_shard, mesh)
    opt = make_opt("adamw", model.parameters())
    _dsd(model, full_sd, rank, broadcast=True)
    out["optimizer_before_load"] = _train(model, rank, opt)

    # Some keys now, the others later (strict=False): no forward in between.
    model = _meta(mfsdp2.fully_shard, mesh)
    first = {k: v for k, v in torch_src.items() if k.startswith("blocks.")}
    model.load_state_dict(first, assign=True, strict=False)
    x = torch.zeros(2, 12, dtype=F64)
    try:
        model(x)
        out["partial_forward"] = "ran"
    except RuntimeError as e:
        out["partial_forward"] = str(e)
    model.load_state_dict({k: v for k, v in torch_src.items() if k not in first}, assign=True, strict=False)
    out["completed_later"] = _train(model, rank)

    # A state dict without values: refused, naming the key.
    try:
        _meta(mfsdp2.fully_shard, mesh).load_state_dict(_meta(mfsdp2.fully_shard, mesh).state_dict(), assign=True)
        out["meta_source"] = "loaded"
    except RuntimeError as e:
        out["meta_source"] = str(e)
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(_rank, WS, timeout=300)


@functools.lru_cache(maxsize=None)
def _reference():
    return reference_run("net", "adamw", STEPS, GB, dtype=F64)


CASES = [(s, h) for s in STRATEGIES
         for h in ("dsd_broadcast", "dsd_full", "accelerate", "assign_fsdp2_sd", "assign_mfsdp2_sd", "mfsdp2_helper")]
CASES += [("no_shard", "dsd_broadcast"), "optimizer_before_load", "completed_later"]


def _check(got, want, where):
    losses, weights = got
    want_losses, want_weights = want
    for s, (a, b) in enumerate(zip(losses, want_losses)):
        assert abs(a - b) <= REL_F64 * max(abs(b), 1e-3), (where, s, a, b)
    for k, w in want_weights.items():
        assert_close_rel(weights[k], w, f"{where} {k}", REL_F64)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=str)
def test_meta_model_initialised_by_loading(case):
    ref_losses, ref_weights = _reference()
    for rank, r in enumerate(_results()):
        _check(r["fsdp2"], (ref_losses, ref_weights), f"fsdp2 rank {rank}")  # the comparison is meaningful
        _check(r[case], r["fsdp2"], f"{case} vs fsdp2, rank {rank}")
        _check(r[case], (ref_losses, ref_weights), f"{case} vs unsharded, rank {rank}")


@pytest.mark.slow
def test_partial_load_and_meta_sources():
    for r in _results():
        assert "meta device" in r["partial_forward"], r["partial_forward"]
        assert ("on the meta device (no values" in r["meta_source"]
                and "'inp.weight'" in r["meta_source"]), r["meta_source"]
