"""torch's composable DDP, ``replicate()``, over a model that holds units: the units' parameters
are theirs (torch's composable registry lists them as ``fully_shard``-managed), ``replicate``
all-reduces the rest, and training equals FSDP2's under the same ``replicate()`` on the same model
and data. Before the units were registered, ``replicate`` tried to synchronise their uneven
shards and failed at construction."""

from __future__ import annotations

import torch
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
        losses = []
        for step in range(3):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        params = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone())
                  for k, p in model.named_parameters()}
        out[name] = (losses, params)
    return out


def test_replicate_over_a_model_holding_units_equals_fsdp2():
    for res in run_ranks(_run, 2):
        (l_t, p_t), (l_m, p_m) = res["fsdp2"], res["mfsdp2"]
        assert l_t == l_m
        assert list(p_t) == list(p_m)
        for k in p_t:
            assert torch.equal(p_t[k], p_m[k]), k


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
