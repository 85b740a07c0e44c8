"""``model.state_dict()`` / ``load_state_dict`` and torch's ``clip_grad_norm_`` as torch FSDP2's
suite uses them, run by FSDP2 and by mfsdp2 on the same float64 model in the same process.

* Keys (buffers included, non-persistent ones left out) in FSDP2's order; every parameter a
  DTensor with the global shape and dtype and a dim-0 shard placement; full values the model's.
* With ``reshard_after_forward=False`` a state dict taken after a forward (parameters still
  unsharded) equals the one taken before.
* The values alias the sharded parameters (same local storage), so a state dict taken once still
  shows the weights after optimizer steps.
* ``load_state_dict`` of new DTensors (clones filled with other values) writes into the existing
  parameters (local storage unchanged).
* Meta-device init from a checkpoint: ``load_state_dict(..., assign=True)`` of
  ``distribute_tensor(full, p.device_mesh, p.placements)`` pieces, key by key with
  ``strict=False`` and all at once from rank 0's full state dict; the result equals a model built
  normally and trains like it (loss and gradients of a step); also under ``CPUOffloadPolicy``.
* A full state dict on rank 0 from the values' ``full_tensor()``.
* ``torch.nn.utils.clip_grad_norm_(..., foreach=True)`` for norm orders 2, 1 and inf: the total
  norm, the clipped gradients, and the all-reduces it issues (counted by ``CommDebugMode``) are
  FSDP2's; the norm is the unsharded model's.
* Whole-tensor ``max`` / ``min`` / ``amax`` / ``amin`` / inf-norm of each gradient equal the same
  reduction of the full gradient, on ranks holding no rows of it too.

Tolerance: REL_F64 (float64; only reduction order differs).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from . import full, runtimes
from .._dist import run_ranks
from ..models import REL_F64, assert_close_rel

WS, D = 2, 5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, 3 * D)
        self.fc2 = nn.Linear(3 * D, D)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D))
        self.register_buffer("offset", torch.ones(D), persistent=False)

    def forward(self, x):
        return (self.fc2(F.relu(self.fc1(x))) + self.offset) * self.scale


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Block(), nn.Sequential(Block(), nn.Linear(D, D)), Block()).double()


def _wrap(model, shard, mesh, **kw):
    for m in (model[0], model[1][0], model[2]):
        shard(m, mesh=mesh, **kw)
    shard(model, mesh=mesh, **kw)
    return model


def _x(i, rank=0):
    return torch.randn(3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * i + rank))


def _describe(sd):
    from torch.distributed.tensor import DTensor

    return [
        (k, type(v).__name__, tuple(v.shape), v.dtype, isinstance(v, DTensor) and v.placements[-1].is_shard(0), full(v))
        for k, v in sd.items()
    ]


def keys_and_values(shard, mesh, rank):
    model = _wrap(_model(), shard, mesh)
    return _describe(model.state_dict())


def after_forward(shard, mesh, rank):
    model = _wrap(_model(), shard, mesh, reshard_after_forward=False)
    before = {k: full(v) for k, v in model.state_dict().items()}
    model(_x(0, rank))  # the units stay unsharded
    after = model.state_dict()
    return {"same": all(torch.equal(full(after[k]), v) for k, v in before.items()), "after": _describe(after)}


def aliasing(shard, mesh, rank):
    model = _wrap(_model(), shard, mesh)
    sd = model.state_dict()
    params = dict(model.named_parameters())
    alias = [sd[k].to_local().data_ptr() == p.to_local().data_ptr() for k, p in params.items() if p.to_local().numel()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        model(_x(step, rank)).sum().backward()
        opt.step()
        opt.zero_grad()
    return {"alias": all(alias), "tracks": all(torch.equal(full(sd[k]), full(p)) for k, p in params.items())}


def load_new_dtensors(shard, mesh, rank):
    model = _wrap(_model(), shard, mesh)
    ptrs = {k: p.to_local().data_ptr() for k, p in model.named_parameters()}
    sd = {k: v.detach().clone().fill_(7.0) if k in ptrs else v for k, v in model.state_dict().items()}
    model.load_state_dict(sd)
    return {
        "values": all(torch.equal(full(p), torch.full(p.shape, 7.0, dtype=p.dtype)) for p in model.parameters()),
        "in_place": all(p.to_local().data_ptr() == ptrs[k] for k, p in model.named_parameters()
                        if p.to_local().numel()),
    }


def _meta_model(shard, mesh, **kw):
    with torch.device("meta"):
        model = _model()
    return _wrap(model, shard, mesh, **kw)


def _to_empty(model):
    """``to_empty`` and the non-persistent buffers' values (no state dict carries them)."""
    model.to_empty(device="cpu")
    for m in model.modules():
        if isinstance(m, Block):
            m.offset.fill_(1.0)


def _step_of(model, rank):
    loss = model(_x(5, rank)).pow(2).sum()
    loss.backward()
    return loss.detach(), {k: full(p.grad) for k, p in model.named_parameters()}


def meta_init_from_state_dict(shard, mesh, rank, **kw):
    from torch.distributed.tensor import distribute_tensor

    full_sd = _model().state_dict()
    ref = _wrap(_model(), shard, mesh)
    out = {}
    for how in ("key_by_key", "rank0_broadcast"):
        model = _meta_model(shard, mesh, **kw)
        if how == "key_by_key":
            _to_empty(model)
        pieces = {}
        for k, p in model.named_parameters():
            src = full_sd[k].clone() if how == "key_by_key" or rank == 0 else torch.empty(p.shape, dtype=p.dtype)
            if how == "rank0_broadcast":
                torch.distributed.broadcast(src, src=0)
            pieces[k] = nn.Parameter(distribute_tensor(src, p.device_mesh, p.placements))
        if how == "key_by_key":
            for k, v in pieces.items():
                model.load_state_dict({k: v}, assign=True, strict=False)
            model.load_state_dict({k: v for k, v in full_sd.items() if k not in pieces}, strict=False)
        else:
            _to_empty(model)
            model.load_state_dict({**{k: v for k, v in full_sd.items() if k not in pieces}, **pieces}, assign=True)
        out[how] = {
            "equal": all(torch.equal(full(p), full(q)) for p, q in zip(model.parameters(), ref.parameters())),
            "step": _step_of(model, rank),
        }
    out["ref_step"] = _step_of(ref, rank)
    return out


def meta_init_offloaded(shard, mesh, rank):
    """The same under torch's ``CPUOffloadPolicy`` (FSDP2's ``dp_state_dict_cpu_offload``): the
    pieces are assigned into units whose main state lives in host memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return meta_init_from_state_dict(shard, mesh, rank, offload_policy=CPUOffloadPolicy(pin_memory=False))


def full_on_rank0(shard, mesh, rank):
    model = _wrap(_model(), shard, mesh)
    sd = {}
    for k, v in model.state_dict().items():
        t = full(v)
        if rank == 0:
            sd[k] = t
    return sd


def clip(shard, mesh, rank):
    from torch.distributed.tensor.debug import CommDebugMode

    out = {}
    for norm_type in (2.0, 1.0, float("inf")):
        model = _wrap(_model(), shard, mesh)
        model(_x(0, rank)).pow(2).sum().backward()
        before = {k: full(p.grad) for k, p in model.named_parameters()}
        with CommDebugMode() as comm:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5, norm_type=norm_type, foreach=True)
        out[norm_type] = {
            "total": full(total),
            "all_reduces": sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op)),
            "before": before,
            "after": {k: full(p.grad) for k, p in model.named_parameters()},
        }
    return out


def reductions(shard, mesh, rank):
    """Whole-tensor max / min / amax / amin / inf-norm of every gradient (logging code does this)."""
    model = _wrap(_model(), shard, mesh)
    model(_x(0, rank)).pow(2).sum().backward()
    ops = {
        "absmax": lambda g: g.abs().max(),
        "min": lambda g: g.min(),
        "amax": lambda g: g.amax(),
        "amin": lambda g: g.amin(),
        "norm_inf": lambda g: torch.linalg.vector_norm(g, float("inf")),
    }
    return {(k, name): (full(f(p.grad)), f(full(p.grad)))
            for k, p in model.named_parameters() for name, f in ops.items()}


CASES = (keys_and_values, after_forward, aliasing, load_new_dtensors, meta_init_from_state_dict, meta_init_offloaded,
         full_on_rank0, clip, reductions)


def _rank(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for lib, shard in runtimes().items():
        for fn in CASES:
            out[(fn.__name__, lib)] = fn(shard, mesh, rank)
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(_rank, WS, timeout=300)


def _same_rows(ours, theirs, where):
    assert [r[:5] for r in ours] == [r[:5] for r in theirs], (where, [r[:5] for r in ours], [r[:5] for r in theirs])
    for (k, *_, a), (_, *_, b) in zip(ours, theirs):
        assert torch.equal(a, b), (where, k)


def test_state_dict_keys_types_shapes_and_values_match_fsdp2():
    for res in _results():
        ours, theirs = res[("keys_and_values", "mfsdp2")], res[("keys_and_values", "fsdp2")]
        assert "0.offset" not in [r[0] for r in theirs] and "0.scale" in [r[0] for r in theirs]
        _same_rows(ours, theirs, "state_dict")


def test_state_dict_after_a_forward_without_reshard_matches_fsdp2():
    for res in _results():
        ours, theirs = res[("after_forward", "mfsdp2")], res[("after_forward", "fsdp2")]
        assert theirs["same"] and ours["same"]
        _same_rows(ours["after"], theirs["after"], "state_dict after forward")


@pytest.mark.parametrize("what", ["aliasing", "load_new_dtensors"])
def test_state_dict_values_are_the_parameters_like_fsdp2(what):
    for res in _results():
        ours, theirs = res[(what, "mfsdp2")], res[(what, "fsdp2")]
        assert all(theirs.values()), theirs
        assert ours == theirs, (what, ours)


@pytest.mark.parametrize("case", ["meta_init_from_state_dict", "meta_init_offloaded"])
def test_meta_init_from_a_state_dict_matches_fsdp2(case):
    for res in _results():
        ours, theirs = res[(case, "mfsdp2")], res[(case, "fsdp2")]
        for how in ("key_by_key", "rank0_broadcast"):
            assert theirs[how]["equal"] and ours[how]["equal"], how
            for side in (ours, theirs):
                loss, grads = side[how]["step"]
                ref_loss, ref_grads = side["ref_step"]
                assert_close_rel(loss, ref_loss, f"{how} loss", REL_F64)
                for k, g in ref_grads.items():
                    assert_close_rel(grads[k], g, f"{how} grad {k}", REL_F64)
            assert_close_rel(ours[how]["step"][0], theirs[how]["step"][0], f"{how} loss vs FSDP2", REL_F64)


def test_full_state_dict_on_rank0_matches_fsdp2_and_the_model():
    ref = _model().state_dict()
    for rank, res in enumerate(_results()):
        ours, theirs = res[("full_on_rank0", "mfsdp2")], res[("full_on_rank0", "fsdp2")]
        if rank:
            assert ours == theirs == {}
            continue
        assert list(ours) == list(theirs) == list(ref)
        for k, v in ref.items():
            assert torch.equal(ours[k], v) and torch.equal(theirs[k], v), k


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_torch_clip_grad_norm_matches_fsdp2(norm_type):
    for res in _results():
        ours, theirs = res[("clip", "mfsdp2")][norm_type], res[("clip", "fsdp2")][norm_type]
        assert ours["all_reduces"] == theirs["all_reduces"], (ours["all_reduces"], theirs["all_reduces"])
        assert_close_rel(ours["total"], theirs["total"], "total norm", REL_F64)
        grads = torch.cat([g.flatten() for g in theirs["before"].values()])
        assert_close_rel(theirs["total"], torch.linalg.vector_norm(grads, norm_type), "FSDP2 vs unsharded norm",
                         REL_F64)
        assert theirs["total"] > 0.5, "clipping must be active"
        for k, g in theirs["after"].items():
            assert_close_rel(ours["before"][k], theirs["before"][k], f"grad {k}", REL_F64)
            assert_close_rel(ours["after"][k], g, f"clipped grad {k}", REL_F64)


def test_whole_tensor_reductions_of_gradients_match_fsdp2():
    """Each reduction of the sharded gradient equals the same reduction of the full gradient, on
    both runtimes (mfsdp2's layout leaves ranks without rows of some parameters: their empty
    pieces used to raise there while the other ranks waited)."""
    for res in _results():
        ours, theirs = res[("reductions", "mfsdp2")], res[("reductions", "fsdp2")]
        assert list(ours) == list(theirs)
        for key, (sharded, whole) in theirs.items():
            assert torch.equal(sharded, whole), ("FSDP2", key)
            assert torch.equal(ours[key][0], ours[key][1]), ("mfsdp2", key)
            assert_close_rel(ours[key][0], sharded, f"{key}", REL_F64)
