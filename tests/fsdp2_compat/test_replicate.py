"""torch's composable DDP, ``replicate()``, over a model that holds units: the units' parameters
are theirs (torch's composable registry lists them as ``fully_shard``-managed), ``replicate``
all-reduces the rest, and training equals FSDP2's under the same ``replicate()`` on the same model
and data -- also when the forward overlaps the user's own asynchronous collectives with explicit
``unshard(async_op=True)`` calls (FSDP2's ``test_unshard_async``). Before the units were
registered, ``replicate`` tried to synchronise their uneven shards and failed at construction."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.contract import _get_registry
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import init_device_mesh

from . import runtimes
from .._dist import run_ranks


def _run(rank: int, ws: int) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, shard in runtimes().items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 3))
        shard(model[2], mesh=mesh)
        assert "fully_shard" in (_get_registry(model[2]) or {})
        replicate(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out[name] = _train(model, opt, 3, lambda s: model(
            torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * s + rank))).pow(2).mean())
    return out


def _train(model, opt, steps: int, loss_of) -> tuple:
    """``(losses, full parameters)`` after ``steps`` steps of ``loss_of(step)``; the optimizer steps
    under ``implicit_replication`` (one foreach list of plain and DTensor parameters)."""
    from torch.distributed.tensor.experimental import implicit_replication

    losses = []
    for s in range(steps):
        loss = loss_of(s)
        loss.backward()
        with implicit_replication():
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone())
                    for k, p in model.named_parameters()}


def test_replicate_over_a_model_holding_units_equals_fsdp2():
    for res in run_ranks(_run, 2):
        (l_t, p_t), (l_m, p_m) = res["fsdp2"], res["mfsdp2"]
        assert l_t == l_m
        assert list(p_t) == list(p_m)
        for k in p_t:
            assert torch.equal(p_t[k], p_m[k]), k


class _Mixer(nn.Module):
    """A projection whose output also starts an asynchronous all-reduce of its own (a user
    collective, not differentiated): returns the activation, the buffer and its work."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor):
        y = torch.tanh(x @ self.weight)
        side = y.detach().clone()
        return y, side, dist.all_reduce(side, async_op=True)


class _Heads(nn.Module):
    """Three MLPs, each consuming one mixer's output once that mixer's collective is done."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
                                  for _ in range(3))

    def forward(self, pending: list) -> torch.Tensor:
        out = 0
        for (y, side, work), mlp in zip(pending, self.mlps):
            work.wait()
            out = out + mlp(y + 0.1 * side)
        return out


class _OverlappedHeads(nn.Module):
    """Three mixers feeding three MLP units; each unit is unsharded with ``async_op=True`` right
    after its mixer started its collective, so the unit's all-gather and the user's all-reduce
    are in flight together until the heads wait on them."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mixers = nn.ModuleList(_Mixer(dim) for _ in range(3))
        self.heads = _Heads(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pending = []
        for mixer, mlp in zip(self.mixers, self.heads.mlps):
            pending.append(mixer(x))
            if hasattr(mlp, "unshard"):  # a unit (either runtime)
                mlp.unshard(async_op=True)
        return self.heads(pending)


def _run_unshard_async(rank: int, ws: int) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, shard in [("replicate", None)] + list(runtimes().items()):
        torch.manual_seed(0)
        model = _OverlappedHeads(8)
        if shard is not None:
            for mlp in model.heads.mlps:
                shard(mlp, mesh=mesh, reshard_after_forward=False)
            shard(model.heads, mesh=mesh)
        replicate(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + rank))
        out[name] = _train(model, opt, 4, lambda s: model(x).sum())
    return out


def test_async_unshard_overlapping_user_collectives_under_replicate_equals_fsdp2():
    """Equal to FSDP2 and to the model under ``replicate()`` alone, bit for bit: at two ranks
    every gradient average is one sum of two terms and a division by two (exact), whichever
    runtime reduces it and in whichever order."""
    for res in run_ranks(_run_unshard_async, 2):
        (l_t, p_t), (l_m, p_m), (l_r, p_r) = res["fsdp2"], res["mfsdp2"], res["replicate"]
        assert l_m == l_t == l_r
        assert list(p_t) == list(p_m) == list(p_r)
        for k in p_t:
            assert torch.equal(p_m[k], p_t[k]) and torch.equal(p_m[k], p_r[k]), k


def _share(rank: int, ws: int) -> list:
    """torch's ``share_comm_ctx`` over two mfsdp2 roots (pipeline chunks): the second root's units
    issue on the first's streams. On the CPU there are no streams, so the first root's
    communicator carries stand-ins for this check."""
    from torch.distributed.fsdp import share_comm_ctx

    from mfsdp2 import fully_shard

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    # Two process groups over the same ranks: each root gets communicators of its own.
    meshes = [init_device_mesh("cpu", (ws,)), DeviceMesh.from_group(dist.new_group(list(range(ws))), "cpu")]
    roots = []
    for mesh in meshes:
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
        roots.append(m)
    first = roots[0]._mfsdp2_state.comm
    saved = (first.ag_stream, first.rs_stream, first.ar_stream)
    first.ag_stream, first.rs_stream, first.ar_stream = "ag", "rs", "ar"
    try:
        share_comm_ctx(roots)
        second = [c for s in (roots[1]._mfsdp2_state, roots[1][0]._mfsdp2_state) for c in s.communicators()]
        assert all(c is not first for c in second)
        return [(c.ag_stream, c.rs_stream, c.ar_stream) for c in second]
    finally:
        for c in [first] + second:
            c.ag_stream, c.rs_stream, c.ar_stream = saved


def test_torch_share_comm_ctx_shares_streams():
    for streams in run_ranks(_share, 2):
        assert streams and all(s == ("ag", "rs", "ar") for s in streams), streams
