"""Float8 *parameters* (a frozen, quantised layer stored in ``torch.float8_e4m3fn``, dequantised
in its forward) shard, gather and compute like the unsharded model: bit-exact, since gathering is
a byte copy and the forward's arithmetic is the same.

Before: the all-gather handed gloo a float8 tensor, which it rejects ("Invalid scalar type"), and
the failure surfaced as another rank having died."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard

from .._dist import run_ranks

F8 = torch.float8_e4m3fn


class QuantLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        w = torch.randn(d_out, d_in)
        self.scale = nn.Parameter((w.abs().amax() / 448.0).reshape(1), requires_grad=False)
        self.weight = nn.Parameter((w / self.scale).to(F8), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(d_out))  # trainable, float32

    def forward(self, x):
        return x @ (self.weight.to(x.dtype) * self.scale).t() + self.bias


def _model():
    torch.manual_seed(0)
    return nn.Sequential(QuantLinear(12, 7), nn.ReLU(), QuantLinear(7, 5))


def _run(rank, ws):
    model = _model()
    mesh = init_device_mesh("cpu", (ws,))
    for m in model:
        if isinstance(m, QuantLinear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(1))
    out = model(x)
    out.sum().backward()
    full = {k: p.full_tensor() for k, p in model.named_parameters()}
    grads = {k: p.grad.full_tensor() for k, p in model.named_parameters() if p.grad is not None}
    return out.detach(), full, grads


@pytest.mark.parametrize("ws", [2, 4])
def test_float8_parameters_gather_bit_exact(ws):
    ref = _model()
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(1))
    want = ref(x)
    want.sum().backward()
    for out, full, grads in run_ranks(_run, ws):
        assert torch.equal(out, want.detach())
        for k, p in ref.named_parameters():
            assert full[k].dtype == p.dtype, (k, full[k].dtype)
            assert torch.equal(full[k].view(torch.uint8) if p.dtype == F8 else full[k],
                               p.detach().view(torch.uint8) if p.dtype == F8 else p.detach()), k
            if p.grad is not None:
                # the output is a plain sum over ranks' batch copies: every rank saw the same x, so the
                # averaged gradient equals the unsharded one up to the mean's rounding (exact here:
                # identical addends averaged)
                assert torch.equal(grads[k], p.grad), k
