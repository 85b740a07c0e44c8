"""Tensor-parallel parameters that ``fully_shard`` shards on the dim their TP placement already
splits (mfsdp2.dtensors.shard_dim, mfsdp2.dtensors.tensor_parallel), side by side with torch
FSDP2 given the same ``shard_placement_fn`` in the same processes, and the unsharded model.

A (dp=2, tp=2) mesh of 4 CPU ranks; each block's ``fc1`` column-wise parallel (``Shard(0)`` on
tp), ``fc2`` row-wise parallel (``Shard(1)`` on tp), then ``fully_shard`` over ``mesh['dp']``.
Each TP Linear is a unit of its own (then its block, then the root), so the dp split falls inside
the weight's TP piece. Cases: ``dim1`` -- ``Shard(1)`` for every matrix (``fc2.weight``'s dim 1
is TP's), ``mixed`` -- ``Shard(0)`` for the column-wise weights (dim 0 is TP's), ``Shard(-1)`` for
the row-wise ones, ``None`` for the rest, with ``ContiguousLinear`` blocks, and ``uneven`` -- a
row-wise ``Linear(41, 16)`` whose TP pieces hold 21 and 20 columns, sharded on that dim (FSDP2
refuses: 21 does not divide by 2; mfsdp2 only, against the unsharded model).

FSDP2 places such a parameter ``(_StridedShard(d, split_factor=tp), Shard(d))`` on its ``(dp, tp)``
mesh; mfsdp2's optimizer-facing DTensor lives on the ``(tp, dp)`` mesh as ``(Shard(d),
RowShard(d, rows))``, which DTensor reads left to right: TP splits the global tensor, dp the
TP-local piece. Checked:

* training (3 AdamW steps, float64): losses, full gradients of the last step, full parameters and
  AdamW states equal the unsharded model's to ``REL_F64`` (tests/models.py has the error
  analysis) and FSDP2's **bit for bit** in ``mixed``. In ``dim1`` they equal FSDP2's to
  ``REL_F64`` only: mfsdp2's gathered ``Shard(d != 0)`` parameter is a strided view of its buffer,
  FSDP2's a contiguous copy, and the CPU GEMM sums a transposed operand in another order --
  ``mixed`` computes with a contiguous copy of the piece in both runtimes (``ContiguousLinear``),
  which leaves everything else (layout, collectives, reductions, AdamW) to be compared exactly;
* the placement is truthful: the local piece is the full tensor sliced at the offsets
  ``compute_local_shape_and_global_offset`` derives from it (what DCP writes), and the row-wise
  weight of some block is split between both dp ranks (the nested offsets are exercised);
* ``redistribute`` to ``Replicate`` on both dims, to the TP placement alone and to ``torch.chunk``'s
  nested ``(Shard(d), Shard(d))`` gives the slices of the full tensor each placement describes;
* DCP through torch's DSD (model and AdamW states): a checkpoint written by FSDP2 loads into
  mfsdp2 and the reverse, each equal to the writer's parameters and states bit for bit; mfsdp2's
  model entries load into plain full tensors, and those through ``load_state_dict`` back;
* FSDP2's per-parameter state (``FSDPParam.fsdp_placement``, ``_orig_size``) reads the same on
  mfsdp2's accessor: the data-parallel ``Shard(d)`` and the TP-local size.
"""

from __future__ import annotations

import functools
import logging
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from .._dist import run_ranks
from ..fsdp2_compat import full, runtimes
from ..models import F64, REL_F64, Net, assert_close_rel, batch, loss_fn, make_opt

WS, STEPS, GB = 4, 3, 8


class UnevenNet(Net):
    """Net plus a root-level ``down(gelu(up(h)))`` whose row-wise ``down`` (``Linear(41, 16)``)
    splits 41 columns over tp 2: TP pieces of 21 and 20 columns."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 41)
        self.down = nn.Linear(41, 16)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h + self.down(F.gelu(self.up(h))))


class ContiguousLinear(nn.Linear):
    """A Linear that computes with a contiguous copy of its weight's TP piece: the same GEMM
    whether the runtime's gathered weight is a strided view (mfsdp2's ``Shard(d != 0)``) or a
    contiguous copy (FSDP2's), so the two runs must agree bit for bit. (``w.contiguous()`` would
    not do: the DTensor's global strides are contiguous whatever its piece's are.)"""

    def forward(self, x):
        w = self.weight
        if isinstance(w, DTensor):
            w = DTensor.from_local(w.to_local().contiguous(), w.device_mesh, w.placements, run_check=False,
                                   shape=w.shape, stride=w.stride())
        return F.linear(x, w, self.bias)


class ContiguousNet(Net):
    def __init__(self):
        super().__init__()
        for b in self.blocks:
            for name in ("fc1", "fc2"):
                old = getattr(b, name)
                new = ContiguousLinear(old.in_features, old.out_features)
                new.load_state_dict(old.state_dict())
                setattr(b, name, new)


def _dim1(p):
    return Shard(1) if p.dim() == 2 else None


def _mixed(p):
    if not isinstance(p, DTensor) or p.dim() != 2:
        return None
    return Shard(0) if p.placements[0] == Shard(0) else Shard(-1)


CASES = {"dim1": ("net", _dim1), "mixed": ("contiguous", _mixed), "uneven": ("uneven", _dim1)}


def _plain(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {"net": Net, "contiguous": ContiguousNet, "uneven": UnevenNet}[kind]().to(F64)


def _model(kind: str, mesh, shard, fn) -> nn.Module:
    model = _plain(kind)
    units = []
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        units += [b.fc1, b.fc2, b]
    if kind == "uneven":
        parallelize_module(model, mesh["tp"], {"down": RowwiseParallel(input_layouts=Replicate())})
        units.append(model.down)
    # each TP Linear a unit of its own: its weight is most of its group, so the group's split
    # between the dp ranks falls inside the weight's TP piece (offsets within it are used)
    for m in units + [model]:
        shard(m, mesh=mesh["dp"], shard_placement_fn=fn)
    return model


def _train(model, dp: int = 0, dp_size: int = 1) -> tuple:
    """STEPS AdamW steps on this dp rank's slice of the global batch: (losses, last step's full
    gradients, full parameters, full AdamW states, the optimizer)."""
    opt = make_opt("adamw", model.parameters())
    losses, grads = [], {}
    n = GB // dp_size
    for step in range(STEPS):
        x, y = batch(step, GB, 12, dtype=F64)
        loss = loss_fn(model(x[dp * n : (dp + 1) * n]), y[dp * n : (dp + 1) * n])
        loss.backward()
        if step == STEPS - 1:
            grads = {k: full(p.grad) for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if dp_size > 1:
            torch.distributed.all_reduce(t)
            t /= torch.distributed.get_world_size()
        losses.append(t.item())
    return losses, grads, {k: full(p) for k, p in model.named_parameters()}, _states(model, opt), opt


def _slices(p: DTensor) -> bool:
    """Whether ``p``'s local piece is its full tensor sliced at the offsets its placements give."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    whole = p.full_tensor()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = p.to_local()
    if tuple(local.shape) != tuple(shape):
        return False
    if local.numel() == 0:
        return True
    for d, (o, n) in enumerate(zip(offset, shape)):
        whole = whole.narrow(d, o, n)
    return torch.equal(local, whole)


def _redistributions(p: DTensor) -> dict:
    """Each redistribution of ``p`` against the slices of its full tensor the target describes."""
    if not isinstance(p.placements[0], Shard):
        return {"replicate": True, "tp only": True, "chunk": True}  # a replicated TP parameter: nothing nested
    whole = p.full_tensor().detach()
    d = p.placements[0].dim
    out = {}
    for name, target in (("replicate", (Replicate(), Replicate())), ("tp only", (Shard(d), Replicate())),
                         ("chunk", (Shard(d), Shard(d)))):
        want = distribute_tensor(whole, p.device_mesh, target).to_local()
        out[name] = torch.equal(p.redistribute(p.device_mesh, target).to_local(), want)
    return out


def _facts(model) -> dict:
    """Placements, truthful slices and redistributions of every tensor-parallel parameter."""
    out = {}
    for k, p in model.named_parameters():
        if p.device_mesh.ndim != 2:
            continue
        split = p.placements[1].rows
        out[k] = {
            "placements": str(p.placements), "mesh": tuple(p.device_mesh.mesh_dim_names),
            "split_on_both": all(split), "slices": _slices(p), **_redistributions(p),
            "grad_slices": _slices(p.grad) if p.grad is not None else None,
        }
    return out


def _states(model, opt) -> dict:
    names = {id(p): k for k, p in model.named_parameters()}
    return {f"{names[id(p)]}.{s}": full(v) for p, st in opt.state.items() for s, v in st.items() if s != "step"}


def _checkpoints(kind, mesh, fn, trained: dict, path: str) -> dict:
    """DCP between the runtimes (torch's DSD: model and AdamW states): each runtime's trained
    model saved and loaded into a fresh model of the other; mfsdp2's model entries also loaded
    into plain full tensors, and those through ``load_state_dict`` into a fresh mfsdp2 model.
    ``{(writer, reader): (full parameters, full AdamW states)}``."""
    out = {}
    for name, (model, opt) in trained.items():
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(sd, checkpoint_id=f"{path}/{name}")
    for src, dst in (("fsdp2", "mfsdp2"), ("mfsdp2", "fsdp2")):
        fresh = _model(kind, mesh, runtimes()[dst], fn)
        opt = make_opt("adamw", fresh.parameters())
        sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, opt)}
        dcp.load(sd, checkpoint_id=f"{path}/{src}")
        set_model_state_dict(fresh, sd["model"])
        set_optimizer_state_dict(fresh, opt, sd["optim"])
        out[(src, dst)] = ({k: full(p) for k, p in fresh.named_parameters()}, _states(fresh, opt))
    sd = trained["mfsdp2"][0].state_dict()
    plain = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    dcp.load({"model": plain}, checkpoint_id=f"{path}/mfsdp2")
    out[("mfsdp2", "plain")] = (plain, None)
    fresh = _model(kind, mesh, runtimes()["mfsdp2"], fn)
    fresh.load_state_dict(plain)
    out[("mfsdp2", "plain -> mfsdp2")] = ({k: full(p) for k, p in fresh.named_parameters()}, None)
    return out


def _rank(rank: int, ws: int, path: str) -> dict:
    # DTensor warns at every gather of a nested split that it takes two collectives, FSDP2 that a
    # TP Linear returns a view
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank(0)
    out = {}
    for case, (kind, fn) in CASES.items():
        if kind == "uneven":
            try:
                _model(kind, mesh, runtimes()["fsdp2"], fn)
                out["fsdp2_uneven"] = "accepted"
            except NotImplementedError as e:
                out["fsdp2_uneven"] = str(e)
            model = _model(kind, mesh, runtimes()["mfsdp2"], fn)
            out[case] = {"mfsdp2": _train(model, dp, 2)[:4], "facts": _facts(model)}
            continue
        models = {name: _model(kind, mesh, shard, fn) for name, shard in runtimes().items()}
        runs = {name: _train(m, dp, 2) for name, m in models.items()}
        out[case] = {name: run[:4] for name, run in runs.items()}
        out[case]["facts"] = _facts(models["mfsdp2"])
        out[case]["fsdp2_placements"] = {k: str(p.placements) for k, p in models["fsdp2"].named_parameters()}
        out[case]["accessor"] = {name: _accessor(m) for name, m in models.items()}
        trained = {name: (models[name], runs[name][4]) for name in models}
        out[case]["checkpoints"] = _checkpoints(kind, mesh, fn, trained, f"{path}/{case}")
    return out


def _accessor(model) -> list:
    """FSDP2's per-parameter state of block 0's row-wise unit: (fsdp_placement, _orig_size) each."""
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(model.blocks[0].fc2, FSDPModule)
    group = model.blocks[0].fc2._get_fsdp_state()._fsdp_param_group
    return [(isinstance(fp.fsdp_placement, Shard) and fp.fsdp_placement.dim, tuple(fp._orig_size))
            for fp in group.fsdp_params]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_rank, WS, str(tmp_path_factory.mktemp("tp_shard_dim")), timeout=400)


@functools.lru_cache(maxsize=None)
def _reference(kind: str) -> tuple:
    torch.set_num_threads(1)
    return _train(_plain(kind))


def _same(got, want, where: str) -> None:
    losses, grads, params, states = got[:4]
    for s, (a, b) in enumerate(zip(losses, want[0], strict=True)):
        assert abs(a - b) <= REL_F64 * max(abs(b), 1e-3), (where, "loss", s, a, b)
    for part, got_d, want_d in (("grad", grads, want[1]), ("param", params, want[2]), ("state", states, want[3])):
        assert sorted(got_d) == sorted(want_d), (where, part)
        for k, v in want_d.items():
            assert_close_rel(got_d[k], v, f"{where} {part} {k}", REL_F64)


def _identical(got, want, where: str) -> None:
    assert got[0] == want[0], (where, "losses", got[0], want[0])
    for part, got_d, want_d in zip(("grad", "param", "state"), got[1:4], want[1:4]):
        assert sorted(got_d) == sorted(want_d), (where, part)
        for k, v in want_d.items():
            assert torch.equal(got_d[k], v), f"{where} {part} {k}: max diff {(got_d[k] - v).abs().max().item()}"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dim1", "mixed"])
def test_training_equals_fsdp2_and_unsharded(results, case):
    ref = _reference(CASES[case][0])
    for rank, r in enumerate(results):
        _same(r[case]["fsdp2"], ref, f"{case} fsdp2 vs unsharded, rank {rank}")
        _same(r[case]["mfsdp2"], ref, f"{case} mfsdp2 vs unsharded, rank {rank}")
        if case == "mixed":  # the same GEMMs in both runtimes (ContiguousLinear): bit for bit
            _identical(r[case]["mfsdp2"], r[case]["fsdp2"], f"{case} mfsdp2 vs fsdp2, rank {rank}")
        else:  # mfsdp2 multiplies by strided views: the GEMM sums in another order
            _same(r[case]["mfsdp2"], r[case]["fsdp2"], f"{case} mfsdp2 vs fsdp2, rank {rank}")


@pytest.mark.slow
def test_uneven_tp_pieces_train_like_unsharded(results):
    for rank, r in enumerate(results):
        # FSDP2 refuses where the TP piece (21 columns on tp rank 0) does not divide by dp
        assert ("uneven sharding" in r["fsdp2_uneven"]) == (rank % 2 == 0), (rank, r["fsdp2_uneven"])
        _same(r["uneven"]["mfsdp2"], _reference("uneven"), f"uneven, rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_placements_describe_the_pieces(results, case):
    """(Shard(d), RowShard(d, rows)) on the (tp, dp) mesh for a TP parameter sharded on TP's own
    dim ``d``; its pieces, its gradient's and every redistribution are the slices it describes."""
    nested = {"dim1": {"fc2.weight": 1}, "mixed": {"fc1.weight": 0, "fc2.weight": 1},
              "uneven": {"fc2.weight": 1, "down.weight": 1}}[case]
    for r in results:
        facts = r[case]["facts"]
        for k, f in facts.items():
            assert f["mesh"] == ("tp", "dp"), (k, f)
            assert f["slices"] and f["grad_slices"] in (True, None), (k, f)
            assert f["replicate"] and f["tp only"] and f["chunk"], (k, f)
            want = nested.get(k.split(".", 2)[-1] if k.startswith("blocks.") else k)
            if want is not None:
                assert f["placements"].startswith(f"(Shard(dim={want}), RowShard(dim={want}"), (k, f)
                if case != "uneven":  # FSDP2's placement of the same parameter
                    assert r[case]["fsdp2_placements"][k].startswith(f"(_StridedShard(dim={want}, sf=2)"), k
        # some nested parameter holds rows on both dp ranks: the offsets inside a TP piece are used
        assert any(f["split_on_both"] and k.endswith(tuple(nested)) for k, f in facts.items()), facts


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dim1", "mixed"])
def test_dcp_checkpoints_move_between_runtimes(results, case):
    for rank, r in enumerate(results):
        for (src, dst), (params, states) in r[case]["checkpoints"].items():
            where = f"{case}: {src} checkpoint -> {dst}, rank {rank}"
            want_params, want_states = r[case][src][2], r[case][src][3]
            assert sorted(params) == sorted(want_params), where
            for k, v in want_params.items():
                assert torch.equal(params[k], v), f"{where}, {k}"
            if states is not None:
                assert sorted(states) == sorted(want_states), where
                for k, v in want_states.items():
                    assert torch.equal(states[k], v), f"{where}, {k}"


@pytest.mark.slow
def test_fsdp2_param_state_names_the_data_parallel_placement(results):
    """FSDP2's ``FSDPParam.fsdp_placement`` is the data-parallel ``Shard(d)`` (not the TP
    placement) and its ``_orig_size`` the TP-local size: mfsdp2's accessor says the same."""
    for r in results:
        for case in ("dim1", "mixed"):
            acc = r[case]["accessor"]
            assert acc["mfsdp2"] == acc["fsdp2"], (case, acc)
