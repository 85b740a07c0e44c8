"""How close :func:`mfsdp2.memory.layout.plan_layout` comes to the smallest admissible shard size.

Minimality is checked against the rules, not against numbers copied from the planner: the
oracles of ``tests/memory/_layout_oracles.py`` (a brute force over every shard size and placement,
and a faster exact search checked against it here on every small case) give the minimum. Covered:
the Llama-style transformer block over N = 2..64 (provable minimum, the 0.5 % padding target and
where it is impossible), counterexamples to a padding bound built from the result's multiple,
and every small case (one or two params, N <= 4, align <= 4). Where the planner is not minimal,
strict xfail rows say so.
"""

from __future__ import annotations

import itertools
import math

import pytest

from mfsdp2.memory.layout import BufferLayout, plan_layout

from ._layout_oracles import _up, brute_min_shard, check_layout, exact_optimal_shard, optimal_layout, padding_bound


# ------------------------------------------------------------------------------------------------
# 1. Llama-style transformer block
# ------------------------------------------------------------------------------------------------
HIDDEN, FFN = 4096, 14336
LCM_ROWS = math.lcm(HIDDEN, FFN)  # 28672: rows of w1/w3 (4096) and of w2 (14336)


def llama_block(kv_rows: int):
    return [
        (HIDDEN,),  # attention norm
        (HIDDEN, HIDDEN),  # wq
        (kv_rows, HIDDEN),  # wk
        (kv_rows, HIDDEN),  # wv
        (HIDDEN, HIDDEN),  # wo
        (HIDDEN,),  # ffn norm
        (FFN, HIDDEN),  # w1
        (FFN, HIDDEN),  # w3
        (HIDDEN, FFN),  # w2
    ]


VARIANTS = {"mha": llama_block(HIDDEN), "gqa": llama_block(1024)}


def llama_minimum(shapes, world_size: int) -> tuple[int, bool]:
    """``(N * S* - T, provable)`` with ``S* = ceil(T / (N * 28672)) * 28672``.

    Why it is the minimum when ``provable``: every valid S has ``N * S >= T``. w1 (rows of 4096)
    and w2 (rows of 14336) both have n = 4096 * 14336 elements; any interval of n > 2S elements
    contains two multiples of S, so for S < n/2 both cross two shard boundaries, which are S
    apart, forcing ``S % 4096 == 0`` and ``S % 14336 == 0``, i.e. ``S % 28672 == 0``. If
    ``S* <= n/2`` every S in [T/N, S*) is below n/2 and not a multiple of 28672 (S* is the first
    multiple of 28672 >= T/N), so none is valid and the padding is at least ``N * S* - T``.
    For small N (S* > n/2) this is no lower bound: the planner beats it at e.g. N = 2, 3, 7.
    """
    T = sum(math.prod(s) for s in shapes)
    s_star = _up(-(-T // world_size), LCM_ROWS)
    n = HIDDEN * FFN
    return world_size * s_star - T, 2 * (s_star - 1) < n


LLAMA_CASES = [(v, a, n) for v in VARIANTS for a in (4, 8) for n in range(2, 65)]


@pytest.mark.parametrize("variant,align,world_size", LLAMA_CASES)
def test_llama_block_padding(variant, align, world_size):
    shapes = VARIANTS[variant]
    layout = plan_layout(shapes, world_size, align)
    check_layout(layout, shapes, world_size, align)
    minimum, provable = llama_minimum(shapes, world_size)
    if provable:  # N >= 9 (MHA) / N >= 8 (GQA): the layout is optimal
        assert layout.padding_numel == minimum
    # Never worse than "S = first multiple of 28672 >= T/N" (which is always feasible here).
    assert layout.padding_numel <= minimum
    # 0.5 % wherever it is possible at all.
    if minimum / (minimum + sum(math.prod(s) for s in shapes)) <= 0.005:
        assert layout.padding_fraction <= 0.005, layout.describe()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("align", [4, 8])
@pytest.mark.parametrize("world_size", [2, 4, 8, 16, 32, 64])
def test_llama_block_powers_of_two_under_half_percent(variant, align, world_size):
    layout = plan_layout(VARIANTS[variant], world_size, align)
    assert layout.padding_fraction <= 0.005, layout.describe()


@pytest.mark.parametrize(
    "variant,impossible",
    [("mha", {52, 53, 54, 61}), ("gqa", {45, 50, 51, 58})],
)
def test_llama_block_half_percent_impossible_exactly_where_expected(variant, impossible):
    """For these N even the optimal layout pads more than 0.5 % (provable minimum above)."""
    shapes = VARIANTS[variant]
    T = sum(math.prod(s) for s in shapes)
    over = set()
    for n in range(2, 65):
        minimum, provable = llama_minimum(shapes, n)
        if minimum / (minimum + T) > 0.005:
            assert provable
            over.add(n)
    assert over == impossible


# The planner is not optimal for these small N (all under 0.07 % padding, so only a note):
# MHA N=6, GQA N=4/5: w2 is the last param; when it overflows the buffer at a trial S, _place sees
# the buffer end N*S as a second boundary and folds 14336 (then 4096) into S's multiple instead of
# growing S. MHA N=4: the growth step S += ceil(excess / N) overshoots the optimum.
LLAMA_SUBOPTIMAL = {("mha", 4), ("mha", 6), ("gqa", 4), ("gqa", 5)}


def _llama_opt_params():
    for v, a, n in LLAMA_CASES:
        marks = ()
        if (v, n) in LLAMA_SUBOPTIMAL:
            marks = pytest.mark.xfail(strict=True, reason="planner pads more than the exact optimum")
        yield pytest.param(v, a, n, marks=marks, id=f"{v}-{a}-{n}")


@pytest.mark.parametrize("variant,align,world_size", list(_llama_opt_params()))
def test_llama_block_matches_exact_optimum(variant, align, world_size):
    shapes = VARIANTS[variant]
    layout = plan_layout(shapes, world_size, align)
    best = exact_optimal_shard(shapes, world_size, align, layout.shard_numel)
    assert layout.shard_numel == best


@pytest.mark.parametrize("variant,align,world_size", LLAMA_CASES)
def test_exact_optimum_is_a_valid_layout(variant, align, world_size):
    """The oracle's claims are backed by real layouts that pass every check."""
    shapes = VARIANTS[variant]
    planned = plan_layout(shapes, world_size, align)
    best = optimal_layout(shapes, world_size, align, planned.shard_numel)
    check_layout(best, shapes, world_size, align)
    assert best.padding_numel <= planned.padding_numel


# ------------------------------------------------------------------------------------------------
# 2. Padding bound with the multiple recomputed from the result: counterexamples
# ------------------------------------------------------------------------------------------------
def result_multiple(layout: BufferLayout) -> int:
    """lcm(align, row sizes of the params that span two or more boundaries in ``layout``)."""
    S, N = layout.shard_numel, layout.world_size
    m = layout.align
    for s in layout.slots:
        if s.numel:
            inside = sum(1 for k in range(1, N) if s.offset < k * S < s.offset + s.numel)
            if inside >= 2:
                m = math.lcm(m, s.row_numel)
    return m


def _result_bound(layout: BufferLayout) -> int:
    N, align = layout.world_size, layout.align
    gaps = sum(math.lcm(s.row_numel, align) - 1 + align - 1 for s in layout.slots if s.numel)
    return gaps + N * result_multiple(layout) + N * align


def test_result_multiple_bound_is_unattainable():
    """[(22, 105)], N=8, align=16: every S < 1155 makes the param cross two boundaries, forcing
    S % lcm(105, 16) == 0, so the optimum is S = 1680, where it crosses only one. Bounding padding
    by N * lcm(rows spanning >= 2 boundaries *in the result*) therefore fails even for the optimum."""
    shapes, n, align = [(22, 105)], 8, 16
    layout = plan_layout(shapes, n, align)
    best = optimal_layout(shapes, n, align, layout.shard_numel)
    check_layout(best, shapes, n, align)
    assert best.shard_numel == layout.shard_numel == brute_min_shard(shapes, n, align) == 1680
    assert best.padding_numel == 8 * 1680 - 22 * 105 > _result_bound(best) == (
        (math.lcm(105, 16) - 1) + (16 - 1) + 8 * 16 + 8 * 16)


SUBOPTIMAL_SMALL = [
    # Pushed to start on a boundary, the param then crosses the next one; the planner folds 7 into
    # the multiple (S=28) although S=24 holds it whole on rank 0.
    pytest.param([(3, 7)], 3, 4, id="3x7-N3"),
    # N=2 has one boundary, but _place treats the buffer end (2*S) as a second one while the param
    # overflows and folds 115 (S=11960); S=11736 with offset 696 is admissible.
    pytest.param([(198, 115)], 2, 8, id="198x115-N2"),
]


@pytest.mark.parametrize("shapes,world_size,align", SUBOPTIMAL_SMALL)
def test_result_multiple_bound_counterexamples(shapes, world_size, align):
    """The planner exceeds the result-multiple bound here although the optimum stays within it."""
    layout = plan_layout(shapes, world_size, align)
    check_layout(layout, shapes, world_size, align)
    best = optimal_layout(shapes, world_size, align, layout.shard_numel)
    check_layout(best, shapes, world_size, align)
    assert best.shard_numel == brute_min_shard(shapes, world_size, align)
    assert best.padding_numel <= _result_bound(best)
    assert layout.padding_numel > _result_bound(layout)
    assert layout.padding_numel <= padding_bound(layout)  # the planner-multiple bound still holds


@pytest.mark.xfail(strict=True, reason="planner folds a row into S's multiple where growing S is cheaper")
@pytest.mark.parametrize("shapes,world_size,align", SUBOPTIMAL_SMALL)
def test_planner_reaches_optimum_small(shapes, world_size, align):
    assert plan_layout(shapes, world_size, align).shard_numel == brute_min_shard(shapes, world_size, align)


# ------------------------------------------------------------------------------------------------
# 3. Minimality by brute force on every small case
# ------------------------------------------------------------------------------------------------
_SMALL_SHAPES = [(1,), (2,), (3,), (5,), (7,), (1, 3), (2, 3), (3, 2), (2, 4), (3, 5), (4, 3), (1, 6), (3, 7),
                 (2, 2, 2), (0, 3)]
SMALL_CASES = [
    (shapes, n, align)
    for k in (1, 2)
    for shapes in itertools.product(_SMALL_SHAPES, repeat=k)
    for n in (1, 2, 3, 4)
    for align in (1, 2, 4)
]


def test_small_cases_valid_and_the_oracles_agree():
    """On every small case (one or two params from a pool of small shapes, N <= 4, align <= 4):
    the plan obeys the rules, its S is admissible to the brute force, it stays within the
    documented bound, and exact_optimal_shard (the oracle for the Llama table) equals the brute
    force's minimum."""
    for shapes, n, align in SMALL_CASES:
        layout = plan_layout(shapes, n, align)
        check_layout(layout, shapes, n, align)
        best = brute_min_shard(shapes, n, align)
        assert best <= layout.shard_numel, (shapes, n, align)
        assert layout.padding_numel <= padding_bound(layout), (shapes, n, align)
        assert exact_optimal_shard(shapes, n, align, layout.shard_numel) == best, (shapes, n, align)


@pytest.mark.xfail(
    strict=True,
    reason="not minimal on about 1 small case in 6: folds a row into S's multiple where growing S "
    "is cheaper ([(2, 3)], N=2, align=4: S=12, minimum 8), treats the buffer end as a boundary "
    "([(1,), (1, 3)], N=1, align=2: S=8, minimum 6), and the growth step overshoots ([(2, 4), (6,)], "
    "N=2, align=1: S=9, minimum 8)",
)
def test_small_cases_planner_is_minimal():
    worse = [(shapes, n, align) for shapes, n, align in SMALL_CASES
             if plan_layout(shapes, n, align).shard_numel != brute_min_shard(shapes, n, align)]
    assert not worse, f"{len(worse)} of {len(SMALL_CASES)} small cases pad more than the minimum, e.g. {worse[:5]}"


def test_brute_force_oracle_finds_known_minima():
    """The brute force itself, on cases whose minimum follows from the rules by hand: one vector
    of 10 over 4 ranks (S = ceil(10/4) = 3 holds it); a (2, 3) parameter over 2 ranks with align
    4 (S = 4 cuts its 6 elements mid-row at 4 wherever it starts in [0, 2], so S = 8); and N = 1
    (no boundaries: S = the aligned total)."""
    assert brute_min_shard([(10,)], 4, 1) == 3
    assert brute_min_shard([(2, 3)], 2, 4) == 8
    assert brute_min_shard([(1,), (1, 3)], 1, 2) == 6
    assert brute_min_shard([(2, 4), (6,)], 2, 1) == 8
