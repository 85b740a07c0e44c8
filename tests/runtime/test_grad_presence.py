"""Gradient presence without a per-step host collective (``mfsdp2.runtime.grad_presence``).

* Collectives per training step, counted at the ``torch.distributed`` functions (independently
  of mfsdp2's own ``comm_stats``): ZeRO-3 issues exactly torch FSDP2's all-gathers,
  reduce-scatters and all-reduces, run in the same process on the same model -- the end-of-backward
  gradient-presence all-reduce (a gloo/TCP round trip on the CPU twin group on GPUs) is gone;
  HSDP issues no more all-reduces than its units' reductions across replicas. With
  ``set_reduce_scatter_unused_params(True)`` it is back: exactly one more all-reduce per step.
* The case it protected, ranks using different parameters (an expert that got tokens on one rank
  only), fails fast without that call -- the rank holding rows of the expert raises naming it,
  instead of silently never stepping them -- and trains like the unsharded reference with it
  (``tests/system/test_parity.py::test_parameters_used_on_some_ranks_only_train_like_the_reference``).
  A parameter no rank used keeps ``grad=None`` either way (tests/system/test_core.py).
* The CUDA check's bookkeeping (a non-blocking copy whose event is polled, never waited for,
  except when too many are in flight) with stand-in events on the CPU.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2.base import compat
from mfsdp2 import fully_shard
from mfsdp2.runtime import grad_presence
from mfsdp2.runtime.grad_presence import GradientPresenceError

from .._dist import run_ranks
from ..models import F64, batch, build, loss_fn, make_opt
from ..system.test_parity import _Routed

WS, GB = 2, 8
STRATEGIES = ["optim_grads_params", "optim_grads", "optim", "no_shard"]
NAMES = (compat.all_gather_name(), compat.reduce_scatter_name(), "all_reduce", "isend", "irecv")


class _Counting:
    """Calls of the torch.distributed collectives, by name, while installed."""

    def __enter__(self):
        self.counts = dict.fromkeys(NAMES, 0)
        self.saved = {n: getattr(dist, n) for n in NAMES}
        for n, f in self.saved.items():
            setattr(dist, n, self._wrap(n, f))
        return self.counts

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(dist, n, f)


def _steps(model, rank, ws, mesh_shape, opt_in: bool | None) -> list[dict]:
    if opt_in is not None:
        model.set_reduce_scatter_unused_params(opt_in)
    opt = make_opt("adamw", model.parameters())
    out = []
    for step in range(3):  # the first: lazy init and recording, not counted
        x, y = batch(step, GB, model.inp.in_features, dtype=F64)
        n = GB // ws
        with _Counting() as c:
            loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
            opt.step()
            opt.zero_grad()
        if step:
            out.append(dict(c))
    return out


def _shard(shard, model, mesh, **kw):
    for b in model.blocks:
        shard(b, mesh=mesh, **kw)
    shard(model, mesh=mesh, **kw)
    if hasattr(model, "set_all_reduce_bucket_cap_mb"):
        model.set_all_reduce_bucket_cap_mb(0)  # every unit reduces alone, as in FSDP2
    return model


def _first_step_raises(model, rank, ws) -> str:
    """Step 0: every rank routes to experts 1 and 2 only; step 1: rank 1 alone sends a sample to
    expert 0. Returns this rank's error message ("" when it trained on)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        g = torch.Generator().manual_seed(7 + step)
        x = torch.randn(GB, 4, generator=g, dtype=F64)
        x[:, 0] = -x[:, 0].abs()  # x0 <= 0: never expert 0
        if step == 1:
            x[GB // 2, :2] = torch.tensor([1.0, 3.0], dtype=F64)  # rank 1's first row: expert 0
        y = torch.randn(GB, generator=g, dtype=F64)
        n = GB // ws
        try:
            ((model(x[rank * n : (rank + 1) * n]) - y[rank * n : (rank + 1) * n]) ** 2).mean().backward()
        except GradientPresenceError as e:
            return str(e)
        opt.step()
        opt.zero_grad()
    return ""


def _run(rank, ws):
    from torch.distributed.fsdp import fully_shard as torch_shard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (ws,))
    hsdp = init_device_mesh("cpu", (ws, 1), mesh_dim_names=("replicate", "shard"))
    out = {}
    out["fsdp2"] = _steps(_shard(torch_shard, build("net", dtype=F64), mesh), rank, ws, (ws,), None)
    out["zero3"] = _steps(_shard(fully_shard, build("net", dtype=F64), mesh), rank, ws, (ws,), None)
    out["zero3_opt_in"] = _steps(_shard(fully_shard, build("net", dtype=F64), mesh), rank, ws, (ws,), True)
    out["hsdp"] = _steps(_shard(fully_shard, build("net", dtype=F64), hsdp), rank, ws, (ws, 1), None)
    out["hsdp_opt_in"] = _steps(_shard(fully_shard, build("net", dtype=F64), hsdp), rank, ws, (ws, 1), True)
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        moe = _Routed().to(F64)
        fully_shard(moe, mesh=mesh, sharding_strategy=strategy)
        out[f"moe_error_{strategy}"] = _first_step_raises(moe, rank, ws)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_run, WS)


@pytest.mark.slow
def test_zero3_issues_fsdp2s_collectives_and_no_presence_all_reduce(runs):
    for rank, r in enumerate(runs):
        ag, rs, ar = NAMES[:3]
        for theirs, ours in zip(r["fsdp2"], r["zero3"]):
            assert theirs[ag] > 0 and ours[ag] == theirs[ag], (rank, theirs, ours)
            # On gloo a small unit's reduce-scatter is an all-reduce of its whole flat gradient
            # (comm/communicator.py; this model's units are all small): one collective per unit's reduction,
            # as FSDP2's reduce-scatters, and nothing more.
            assert ours["isend"] == ours["irecv"] == 0, (rank, ours)
            assert ours[rs] + ours[ar] == theirs[rs] + theirs[ar], (rank, theirs, ours)
        for plain, opted in zip(r["zero3"], r["zero3_opt_in"]):
            assert opted[ar] == plain[ar] + 1, (rank, plain, opted)  # the agreement, asked for
            assert {k: v for k, v in opted.items() if k != ar} == {k: v for k, v in plain.items() if k != ar}


@pytest.mark.slow
def test_hsdp_issues_no_presence_all_reduce_unless_asked(runs):
    for rank, r in enumerate(runs):
        ar = NAMES[2]
        for plain, opted in zip(r["hsdp"], r["hsdp_opt_in"]):
            # shard groups of one rank: nothing but one all-reduce across replicas per unit (4 units)
            assert plain[ar] == 4, (rank, plain)
            assert opted[ar] == plain[ar] + 1, (rank, plain, opted)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameter_used_on_another_rank_only_fails_fast_without_the_opt_in(runs, strategy):
    rank0, rank1 = runs[0][f"moe_error_{strategy}"], runs[1][f"moe_error_{strategy}"]
    # rank 0 holds rows of expert 0 (all of them under no_shard), whose reduced gradient came
    # from rank 1 alone
    assert "experts.0.weight" in rank0 and "set_reduce_scatter_unused_params(True)" in rank0, rank0
    assert "step 1" in rank0, rank0
    assert rank1 == "", rank1  # it had the gradient: its own answer is complete


class _Event:
    def __init__(self, done: bool):
        self.done, self.waited = done, False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = True
        self.done = True


def _ctx(*checks):
    return types.SimpleNamespace(presence_checks=list(checks))


def test_cuda_checks_are_polled_not_waited():
    busy = (_Event(False), torch.tensor([True]), ["u: a"], 3)
    ctx = _ctx(busy)
    grad_presence._poll(ctx, block=False)  # not finished: left alone, not waited for
    assert ctx.presence_checks == [busy] and not busy[0].waited
    clean = (_Event(True), torch.tensor([False, False]), ["u: b", "u: c"], 4)
    ctx = _ctx(clean, busy)
    grad_presence._poll(ctx, block=False)  # finished and clean: dropped; the next one still runs
    assert ctx.presence_checks == [busy]
    used = (_Event(True), torch.tensor([False, True]), ["u: b", "u: c"], 5)
    with pytest.raises(GradientPresenceError, match=r"step 5 .*'u: c'"):
        grad_presence._poll(_ctx(used), block=False)


def test_too_many_cuda_checks_in_flight_wait_for_the_oldest():
    events = [_Event(False) for _ in range(grad_presence.MAX_PENDING_CHECKS + 2)]
    ctx = _ctx(*[(e, torch.tensor([False]), ["u: a"], i) for i, e in enumerate(events)])
    grad_presence._poll(ctx, block=True, keep=grad_presence.MAX_PENDING_CHECKS)
    assert [e.waited for e in events] == [True, True] + [False] * grad_presence.MAX_PENDING_CHECKS
    assert len(ctx.presence_checks) == grad_presence.MAX_PENDING_CHECKS
