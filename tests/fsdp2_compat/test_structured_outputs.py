"""A unit whose forward returns a dataclass (model-output records) gets its pre-backward unshard
like one returning a tensor: it failed in backward (``setStorage ... storage of size 0``: the
weights were freed and no hook found the output's tensors). Checked against the unsharded model
in float64: losses and every parameter after a few steps, 1e-10 relative."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, assert_losses_close, batch, loss_fn

WS, STEPS, GB = 2, 3, 8


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    extras: dict


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 12)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return Output(hidden=h, extras={"squares": [h * h]})


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(12, 1)

    def forward(self, x):
        for b in self.blocks:
            o = b(x)
            x = o.hidden + 0.1 * o.extras["squares"][0]
        return self.head(x)


def _train(model, rank, ws, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    n = GB // ws
    for s in range(steps):
        x, y = batch(s, GB, 12, dtype=F64)
        loss = loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if ws > 1:
            torch.distributed.all_reduce(t)
        losses.append(t.item() / ws)
    return losses


def _sharded(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    model = Model().to(F64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _train(model, rank, ws, STEPS), {k: p.full_tensor() for k, p in model.named_parameters()}


def test_dataclass_outputs_get_their_backward_unshard():
    ref = Model().to(F64)
    ref_losses = _train(ref, 0, 1, STEPS)
    for losses, full in run_ranks(_sharded, WS):
        assert_losses_close(losses, ref_losses, "losses", REL_F64)
        for k, p in ref.named_parameters():
            assert_close_rel(full[k], p.detach(), k, REL_F64)
