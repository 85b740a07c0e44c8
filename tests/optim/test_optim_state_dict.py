"""mfsdp2.optim.AdamW's state dicts interoperate with ``torch.optim.AdamW`` both ways, at world size 2:

* ``load_state_dict`` of a ``torch.save``d state (ours -> torch, torch -> ours), then training on: the
  same weights and states, bit for bit, as the run that was never interrupted;
* DCP through ``mfsdp2.checkpoint.state_dict`` (ours -> torch, torch -> ours) and torch's DSD (the same
  sharded and full state dicts as torch AdamW's; a fresh optimizer initialised by DSD);
* a torch AdamW state of the unsharded model (plain full tensors) loaded into ours, and our
  checkpoint loaded by an unsharded model through torch's DSD;
* torch FSDP2 with torch AdamW reading our checkpoint and writing one we read (separate
  processes, as in tests/checkpoint/test_checkpoint.py).

Loading moves bytes: every loaded state is compared with the saved one bitwise.
"""

from __future__ import annotations

import io
import os

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from mfsdp2 import fully_shard
from mfsdp2.checkpoint import state_dict as msd
from mfsdp2.optim import AdamW
from mfsdp2.checkpoint.state_dict import StateDictOptions, tensors_by_path

from .._dist import run_ranks
from ..models import batch, build, loss_fn, sharded_train_step

FULL = StateDictOptions(full_state_dict=True)
GB = 8


def _model(seed=0, fsdp2=False):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard = torch_fully_shard if fsdp2 else fully_shard
    mesh = init_device_mesh("cpu", (2,))
    m = build("net", seed=seed)
    for b in m.blocks:
        shard(b, mesh=mesh)
    return shard(m, mesh=mesh)


def _opt(model, ours: bool):
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if p.dim() >= 2]},
              {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]
    return (AdamW(groups, lr=1e-2, weight_decay=0.1) if ours
            else torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=False))


def _train(model, opt, start, steps, rank):
    return [sharded_train_step(model, opt, s, rank, 2, GB) for s in range(start, start + steps)]


def _same(a, b, what):
    ta, tb = tensors_by_path(a), tensors_by_path(b)
    assert ta.keys() == tb.keys(), f"{what}: keys differ {sorted(map(str, ta.keys() ^ tb.keys()))[:6]}"
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), f"{what}: {k} differs"
    assert ta


def _saved(sd):
    """``sd`` through ``torch.save`` / ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _full(model, opt):
    return msd.get_state_dict(model, opt, options=FULL)


def _owns_all(opt):
    """Every mfsdp2 parameter's state is our flat views again (after a load)."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            hit = opt._find(p)
            if st and hit is not None:
                g, i = hit
                assert opt._flat[id(g)].owns(st, i, group["amsgrad"]), opt._name(g, i)


def _interop(rank, ws, path):
    out = {}
    # reference: ours, 5 steps uninterrupted; and the same 3 steps, then handed over
    straight = _model()
    s_opt = _opt(straight, True)
    _train(straight, s_opt, 0, 5, rank)
    want = _full(straight, s_opt)

    for src_ours in (True, False):  # load_state_dict in the same process, both ways
        a = _model()
        oa = _opt(a, src_ours)
        _train(a, oa, 0, 3, rank)
        b = _model(seed=3)
        b.load_state_dict(a.state_dict())
        ob = _opt(b, not src_ours)
        ob.load_state_dict(_saved(oa.state_dict()))
        if not src_ours:
            _owns_all(ob)
        _same(_full(b, ob), _full(a, oa), f"load_state_dict ours={src_ours}")
        _train(b, ob, 3, 2, rank)
        _same(_full(b, ob), want, f"load_state_dict ours={src_ours}, trained on")

    for src_ours in (True, False):  # DCP through mfsdp2.checkpoint.state_dict, both ways
        a = _model()
        oa = _opt(a, src_ours)
        _train(a, oa, 0, 3, rank)
        ck = os.path.join(path, f"dcp_{src_ours}")
        model_sd, optim_sd = msd.get_state_dict(a, oa)
        msd.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ck)
        b = _model(seed=4)
        ob = _opt(b, not src_ours)
        model_sd, optim_sd = msd.get_state_dict(b, ob)
        sd = {"model": model_sd, "optim": optim_sd}
        msd.load(sd, checkpoint_id=ck)
        msd.set_state_dict(b, ob, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if not src_ours:
            _owns_all(ob)
        _same(_full(b, ob), _full(a, oa), f"DCP ours={src_ours}")
        _train(b, ob, 3, 2, rank)
        _same(_full(b, ob), want, f"DCP ours={src_ours}, trained on")

    # torch's DSD: the same sharded and full state dicts as torch AdamW's (fresh ones too)
    pair = [_model(), _model()]
    opts = [_opt(pair[0], True), _opt(pair[1], False)]
    for trained in (False, True):
        if trained:
            for m, o in zip(pair, opts):
                _train(m, o, 0, 2, rank)
        for opts_ in (StateDictOptions(), FULL):
            sds = [dsd.get_optimizer_state_dict(m, o, options=opts_) for m, o in zip(pair, opts)]
            ta, tb = (tensors_by_path(s) for s in sds)
            assert ta.keys() == tb.keys()
            for k in ta:
                x, y = ta[k], tb[k]
                assert type(x) is type(y) and x.dtype == y.dtype, k
                if isinstance(x, DTensor):
                    assert x.placements == y.placements and torch.equal(x.to_local(), y.to_local()), k
                else:
                    assert torch.equal(x, y), k
    fresh = _model()
    fo = _opt(fresh, True)
    fresh.load_state_dict(pair[1].state_dict())
    dsd.set_optimizer_state_dict(fresh, fo, dsd.get_optimizer_state_dict(pair[1], opts[1], options=FULL), options=FULL)
    _owns_all(fo)
    _same(_full(fresh, fo), _full(pair[1], opts[1]), "DSD full load of torch's into ours")

    # unsharded torch AdamW (plain full tensors) -> ours
    ref = build("net")
    r_opt = _opt(ref, False)
    for s in range(3):
        x, y = batch(s, GB, 12)
        loss_fn(ref(x), y).backward()
        r_opt.step()
        r_opt.zero_grad()
    m = _model(seed=5)
    m.load_state_dict(ref.state_dict())
    o = _opt(m, True)
    o.load_state_dict(_saved(r_opt.state_dict()))
    _owns_all(o)
    for p, rp in zip(m.parameters(), ref.parameters()):
        st, rst = o.state[p], r_opt.state[rp]
        assert st["step"].item() == rst["step"].item()
        for k in ("exp_avg", "exp_avg_sq"):
            assert isinstance(st[k], DTensor) and torch.equal(st[k].full_tensor(), rst[k])

    # our checkpoint for the other readers (unsharded below, FSDP2 in its own processes)
    model_sd, optim_sd = msd.get_state_dict(straight, s_opt)
    msd.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "ours"))
    out["want"] = want
    return out


def _fsdp2_side(rank, ws, path):
    """FSDP2 + torch AdamW reads our checkpoint; writes one of its own after 2 steps."""
    model = _model(seed=7, fsdp2=True)
    opt = _opt(model, False)
    model_sd, optim_sd = dsd.get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=os.path.join(path, "ours"))
    dsd.set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    loaded = dsd.get_state_dict(model, opt, options=FULL)
    writer = _model(fsdp2=True)
    w_opt = _opt(writer, False)
    _train(writer, w_opt, 0, 2, rank)
    model_sd, optim_sd = dsd.get_state_dict(writer, w_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "fsdp2"))
    return loaded, dsd.get_state_dict(writer, w_opt, options=FULL)


def _read_fsdp2(rank, ws, path):
    m = _model(seed=8)
    o = _opt(m, True)
    model_sd, optim_sd = msd.get_state_dict(m, o)
    sd = {"model": model_sd, "optim": optim_sd}
    msd.load(sd, checkpoint_id=os.path.join(path, "fsdp2"))
    msd.set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _owns_all(o)
    return _full(m, o)


def _unsharded_reads(path):
    model = build("net", seed=5)
    opt = _opt(model, False)
    model_sd, optim_sd = dsd.get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path)
    dsd.set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return dsd.get_state_dict(model, opt)


def test_state_dicts_interoperate_with_torch_adamw(tmp_path):
    path = str(tmp_path)
    ours = run_ranks(_interop, 2, path)
    want = ours[0]["want"]
    _same(ours[1]["want"], want, "ranks agree")
    _same(_unsharded_reads(os.path.join(path, "ours")), want, "ours -> unsharded torch AdamW")
    fsdp2 = run_ranks(_fsdp2_side, 2, path)
    for rank in range(2):
        _same(fsdp2[rank][0], want, f"ours -> FSDP2 rank {rank}")
    back = run_ranks(_read_fsdp2, 2, path)
    for rank in range(2):
        _same(back[rank], fsdp2[0][1], f"FSDP2 -> ours rank {rank}")
