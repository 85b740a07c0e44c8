"""A group's reduction route (its reduce ops and divisions, and whether it shares a bucketed
all-reduce) is remembered between backwards and follows every setting it derives from when that
setting changes after training began (``GradientReduction._route``).

Each case runs one backward with the defaults (the route is made), changes one setting on every
unit, and runs a second backward at world size 2 on a float64 model, compared with the unsharded
float64 model's gradients of the same batches (no optimizer step in between, so both backwards see
the initial weights). Each fails if the first backward's route were reused:

* ``set_gradient_divide_factor(1.0)``: the second backward sums over the ranks (``ws * g``),
  every strategy (the divisions are part of the route);
* ``set_custom_reduce_scatter``: ZeRO-2/3 groups, which at two ranks reduce in a shared bucket by
  default, reduce through the user's object instead (it is called; the gradients stay the mean);
* ``set_requires_all_reduce(False)`` on ``no_shard`` (its only collective is the all-reduce across
  replicas): no gradient is exposed after that backward and none is all-reduced; switched back on,
  the next backward exposes the sum of both.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, build, loss_fn

GB = 8


def _backward(model, step: int, rank: int, ws: int) -> None:
    n = GB // ws
    x, y = batch(step, GB, 12, dtype=F64)
    loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()


def _grads(model) -> dict:
    return {k: None if p.grad is None else p.grad.full_tensor() for k, p in model.named_parameters()}


def _units(model) -> list:
    return [m for m in model.modules() if hasattr(m, "set_gradient_divide_factor")]


def _run(rank: int, ws: int, strategy: str, change: str) -> dict:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class Counting(ReduceScatter):
        calls = 0

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            Counting.calls += 1
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=F64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, sharding_strategy=strategy)
    fully_shard(model, mesh=mesh, sharding_strategy=strategy)
    out = {}
    _backward(model, 0, rank, ws)
    out["first"] = _grads(model)
    model.zero_grad(set_to_none=True)
    for m in _units(model):
        if change == "divide_factor":
            m.set_gradient_divide_factor(1.0, recurse=False)
        elif change == "custom_reduce_scatter":
            m.set_custom_reduce_scatter(Counting())
        elif change == "requires_all_reduce":
            m.set_requires_all_reduce(False, recurse=False)
    _backward(model, 1, rank, ws)
    out["second"] = _grads(model)
    out["custom_calls"] = Counting.calls
    if change == "requires_all_reduce":
        for m in _units(model):
            m.set_requires_all_reduce(True, recurse=False)
        _backward(model, 2, rank, ws)
        out["third"] = _grads(model)
    return out


def _reference(steps) -> dict:
    model = build("net", dtype=F64)
    for s in steps:
        x, y = batch(s, GB, 12, dtype=F64)
        loss_fn(model(x), y).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


CASES = [(s, "divide_factor") for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")] + [
    (s, "custom_reduce_scatter") for s in ("optim_grads", "optim_grads_params")] + [
    ("no_shard", "requires_all_reduce")]


@pytest.mark.parametrize("strategy,change", CASES)
def test_route_follows_a_setting_changed_after_a_backward(strategy, change):
    ws = 2
    g0, g1 = _reference([0]), _reference([1])
    for rank, out in enumerate(run_ranks(_run, ws, strategy, change)):
        for k, ref in g0.items():
            assert_close_rel(out["first"][k], ref, f"{k} first rank {rank}", REL_F64)
        if change == "divide_factor":
            for k, ref in g1.items():
                assert_close_rel(out["second"][k], ws * ref, f"{k} summed rank {rank}", REL_F64)
        elif change == "custom_reduce_scatter":
            assert out["custom_calls"] > 0, (strategy, rank)
            for k, ref in g1.items():
                assert_close_rel(out["second"][k], ref, f"{k} custom rank {rank}", REL_F64)
        else:
            assert all(g is None for g in out["second"].values()), (rank, out["second"])
            for k, ref in _reference([1, 2]).items():
                assert_close_rel(out["third"][k], ref, f"{k} accumulated rank {rank}", REL_F64)
