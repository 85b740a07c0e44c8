"""The per-unit host work of a steady-state step stays off torch's expensive generic paths.

What is checked, by counting calls (not by timing, which depends on the machine):

* ``inspect.signature`` is never called: torch's ``Function.apply`` binds a function's default
  arguments through it at every call when ``setup_context`` is defined, and the unit's
  ``_PostBackward`` (which defines it for ``torch.func``) takes the direct path outside transforms;
* a unit with one output tensor hooks it with one tensor hook: no ``register_multi_grad_hook``
  (a unit with several outputs still takes one, its "any" mode being what the pre-backward needs);
  in a quiet pass (:mod:`mfsdp2.runtime.quiet_units`; these persistent one-rank units qualify)
  no unit's outputs are hooked at all;
* under ``torch.func.grad`` the full ``Function.apply`` path runs and gives the unsharded
  gradient (the fast path must not be taken inside a transform).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks


class _Pair(nn.Module):
    """Two outputs: its unit must keep the multi-grad hook."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x), self.b(x)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.pair = _Pair()

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        a, b = self.pair(x)
        return (a * b).sum()


def _counts(rank, ws):
    from mfsdp2 import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = _Model()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model.pair, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 8)
    for _ in range(2):
        model(x).backward()
        opt.step()
        opt.zero_grad()

    counts = {}
    for quiet in (False, True):  # the hooked pass, and the quiet one (mfsdp2.runtime.quiet_units)
        model._mfsdp2_state.ctx.quiet_allowed = quiet
        calls = {"signature": 0, "multi": 0}
        real_sig, real_multi = inspect.signature, torch.autograd.graph.register_multi_grad_hook

        def sig(*a, **k):
            calls["signature"] += 1
            return real_sig(*a, **k)

        def multi(*a, **k):
            calls["multi"] += 1
            return real_multi(*a, **k)

        inspect.signature = sig
        torch.autograd.graph.register_multi_grad_hook = multi
        try:
            model(x).backward()
            calls["quiet"] = model._mfsdp2_state.ctx.quiet
            opt.step()
            opt.zero_grad()
        finally:
            inspect.signature = real_sig
            torch.autograd.graph.register_multi_grad_hook = real_multi
        counts["quiet" if quiet else "hooked"] = calls

    # torch.func through a unit (world size 1: the functional call sees whole parameters).
    unit = fully_shard(nn.Linear(8, 8), mesh=mesh)
    ref = nn.Linear(8, 8)
    with torch.no_grad():
        ref.weight.copy_(unit.weight.full_tensor())
        ref.bias.copy_(unit.bias.full_tensor())

    def loss(inp, mod):
        return torch.tanh(mod(inp)).sum()

    g_unit = torch.func.grad(loss)(x, unit)
    g_ref = torch.func.grad(loss)(x, ref)
    return {**counts, "func_grad_equal": bool(torch.equal(g_unit, g_ref))}


def test_steady_state_step_takes_no_generic_autograd_paths():
    out = run_ranks(_counts, 1)[0]
    hooked, quiet = out["hooked"], out["quiet"]
    assert hooked["signature"] == 0 and quiet["signature"] == 0, out
    assert not hooked["quiet"] and hooked["multi"] == 1, out  # the two-output unit only
    assert quiet["quiet"] and quiet["multi"] == 0, out  # a quiet pass hooks no unit's outputs
    assert out["func_grad_equal"], out
