"""Checkpoints: sharded/full state dicts, exact resume, resharding and FSDP2 interop, fused weights, HF.

Every comparison of weights and optimizer states here is bitwise (``torch.equal``): loading moves
bytes, it must not round them. Checkpoints go through ``torch.distributed.checkpoint`` on disk.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from mfsdp2 import MixedPrecisionPolicy, fully_shard
from mfsdp2.checkpoint import state_dict as msd
from mfsdp2.checkpoint.state_dict import StateDictOptions, tensors_by_path

from .._dist import run_ranks
from ..models import F64, REL_F64, Net, assert_close_rel, batch, build, make_opt, sharded_train_step

FULL = StateDictOptions(full_state_dict=True)
GLOBAL_BATCH = 8


# -- helpers run inside the ranks ------------------------------------------------------------------
def _sharded(kind, ws, seed=0, mp=MixedPrecisionPolicy(), fsdp2=False):
    """``build(kind)`` (or ``kind()`` if callable) sharded per block and at the root."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(seed)
    model = kind() if callable(kind) else build(kind, seed=seed)
    shard = ((lambda m: torch_fully_shard(m, mesh=mesh)) if fsdp2
             else (lambda m: fully_shard(m, mesh=mesh, mp_policy=mp)))
    for b in model.blocks:
        shard(b)
    return shard(model)


def _train(model, opt, steps, start, rank, ws):
    """Data-parallel steps on the global batch; returns the global losses (all ranks agree)."""
    return [sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH) for step in range(start, start + steps)]


def _full(model, opt, torch_dsd=False):
    """(full model state, full optimizer state) as plain tensors, identical on every rank."""
    get = dsd.get_state_dict if torch_dsd else msd.get_state_dict
    return get(model, opt, options=FULL)


def _save(model, opt, path, step, **extra):
    model_sd, optim_sd = msd.get_state_dict(model, opt)
    msd.save({"model": model_sd, "optim": optim_sd, "step": step, **extra}, checkpoint_id=path)


def _load(model, opt, path, **extra):
    model_sd, optim_sd = msd.get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd, "step": -1, **extra}
    aside = msd.load(sd, checkpoint_id=path)
    msd.set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return sd, aside


def _error(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)


def _assert_same(a, b, what=""):
    ta, tb = tensors_by_path(a), tensors_by_path(b)
    assert ta.keys() == tb.keys(), f"{what}: keys differ {sorted(map(str, ta.keys() ^ tb.keys()))[:6]}"
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), f"{what}: {k} differs"
    assert len(ta) > 0


# -- 1. model state dict ----------------------------------------------------------------------------
def _model_state_dict(rank, ws):
    out = {}
    model = _sharded("net", ws)
    ref = build("net").state_dict()
    params = dict(model.named_parameters())
    sd = model.state_dict()
    assert list(sd) == list(ref)
    for k, v in sd.items():
        assert isinstance(v, DTensor) and v.shape == ref[k].shape and v.dtype == torch.float32, k
        rows = params[k].placements[0].rows
        start = sum(rows[:rank])
        (chunk,) = v.__create_chunk_list__()
        assert tuple(chunk.sizes) == (rows[rank],) + tuple(v.shape[1:]), k
        if rows[rank]:  # torch files an empty piece at offset = global size
            assert tuple(chunk.offsets) == (start,) + (0,) * (v.dim() - 1), k
        assert (v.__create_write_items__(k, v) == []) == (rows[rank] == 0), k
        assert v.to_local().data_ptr() == params[k].to_local().data_ptr() or rows[rank] == 0, k
        assert torch.equal(v.to_local(), ref[k][start : start + rows[rank]]), k
    out["full"] = msd.get_model_state_dict(model, options=FULL)
    out["offload"] = msd.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # Gathered root: state_dict() still hands out the sharded main weights; loading is refused.
    model.unshard()
    assert all(isinstance(v, DTensor) for v in model.state_dict().values())
    out["unsharded_error"] = _error(lambda: model.load_state_dict(ref))
    model.reshard()

    # Loading full plain tensors, torch's own full-state-dict path, rank-0 broadcast, and derived
    # DTensors (out-of-place results: labelled plain Shard(0) although they hold our rows).
    for how in ("plain", "derived", "torch_full", "broadcast"):
        m = _sharded("net", ws, seed=1)
        if how == "plain":
            m.load_state_dict(ref)
        elif how == "derived":
            m.load_state_dict({k: v * 1 for k, v in model.state_dict().items()})
        elif how == "torch_full":  # torch distribute_tensor()s to chunk-shaped Shard(0): re-sliced
            dsd.set_model_state_dict(m, dict(ref), options=FULL)  # (torch mutates its argument)
        else:
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            msd.set_model_state_dict(m, ref if rank == 0 else {}, options=opts)
        out[how] = msd.get_model_state_dict(m, options=FULL)

    # bf16 compute: the fp32 checkpoint lands in the fp32 main weights unrounded, and the bf16
    # compute weights are re-cast from them (same forward as a bf16 model built from those weights).
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    m16 = _sharded("net", ws, seed=1, mp=bf16)
    x, _ = batch(0, GLOBAL_BATCH, 12)
    with torch.no_grad():
        m16(x)  # gathers and casts once with the seed-1 weights
    msd.set_model_state_dict(m16, model.state_dict())
    out["bf16_main"] = msd.get_model_state_dict(m16, options=FULL)
    with torch.no_grad():
        out["bf16_out"] = m16(x)
        out["bf16_ref_out"] = _sharded("net", ws, seed=0, mp=bf16)(x)

    # Mid-forward: a load from inside a unit's forward is refused with a clear error.
    mf = _sharded("net", ws, seed=2)
    mf.blocks[1].register_forward_pre_hook(lambda mod, args: mf.load_state_dict(ref))
    out["midforward_error"] = _error(lambda: mf(x))
    return out


def test_model_state_dict():
    results = run_ranks(_model_state_dict, 2)
    ref = build("net").state_dict()
    for rank, r in enumerate(results):
        _assert_same(r["full"], ref, f"rank {rank} full")
        for how in ("plain", "derived", "torch_full", "broadcast", "bf16_main"):
            _assert_same(r[how], ref, f"rank {rank} {how}")
        assert "unsharded" in r["unsharded_error"] and "reshard()" in r["unsharded_error"]
        assert "mid-forward" in r["midforward_error"]
        assert r["bf16_out"].dtype == torch.bfloat16 and torch.equal(r["bf16_out"], r["bf16_ref_out"])
    _assert_same(results[0]["offload"], ref, "cpu_offload rank 0")
    assert results[1]["offload"] == {}


# -- 2. exact resume ----------------------------------------------------------------------------------
def _resume_first(rank, ws, kind, opt_kinds, path):
    """Per optimizer: a straight 6-step run, and 3 steps + save + 3 steps; both must agree."""
    out = {}
    for ok in opt_kinds:
        straight = _sharded(kind, ws)
        s_opt = make_opt(ok, straight.parameters())
        s_losses = _train(straight, s_opt, 6, 0, rank, ws)
        model = _sharded(kind, ws)
        out["rows"] = {k: p.placements[0].rows for k, p in model.named_parameters()}
        opt = make_opt(ok, model.parameters())
        losses = _train(model, opt, 3, 0, rank, ws)
        _save(model, opt, os.path.join(path, ok), 3, args={"opt": ok, "lr": 0.01})
        full3 = _full(model, opt)
        losses += _train(model, opt, 3, 3, rank, ws)
        assert losses == s_losses, (ok, losses, s_losses)  # saving has no side effects
        _assert_same(_full(model, opt), _full(straight, s_opt), f"{ok} save side effects")
        out[ok] = dict(losses=losses, full3=full3, full6=_full(model, opt))
    return out


def _resume_second(rank, ws, kind, opt_kinds, path):
    out = {}
    for ok in opt_kinds:
        model = _sharded(kind, ws)
        opt = make_opt(ok, model.parameters())
        sd, aside = _load(model, opt, os.path.join(path, ok), args={"opt": "", "lr": 0.0})
        assert aside == {} and sd["step"] == 3 and sd["args"] == {"opt": ok, "lr": 0.01}, (
            aside, sd["step"], sd["args"])
        full3 = _full(model, opt)
        losses = _train(model, opt, 3, sd["step"], rank, ws)
        out[ok] = dict(losses=losses, full3=full3, full6=_full(model, opt))
    return out


def _check_resume(first, second, opt_kinds):
    for ok in opt_kinds:
        for rank, (a, b) in enumerate(zip(first, second)):
            _assert_same(b[ok]["full3"], a[ok]["full3"], f"{ok} rank {rank} after load")
            assert b[ok]["losses"] == a[ok]["losses"][3:], (ok, b[ok]["losses"], a[ok]["losses"])
            _assert_same(b[ok]["full6"], a[ok]["full6"], f"{ok} rank {rank} after 3 more steps")
        assert first[0][ok]["losses"][-1] < first[0][ok]["losses"][0]


@pytest.fixture(scope="module")
def ws2_checkpoint(tmp_path_factory):
    """World size 2, model "net": checkpoints after 3 steps of AdamW and of SGD + momentum."""
    path = str(tmp_path_factory.mktemp("ws2"))
    return path, run_ranks(_resume_first, 2, "net", ["adamw", "sgd"], path)


def test_exact_resume_adamw_and_sgd(ws2_checkpoint):
    path, first = ws2_checkpoint
    second = run_ranks(_resume_second, 2, "net", ["adamw", "sgd"], path)
    _check_resume(first, second, ["adamw", "sgd"])


# -- 3. world size 4 with empty pieces: resume, metadata, resharding to 2 and 1 and unsharded ----
@pytest.fixture(scope="module")
def ws4_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ws4"))
    return path, run_ranks(_resume_first, 4, "tiny", ["adamw", "sgd"], path)


@pytest.mark.slow
def test_ws4_empty_pieces_resume_exact(ws4_checkpoint):
    path, first = ws4_checkpoint
    second = run_ranks(_resume_second, 4, "tiny", ["adamw", "sgd"], path)
    _check_resume(first, second, ["adamw", "sgd"])


@pytest.mark.slow
def test_ws4_empty_pieces_write_nothing(ws4_checkpoint):
    path, first = ws4_checkpoint
    rows = first[0]["rows"]
    assert any(0 in r for r in rows.values()), "the tiny model should leave some rank without rows"
    for ok in ("adamw", "sgd"):
        md = dcp.FileSystemReader(os.path.join(path, ok)).read_metadata().state_dict_metadata
        for name, r in rows.items():
            states = ["exp_avg", "exp_avg_sq"] if ok == "adamw" else ["momentum_buffer"]
            for key in [f"model.{name}"] + [f"optim.state.{name}.{s}" for s in states]:
                got = sorted((tuple(c.offsets)[0], tuple(c.sizes)[0]) for c in md[key].chunks)
                want = [(sum(r[:q]), r[q]) for q in range(4) if r[q]]
                assert got == want, (key, got, want)


def _load_into(rank, ws, kind, paths):
    out = {}
    for ok, path in paths.items():
        model = _sharded(kind, ws, seed=5)
        opt = make_opt(ok, model.parameters())
        sd, _ = _load(model, opt, path, args={"opt": "", "lr": 0.0})
        out[ok] = _full(model, opt)
    return out


def _load_unsharded(kind, ok, path):
    """No process group at all: a plain model and optimizer through torch's DSD."""
    model = build(kind, seed=5)
    opt = make_opt(ok, model.parameters())
    model_sd, optim_sd = dsd.get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path)
    dsd.set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return dsd.get_state_dict(model, opt)


@pytest.mark.slow
def test_ws4_reshard_to_2_1_and_unsharded(ws4_checkpoint):
    path, first = ws4_checkpoint
    paths = {ok: os.path.join(path, ok) for ok in ("adamw", "sgd")}
    for ws in (2, 1):
        for rank, r in enumerate(run_ranks(_load_into, ws, "tiny", paths)):
            for ok in paths:
                _assert_same(r[ok], first[0][ok]["full3"], f"4->{ws} {ok} rank {rank}")
    for ok in paths:
        _assert_same(_load_unsharded("tiny", ok, paths[ok]), first[0][ok]["full3"], f"4->unsharded {ok}")


# -- 4. interop with torch FSDP2, 2 -> 1, unsharded -------------------------------------------------
# torch FSDP2 and mfsdp2 run in separate processes, as they would in practice: RowShard compares
# equal to Shard(0), so DTensor's process-wide caches mix the two layouts up (see checkpoint._common).
def _fsdp2_side(rank, ws, path):
    """torch FSDP2 reads mfsdp2's checkpoint, and writes one of its own (no step/args entries)."""
    model = _sharded("net", ws, seed=7, fsdp2=True)
    opt = make_opt("adamw", model.parameters())
    model_sd, optim_sd = dsd.get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=os.path.join(path, "adamw"))
    dsd.set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    loaded = _full(model, opt, torch_dsd=True)
    writer = _sharded("net", ws, fsdp2=True)
    w_opt = make_opt("adamw", writer.parameters())
    _train(writer, w_opt, 2, 0, rank, ws)
    model_sd, optim_sd = dsd.get_state_dict(writer, w_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "fsdp2"))
    return loaded, _full(writer, w_opt, torch_dsd=True)


def _mfsdp2_side(rank, ws, path):
    out = {}
    reader = _sharded("net", ws, seed=8)
    r_opt = make_opt("adamw", reader.parameters())
    _, aside = _load(reader, r_opt, os.path.join(path, "fsdp2"), args={"x": 1})  # no step/args there
    out["from_fsdp2"], out["aside"] = _full(reader, r_opt), sorted(aside)

    model = _sharded("net", ws)
    opt = make_opt("adamw", model.parameters())
    _train(model, opt, 2, 0, rank, ws)
    out["before"] = before = _full(model, opt)
    for st in opt.state.values():  # states kept as plain local tensors: offsets come from the param
        st["exp_avg"] = st["exp_avg"].to_local()
    _save(model, opt, os.path.join(path, "plain_states"), 2)
    m = _sharded("net", ws, seed=9)
    o = make_opt("adamw", m.parameters())
    _load(m, o, os.path.join(path, "plain_states"))
    out["plain_states"] = _full(m, o)
    # Full state dicts load too: on every rank, or from rank 0 only (broadcast).
    for bcast in (False, True):
        m = _sharded("net", ws, seed=9)
        o = make_opt("adamw", m.parameters())
        give = not bcast or rank == 0
        msd.set_state_dict(m, o, model_state_dict=before[0] if give else {}, optim_state_dict=before[1] if give else {},
                           options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=bcast))
        out[f"full_load_{bcast}"] = _full(m, o)
    return out


def test_interop_fsdp2_2to1_unsharded(ws2_checkpoint):
    path, first = ws2_checkpoint
    ref = first[0]["adamw"]["full3"]  # written by mfsdp2 at world size 2
    fsdp2 = run_ranks(_fsdp2_side, 2, path)
    ours = run_ranks(_mfsdp2_side, 2, path)
    for rank in range(2):
        _assert_same(fsdp2[rank][0], ref, f"mfsdp2 -> FSDP2 rank {rank}")
        r = ours[rank]
        _assert_same(r["from_fsdp2"], fsdp2[0][1], f"FSDP2 -> mfsdp2 rank {rank}")
        assert r["aside"] == ["args", "step"]
        for key in ("plain_states", "full_load_False", "full_load_True"):
            _assert_same(r[key], r["before"], f"rank {rank} {key}")
    (one,) = run_ranks(_load_into, 1, "net", {"adamw": os.path.join(path, "adamw")})
    _assert_same(one["adamw"], ref, "2 -> 1")
    _assert_same(_load_unsharded("net", "adamw", os.path.join(path, "adamw")), ref, "2 -> unsharded")


# -- 5. fused weights: separate gate/up <-> SwiGLU fc1 = [gate; up] ---------------------------------
class _SwiBlock(nn.Module):
    def __init__(self, d, hidden, fused):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        if fused:
            self.fc1 = nn.Linear(d, 2 * hidden, bias=False)
        else:
            self.gate_proj = nn.Linear(d, hidden, bias=False)
            self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        if hasattr(self, "fc1"):
            g, u = self.fc1(h).chunk(2, dim=-1)
        else:
            g, u = self.gate_proj(h), self.up_proj(h)
        return x + self.down_proj(F.silu(g) * u)


def _swi_net(fused):
    net = Net(d=16, hidden=24, n_blocks=2)  # its forward, with SwiGLU blocks instead of GELU ones
    net.blocks = nn.ModuleList(_SwiBlock(16, 24, fused) for _ in range(2))
    return net.to(F64)  # the fused and separate forwards are compared at REL_F64 (tests/models.py)


_FC1 = [(f"blocks.{i}.fc1.weight", f"blocks.{i}.gate_proj.weight", f"blocks.{i}.up_proj.weight") for i in range(2)]


def _split_all(*sds):
    for sd in sds:
        for fc1, gate, up in _FC1:
            msd.split_swiglu(sd, fc1, gate, up)


def _join_all(*sds):
    for sd in sds:
        for fc1, gate, up in _FC1:
            msd.join_swiglu(sd, gate, up, fc1)


def _fused(rank, ws, path):
    out = {}
    sep = _sharded(lambda: _swi_net(False), ws, 0)
    opt = make_opt("adamw", sep.parameters())
    _train(sep, opt, 2, 0, rank, ws)
    _save(sep, opt, os.path.join(path, "sep"), 2)
    out["sep"] = _full(sep, opt)

    # separate checkpoint -> fused model: split the fused state dict, load, join back, set.
    fused = _sharded(lambda: _swi_net(True), ws, 3)
    f_opt = make_opt("adamw", fused.parameters())
    model_sd, optim_sd = msd.get_state_dict(fused, f_opt)
    _split_all(model_sd, optim_sd)
    out["straddles"] = all(model_sd[k].to_local().shape[0] > 0 for k in _FC1[0][1:])
    sd = {"model": model_sd, "optim": optim_sd, "step": -1}
    msd.load(sd, checkpoint_id=os.path.join(path, "sep"))
    _join_all(sd["model"], sd["optim"])
    msd.set_state_dict(fused, f_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    out["fused"] = _full(fused, f_opt)
    x, _ = batch(9, GLOBAL_BATCH, 12, dtype=F64)
    with torch.no_grad():
        out["outs"] = (sep(x), fused(x))

    # ... and back: fused checkpoint -> a fresh separate model (join its state dict, load, split).
    _save(fused, f_opt, os.path.join(path, "fused"), 2)
    sep2 = _sharded(lambda: _swi_net(False), ws, 4)
    s2_opt = make_opt("adamw", sep2.parameters())
    model_sd, optim_sd = msd.get_state_dict(sep2, s2_opt)
    _join_all(model_sd, optim_sd)
    sd = {"model": model_sd, "optim": optim_sd, "step": -1}
    msd.load(sd, checkpoint_id=os.path.join(path, "fused"))
    _split_all(sd["model"], sd["optim"])
    msd.set_state_dict(sep2, s2_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    out["sep2"] = _full(sep2, s2_opt)

    # Sharded round trips are exact, placements included.
    for model in (fused, sep):
        before = msd.get_model_state_dict(model)
        after = dict(before)
        (_join_all if model is sep else _split_all)(after)
        (_split_all if model is sep else _join_all)(after)
        assert list(after) == list(before)
        for k, v in before.items():
            assert after[k].placements == v.placements and after[k].placements[0].rows == v.placements[0].rows, k
            assert torch.equal(after[k].to_local(), v.to_local()), k
    return out


def test_fused_split_join(tmp_path):
    results = run_ranks(_fused, 2, str(tmp_path))
    sep_model, sep_optim = results[0]["sep"]
    # The expected fused state, built with the unsharded (plain tensor) path of the same helpers.
    copy = lambda m, o: (dict(m), {"state": dict(o["state"]), "param_groups": [dict(g) for g in o["param_groups"]]})  # noqa: E731
    want_model, want_optim = copy(sep_model, sep_optim)
    _join_all(want_model, want_optim)
    fc1, gate, up = _FC1[1]
    assert torch.equal(want_model[fc1], torch.cat([sep_model[gate], sep_model[up]]))
    assert torch.equal(want_optim["state"][fc1]["exp_avg"],
                       torch.cat([sep_optim["state"][gate]["exp_avg"], sep_optim["state"][up]["exp_avg"]]))
    assert any(r["straddles"] for r in results), "some rank should hold rows of both gate and up"
    for rank, r in enumerate(results):
        _assert_same(r["fused"], (want_model, want_optim), f"sep -> fused rank {rank}")
        _assert_same(r["sep2"], r["sep"], f"fused -> sep rank {rank}")
        a, b = r["outs"]
        assert_close_rel(a, b, f"fused vs separate output rank {rank}", REL_F64)
    # Unsharded round trips are exact too.
    back_model, back_optim = copy(want_model, want_optim)
    _split_all(back_model, back_optim)
    _assert_same((back_model, back_optim), (sep_model, sep_optim), "unsharded join/split")
    assert list(back_model) == list(sep_model)
    assert back_optim["param_groups"][0]["params"] == sep_optim["param_groups"][0]["params"]


# -- 6. Hugging Face safetensors ------------------------------------------------------------------
_HF_CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
_IDS = torch.arange(24).view(2, 12) % 128


class _MiniLlama(nn.Module):
    """The parameter names of transformers' LlamaForCausalLM (a stand-in where it is not installed)."""

    def __init__(self, c):
        super().__init__()
        d, ffn, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        kv = d // c["num_attention_heads"] * c["num_key_value_heads"]

        def layer():
            m = nn.Module()
            m.self_attn = nn.ModuleDict({n: nn.Linear(d, o, bias=False) for n, o in
                                         [("q_proj", d), ("k_proj", kv), ("v_proj", kv), ("o_proj", d)]})
            m.mlp = nn.ModuleDict({n: nn.Linear(i, o, bias=False) for n, i, o in
                                   [("gate_proj", d, ffn), ("up_proj", d, ffn), ("down_proj", ffn, d)]})
            m.input_layernorm, m.post_attention_layernorm = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
            return m

        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(v, d)
        self.model.layers = nn.ModuleList(layer() for _ in range(c["num_hidden_layers"]))
        self.model.norm = nn.LayerNorm(d, bias=False)
        self.lm_head = nn.Linear(d, v, bias=False)


class _Counting:
    """Wraps a safetensors file (or one of its slices) and counts the bytes of what it hands out."""

    def __init__(self, inner, counted):
        self.inner, self.counted = inner, counted

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def __getattr__(self, name):  # keys(), get_shape()
        return getattr(self.inner, name)

    def get_slice(self, name):
        return _Counting(self.inner.get_slice(name), self.counted)

    def get_tensor(self, name):
        t = self.inner.get_tensor(name)
        self.counted["whole"] += t.numel() * t.element_size()
        return t

    def __getitem__(self, idx):
        t = self.inner[idx]
        self.counted["slices"] += t.numel() * t.element_size()
        return t


def _hf_model(use_hf: bool):
    if not use_hf:
        return _MiniLlama(_HF_CONFIG)
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**_HF_CONFIG))


def _hf(rank, ws, src, dst, use_hf):
    import mfsdp2.checkpoint.hf as hf

    mesh = init_device_mesh("cpu", (ws,))
    with torch.device("meta"):  # no rank ever holds the full model
        model = _hf_model(use_hf)
    if use_hf:
        model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    for layer in model.model.layers:
        layer.to_empty(device="cpu")
        fully_shard(layer, mesh=mesh)
    for m in (model.model.embed_tokens, model.model.norm, model.lm_head):
        m.to_empty(device="cpu")
    fully_shard(model, mesh=mesh)

    counted = {"slices": 0, "whole": 0}
    real_safe_open = hf._safe_open()
    hf._safe_open = lambda: (lambda *a, **k: _Counting(real_safe_open(*a, **k), counted))
    stats = msd.load_hf_safetensors(model, src)
    out = {"stats": stats, "counted": counted}
    full = msd.get_model_state_dict(model, options=FULL)
    if rank == 0:
        out["full"] = full
    if use_hf:
        with torch.no_grad():
            out["logits"] = model(input_ids=_IDS).logits
    msd.save_hf_safetensors(model, dst)
    return out


def test_hf_safetensors_load_and_export(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file

    use_hf = importlib.util.find_spec("transformers") is not None  # else a stand-in with its names
    src, dst = tmp_path / "hf", tmp_path / "out.safetensors"
    src.mkdir()
    torch.manual_seed(0)
    ref = _hf_model(use_hf)
    if use_hf:
        ref.save_pretrained(str(src))
    else:
        save_file(ref.state_dict(), str(src / "model.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    ws = 2
    results = run_ranks(_hf, ws, str(src), str(dst), use_hf)
    for rank, r in enumerate(results):
        assert r["counted"]["whole"] == 0, "sharded parameters must be read by slices"
        assert r["stats"].bytes_read == r["counted"]["slices"]
        assert abs(r["stats"].bytes_read - total / ws) <= 0.05 * total / ws, (rank, r["stats"].bytes_read, total)
        assert r["stats"].missing == [] and r["stats"].unexpected == []
    assert sum(r["stats"].bytes_read for r in results) == total  # every row read exactly once
    _assert_same(results[0]["full"], tensors, "loaded parameters")
    _assert_same(load_file(str(dst)), tensors, "exported file")
    if use_hf:
        with torch.no_grad():
            want = ref(input_ids=_IDS).logits
        for r in results:
            assert torch.allclose(r["logits"], want, rtol=1e-5, atol=1e-5)
