"""torch's own distributed state-dict API (``torch.distributed.checkpoint.state_dict``) on an
mfsdp2 model gives what it gives on the same model sharded by torch FSDP2, for every
``StateDictOptions`` combination a user passes: ``full_state_dict``, ``cpu_offload``,
``broadcast_from_rank0``, ``strict``; on 1-D meshes and on HSDP's (replicate, shard) mesh.

Both models train side by side in one process (float64, the same data), so every value compares
exactly up to float64 reduction-order rounding (``REL_F64``); FSDP2 is the reference for what
each option returns (types, which ranks get what) and the unsharded model for the values.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed.checkpoint.state_dict as dsd
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from . import sharded_pair
from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, build, make_opt, reference_step, sharded_train_step

STEPS, GB = 2, 8

GET_OPTIONS = [dict(full_state_dict=f, cpu_offload=c) for f, c in itertools.product([False, True], [False, True])]
SET_OPTIONS = [
    dict(full_state_dict=False, strict=True),
    dict(full_state_dict=False, strict=False),
    dict(full_state_dict=True, strict=True),
    dict(full_state_dict=True, broadcast_from_rank0=True, strict=True),
    dict(full_state_dict=True, broadcast_from_rank0=True, strict=False),
]


def _describe(tree):
    """Comparable form of a state dict: nested keys -> (kind, full value); kind says what DSD
    returned (a DTensor, or a plain tensor and its device)."""
    out = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(prefix + (k,), x)
        elif isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
            for i, x in enumerate(v):
                walk(prefix + (i,), x)
        elif isinstance(v, DTensor):
            out[prefix] = ("dtensor", v.full_tensor())
        elif isinstance(v, torch.Tensor):
            out[prefix] = (f"tensor:{v.device.type}", v.detach().clone())
        else:
            out[prefix] = ("value", v)

    walk((), tree)
    return out


def _mesh(ws, hsdp):
    """1-D over every rank, or HSDP's (replicate=2, shard=ws/2)."""
    if hsdp:
        return init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (ws,))


def _get(rank, ws, kind, hsdp=False):
    mesh = _mesh(ws, hsdp)
    models = sharded_pair(mesh, kind)
    opts = {k: make_opt("adamw", m.parameters()) for k, m in models.items()}
    for step in range(STEPS):
        for k in models:
            sharded_train_step(models[k], opts[k], step, rank, ws, GB)
    got = {}
    for i, o in enumerate(GET_OPTIONS):
        options = StateDictOptions(**o)
        for k, m in models.items():
            msd = dsd.get_model_state_dict(m, options=options)
            osd = dsd.get_optimizer_state_dict(m, opts[k], options=options)
            got[k, i] = (_describe(msd), _describe(osd))
    return got


def _assert_same(ours, theirs, what):
    assert set(ours) == set(theirs), f"{what}: keys differ: {sorted(set(ours) ^ set(theirs), key=str)[:8]}"
    for key, (kind, value) in theirs.items():
        okind, ovalue = ours[key]
        assert okind == kind, f"{what} {key}: mfsdp2 gives {okind}, FSDP2 {kind}"
        if isinstance(value, torch.Tensor):
            assert ovalue.shape == value.shape and ovalue.dtype == value.dtype, (what, key, ovalue.shape, value.shape)
            if value.is_floating_point() and value.numel():
                assert_close_rel(ovalue, value, f"{what} {key}", REL_F64)
            else:
                assert torch.equal(ovalue, value), (what, key)
        else:
            assert ovalue == value, (what, key, ovalue, value)


# "tiny" at world size 4: some ranks hold no rows of some parameters (empty local shards); "hsdp":
# a (replicate=2, shard=2) mesh, DTensors with (Replicate, Shard) placements on both runtimes.
CASES = pytest.mark.parametrize(
    "kind,ws,hsdp", [("net", 2, False), ("tiny", 4, False), ("net", 4, True)], ids=["net-ws2", "tiny-ws4", "hsdp-2x2"]
)


def _trained_reference(kind):
    """The unsharded model and its AdamW after STEPS steps on the full batches."""
    ref = build(kind, dtype=F64)
    ref_opt = make_opt("adamw", ref.parameters())
    for s in range(STEPS):
        reference_step(ref, ref_opt, s, GB, F64)
    return ref, ref_opt


@CASES
def test_get_state_dicts_match_fsdp2_for_every_option(kind, ws, hsdp):
    ref, _ = _trained_reference(kind)
    results = run_ranks(_get, ws, kind, hsdp)
    for rank, got in enumerate(results):
        for i, o in enumerate(GET_OPTIONS):
            for part in (0, 1):
                _assert_same(got["mfsdp2", i][part], got["fsdp2", i][part],
                             f"rank {rank} {o} {('model', 'optim')[part]}")
            model_sd = got["fsdp2", i][0]
            if o["full_state_dict"] and o["cpu_offload"] and rank != 0:
                assert model_sd == {}, "FSDP2 gives ranks other than 0 an empty dict here"
                continue
            for k, p in ref.named_parameters():
                assert_close_rel(model_sd[(k,)][1], p.detach(), f"{o} {k}", REL_F64)


def _set(rank, ws, kind, full_model_sd, full_optim_sd, hsdp=False):
    """Load a full checkpoint (the unsharded model's, after STEPS steps) into fresh sharded models
    through every option, then train one more step: both must continue identically."""
    mesh = _mesh(ws, hsdp)
    out = {}
    for i, o in enumerate(SET_OPTIONS):
        models = sharded_pair(mesh, kind)
        opts = {k: make_opt("adamw", m.parameters()) for k, m in models.items()}
        options = StateDictOptions(**o)
        for k, m in models.items():
            if o["full_state_dict"]:
                msd, osd = _fqn_optim(m, opts[k], full_model_sd, full_optim_sd)
                if o.get("broadcast_from_rank0") and rank != 0:
                    msd, osd = {}, {}
            else:  # a sharded state dict, as a DCP load produces: take the model's own and fill it
                msd = dsd.get_model_state_dict(m)
                osd = dsd.get_optimizer_state_dict(m, opts[k])
                _fill_sharded(msd, full_model_sd)
                _fill_sharded(osd["state"], {n: s for n, s in full_optim_sd.items()})
            if not o["strict"] and msd:
                msd = dict(msd)
                msd.pop(next(iter(msd)))  # one key missing: allowed with strict=False only
            dsd.set_model_state_dict(m, msd, options=options)
            dsd.set_optimizer_state_dict(m, opts[k], osd, options=options)
            loss = sharded_train_step(m, opts[k], STEPS, rank, ws, GB)
            out[k, i] = (loss, {n: p.full_tensor() for n, p in m.named_parameters()})
    return out


def _fqn_optim(model, opt, full_model_sd, full_optim_sd):
    """The full optimizer state dict in DSD's FQN-keyed form."""
    state = {n: {k: v.clone() for k, v in s.items()} for n, s in full_optim_sd.items()}
    groups = [dict(g) for g in opt.param_groups]
    for g in groups:
        g["params"] = [n for n, _ in model.named_parameters()]
    return {k: v.clone() for k, v in full_model_sd.items()}, {"state": state, "param_groups": groups}


def _fill_sharded(sharded, full):
    for k, v in sharded.items():
        if isinstance(v, dict):
            _fill_sharded(v, full[k])
        elif isinstance(v, DTensor):  # this rank's piece, wherever the layout puts it
            shape, offset = compute_local_shape_and_global_offset(full[k].shape, v.device_mesh, v.placements)
            v.to_local().copy_(full[k][tuple(slice(o, o + n) for o, n in zip(offset, shape))])
        elif isinstance(v, torch.Tensor):
            v.copy_(full[k])


@CASES
def test_set_state_dicts_match_fsdp2_for_every_option(kind, ws, hsdp):
    ref, ref_opt = _trained_reference(kind)
    names = {id(p): n for n, p in ref.named_parameters()}
    full_model_sd = {n: p.detach().clone() for n, p in ref.named_parameters()}
    full_optim_sd = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in ref_opt.state.items()}
    ref_loss = reference_step(ref, ref_opt, STEPS, GB, F64)
    ref_after = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for out in run_ranks(_set, ws, kind, full_model_sd, full_optim_sd, hsdp):
        for i, o in enumerate(SET_OPTIONS):
            for k in ("fsdp2", "mfsdp2"):
                loss, params = out[k, i]
                if o["strict"]:  # a dropped key keeps the fresh init: only the strict runs continue the reference
                    assert abs(loss - ref_loss) <= REL_F64 * abs(ref_loss), (k, o, loss, ref_loss)
                    for n, p in ref_after.items():
                        assert_close_rel(params[n], p, f"{k} {o} {n}", REL_F64)
            assert abs(out["mfsdp2", i][0] - out["fsdp2", i][0]) <= REL_F64 * abs(out["fsdp2", i][0]), o
            for n, p in out["fsdp2", i][1].items():
                assert_close_rel(out["mfsdp2", i][1][n], p, f"mfsdp2 vs FSDP2 {o} {n}", REL_F64)
