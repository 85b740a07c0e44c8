"""Gradient accumulation without sync under a bf16-compute / fp32-reduce policy sums the
micro-batches in fp32, as torch FSDP2 does.

Before: each micro-batch's unsharded bf16 gradient was added by autograd to the previous ones in
bf16, so the accumulated gradient lost up to 8 bits per partial sum (about half the elements of a
layer differed from FSDP2's, by up to 1e-4 absolute).

Both run in one process on the same model and data; the gradients they reduce are then the same
bf16 micro-batch gradients summed in fp32 in the same order, so they differ only by the
reduce-scatter's fp32 rounding (FSDP2 divides before and after a SUM on gloo, we average):
a few fp32 roundings, <= 1e-6 relative. bf16 accumulation is off by ~1e-3 relative (u_bf16 =
3.9e-3 per partial sum over three sums), so 1e-5 separates the two with two decades each side.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import MixedPrecisionPolicy
from mfsdp2 import fully_shard as mfsdp2_shard

from .._dist import run_ranks
from ..models import batch, build, loss_fn

WS, MICRO, GB = 2, 4, 16
REL = 1e-5


def _accumulate(rank, ws, reshard_after_backward):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_shard

    mesh = init_device_mesh("cpu", (ws,))
    models = {"fsdp2": build("net"), "mfsdp2": build("net")}
    policies = {
        "fsdp2": (torch_shard, TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        "mfsdp2": (mfsdp2_shard, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    }
    for k, m in models.items():
        shard, mp = policies[k]
        for b in m.blocks:
            shard(b, mesh=mesh, mp_policy=mp)
        shard(m, mesh=mesh, mp_policy=mp)
    x, y = batch(0, GB, models["fsdp2"].inp.in_features)
    per = GB // (ws * MICRO)
    grads = {}
    for k, m in models.items():
        m.set_reshard_after_backward(reshard_after_backward)
        for i in range(MICRO):
            last = i == MICRO - 1
            m.set_requires_gradient_sync(last)
            if last:
                m.set_reshard_after_backward(True)
            lo = (rank * MICRO + i) * per
            loss = loss_fn(m(x[lo : lo + per]).float(), y[lo : lo + per])
            loss.backward()
        grads[k] = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    return grads


@pytest.mark.parametrize("reshard_after_backward", [True, False], ids=["reshard", "keep_unsharded"])
def test_unsynced_micro_batches_accumulate_in_fp32_like_fsdp2(reshard_after_backward):
    for grads in run_ranks(_accumulate, WS, reshard_after_backward):
        for n, g in grads["fsdp2"].items():
            ours = grads["mfsdp2"][n]
            assert ours.dtype == g.dtype == torch.float32, (n, ours.dtype, g.dtype)
            err = (ours - g).norm() / g.norm().clamp_min(1e-30)
            assert err <= REL, f"{n}: relative difference {err:.2e} from FSDP2's gradient (bf16 accumulation?)"
