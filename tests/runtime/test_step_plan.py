"""A unit's step plan is rebuilt after every change it assumed, and only then
(:mod:`mfsdp2.runtime.step_plan`).

Every scenario trains a 4-block model at world size 2 (blocks and root are units), makes one
change after the plans were built, trains on, and compares with an unsharded float64 reference
that makes the same change (or with the behaviour the change asks for: a unit kept gathered, no
reduction under ``no_sync``). Each scenario runs twice: with the runtime as it is, and with a
*stale* runtime whose plans are never rebuilt once made (and whose recorded order is never
replaced). The tests require the first to be right and the second to be wrong, so each one
fails if the plan (or the order) were reused across its change.

Changes: a strategy flag (``set_reshard_after_forward``), gradient sync (``no_sync`` through
``set_requires_gradient_sync``), ``requires_grad`` (a block frozen, then unfrozen), the
parameters (``model.double()``: new groups, new dtype), the module order (blocks run in another
order). ``eval()`` passes under ``no_grad`` between steps use the plans as they are (nothing in a
plan depends on the mode); that test checks they change nothing.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks

STEPS = 3  # steps before the change (the plans exist from the first), and after it
WIDTH = 8
SCENARIOS = ("flags", "sync", "requires_grad", "parameters", "order", "eval")


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.order = [0, 1, 2, 3]

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.blocks[i](x))
        return x.square().mean()


def _batch(step: int, rank: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, WIDTH, generator=g, dtype=torch.float64).to(dtype)


def _change(scenario: str, model: nn.Module, sharded: bool) -> None:
    """The change, applied to the sharded model and to the reference alike."""
    if scenario == "requires_grad":
        model.blocks[1].requires_grad_(True)
    elif scenario == "parameters":
        model.double()
    elif scenario == "order":
        model.order = [0, 2, 1, 3]
    elif scenario == "flags" and sharded:
        for b in model.blocks:
            b.set_reshard_after_forward(False)


def _reference(scenario: str, ws: int) -> dict:
    """The unsharded model trained in float64 on every rank's batches (the mean loss over ranks)."""
    torch.manual_seed(0)
    model = _Model().double()
    if scenario == "requires_grad":
        model.blocks[1].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2 * STEPS):
        if step == STEPS:
            _change(scenario, model, sharded=False)
        micro = 2 if scenario == "sync" and step == STEPS else 1
        for m in range(micro):
            loss = sum(model(_batch(10 * step + m, r, torch.float64)) for r in range(ws)) / ws
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _stale_runtime():
    """Plans never rebuilt after the first step, and the first recorded order kept: the runtime a plan
    reused across a change would give."""
    from mfsdp2.runtime import backward, hooks, schedule, step_plan, unshard

    def stale_plan_of(state):  # built through the first (recorded) step, then kept
        if state.plan is None or state.ctx.step == 0:
            state.plan = step_plan._build(state)
        return state.plan

    for mod in (hooks, backward, unshard):
        mod.plan_of = stale_plan_of
    real_end = schedule.Schedule.end_forward

    def end_forward(self, record):
        kept = list(self.recorded)
        real_end(self, record)
        if kept:
            self.recorded = kept

    schedule.Schedule.end_forward = end_forward


def _train(rank, ws, scenario: str, stale: bool) -> dict:
    from mfsdp2 import fully_shard
    from mfsdp2.groups.param_group import ParameterGroup
    from mfsdp2.runtime.state import ShardState

    if stale:
        _stale_runtime()
    calls = {"reduce": 0}
    real_reduce = ParameterGroup.reduce_grads

    def reduce_grads(self, *a, **k):  # counts the reductions a backward issues
        calls["reduce"] += 1
        return real_reduce(self, *a, **k)

    ParameterGroup.reduce_grads = reduce_grads
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = _Model()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if scenario == "requires_grad":  # frozen after sharding (trainable when sharded)
        model.blocks[1].requires_grad_(False)
    dtype = torch.float32
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict = {"held_after_forward": [], "reduces_unsynced": 0, "error": None}
    try:
        for step in range(2 * STEPS):
            if step == STEPS:
                _change(scenario, model, sharded=True)
                if scenario == "parameters":
                    dtype = torch.float64
            if scenario == "eval":  # an evaluation pass before every step
                model.eval()
                with torch.no_grad():
                    model(_batch(-1, rank, dtype))
                out["held_after_forward"].append(
                    [b._mfsdp2_state.shard_state is not ShardState.SHARDED for b in model.blocks])
                model.train()
            micro = 2 if scenario == "sync" and step == STEPS else 1
            for m in range(micro):
                model.set_requires_gradient_sync(m == micro - 1)
                loss = model(_batch(10 * step + m, rank, dtype))
                if step == 2 * STEPS - 1 and scenario == "flags":
                    out["held_after_forward"].append(
                        [b._mfsdp2_state.shard_state is not ShardState.SHARDED for b in model.blocks])
                before = calls["reduce"]
                loss.backward()
                if m < micro - 1:
                    out["reduces_unsynced"] += calls["reduce"] - before
            opt.step()
            opt.zero_grad()
    except Exception as e:  # a stale runtime may fail outright; that is one way of being wrong
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["params"] = {n: p.full_tensor().detach().double().clone() for n, p in model.named_parameters()}
    out["mispredictions"] = model._mfsdp2_state.ctx.schedule.mispredictions
    return out


@functools.lru_cache(maxsize=None)
def _runs(scenario: str, stale: bool) -> dict:
    return run_ranks(_train, 2, scenario, stale)[0]


def _matches(run: dict, scenario: str) -> bool:
    if run["error"] is not None:
        return False
    ref = _reference(scenario, 2)
    # float32 training over 2 * STEPS steps of a width-8 model: a few float32 ulps of the
    # weights per step; 1e-5 absolute is ~100x that and far below any step's change (lr 0.1).
    return all(torch.allclose(run["params"][n], ref[n], rtol=0, atol=1e-5) for n in ref)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_plan_follows_change(scenario):
    run = _runs(scenario, stale=False)
    assert run["error"] is None, run["error"]
    assert _matches(run, scenario)
    if scenario == "flags":
        assert run["held_after_forward"] == [[True] * 4]  # every block kept gathered, as now asked
    if scenario == "sync":
        assert run["reduces_unsynced"] == 0
    if scenario == "order":
        assert run["mispredictions"] == 1  # the pass that met the new order; the next follow it
    if scenario == "eval":
        assert all(held == [False] * 4 for held in run["held_after_forward"])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "eval"])
def test_stale_plan_is_observably_wrong(scenario):
    """The control: the same change under plans that are never rebuilt goes wrong."""
    run = _runs(scenario, stale=True)
    if scenario == "flags":
        assert run["held_after_forward"] != [[True] * 4]
    elif scenario == "sync":
        assert run["reduces_unsynced"] > 0
    elif scenario == "order":
        assert run["mispredictions"] > 1
    else:
        assert not _matches(run, scenario)
