"""``shard_placement_fn`` returning ``Shard(d)`` with ``d != 0`` (mfsdp2.dtensors.shard_dim), side by side
with torch FSDP2 given the same function in the same process, and the unsharded model.

Models (float64): torchtitan's MoE shape -- expert weights ``(experts, dim, hidden)`` in their own
unit sharded on dim 1 (``fully_shard(experts, shard_placement_fn=lambda p: Shard(1))``), the rest
on dim 0 (or on their last, ``Shard(-1)``) -- and ``Net`` sharded on each parameter's largest
dim (torch's test). Strategies ZeRO-3, ZeRO-2, ZeRO-1, ``reshard_after_forward=False``, CPU offload
and ``no_shard`` (which keeps every parameter whole); per step ``clip_grad_norm_`` (torch's
foreach, or mfsdp2's), three AdamW steps. Compared with FSDP2 and the unsharded model: losses,
total norms, full gradients of the last step, full parameters and AdamW states.

Also: the optimizer-facing parameters say ``RowShard(d)`` where FSDP2's say ``Shard(d)`` and
``full_tensor()`` is the parameter; ``model.state_dict()`` has FSDP2's keys, shapes and full
values; DCP checkpoints (model and optimizer through torch's DSD) written by either runtime load
into either, and the next step equals the writer's own next step; ``copy_`` into such a parameter
from a full tensor, a ``Replicate`` or a ``Shard(d)`` DTensor; a dim whose size does not divide
by the world size (FSDP2 refuses it) trains as the unsharded model; meta build + ``materialize``
equals the normal build; ``model.to(float32)`` keeps the layout; the ``mfsdp2.checkpoint.state_dict``
helpers refuse such models (E43);
``load_state_dict`` of FSDP2's ``Shard(d)`` DTensors gives FSDP2's values.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from . import full
from .._dist import run_ranks
from ..models import F64, REL_F64, Net, assert_close_rel

WS, STEPS, GB, MAX_NORM = 2, 3, 8, 0.05


class Experts(nn.Module):
    """torchtitan's GroupedExperts, dense: every token through every expert (``torch.bmm``)."""

    def __init__(self, experts: int = 2, dim: int = 16, hidden: int = 24):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * hidden**-0.5)

    def forward(self, x):
        xs = x.unsqueeze(0).expand(self.w1.shape[0], *x.shape)
        return torch.bmm(F.silu(torch.bmm(xs, self.w1)), self.w2).mean(0)


class MoE(nn.Module):
    def __init__(self, hidden: int = 24):
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.norm = nn.LayerNorm(16)
        self.experts = Experts(hidden=hidden)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.experts(self.norm(h)))


def _build(kind: str):
    torch.manual_seed(0)
    return (MoE() if kind == "moe" else MoE(hidden=25) if kind == "moe_uneven" else Net()).double()


def _dim1(p):
    from torch.distributed.tensor import Shard

    return Shard(1)


def _largest(p):
    from torch.distributed.tensor import Shard

    return Shard(max(range(p.dim()), key=lambda d: p.shape[d]))


def _last(p):
    from torch.distributed.tensor import Shard

    return Shard(-1)


FNS = {"dim1": _dim1, "largest": _largest, "last": _last}


def _wrap(model, shard, mesh, fn_name: str, **kw):
    fn = FNS[fn_name]
    if isinstance(model, MoE):
        shard(model.experts, mesh=mesh, shard_placement_fn=fn, **kw)
        shard(model, mesh=mesh, **kw)
    else:
        for b in model.blocks:
            shard(b, mesh=mesh, shard_placement_fn=fn, **kw)
        shard(model, mesh=mesh, shard_placement_fn=fn, **kw)
    return model


def _x(step: int) -> torch.Tensor:
    return torch.randn(GB, 12, dtype=F64, generator=torch.Generator().manual_seed(100 + step))


def _train(model, rank: int, clip=None):
    """``(losses, total norms, full grads of the last step, full params, full AdamW states)``."""
    import torch.distributed as dist

    clip = clip or functools.partial(torch.nn.utils.clip_grad_norm_, foreach=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    n = GB // WS
    losses, norms = [], []
    for s in range(STEPS):
        loss = model(_x(s)[rank * n : (rank + 1) * n]).pow(2).mean()
        loss.backward()
        grads = {k: full(p.grad) for k, p in model.named_parameters()}
        norms.append(full(clip(list(model.parameters()), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / WS)
    params = {k: full(p) for k, p in model.named_parameters()}
    states = {(k, s): full(opt.state[p][s]) for k, p in model.named_parameters() for s in ("exp_avg", "exp_avg_sq")}
    return losses, norms, grads, params, states


def _reference(kind: str):
    """Unsharded, on the whole batch."""
    model = _build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for s in range(STEPS):
        loss = model(_x(s)).pow(2).mean()
        loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    states = {(k, s): opt.state[p][s].clone() for k, p in model.named_parameters() for s in ("exp_avg", "exp_avg_sq")}
    return losses, norms, grads, params, states


# (model, shard_placement_fn, mfsdp2 keywords, mfsdp2's clip_grad_norm_ instead of torch's)
RUNS = {
    "moe_zero3": ("moe", "dim1", {}, False),
    "moe_zero2": ("moe", "dim1", {"sharding_strategy": "optim_grads"}, False),
    "moe_zero1_mfsdp2_clip": ("moe", "dim1", {"sharding_strategy": "optim"}, True),
    "moe_last_dim_kept_after_forward": ("moe", "last", {"reshard_after_forward": False}, False),
    "moe_offload": ("moe", "dim1", {"offload": True}, False),
    "moe_no_shard": ("moe", "dim1", {"sharding_strategy": "no_shard"}, False),
    "net_largest": ("net", "largest", {}, False),
}


def _kwargs(kw: dict, fsdp2: bool) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy

    out = {}
    if kw.get("offload"):
        out["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if "reshard_after_forward" in kw:
        out["reshard_after_forward"] = kw["reshard_after_forward"]
    if not fsdp2 and "sharding_strategy" in kw:
        out["sharding_strategy"] = kw["sharding_strategy"]
    return out


def _checkpoint_matrix(mesh, rank: int, path: str) -> dict:
    """Model and AdamW state through torch's DSD and DCP: written by each runtime after a step,
    loaded by each into a fresh model; the next step's loss and weights vs the writer's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard as torch_shard

    import mfsdp2

    libs = {"fsdp2": torch_shard, "mfsdp2": mfsdp2.fully_shard}
    n = GB // WS

    def make(lib):
        model = _wrap(_build("moe"), libs[lib], mesh, "dim1")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, s):
        loss = model(_x(s)[rank * n : (rank + 1) * n]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach(), {k: full(p) for k, p in model.named_parameters()}

    out = {}
    for src in libs:
        model, opt = make(src)
        step(model, opt, 0)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, src))
        want = step(model, opt, 1)
        for dst in libs:
            model2, opt2 = make(dst)
            msd2, osd2 = get_state_dict(model2, opt2)
            sd = {"model": msd2, "optim": osd2}
            dcp.load(sd, checkpoint_id=os.path.join(path, src))
            set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            out[(src, dst)] = (step(model2, opt2, 1), want)
    return out


def _facts(mesh, rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import mfsdp2
    from mfsdp2.checkpoint import state_dict as msd

    out = {}
    base = _build("moe")
    ours = _wrap(_build("moe"), mfsdp2.fully_shard, mesh, "dim1")
    theirs = _wrap(_build("moe"), torch_shard, mesh, "dim1")
    out["placements"] = {
        k: (repr(p.placements[0]), repr(dict(theirs.named_parameters())[k].placements[0]))
        for k, p in ours.named_parameters()
    }
    out["full_is_param"] = {k: torch.equal(full(p), v) for (k, p), v in zip(ours.named_parameters(), base.parameters())}
    sd_o, sd_t = ours.state_dict(), theirs.state_dict()
    out["sd_keys"] = (list(sd_o), list(sd_t))
    out["sd_values"] = {k: (tuple(v.shape) == tuple(sd_t[k].shape), torch.equal(full(v), full(sd_t[k])))
                        for k, v in sd_o.items()}
    # FSDP2's Shard(d) DTensors (torch.chunk slices) loaded with load_state_dict: FSDP2's values.
    other = _wrap(_build("moe"), mfsdp2.fully_shard, mesh, "dim1")
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(sd_t)
    out["load_fsdp2_sd"] = {k: torch.equal(full(p), full(sd_t[k])) for k, p in other.named_parameters()}
    # copy_ into a dim-1 parameter from a full tensor, a Replicate and a torch.chunk Shard(1) DTensor.
    w = ours.experts.w1
    target = torch.arange(w.numel(), dtype=F64).reshape(w.shape)
    copies = {}
    for name, src in {
        "full": target,
        "replicate": distribute_tensor(target, mesh, [Replicate()]),
        "shard1": distribute_tensor(target, mesh, [Shard(1)]),
    }.items():
        with torch.no_grad():
            w.zero_()
            w.copy_(src)
        copies[name] = torch.equal(full(w), target)
    out["copy_"] = copies
    # Meta build + materialize: the normal build's values.
    with torch.device("meta"):
        meta = MoE().double()
    _wrap(meta, mfsdp2.fully_shard, mesh, "dim1")
    torch.manual_seed(0)

    def init(m):
        if isinstance(m, Experts):
            with torch.no_grad():
                m.w1.copy_(base.experts.w1)
                m.w2.copy_(base.experts.w2)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()

    mfsdp2.materialize(meta, init_fn=init)
    out["materialize"] = {k: torch.equal(full(p), v) for (k, p), v in zip(meta.named_parameters(), base.parameters())
                          if "experts" in k}
    # A dtype conversion after fully_shard keeps the layout.
    conv = _wrap(_build("moe"), mfsdp2.fully_shard, mesh, "dim1").to(torch.float32)
    out["to_float32"] = {
        k: (torch.equal(full(p), v.float()), repr(p.placements[0])[:14])
        for (k, p), v in zip(conv.named_parameters(), base.parameters())
    }
    try:
        msd.get_model_state_dict(ours, options=msd.StateDictOptions(full_state_dict=True))
        out["helpers"] = "ran"
    except ValueError as e:
        out["helpers"] = str(e)
    # A dim whose size does not divide by the world size: FSDP2 refuses, mfsdp2 trains.
    try:
        _wrap(_build("moe_uneven"), torch_shard, mesh, "dim1")
        out["fsdp2_uneven"] = "accepted"
    except NotImplementedError as e:
        out["fsdp2_uneven"] = str(e)
    out["uneven"] = _train(_wrap(_build("moe_uneven"), mfsdp2.fully_shard, mesh, "dim1"), rank)
    return out


def _rank(rank, ws, path):
    from torch.distributed.fsdp import fully_shard as torch_shard

    import mfsdp2

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, (kind, fn, kw, our_clip) in RUNS.items():
        theirs = _wrap(_build(kind), torch_shard, mesh, fn, **_kwargs(kw, fsdp2=True))
        ours = _wrap(_build(kind), mfsdp2.fully_shard, mesh, fn, **_kwargs(kw, fsdp2=False))
        out[name] = {
            "fsdp2": _train(theirs, rank),
            "mfsdp2": _train(ours, rank, mfsdp2.clip_grad_norm_ if our_clip else None),
        }
    out["facts"] = _facts(mesh, rank)
    out["checkpoints"] = _checkpoint_matrix(mesh, rank, path)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_rank, WS, str(tmp_path_factory.mktemp("shard_dim")), timeout=400)


@functools.lru_cache(maxsize=None)
def _ref(kind: str):
    return _reference(kind)


def _same(got, want, where: str) -> None:
    losses, norms, grads, params, states = got
    for s, (a, b) in enumerate(zip(losses, want[0])):
        assert abs(a - b) <= REL_F64 * max(abs(b), 1e-3), (where, "loss", s, a, b)
    for s, (a, b) in enumerate(zip(norms, want[1])):
        assert_close_rel(a, b, f"{where} norm {s}", REL_F64)
    for part, got_d, want_d in (("grad", grads, want[2]), ("param", params, want[3]), ("state", states, want[4])):
        assert list(got_d) == list(want_d), (where, part)
        for k, v in want_d.items():
            assert_close_rel(got_d[k], v, f"{where} {part} {k}", REL_F64)


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_training_equals_fsdp2_and_unsharded(results, run):
    kind = RUNS[run][0]
    for rank, r in enumerate(results):
        _same(r[run]["fsdp2"], _ref(kind), f"{run} fsdp2 vs unsharded, rank {rank}")  # the reference holds
        _same(r[run]["mfsdp2"], r[run]["fsdp2"], f"{run} vs fsdp2, rank {rank}")
        _same(r[run]["mfsdp2"], _ref(kind), f"{run} vs unsharded, rank {rank}")


@pytest.mark.slow
def test_placements_state_dict_and_init(results):
    for r in results:
        f = r["facts"]
        for k, (ours, theirs) in f["placements"].items():
            dim = 1 if k.startswith("experts.") else 0
            assert ours.startswith(f"RowShard(dim={dim}") and theirs == f"Shard(dim={dim})", (k, ours, theirs)
        assert all(f["full_is_param"].values()), f["full_is_param"]
        assert f["sd_keys"][0] == f["sd_keys"][1]
        assert all(a and b for a, b in f["sd_values"].values()), f["sd_values"]
        assert all(f["copy_"].values()), f["copy_"]
        assert all(f["load_fsdp2_sd"].values()), f["load_fsdp2_sd"]
        assert f["materialize"] and all(f["materialize"].values()), f["materialize"]
        assert all(eq for eq, _ in f["to_float32"].values()), f["to_float32"]
        assert f["to_float32"]["experts.w1"][1] == "RowShard(dim=1", f["to_float32"]
        assert "sharded on dim != 0" in f["helpers"], f["helpers"]


@pytest.mark.slow
def test_uneven_dim_trains_like_unsharded(results):
    for rank, r in enumerate(results):
        f = r["facts"]
        assert "uneven sharding" in f["fsdp2_uneven"], f["fsdp2_uneven"]
        _same(f["uneven"], _ref("moe_uneven"), f"uneven, rank {rank}")


@pytest.mark.slow
def test_dcp_checkpoints_move_between_runtimes(results):
    for rank, r in enumerate(results):
        for (src, dst), ((loss, weights), (want_loss, want_weights)) in r["checkpoints"].items():
            where = f"{src} checkpoint -> {dst}, rank {rank}"
            assert_close_rel(loss, want_loss, f"{where} loss", REL_F64)
            for k, v in want_weights.items():
                assert_close_rel(weights[k], v, f"{where} {k}", REL_F64)
