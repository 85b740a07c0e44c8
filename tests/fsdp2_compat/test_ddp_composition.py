"""torch DDP (``DistributedDataParallel``) around a model whose middle is sharded by ``fully_shard``,
with a sub-module inside the sharded part left to DDP (``ignored_params``): the layout of FSDP2's
``test_ddp_A_fsdp_B_ddp_C``. DDP is told to skip the units' parameters
(``_set_params_and_buffers_to_ignore_for_model``) and all-reduces the rest, the ignored ones
included; the units reduce-scatter theirs. Training equals FSDP2's in the same composition on the
same model and data, and the model under DDP alone (two ranks: every average is one exact sum of
two terms divided by two, so all three agree bit for bit)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel as DDP

from . import runtimes
from .._dist import run_ranks

DIM, STEPS = 8, 3


class _Inner(nn.Module):
    """Sharded as a unit, except ``side``, which DDP keeps (the unit's ``ignored_params``)."""

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(DIM, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.offset = nn.Parameter(torch.randn(DIM, DIM) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.side(x))) - self.offset


class _Outer(nn.Module):
    """DDP's: a parameter of its own around the sharded ``inner``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()
        self.bias = nn.Parameter(torch.randn(DIM, DIM) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.inner(x) + self.bias).pow(2).mean()


def _train(rank: int, ws: int) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, shard in [("ddp", None)] + list(runtimes().items()):
        torch.manual_seed(0)
        model = _Outer()
        if shard is not None:
            kept = set(model.inner.side.parameters())  # DDP's, not the units'
            shard(model.inner.proj, mesh=mesh, ignored_params=kept)
            shard(model.inner, mesh=mesh, ignored_params=kept)
            sharded = [f"inner.{k}" for k, p in model.inner.named_parameters() if p not in kept]
            DDP._set_params_and_buffers_to_ignore_for_model(model, sharded)
        ddp = DDP(model, broadcast_buffers=False)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        x = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(7 + rank))
        losses = []
        for _ in range(STEPS):
            loss = ddp(x)
            loss.backward()
            with implicit_replication():  # one foreach list of plain and DTensor parameters
                opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[name] = (losses, {k: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone())
                              for k, p in model.named_parameters()},
                     sorted(k for k, p in model.named_parameters() if hasattr(p, "full_tensor")))
    return out


def test_ddp_around_units_with_a_ddp_managed_submodule_equals_fsdp2_and_ddp():
    for res in run_ranks(_train, 2):
        (l_d, p_d, _), (l_t, p_t, dt_t), (l_m, p_m, dt_m) = res["ddp"], res["fsdp2"], res["mfsdp2"]
        # The units hold exactly what they were given: side's parameters stay plain (DDP's).
        assert dt_m == dt_t == ["inner.offset", "inner.proj.bias", "inner.proj.weight"], (dt_m, dt_t)
        assert l_m == l_t == l_d
        assert list(p_m) == list(p_t) == list(p_d)
        for k in p_d:
            assert torch.equal(p_m[k], p_t[k]) and torch.equal(p_m[k], p_d[k]), k
