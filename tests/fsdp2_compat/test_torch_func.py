"""``torch.func`` through units: forward-mode AD (``jvp``), ``grad`` and ``vjp`` with respect to
inputs, and ``functional_call``, each equal to FSDP2's result on the same model and data, with
``reshard_after_forward`` on and off; afterwards plain training still matches FSDP2, and so does a
``grad`` after it. Also with mfsdp2's units gathering in shared buckets (ZeRO-3 with
``set_all_gather_bucket_cap_mb``, and ZeRO-1's re-gather after a step).

What it needs of the runtime: the gathers of a unit's pre-forward run outside functorch's
transforms (the gathered buffers are the runtime's, not traced tensors), and the identity
function that marks a unit's backward is written in ``setup_context`` form with a ``jvp``, as
FSDP2's is.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from . import runtimes
from .._dist import run_ranks


# mfsdp2's configuration beside FSDP2's default: as is; ZeRO-3 units gathering in shared buckets;
# ZeRO-1 (its weights re-gathered in a bucket after each step). The bucket's rows are written into
# the units' buffers when a unit waits, inside the transformed function.
VARIANTS = {"default": ({}, None), "buckets": ({}, 1.0), "optim": ({"sharding_strategy": "optim"}, None)}


def _run(rank: int, ws: int, reshard: bool, variant: str = "default") -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, shard in runtimes().items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        kw, cap = VARIANTS[variant] if name == "mfsdp2" else ({}, None)
        for m in (model[0], model[2]):
            shard(m, mesh=mesh, reshard_after_forward=reshard, **kw)
        shard(model, mesh=mesh, reshard_after_forward=reshard, **kw)
        if cap is not None:
            model.set_all_gather_bucket_cap_mb(cap)
        g = torch.Generator().manual_seed(rank)
        x, v = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
        r = {}
        r["jvp"] = torch.func.jvp(lambda inp: model(inp), (x,), (v,))
        r["functional_call"] = torch.func.functional_call(model, dict(model.named_parameters()), (x,))
        r["grad_x"] = torch.func.grad(lambda inp: model(inp).pow(2).sum())(x)
        if reshard:  # with the weights kept gathered, both runtimes' later forwards mix tensor kinds
            r["vjp"] = torch.func.vjp(lambda inp: model(inp), x)[1](torch.ones(3, 2))[0]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                model(x).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
            r["trained"] = {k: p.full_tensor() for k, p in model.named_parameters()}
            r["grad_x_trained"] = torch.func.grad(lambda inp: model(inp).pow(2).sum())(x)
        out[name] = r
    return out


@pytest.mark.parametrize("reshard,variant", [(True, "default"), (False, "default"), (True, "buckets"),
                                             (True, "optim")])
def test_torch_func_equal_to_fsdp2(reshard, variant):
    for res in run_ranks(_run, 2, reshard, variant):
        theirs, ours = res["fsdp2"], res["mfsdp2"]
        assert list(theirs) == list(ours)
        for key in theirs:
            a, b = theirs[key], ours[key]
            if isinstance(a, dict):
                for k in a:
                    assert torch.equal(a[k], b[k]), (reshard, key, k)
            else:
                for t, o in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                    assert torch.equal(t, o), (reshard, key)
