"""TransformerEngine's gradient-accumulation-fusion contract.

``TEProtocolLinear`` follows TE's protocol exactly (TE >= 2.x, ``transformer_engine.pytorch.Linear``
with ``fuse_wgrad_accumulation=True``): the backward reads ``weight.main_grad`` lazily, accumulates
the weight gradient into it (or overwrites it when ``weight.overwrite_main_grad``), sets
``weight.grad_added_to_main_grad = True`` when the attribute exists and returns a placeholder
gradient (here NaN-filled, so counting it anywhere is loud); without the attribute it returns None.
The check: gradients reach the optimizer exactly once per step, with and without fusion, for
sharded and full-gradient strategies and across micro-batches without gradient sync. The real-TE
test runs only where TE and CUDA import."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, local_grad_rows, loss_fn


class _TELinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fuse: bool):
        ctx.save_for_backward(x, weight)
        ctx.fuse = fuse
        ctx.weight = weight  # the parameter object: TE reads its attributes in backward
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        dx = gy @ weight
        wgrad = gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        dbias = gy.reshape(-1, gy.shape[-1]).sum(0)
        if not ctx.fuse:
            return dx, wgrad, dbias, None
        main_grad = ctx.weight.main_grad  # looked up now, not at forward (TE >= 2.x)
        if getattr(ctx.weight, "overwrite_main_grad", False):
            main_grad.copy_(wgrad)
        else:
            main_grad.add_(wgrad)
        if hasattr(ctx.weight, "grad_added_to_main_grad"):
            ctx.weight.grad_added_to_main_grad = True
            return dx, torch.full_like(weight, float("nan")), dbias, None
        return dx, None, dbias, None


class TEProtocolLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, fuse_wgrad_accumulation: bool):
        super().__init__()
        lin = nn.Linear(d_in, d_out)
        self.weight = lin.weight
        self.bias = lin.bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation

    def forward(self, x):
        return _TELinearFn.apply(x, self.weight, self.bias, self.fuse_wgrad_accumulation)


class TEBlock(nn.Module):
    def __init__(self, d, hidden, fuse):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = TEProtocolLinear(d, hidden, fuse)
        self.fc2 = TEProtocolLinear(hidden, d, fuse)

    def forward(self, x):
        h = self.fc1(self.norm(x))
        return x + self.fc2(F.gelu(h)) + 0.1 * self.fc1(self.norm(x)).sum(-1, keepdim=True)  # fc1 used twice


class TENet(nn.Module):
    def __init__(self, fuse: bool):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(12, 16)
        self.blocks = nn.ModuleList(TEBlock(16, 40, fuse) for _ in range(2))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


GLOBAL_BATCH = 8


def _reference(micro_batches: int, steps: int):
    torch.set_num_threads(1)
    model = TENet(fuse=False).to(F64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = None
    for step in range(steps):
        for m in range(micro_batches):
            x, y = batch(step * micro_batches + m, GLOBAL_BATCH, 12, dtype=F64)
            loss_fn(model(x), y).backward()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return grads, {k: p.detach().clone() for k, p in model.named_parameters()}


def _run(rank, ws, fuse, strategy, micro_batches, steps):
    mesh = init_device_mesh("cpu", (ws,))
    model = TENet(fuse).to(F64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, sharding_strategy=strategy)
    fully_shard(model, mesh=mesh, sharding_strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = GLOBAL_BATCH // ws
    grads = None
    for step in range(steps):
        for m in range(micro_batches):
            model.set_requires_gradient_sync(m == micro_batches - 1)
            x, y = batch(step * micro_batches + m, GLOBAL_BATCH, 12, dtype=F64)
            loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        if step == 0:
            grads = {k: local_grad_rows(p) for k, p in model.named_parameters()}
            leftover = [k for m in model.modules() for k, p in m.named_parameters(recurse=False)
                        if hasattr(p, "main_grad")]
            assert not leftover, f"main_grad views outlived the reduction: {leftover}"
        opt.step()
        opt.zero_grad()
    return grads, {k: p.full_tensor() for k, p in model.named_parameters()}


def _close(a, b, name, rel=REL_F64):  # float64: see tests/models.py
    assert torch.isfinite(a).all(), f"{name}: TE's placeholder gradient was counted"
    assert_close_rel(a, b, name, rel)


@pytest.mark.parametrize(
    "fuse,strategy,micro_batches",
    [
        (True, "optim_grads_params", 1),
        (False, "optim_grads_params", 1),
        (True, "optim_grads_params", 2),
        (True, "optim", 1),
    ],
)
def test_te_protocol_gradients_reach_the_optimizer_exactly_once(fuse, strategy, micro_batches):
    steps = 3
    ref_grads, ref_params = _reference(micro_batches, steps)
    for grads, params in run_ranks(_run, 2, fuse, strategy, micro_batches, steps):
        for name, ref in ref_grads.items():
            start, g = grads[name]  # this rank's rows: a missing grad fails in local_grad_rows
            _close(g, ref[start : start + g.shape[0]], f"grad {name}")
        for name, ref in ref_params.items():
            _close(params[name], ref, f"param {name}")


def _real_te_available() -> bool:
    from mfsdp2.precision.te import transformer_engine

    return torch.cuda.is_available() and transformer_engine() is not None


def _real_te(rank, ws):
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    ref = te.Linear(64, 64, params_dtype=torch.float32, device="cuda")
    fused = te.Linear(64, 64, params_dtype=torch.float32, device="cuda", fuse_wgrad_accumulation=True)
    with torch.no_grad():
        fused.weight.copy_(ref.weight)
        fused.bias.copy_(ref.bias)
    mesh = init_device_mesh("cuda", (ws,))
    fully_shard(fused, mesh=mesh)
    x = torch.randn(8, 64, device="cuda")
    ref(x).square().sum().backward()
    fused(x).square().sum().backward()
    torch.testing.assert_close(fused.weight.grad.full_tensor(), ref.weight.grad)
    return True


@pytest.mark.skipif(not _real_te_available(), reason="TransformerEngine with CUDA is not installed here "
                                                     "(pip install 'mfsdp2[te]' on a GPU machine)")
def test_real_transformer_engine_linear_with_wgrad_fusion():
    import torch.distributed as dist

    # One rank in this process: an in-memory store, no port (a fixed one collided under xdist).
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert _real_te(0, 1)
    finally:
        dist.destroy_process_group()
