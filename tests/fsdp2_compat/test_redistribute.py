"""``redistribute`` of our parameters gives DTensors that hold the rows their placements name.

``RowShard`` compares equal to ``Shard(0)`` (DTensor's sharding rules must accept it as a dim-0
shard), and DTensor decides what ``redistribute`` moves by comparing placements: asked for a plain
``Shard(0)``, it moved nothing, so the result held our uneven rows where a ``torch.chunk`` split
was asked for (its ``to_local()`` was not FSDP2's, and whatever consumed it per rank -- a
hand-written checkpoint, a tensor combined with an FSDP2 one -- got the wrong rows). The reverse,
a chunk-split DTensor redistributed to our ``RowShard``, kept the chunk rows.

Checked at world sizes 2 and 4 on a model whose layout gives ranks uneven (and empty) row counts:
the local tensor after each redistribution against the rows the placement names, cut from the
unsharded tensor; ``full_tensor()`` of every result against the unsharded tensor; the gradient
through a redistribution against the unsharded one; the same redistribution of torch FSDP2's
parameter in the same process (its ``Shard(0)`` *is* the chunk split); and HSDP's
``(Replicate, RowShard)`` at world size 4. Values are copied, never computed: exact equality.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 7), nn.Linear(7, 5), nn.Linear(5, 3)).double()


def _rank(rank, ws):
    from torch.distributed.fsdp import fully_shard as torch_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from mfsdp2 import RowShard
    from mfsdp2.dtensors.placement import chunk_rows
    from mfsdp2 import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    ref = _model()
    full = {k: v.detach().clone() for k, v in ref.named_parameters()}
    ours = fully_shard(_model(), mesh=mesh)
    theirs = torch_shard(_model(), mesh=mesh)
    out = {"uneven": False}
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        (pl,) = p.placements
        split = chunk_rows(full[name].shape[0], ws)
        chunk = full[name][sum(split[:rank]) : sum(split[: rank + 1])]
        mine = full[name][pl.starts[rank] : pl.starts[rank] + pl.rows[rank]]
        out["uneven"] |= tuple(pl.rows) != split

        s0 = p.redistribute(mesh, [Shard(0)])
        assert type(s0.placements[0]) is Shard, (name, s0.placements)
        assert torch.equal(s0.to_local(), chunk), (name, "Shard(0) rows")
        assert torch.equal(s0.to_local(), q.redistribute(mesh, [Shard(0)]).to_local()), (name, "vs FSDP2")
        assert torch.equal(s0.full_tensor(), full[name]), (name, "Shard(0) full")

        rep = p.redistribute(mesh, [Replicate()])
        assert torch.equal(rep.to_local(), full[name]), (name, "Replicate")
        back = rep.redistribute(mesh, [Shard(0)])
        assert type(back.placements[0]) is Shard and torch.equal(back.to_local(), chunk), (name, "R->S0")
        again = s0.redistribute(mesh, p.placements)
        assert isinstance(again.placements[0], RowShard), (name, again.placements)
        assert torch.equal(again.to_local(), mine), (name, "Shard(0) -> RowShard rows")
        assert torch.equal(again.full_tensor(), full[name]), (name, "Shard(0) -> RowShard full")
        chunked = distribute_tensor(full[name], mesh, [Shard(0)])
        assert torch.equal(chunked.redistribute(mesh, p.placements).to_local(), mine), (name, "chunk -> RowShard")
        assert torch.equal(rep.redistribute(mesh, p.placements).to_local(), mine), (name, "R -> RowShard")

        # Autograd through the redistribution: d/dp sum(w * p) = w, each rank its own rows.
        w = torch.arange(full[name].numel(), dtype=full[name].dtype).view_as(full[name])
        leaf = p.detach().requires_grad_(True)
        local_w = w[sum(split[:rank]) : sum(split[: rank + 1])]
        (leaf.redistribute(mesh, [Shard(0)]).to_local() * local_w).sum().backward()
        assert isinstance(leaf.grad, DTensor) and torch.equal(leaf.grad.full_tensor(), w), (name, "grad")
    if ws == 4:  # HSDP: (Replicate, RowShard) -> (Replicate, Shard(0)) and back
        hmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        hsdp = fully_shard(_model(), mesh=hmesh)
        srank = hmesh.get_local_rank("shard")
        for name, p in hsdp.named_parameters():
            s0 = p.redistribute(hmesh, [Replicate(), Shard(0)])
            parts = torch.chunk(full[name], 2)
            assert type(s0.placements[1]) is Shard and torch.equal(s0.to_local(), parts[srank]), (name, "HSDP")
            assert torch.equal(s0.full_tensor(), full[name]), (name, "HSDP full")
            assert torch.equal(s0.redistribute(hmesh, p.placements).to_local(), p.to_local()), (name, "HSDP back")
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_redistribute_gives_the_rows_the_placement_names(ws):
    res = run_ranks(_rank, ws)
    assert res[0]["uneven"], "the model must give some parameter a row split other than torch.chunk's"
