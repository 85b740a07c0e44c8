"""Communicators are made once per (group, device) and never outlive their default process group.

After ``destroy_process_group()`` and a new ``init_process_group()`` in one process, the next
``fully_shard`` gets communicators of the new groups, trains exactly as in the first process
group, and no communicator holds the destroyed default group any more (torch's own C++ objects
may still keep it, so the test asks Python's garbage collector who refers to it).
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard
from mfsdp2.comm import registry

from .._dist import client_store, run_ranks


def _train(rank: int, ws: int) -> tuple[list[float], object]:
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for m in (model[0], model[2]):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    comm = model[0]._mfsdp2_state.groups[0].comm
    assert comm.group is mesh.get_group(0)
    return losses, comm


def _reinit(rank: int, ws: int):
    first, comm1 = _train(rank, ws)
    old_world = dist.group.WORLD
    dist.destroy_process_group()
    port = int(os.environ["MASTER_PORT"])
    dist.init_process_group("gloo", store=dist.PrefixStore("again", client_store(port)), rank=rank, world_size=ws)
    second, comm2 = _train(rank, ws)
    assert comm2.group is not None and dist.get_world_size(comm2.group) == ws
    assert all(c.group is not None for c in registry._cache.values())
    del comm1
    gc.collect()
    holders = [type(r).__name__ for r in gc.get_referrers(old_world)]
    holders = [h for h in holders if h != "frame"]  # this function's own locals
    return first, second, holders


def test_reinit_gets_new_communicators_and_frees_the_old_groups():
    for first, second, holders in run_ranks(_reinit, 2):
        assert first == second
        assert holders == [], f"the destroyed default group is still held by {holders}"


def _host_twins(rank: int, ws: int):
    """The gloo twin a device group's communicator agrees on host facts over (``host()``; any
    device but the CPU has one: the meta device stands in for CUDA here)."""
    meta = torch.device("meta")

    def host_sum() -> float:
        host = registry.communicator_for(dist.group.WORLD, meta).host()
        assert host.device.type == "cpu" and host.group is not dist.group.WORLD
        t = torch.ones(1)
        dist.all_reduce(t, group=host.group)
        return t.item()

    first = host_sum()
    dist.destroy_process_group()
    port = int(os.environ["MASTER_PORT"])
    dist.init_process_group("gloo", store=dist.PrefixStore("again", client_store(port)), rank=rank, world_size=ws)
    return first, host_sum()


def test_reinit_gets_new_host_twins():
    """A twin of a destroyed default group's ranks is not handed out again: the new group's
    communicator makes its own."""
    assert run_ranks(_host_twins, 2) == [(2.0, 2.0)] * 2
