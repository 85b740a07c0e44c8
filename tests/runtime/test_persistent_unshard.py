"""Units whose weights are persistent and current (``no_shard``, ZeRO-1, ZeRO-2 between optimizer
steps) unshard without the gather machinery (``mfsdp2.runtime.unshard.nothing_to_gather``).

* Counted at two ranks on a stack of small units: a steady-state step (forward, backward,
  optimizer step) calls ``ParameterGroup.unshard`` once per group -- the forward's re-gather after
  the step -- and a micro-batch without a step (nothing changed: the CPU's content check agrees
  nothing is stale) calls it never; no ``ag_issue`` event is recorded in either backward. The
  general path asked every group again in each pre-backward and for every prefetch.
* ZeRO-3 units keep the general path: each gathers in forward and in backward.
* The losses and parameters equal those of the same model trained with the fast path turned
  off, bit for bit (the fast path skips work that issues nothing).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard
from mfsdp2.base.profiling import event_log
from mfsdp2.groups.param_group import ParameterGroup

from .._dist import run_ranks

UNITS = 6


def _build(strategy: str, mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(UNITS)])
    for layer in model:
        fully_shard(layer, mesh=mesh, sharding_strategy=strategy)
    return fully_shard(model, mesh=mesh, sharding_strategy=strategy)


def _run(rank: int, ws: int, strategy: str, fast: bool) -> dict:
    import mfsdp2.runtime.unshard as unshard_mod

    if not fast:
        unshard_mod.nothing_to_gather = lambda state: False
    mesh = init_device_mesh("cpu", (ws,))
    model = _build(strategy, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls = [0]
    orig = ParameterGroup.unshard

    def counting(self, *a, **k):
        calls[0] += 1
        return orig(self, *a, **k)

    ParameterGroup.unshard = counting
    torch.manual_seed(1 + rank)
    xs = [torch.randn(4, 16) for _ in range(6)]
    out = {"losses": [], "step_calls": [], "micro_calls": [], "bwd_ag_issue": []}
    event_log.enabled = True
    try:
        for i, x in enumerate(xs):
            micro = i % 2 == 1  # every other pass: a micro-batch without an optimizer step after it
            calls[0] = 0
            loss = model(x).square().mean()
            event_log.clear()
            loss.backward()
            out["bwd_ag_issue"].append(sum(1 for kind, _ in event_log.events if kind == "ag_issue"))
            if not micro:
                opt.step()
                opt.zero_grad(set_to_none=True)
            out["losses"].append(loss.item())
            if i >= 2:  # steady state: the recorded order exists, the previous pass stepped or not
                out["micro_calls" if i % 2 == 0 else "step_calls"].append(calls[0])
    finally:
        event_log.enabled = False
        ParameterGroup.unshard = orig
    out["params"] = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_persistent_units_skip_the_gather_path(strategy):
    fast = run_ranks(_run, 2, strategy, True)
    slow = run_ranks(_run, 2, strategy, False)
    groups = UNITS + 0  # the root holds no parameters of its own
    for r, (f, s) in enumerate(zip(fast, slow)):
        # Pass i runs after pass i-1: even passes follow a micro-batch (no step), odd ones a step.
        assert f["micro_calls"] == [0] * len(f["micro_calls"]), (strategy, r, f["micro_calls"])
        assert f["step_calls"] == [groups] * len(f["step_calls"]), (strategy, r, f["step_calls"])
        assert f["bwd_ag_issue"] == [0] * len(f["bwd_ag_issue"]), (strategy, r, f["bwd_ag_issue"])
        # The general path asks the groups again (pre-backward, prefetches): strictly more calls.
        assert sum(s["step_calls"]) > sum(f["step_calls"]) and sum(s["micro_calls"]) > 0, (strategy, r, s)
        assert f["losses"] == s["losses"], (strategy, r)
        for n, v in f["params"].items():
            assert torch.equal(v, s["params"][n]), (strategy, r, n)


def test_zero3_units_gather_in_forward_and_backward():
    (f, _) = run_ranks(_run, 2, "optim_grads_params", True)
    assert all(n > 0 for n in f["bwd_ag_issue"]), f["bwd_ag_issue"]
    assert all(n >= 2 * (UNITS - 1) for n in f["micro_calls"]), f["micro_calls"]
