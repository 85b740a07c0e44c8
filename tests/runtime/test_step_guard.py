"""The step guard's duplicate-parameter check (E61) stops every rank of the data-parallel group
when one rank's optimizer holds a parameter twice: the duplicates sit on the ranks holding empty
pieces (Accelerate's ``prepare`` maps parameters by ``data_ptr()``, 0 for those), and a rank that
raised alone would leave the others waiting at their next collective."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard
from mfsdp2.runtime.step_guard import DuplicateParameterError

from .._dist import run_ranks
from ..models import build


def _one_rank_rewritten(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    net = build("net")
    for b in net.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    net(torch.zeros(1, 12)).sum().backward()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if rank == 0:
        opt.param_groups[0]["params"][-2] = net.head.bias
    try:
        opt.step()
    except DuplicateParameterError as e:
        return str(e)
    return None


def test_a_duplicate_on_one_rank_stops_every_rank():
    msgs = run_ranks(_one_rank_rewritten, 2, timeout=120)
    assert "holds parameter 'head.bias' of unit 'root' 2 times" in msgs[0], msgs
    assert msgs[1] is not None and "another rank's SGD holds a parameter of unit" in msgs[1], msgs
