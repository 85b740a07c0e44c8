"""Which reduce ops a gradient reduction uses, and where it divides: FSDP2's rules, as a table.

A drop-in must average gradients with FSDP2's arithmetic, not merely to the same mean: the
order of a division and a sum changes the last bit, and in float16 it decides whether a sum of
many ranks overflows. torch 2.13's FSDP2 (``_get_gradient_divide_factors``) decides per
reduction from the reduce dtype, the shard and replicate group sizes, the user's divide factor
and ``force_sum_reduction_for_comms``:

* float32 / bfloat16, no forced sum: ``AVG`` in both stages (``SUM`` when a single rank
  reduces: NCCL's ``AVG`` is unreliable at world size 1); a divide factor equal to the shard
  group's size is ``AVG`` too; any other factor ``D`` is ``PREMUL_SUM(1/D)`` over the shard
  group and ``SUM`` across replicas.
* float16 and other narrow dtypes (overflow risk), or a forced sum: ``SUM`` in both stages, the
  factor (default: every data-parallel rank) split into a power-of-two pre-divide near its square
  root and the rest as a post-divide, so the partial sums stay within float16's range.

Where mfsdp2 departs, and why:

* a factor of 1 issues plain ``SUM`` (a ``PREMUL_SUM(1.0)`` is a no-op scaling pass);
* bfloat16 never uses ``PREMUL_SUM``: NCCL read its scalar with the wrong width, so a
  power-of-two factor became zero and every gradient silently zero (pytorch#190745); the sum is
  divided afterwards instead (bfloat16 has float32's range: nothing overflows);
* backends without ``PREMUL_SUM`` (gloo) multiply the packed gradients by ``1/D`` before a
  ``SUM`` -- the arithmetic ``PREMUL_SUM`` performs inside the collective.

The divisions are true divisions (``div_``), as FSDP2's: ``x / 3`` and ``x * (1/3)`` differ in
the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

__all__ = ["ReducePlan", "plan_reduction", "divide"]

Op = Union[dist.ReduceOp, "dist.ReduceOp.RedOpType"]


@dataclass(frozen=True)
class ReducePlan:
    """How one reduction runs: scale or divide the packed input, the shard group's collective,
    the replicas' all-reduce, then the division of the result (after the all-reduce hook)."""

    pre_scale: Optional[float]  # multiply the packed input by this (PREMUL_SUM's arithmetic off NCCL)
    pre_divide: Optional[float]  # divide the packed input by this (float16: the power-of-two part)
    op: Op  # the shard group's collective
    replicate_op: Op  # the all-reduce across replicas (HSDP, no_shard)
    post_divide: Optional[float]  # divide the reduced result by this


def plan_reduction(
    reduce_dtype: torch.dtype,
    shard_size: int,
    replicate_size: int,
    factor: Optional[float],
    force_sum: bool,
    premul_sum: Callable[[float], Optional[Op]],
) -> ReducePlan:
    """The :class:`ReducePlan` of a reduction over ``shard_size`` x ``replicate_size`` ranks.

    ``premul_sum(s)``: the backend's ``PREMUL_SUM(s)`` op, or None where it has none."""
    avg, total = dist.ReduceOp.AVG, dist.ReduceOp.SUM
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    ranks = shard_size * replicate_size
    if not overflow_risk and not force_sum:
        if factor is None:
            if ranks == 1:
                return ReducePlan(None, None, total, total, None)
            return ReducePlan(None, None, avg, avg, None)
        if factor == 1:
            return ReducePlan(None, None, total, total, None)
        if shard_size > 1 and factor == shard_size:
            return ReducePlan(None, None, avg, total, None)
        if shard_size == 1:  # no shard-group collective: FSDP2 divides the input, then sums replicas
            return ReducePlan(None, float(factor), total, total, None)
        if reduce_dtype == torch.bfloat16:
            return ReducePlan(None, None, total, total, float(factor))
        premul = premul_sum(1.0 / factor)
        if premul is not None:
            return ReducePlan(None, None, premul, total, None)
        return ReducePlan(1.0 / factor, None, total, total, None)
    if factor is None:
        factor = float(ranks)
    if overflow_risk:
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return ReducePlan(None, float(pre) if pre != 1 else None, total, total,
                          factor / pre if factor / pre != 1 else None)
    return ReducePlan(None, None, total, total, float(factor) if factor != 1 else None)


def divide(t: torch.Tensor, by: Optional[float]) -> None:
    """``t /= by`` in place, as FSDP2's ``_div_if_needed`` (nothing for None or 1)."""
    if by is not None and by != 1:
        t.div_(by)
