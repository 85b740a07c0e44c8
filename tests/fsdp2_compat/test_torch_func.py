"""``torch.func`` through units: forward-mode AD (``jvp``), ``grad`` and ``vjp`` with respect to
inputs, and ``functional_call``, each equal to FSDP2's result on the same model and data, with
``reshard_after_forward`` on and off; afterwards plain training still matches FSDP2.

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


def _run(rank: int, ws: int, reshard: bool) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, shard in runtimes().items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        for m in (model[0], model[2]):
            shard(m, mesh=mesh, reshard_after_forward=reshard)
        shard(model, mesh=mesh, reshard_after_forward=reshard)
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
        out[name] = r
    return out


@pytest.mark.parametrize("reshard", [True, False])
def test_torch_func_equal_to_fsdp2(reshard):
    for res in run_ranks(_run, 2, reshard):
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
