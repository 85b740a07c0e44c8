"""The reduce ops and divisions of a gradient reduction are FSDP2's.

* The table: every (reduce dtype, shard size, replicas, divide factor, forced sum, backend with
  or without ``PREMUL_SUM``) against torch's own ``_get_gradient_divide_factors``, the function
  FSDP2 calls. Where mfsdp2 departs (a factor of 1, bfloat16 ``PREMUL_SUM``, a backend without
  ``PREMUL_SUM``, a shard group of one rank), the test states what FSDP2 computes and checks
  that mfsdp2's plan computes the same value in exact arithmetic.
* End to end: float16 mixed precision trains bit for bit as FSDP2 at world sizes 2 and 4 (the
  gradients of every step and the weights after it), with the default mean and with a divide
  factor that is not a power of two, which FSDP2 splits into a power-of-two pre-divide and a
  post-divide. AVG in float16, what a reduction without the split would do, rounds differently.
  Above two ranks FSDP2 gets a reduce-scatter that sums in rank order, as mfsdp2's does
  (``tests/_reduce_order.py``: gloo's own ring sums in an order that depends on the layout), so
  only the divisions can differ.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

from mfsdp2.groups.reduce_plan import ReducePlan, divide, plan_reduction

from .._dist import run_ranks
from .._reduce_order import RankOrderReduceScatter
from ..fsdp2_compat import runtimes, snapshot


class _Group:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def _nccl_premul(s: float):
    return ("PREMUL_SUM", s)


def _is_premul(op) -> bool:
    return not isinstance(op, dist.ReduceOp.RedOpType) and not isinstance(op, tuple)


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
CASES = list(itertools.product(DTYPES, (1, 2, 4), (1, 2), (None, 1.0, 2.0, 3.0, 4.0, 8.0), (False, True),
                               (True, False)))


@pytest.mark.parametrize("dtype,shard,replicas,factor,force_sum,nccl", CASES)
def test_plan_against_fsdp2(dtype, shard, replicas, factor, force_sum, nccl):
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    pre, post, rs_op, ar_op = _get_gradient_divide_factors(
        _Group(shard), _Group(replicas) if replicas > 1 else None, dtype, "cuda", factor, force_sum)
    plan = plan_reduction(dtype, shard, replicas, factor, force_sum, _nccl_premul if nccl else lambda s: None)
    assert isinstance(plan, ReducePlan)
    where = (dtype, shard, replicas, factor, force_sum, nccl)
    if _is_premul(rs_op) or (rs_op == AVG and factor is not None):
        # FSDP2 scales inside the shard group's collective: PREMUL_SUM(1/D), or AVG when D is the
        # shard group's size. Its result is sum(g) / D.
        assert pre is None and post is None and ar_op == SUM, where
        if factor == 1.0:
            assert plan == ReducePlan(None, None, SUM, SUM, None), where  # no scaling pass
        elif shard == 1:
            # No shard-group collective runs: FSDP2 divides the input by D (its world-size-1 path)
            assert plan == ReducePlan(None, factor, SUM, SUM, None), where
        elif rs_op == AVG:
            assert plan == ReducePlan(None, None, AVG, SUM, None), where
        elif dtype == torch.bfloat16:
            # NCCL's bfloat16 PREMUL_SUM read its factor with the wrong width (zeros for powers
            # of two): mfsdp2 sums and divides after (bfloat16 cannot overflow where float32 doesn't)
            assert plan == ReducePlan(None, None, SUM, SUM, factor), where
        elif nccl:
            assert plan == ReducePlan(None, None, ("PREMUL_SUM", 1.0 / factor), SUM, None), where
        else:
            # gloo has no PREMUL_SUM: the packed input is multiplied by 1/D, as PREMUL_SUM does
            assert plan == ReducePlan(1.0 / factor, None, SUM, SUM, None), where
        return
    # Everything else is FSDP2's plan exactly: the ops, and divisions by the same numbers.
    assert (plan.op, plan.replicate_op) == (rs_op, ar_op), where
    assert plan.pre_scale is None, where
    assert (plan.pre_divide or 1) == (pre or 1), where
    assert (plan.post_divide or 1) == (post or 1), where


def test_divide_is_a_true_division():
    """``x / 3`` and ``x * (1/3)`` differ in the last bit for some x; FSDP2 divides."""
    x = torch.randn(10000, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    divide(y, 3.0)
    assert torch.equal(y, x / 3) and not torch.equal(y, x * (1 / 3))
    z = x.clone()
    divide(z, 1.0)
    divide(z, None)
    assert torch.equal(z, x)


# -- end to end: float16 against FSDP2 -------------------------------------------------------------
STEPS = 3


def _model() -> nn.Module:
    """One weight per unit, rows divisible by 4 and rows of 8 elements or more: mfsdp2's flat
    layout is then FSDP2's (each rank's rows at the same place), so gloo sums every element in
    the same rank order in both runtimes and only the divisions can tell them apart."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(), nn.Linear(32, 24, bias=False), nn.Tanh(),
                         nn.Linear(24, 8, bias=False))


def _fp16_run(rank: int, ws: int, factor):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (ws,))
    mp = MixedPrecisionPolicy(param_dtype=torch.float16)
    out = {}
    for name, shard in runtimes().items():
        model = _model()
        for m in model:
            if any(True for _ in m.parameters()):
                shard(m, mesh=mesh, mp_policy=mp)
        shard(model, mesh=mesh, mp_policy=mp)
        if factor is not None:
            for m in model.modules():
                if hasattr(m, "set_gradient_divide_factor"):
                    m.set_gradient_divide_factor(factor)
        if name == "fsdp2" and ws > 2:
            for m in model.modules():
                if hasattr(m, "set_custom_reduce_scatter"):
                    m.set_custom_reduce_scatter(RankOrderReduceScatter())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        record = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(8, 16, generator=g)
            loss = model(x).float().pow(2).sum() * 4
            loss.backward()
            record.append(snapshot(model))
            opt.step()
            opt.zero_grad()
        record.append(snapshot(model))
        out[name] = record
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ws", [2, 4])
def test_float16_bit_identical_to_fsdp2(ws):
    for factor in (None, 3.0):
        res = run_ranks(_fp16_run, ws, factor)[0]
        for step, (theirs, ours) in enumerate(zip(res["fsdp2"], res["mfsdp2"])):
            assert list(theirs) == list(ours)
            for k in theirs:
                for what, a, b in (("param", ours[k][0], theirs[k][0]), ("grad", ours[k][1], theirs[k][1])):
                    assert (a is None) == (b is None), (factor, step, k, what)
                    if a is not None:
                        assert torch.equal(a, b), (ws, factor, step, k, what, (a - b).abs().max().item())
