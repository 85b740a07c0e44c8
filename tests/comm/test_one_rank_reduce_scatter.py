"""A reduce-scatter over a group of one rank is the identity, so ZeRO-2/3 groups on such a shard
group pack their gradients straight into the main gradient (``Communicator.reduces_alone``,
``GradientReduction.reduce_grads``). These tests fail if the identity were taken where it is not
one, or hid a call the user asked for:

* ``reduce_scatter(t, t)`` at one rank leaves ``t`` as it is and is counted as a reduce-scatter;
  an output that only overlaps its input is still refused (E19);
* a user's reduce-scatter (``set_custom_reduce_scatter``) is called at every reduction at one
  rank too, as FSDP2 calls it, and training is bit-identical with and without it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from mfsdp2 import fully_shard
from mfsdp2.comm.communicator import Communicator, comm_stats
from mfsdp2.comm.custom import CustomCommunicator

from .._dist import run_ranks

UNITS, STEPS = 3, 3


def _identity(rank: int, ws: int) -> dict:
    comm = Communicator(dist.group.WORLD, torch.device("cpu"))
    t = torch.arange(8, dtype=torch.float32)
    before = comm_stats.reduce_scatter_calls
    comm.reduce_scatter(t, t, dist.ReduceOp.SUM).wait()
    out = {"alone": comm.reduces_alone, "unchanged": bool(torch.equal(t, torch.arange(8.0))),
           "counted": comm_stats.reduce_scatter_calls - before,
           "custom_alone": CustomCommunicator(comm, reduce_scatter=object()).reduces_alone,
           "custom_less_alone": CustomCommunicator(comm).reduces_alone}
    try:
        comm.reduce_scatter(t[1:], t[:-1], dist.ReduceOp.SUM)
        out["overlap_refused"] = False
    except RuntimeError as e:
        out["overlap_refused"] = "E19" in str(e)
    return out


def test_one_rank_reduce_scatter_of_a_tensor_into_itself_is_the_identity():
    r = run_ranks(_identity, 1)[0]
    assert r["alone"] and r["unchanged"] and r["counted"] == 1, r
    assert r["overlap_refused"], r
    assert not r["custom_alone"] and r["custom_less_alone"], r


class _Counting(ReduceScatter):
    def __init__(self):
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _train(rank: int, ws: int, custom: bool) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(UNITS)])
    counter = _Counting()
    for layer in model:
        fully_shard(layer, mesh=mesh)
        if custom:
            layer.set_custom_reduce_scatter(counter)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i in range(STEPS):
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "calls": counter.calls,
            "params": [p.full_tensor() for p in model.parameters()]}


def test_a_custom_reduce_scatter_is_called_at_one_rank():
    got = run_ranks(_train, 1, True)[0]
    want = run_ranks(_train, 1, False)[0]
    assert got["calls"] == UNITS * STEPS, got["calls"]
    assert got["losses"] == want["losses"]
    for a, b in zip(got["params"], want["params"]):
        assert torch.equal(a, b)
