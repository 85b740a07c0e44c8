"""torch 2.13's ``fully_shard`` arguments and ``FSDPModule`` methods, behaviour against FSDP2.

Each scenario trains the same float64 model on the same per-rank data with mfsdp2 and with torch
FSDP2, each in its own ``run_ranks`` call (in one process DTensor's caches relabel our RowShard
parameters once FSDP2 built its own; see test_meta_init.py), and compares full parameters after
``STEPS`` SGD steps, full gradients of the first step and the losses, rank by rank, to 1e-10
relative. Where FSDP2 is the unsharded model's equal, mfsdp2 is also checked against the
unsharded float64 reference. Collective counts are compared where they are the contract
(``set_unshard_in_backward(False)``: no all-gather in backward; custom collectives: every
gather and reduce-scatter goes through the user's object).

On a torch whose FSDP2 lacks part of this API (2.11: ``DataParallelMeshDims``,
``reset_iter_state``, three of the knobs) mfsdp2 still runs every scenario against the unsharded
reference (``DataParallelMeshDims`` then a stand-in with its fields); only the comparison with
FSDP2 of a scenario FSDP2 cannot run is skipped, naming what it lacks.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Optional, Union

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks
from ..models import Block, assert_close_rel

WS, STEPS, B, T, V, D = 2, 3, 4, 5, 24, 12
REL = 1e-10


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block(D, 20) for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.output = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _data(step: int):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _loss(model, tokens, targets, n_total):
    return F.cross_entropy(model(tokens).reshape(-1, V), targets.reshape(-1), reduction="sum") / n_total


class _Boom(Exception):
    pass


# -- scenarios: (wrap, after_wrap) applied identically with either library -------------------------
def _wrap_default(model, fully_shard, mesh, lib):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


@dataclasses.dataclass
class _DataParallelMeshDims:
    """torch 2.13's ``torch.distributed.fsdp.DataParallelMeshDims`` (its fields and the two
    properties ``fully_shard`` reads), for a torch without it: mfsdp2 takes any such object."""

    shard: Optional[Union[str, tuple]] = None
    replicate: Optional[Union[str, tuple]] = None

    @property
    def shard_names(self) -> tuple:
        return () if self.shard is None else (self.shard,) if isinstance(self.shard, str) else tuple(self.shard)

    @property
    def replicate_names(self) -> tuple:
        return () if self.replicate is None else (
            (self.replicate,) if isinstance(self.replicate, str) else tuple(self.replicate))


def _dp_mesh_dims_class():
    import torch.distributed.fsdp as fsdp

    return getattr(fsdp, "DataParallelMeshDims", _DataParallelMeshDims)


# FSDPModule knobs of torch 2.13 that older FSDP2 lacks (they do not change training: the "knobs"
# scenario calls on FSDP2 only those it has, on mfsdp2 all of them).
KNOBS = (
    ("set_reduce_scatter_unused_params", True),
    ("set_reduce_scatter_max_input_buffers", 2),
    ("set_separate_reduce_scatter_group", False),
    ("set_allocate_memory_from_process_group_for_comm", False),
)


def _wrap(kind: str, model, fully_shard, mesh, lib, counters):
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import Shard

    if kind == "list":  # chunked-loss style: norm and head form one unit
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        out = fully_shard([model.norm, model.output], mesh=mesh)
        assert isinstance(out, list) and len(out) == 2
        fully_shard(model, mesh=mesh)
    elif kind == "placement_fn":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, shard_placement_fn=lambda p: Shard(0) if p.dim() > 1 else None)
        fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: None)
    elif kind == "offload":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    elif kind == "ignored":  # the head stays plain: each rank keeps its own gradient and weights
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh, ignored_params={model.output.weight})
    elif kind == "dp_mesh_dims":
        from torch.distributed.tensor import Replicate, distribute_tensor

        spmd = init_device_mesh("cpu", (WS,), mesh_dim_names=("dp",))
        for m in model.modules():  # what FSDP2 requires: DTensors replicated over the DP dims
            for name, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[name] = nn.Parameter(distribute_tensor(p.detach(), spmd, [Replicate()]))
        dims = _dp_mesh_dims_class()(shard="dp")
        for layer in model.layers:
            fully_shard(layer, mesh=spmd, dp_mesh_dims=dims)
        fully_shard(model, mesh=spmd, dp_mesh_dims=dims)
    elif kind == "unshard_in_backward":
        fully_shard(model.tok_embeddings, mesh=mesh)
        _wrap_default(model, fully_shard, mesh, lib)
        model.tok_embeddings.set_unshard_in_backward(False)
    elif kind == "all_reduce_hook":
        _wrap_default(model, fully_shard, mesh, lib)
        for layer in model.layers:  # a linear hook: same result whatever FSDP2's pre/post divides are
            layer.set_all_reduce_hook(lambda t: t.mul_(0.25))
    elif kind == "force_sum":
        _wrap_default(model, fully_shard, mesh, lib)
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    elif kind == "divide_factor":  # non-recursive in both: only the first layer sums
        _wrap_default(model, fully_shard, mesh, lib)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.layers[0].set_reduce_scatter_divide_factor(1.0)
    elif kind == "custom_comm":
        _wrap_default(model, fully_shard, mesh, lib)
        for layer in model.layers:
            layer.set_custom_all_gather(_CountingAllGather(counters))
            layer.set_custom_reduce_scatter(_CountingReduceScatter(counters))
    elif kind == "knobs":  # accepted everywhere; training must not change
        _wrap_default(model, fully_shard, mesh, lib)
        for name, arg in KNOBS:
            if lib != "torch" or hasattr(model, name):
                getattr(model, name)(arg)
    elif kind == "reset_iter_state":
        _wrap_default(model, fully_shard, mesh, lib)
    else:
        raise ValueError(kind)


def _counting_base():
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


AllGather, ReduceScatter = _counting_base()


class _CountingAllGather(AllGather):
    def __init__(self, counters):
        self.counters = counters

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.counters["custom_ag"] += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountingReduceScatter(ReduceScatter):
    def __init__(self, counters):
        self.counters = counters

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.counters["custom_rs"] += 1
        self.counters.setdefault("rs_ops", set()).add(str(op))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


SCENARIOS = (
    "list", "placement_fn", "offload", "ignored", "dp_mesh_dims", "unshard_in_backward",
    "all_reduce_hook", "force_sum", "divide_factor", "custom_comm", "knobs", "reset_iter_state",
)
# FSDP2 with dp_mesh_dims gathers into replicated DTensors, so the model's inputs and code must be
# DTensor-aware: a plain model cannot run under it. mfsdp2 gathers plain tensors; checked against
# the unsharded model only.
NOT_COMPARABLE = {"dp_mesh_dims"}


def _fsdp2_lacks(kind: str) -> Optional[str]:
    """Why torch's FSDP2 cannot run scenario ``kind`` on this torch (None: it can)."""
    from torch.distributed.fsdp import FSDPModule

    if kind == "reset_iter_state" and not hasattr(FSDPModule, "reset_iter_state"):
        return "this torch's FSDP2 has no FSDPModule.reset_iter_state (torch 2.13)"
    return None


FSDP2_KINDS = tuple(k for k in SCENARIOS if k not in NOT_COMPARABLE and _fsdp2_lacks(k) is None)
# FSDP2's result is the unsharded model's too (the others change the gradient on purpose).
SAME_AS_UNSHARDED = {"list", "placement_fn", "offload", "dp_mesh_dims", "unshard_in_backward", "force_sum",
                     "custom_comm", "knobs", "reset_iter_state"}


def _full(p, lib):
    from torch.distributed.tensor import DTensor

    if p is None:
        return None
    if not isinstance(p, DTensor):
        return p.detach().clone()
    if lib == "torch":
        return p.full_tensor().detach().clone()
    (pl,) = p.placements
    return pl._to_replicate_tensor(p._local_tensor.detach(), p.device_mesh, 0, p.shape).clone()


def _grad(p, lib):
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor) and lib != "torch":
        local = p.grad._local_tensor if p.grad is not None else p._local_tensor.new_zeros(p._local_tensor.shape)
        (pl,) = p.placements
        return pl._to_replicate_tensor(local.detach(), p.device_mesh, 0, p.shape).clone()
    return _full(p.grad, lib)


def _rank(rank, ws, lib, kinds):
    if lib == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from mfsdp2 import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    base = LM().double()
    results = {}
    for kind in kinds:
        counters = {"custom_ag": 0, "custom_rs": 0, "bwd_ag": 0}
        model = copy.deepcopy(base)
        _wrap(kind, model, fully_shard, mesh, lib, counters)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        losses, grads = [], None
        n = B // ws
        for step in range(STEPS):
            tokens, targets = _data(step)
            tok, tgt = tokens[rank * n : (rank + 1) * n], targets[rank * n : (rank + 1) * n]
            if kind == "reset_iter_state" and step == 1:  # a step that raises mid-forward, then recovery
                hook = model.layers[1].register_forward_hook(lambda *a: (_ for _ in ()).throw(_Boom()))
                with pytest.raises(_Boom):
                    _loss(model, tok, tgt, B * T // ws).backward()
                hook.remove()
                model.reset_iter_state()
                opt.zero_grad()
            loss = _loss(model, tok, tgt, B * T // ws)
            ag_before = _ag_count(lib)
            loss.backward()
            counters["bwd_ag"] += _ag_count(lib) - ag_before
            losses.append(loss.detach().clone())
            if step == 0:
                grads = {k: _grad(p, lib) for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        params = {k: _full(p, lib) for k, p in model.named_parameters()}
        results[kind] = (losses, grads, params, counters)
    return results


_TORCH_AG = [0]


def _ag_count(lib: str) -> int:
    if lib == "torch":
        return _TORCH_AG[0]
    import mfsdp2

    return mfsdp2.comm_stats.all_gather_calls


def _torch_rank(rank, ws, kinds):
    """FSDP2 with its all-gathers counted (``dist.all_gather_single`` on torch 2.13,
    ``all_gather_into_tensor`` before: see mfsdp2.base.compat)."""
    from mfsdp2.base import compat

    name = compat.all_gather_name()
    orig = getattr(dist, name)

    def counted(*a, **k):
        _TORCH_AG[0] += 1
        return orig(*a, **k)

    setattr(dist, name, counted)
    try:
        return _rank(rank, ws, "torch", kinds)
    finally:
        setattr(dist, name, orig)


def _reference(kind: str):
    torch.manual_seed(0)
    model = LM().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses, grads = [], None
    for step in range(STEPS):
        tokens, targets = _data(step)
        loss = _loss(model, tokens, targets, B * T)
        loss.backward()
        losses.append(loss.detach())
        if step == 0:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, grads, {k: p.detach().clone() for k, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def _results(lib: str):
    if lib == "torch":
        return run_ranks(_torch_rank, WS, FSDP2_KINDS, timeout=300)
    return run_ranks(_rank, WS, "mfsdp2", SCENARIOS, timeout=300)


@pytest.mark.parametrize("kind", [k for k in SCENARIOS if k not in NOT_COMPARABLE])
def test_behaves_like_fsdp2(kind):
    if _fsdp2_lacks(kind):
        pytest.skip(_fsdp2_lacks(kind))
    ours, theirs = _results("mfsdp2"), _results("torch")
    for rank in range(WS):
        lo, go, po, co = ours[rank][kind]
        lt, gt, pt, ct = theirs[rank][kind]
        for i, (a, b) in enumerate(zip(lo, lt)):
            assert_close_rel(a, b, f"{kind} rank {rank} loss {i}", rel=REL)
        assert set(go) == set(gt)
        for k in gt:
            assert (go[k] is None) == (gt[k] is None), f"{kind} rank {rank} grad {k}: None on one side only"
            if gt[k] is not None:
                assert_close_rel(go[k], gt[k], f"{kind} rank {rank} grad {k}", rel=REL)
            assert_close_rel(po[k], pt[k], f"{kind} rank {rank} param {k}", rel=REL)


@pytest.mark.parametrize("kind", sorted(SAME_AS_UNSHARDED, key=SCENARIOS.index))
def test_matches_unsharded(kind):
    ours = _results("mfsdp2")
    ref_losses, ref_grads, ref_params = _reference(kind)
    for rank in range(WS):
        _, go, po, _ = ours[rank][kind]
        for k in ref_grads:
            assert_close_rel(go[k], ref_grads[k], f"{kind} vs unsharded grad {k}", rel=REL)
            assert_close_rel(po[k], ref_params[k], f"{kind} vs unsharded param {k}", rel=REL)


def test_ignored_params_keep_local_gradients():
    """Each rank's ignored head gets its own rank-local gradient (never averaged), as in FSDP2."""
    ours = _results("mfsdp2")
    g0, g1 = ours[0]["ignored"][1]["output.weight"], ours[1]["ignored"][1]["output.weight"]
    assert (g0 - g1).abs().max() > 1e-6
    assert not isinstance(g0, torch.distributed.tensor.DTensor)


def test_unshard_in_backward_false_issues_no_backward_all_gather():
    for lib in ("mfsdp2", "torch"):
        with_flag = _results(lib)[0]["unshard_in_backward"][3]["bwd_ag"]
        default = _results(lib)[0]["list"][3]["bwd_ag"]  # layers gather in backward either way
        assert with_flag == STEPS * 2, (lib, with_flag)  # the two layers only, not the embedding
        assert default >= STEPS * 2


def test_custom_collectives_are_called_for_every_gather_and_reduce_scatter():
    ours, theirs = _results("mfsdp2")[0]["custom_comm"][3], _results("torch")[0]["custom_comm"][3]
    # Two layers: a gather in forward and one in backward, a reduce-scatter each, per step.
    assert ours["custom_ag"] == theirs["custom_ag"] == STEPS * 2 * 2
    assert ours["custom_rs"] == theirs["custom_rs"] == STEPS * 2
    assert ours["rs_ops"] == {str(dist.ReduceOp.SUM)}
