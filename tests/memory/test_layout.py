"""Tests for :mod:`mfsdp2.memory.layout` (pure planning, no torch.distributed).

Every guarantee is checked against quantities recomputed here from the slots (offsets, shapes) and
the shard size ``S``; :meth:`BufferLayout.piece` / :meth:`BufferLayout.rows_per_rank` are then
compared with that recomputation instead of being trusted.

Minimality is checked against the rules, not against numbers copied from the planner: on small
cases :func:`brute_min_shard` enumerates every admissible shard size and every placement (each
parameter at every aligned offset after the previous one) and the planner's padding is compared
with the smallest it finds; :func:`exact_optimal_shard` (a faster search, needed for the Llama
table) is itself checked against the brute force. Where the planner is not minimal, strict xfail
rows say so.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest

from mfsdp2.memory.layout import BufferLayout, ParamSlot, ShardPiece, plan_layout

from .._optional import given, settings, st


def _up(x: int, a: int) -> int:
    return -(-x // a) * a


def _rows(shape) -> tuple[int, int]:
    """(num_rows, row_numel), recomputed independently of ``row_numel_of``."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


def _planner_multiple(layout: BufferLayout) -> int:
    """The multiple the planner rounded ``S`` to (it says so in ``notes``), else ``align``."""
    for note in layout.notes:
        m = re.search(r"multiple of (\d+)", note)
        if m:
            return int(m.group(1))
    return layout.align


def check_layout(layout: BufferLayout, shapes, world_size: int, align: int) -> None:
    """Assert every documented guarantee of ``layout``, recomputing from offsets and ``S``."""
    shapes = [tuple(int(x) for x in s) for s in shapes]
    N, S = world_size, layout.shard_numel
    assert layout.world_size == N and layout.align == align

    # -- equal shards, alignment -----------------------------------------------------------------
    total = N * S
    assert S > 0
    assert layout.total_numel == total
    assert S % align == 0
    T = sum(math.prod(s) for s in shapes)
    assert layout.param_numel == T
    assert layout.padding_numel == total - T >= 0
    assert layout.padding_fraction == pytest.approx((total - T) / total)

    # -- slots: metadata, order, no overlap, inside the buffer -----------------------------------
    assert len(layout.slots) == len(shapes)
    prev_end = 0
    for i, (slot, shape) in enumerate(zip(layout.slots, shapes)):
        num_rows, row = _rows(shape)
        assert slot.index == i
        assert slot.shape == shape
        assert (slot.num_rows, slot.row_numel) == (num_rows, row)
        assert slot.numel == num_rows * row == math.prod(shape)
        assert slot.offset % align == 0
        assert slot.offset >= prev_end, f"param {i} overlaps or precedes param {i - 1}"
        assert slot.offset + slot.numel <= total
        prev_end = slot.offset + slot.numel

    # -- whole rows at every boundary; pieces recomputed and compared with piece() ----------------
    for i, slot in enumerate(layout.slots):
        o, n, row, num_rows = slot.offset, slot.numel, slot.row_numel, slot.num_rows
        for m in range(1, N):
            b = m * S
            if o < b < o + n:
                assert (b - o) % row == 0, f"boundary {b} cuts param {i} (offset {o}, row {row}) mid-row"
        expected_rows = []
        covered = 0
        for r in range(N):
            lo_b, hi_b = r * S, (r + 1) * S
            a, e = max(o, lo_b), min(o + n, hi_b)
            got = layout.piece(i, r)
            assert isinstance(got, ShardPiece) and (got.param_index, got.rank) == (i, r)
            if a < e:
                assert (a - o) % row == 0 and (e - o) % row == 0
                r0, r1 = (a - o) // row, (e - o) // row
                assert r0 == covered, f"param {i}: rows {covered}..{r0} on no rank or twice"
                covered = r1
                assert (got.row_start, got.row_end, got.shard_offset, got.numel) == (r0, r1, a - lo_b, e - a)
                assert 0 <= got.shard_offset and got.shard_offset + got.numel <= S
                expected_rows.append(r1 - r0)
            elif n == 0 and num_rows:
                # Rows of zero elements ((5, 0)): all on the rank whose shard holds the offset.
                owner = min(o // S, N - 1)
                r0 = 0 if r <= owner else num_rows
                r1 = num_rows if r == owner else r0
                assert (got.row_start, got.row_end, got.numel) == (r0, r1, 0)
                assert 0 <= got.shard_offset <= S
                covered += r1 - r0
                expected_rows.append(r1 - r0)
            else:
                # Empty piece: zero rows, positioned before (row 0) or after (num_rows) the param.
                # shard_offset is not compared: for a rank before the param it is offset - r*S, which
                # can lie past the end of the shard (harmless for the empty slices it is used for).
                edge = 0 if (n == 0 or hi_b <= o) else num_rows
                assert (got.row_start, got.row_end, got.numel) == (edge, edge, 0)
                assert got.shard_offset >= 0
                expected_rows.append(0)
            assert got.num_rows == expected_rows[-1]
        assert covered == num_rows
        assert layout.rows_per_rank(i) == tuple(expected_rows)
        assert sum(layout.rows_per_rank(i)) == num_rows

    # -- long rows ---------------------------------------------------------------------------------
    natural = -(-T // N)
    longest = max((s.row_numel for s in layout.slots if s.numel), default=0)
    assert S >= longest
    long_note = [note for note in layout.notes if str(longest) in note and "whole" in note]
    if longest > natural:
        assert long_note, layout.notes
    else:
        assert not long_note, layout.notes
    for i, slot in enumerate(layout.slots):
        if slot.numel and slot.row_numel > natural and slot.num_rows == 1:
            holders = [r for r, k in enumerate(layout.rows_per_rank(i)) if k]
            assert len(holders) == 1, f"long-row param {i} split over ranks {holders}"


def padding_bound(layout: BufferLayout) -> int:
    """The documented padding bound, with the multiple the planner reports rounding ``S`` to.

    ``sum_i (lcm(row_i, align) - 1 + align - 1)`` (start shift + alignment of each non-empty param)
    ``+ N * multiple + N * align``, plus ``N * longest_row - T`` when a row longer than ``T / N``
    forces ``S`` up (that padding is a property of the model; the plain bound cannot hold there, see
    ``test_handwritten_long_row_kept_whole``).

    NOTE: the stricter reading "multiple = lcm(align, rows of the params that span >= 2 boundaries
    *in the result*)" is false, see ``test_result_multiple_bound_*`` below.
    """
    N, align, S = layout.world_size, layout.align, layout.shard_numel
    multiple = _planner_multiple(layout)
    live = [s for s in layout.slots if s.numel]
    # The reported multiple must be real: S is a multiple of it, and it is built from align and rows.
    assert S % multiple == 0 and multiple % align == 0
    assert math.lcm(align, *(s.row_numel for s in live)) % multiple == 0
    gaps = sum(math.lcm(s.row_numel, align) - 1 + align - 1 for s in live)
    T = layout.param_numel
    longest = max((s.row_numel for s in live), default=0)
    return gaps + N * multiple + N * align + max(0, N * longest - T)


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


def naive_shard(shapes, world_size: int, align: int, limit: int = 10**7):
    """S of the naive plan: every param start and S aligned to lcm(align, all row sizes); None if huge."""
    rows = [_rows(s) for s in shapes]
    big = math.lcm(align, *(row for num_rows, row in rows if num_rows * row))
    if big > limit:
        return None
    cursor = 0
    for num_rows, row in rows:
        if num_rows * row:
            cursor = _up(cursor, big) + num_rows * row
    return _up(max(-(-cursor // world_size), 1), big)


# ------------------------------------------------------------------------------------------------
# Exact optimum (independent of the planner)
# ------------------------------------------------------------------------------------------------
def _earliest_offset(cursor: int, n: int, row: int, S: int, align: int):
    """Smallest aligned offset >= cursor at which a param (n elements, rows of ``row``) is valid
    for shard size S, ignoring the buffer end; None if no offset is valid."""
    lo = _up(cursor, align)
    if n == 0:
        return lo
    step = math.lcm(row, align)  # S is a multiple of align, so valid starts are b - k*step
    for window in range(2):  # the window after the first one repeats itself
        b = (lo // S + 1) * S  # first boundary strictly after lo
        if lo + n <= b:
            return lo
        k = (b - lo) // step
        if k >= 1:
            o = b - k * step
            if o + n <= b + S or S % row == 0:  # a second boundary needs S % row == 0
                return o
        lo = b
    return None


def _placement(shapes, S: int, align: int):
    """Greedy earliest-valid placement; optimal for a fixed S (the earliest valid offset of the
    next param is monotone in the cursor, so ending each param as early as possible never hurts)."""
    offsets, cursor = [], 0
    for shape in shapes:
        num_rows, row = _rows(shape)
        n = num_rows * row
        o = _earliest_offset(cursor, n, row, S, align)
        if o is None:
            return None, None
        offsets.append(o)
        if n:
            cursor = o + n
    return offsets, cursor


def exact_optimal_shard(shapes, world_size: int, align: int, s_max: int):
    """Smallest feasible S <= s_max (S multiple of align, S >= every row, N*S >= end), or None.

    Scans S upwards; an S at which some param has n > 2*S (so it crosses two boundaries wherever
    it goes) must be a multiple of that param's row, which lets the scan skip ahead.
    """
    rows = [_rows(s) for s in shapes]
    T = sum(r * c for r, c in rows)
    longest = max((c for r, c in rows if r * c), default=0)
    S = _up(max(-(-T // world_size), longest, 1), align)
    while S <= s_max:
        need, release = align, None
        for r, c in rows:
            if r * c > 2 * S:
                need = math.lcm(need, c)
                free = _up(-(-(r * c) // 2), align)  # from here on it need not cross two
                release = free if release is None else min(release, free)
        if S % need:
            S = min(_up(S, need), release)
            continue
        offsets, end = _placement(shapes, S, align)
        if offsets is not None and end <= world_size * S:
            return S
        S += align
    return None


def _admissible(o: int, n: int, row: int, S: int, world_size: int) -> bool:
    """The layout rule: every shard boundary strictly inside [o, o + n) falls on a row edge."""
    return all((m * S - o) % row == 0 for m in range(1, world_size) if o < m * S < o + n)


def brute_min_shard(shapes, world_size: int, align: int) -> int:
    """The smallest shard size S admitting a layout, by brute force over every S (a positive
    multiple of ``align``, ``N*S >= T``) and every placement: parameters in order, each at any
    aligned offset at or after the previous one's end whose shard boundaries cut no row, all inside
    ``N*S``. The scan starts at the longest row: a shorter S always puts a boundary inside that
    row (for N = 1, N*S >= T covers it). The set of reachable end positions is carried parameter
    by parameter, so no placement is skipped."""
    rows = [_rows(s) for s in shapes]
    T = sum(r * c for r, c in rows)
    longest = max((c for r, c in rows if r * c), default=0)
    S = max(align, _up(-(-T // world_size), align), _up(longest, align))
    while True:
        ends = {0}
        for num_rows, row in rows:
            n = num_rows * row
            if n == 0:  # any aligned offset at the cursor; it moves nothing
                continue
            top = world_size * S - n
            ends = {o + n for e in ends for o in range(_up(e, align), top + 1, align)
                    if _admissible(o, n, row, S, world_size)}
            if not ends:
                break
        if ends:
            return S
        S += align


def optimal_layout(shapes, world_size: int, align: int, s_max: int) -> BufferLayout:
    S = exact_optimal_shard(shapes, world_size, align, s_max)
    assert S is not None
    offsets, _ = _placement(shapes, S, align)
    slots = tuple(
        ParamSlot(i, tuple(shape), offsets[i], math.prod(shape), *_rows(shape)) for i, shape in enumerate(shapes)
    )
    return BufferLayout(world_size, S, align, slots)


# ------------------------------------------------------------------------------------------------
# 1. Properties on random shape lists
# ------------------------------------------------------------------------------------------------
_dim = st.integers(1, 300)
_dim0 = st.integers(-15, 300).map(lambda d: max(d, 0))  # ~5 % zero-size params
_shape = st.one_of(
    st.tuples(_dim0),
    st.tuples(st.integers(1, 5000)),  # occasional long 1-D params (norms, biases)
    st.tuples(_dim0, _dim),
    st.tuples(_dim0, _dim, _dim),
)
_shapes = st.lists(_shape, min_size=1, max_size=12)
_world = st.integers(1, 64)
_align = st.sampled_from([1, 2, 4, 8, 16])


def check_random_case(shapes, world_size, align):
    layout = plan_layout(shapes, world_size, align)
    check_layout(layout, shapes, world_size, align)

    # Deterministic (also for list vs tuple input).
    assert plan_layout(shapes, world_size, align) == layout
    assert plan_layout([list(s) for s in shapes], world_size, align) == layout

    # Padding bound (see padding_bound for why the multiple is the planner's, not the result's).
    assert layout.padding_numel <= padding_bound(layout)
    return layout


@settings(max_examples=300, deadline=None)
@given(shapes=_shapes, world_size=_world, align=_align)
def test_layout_properties(shapes, world_size, align):
    check_random_case(shapes, world_size, align)
    # NOT asserted here: "S <= S of the naive plan (everything aligned to the LCM of all row sizes)".
    # It fails (the growth step can overshoot); see test_never_worse_than_naive_lcm_plan.


@pytest.mark.xfail(strict=True, reason="growth step S += ceil(excess / N) overshoots the naive plan")
def test_never_worse_than_naive_lcm_plan():
    """[(2, 4), (6,)], N=2, align=1: trial S=7 shifts (2, 4) to offset 3, the buffer overflows by 3
    and S jumps to 7 + ceil(3/2) = 9 (padding 4). The naive plan (and optimum) is S=8: (2, 4) at 0,
    (6,) at 8, padding 2."""
    shapes = [(2, 4), (6,)]
    assert naive_shard(shapes, 2, 1) == exact_optimal_shard(shapes, 2, 1, 100) == 8
    assert plan_layout(shapes, 2, 1).shard_numel <= 8


def test_invalid_arguments():
    with pytest.raises(ValueError):
        plan_layout([(4, 4)], 0)
    with pytest.raises(ValueError):
        plan_layout([(4, 4)], 2, align=0)


# ------------------------------------------------------------------------------------------------
# 2. Llama-style transformer block
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
# 3. Handwritten cases
# ------------------------------------------------------------------------------------------------
def test_handwritten_single_vector():
    layout = plan_layout([(10,)], 4, align=1)
    check_layout(layout, [(10,)], 4, 1)
    assert layout.shard_numel == brute_min_shard([(10,)], 4, 1)
    # Pieces are consecutive row ranges covering the vector (check_layout recomputed each one).
    pieces = [layout.piece(0, r) for r in range(4)]
    assert pieces[0].row_start == 0 and pieces[-1].row_end == 10
    assert all(a.row_end == b.row_start for a, b in zip(pieces, pieces[1:]))


def test_handwritten_long_row_kept_whole():
    shapes = [(1, 1000), (8, 4)]  # T = 1032, T/N = 129 < 1000
    layout = plan_layout(shapes, 8, align=4)
    check_layout(layout, shapes, 8, 4)
    # S >= the longest row is forced by the rules (a longer row would contain a boundary), so the
    # minimum is S = 1000 = the row, and the long-row parameter sits on one rank.
    assert layout.shard_numel == brute_min_shard(shapes, 8, 4) == 1000
    assert sum(1 for k in layout.rows_per_rank(0) if k) == 1
    assert any("1000" in note and "whole" in note for note in layout.notes)
    # Padding is N*1000 - T = 6968: far above sum(lcm - 1 + align - 1) + N*M + N*align = 1072, so the
    # plain documented bound needs the N*longest - T term when a long row sets S.
    assert layout.padding_numel == 8 * 1000 - 1032
    assert layout.padding_numel <= padding_bound(layout)


def test_handwritten_long_rows_multi_row_param_one_row_per_rank():
    """A param with several long rows is not held whole (S would have to be 2000): each row is."""
    shapes = [(2, 1000), (8, 4)]
    layout = plan_layout(shapes, 8, align=4)
    check_layout(layout, shapes, 8, 4)
    assert layout.shard_numel == brute_min_shard(shapes, 8, 4) == 1000
    assert sorted(layout.rows_per_rank(0), reverse=True)[:3] == [1, 1, 0]


@pytest.mark.parametrize(
    "align",
    [1, 4, pytest.param(16, marks=pytest.mark.xfail(strict=True, reason="N=1 pays boundary padding"))],
)
def test_handwritten_single_rank(align):
    shapes = [(3,), (5, 2), (2, 3, 4), (7,)]
    layout = plan_layout(shapes, 1, align)
    check_layout(layout, shapes, 1, align)
    # One rank: no boundaries, so the only padding is aligning each start and the end.
    end = 0
    for shape in shapes:
        end = _up(end, align) + math.prod(shape)
    assert layout.shard_numel == _up(end, align)
    offsets, cursor = [], 0
    for shape in shapes:
        offsets.append(_up(cursor, align))
        cursor = offsets[-1] + math.prod(shape)
    assert [s.offset for s in layout.slots] == offsets
    assert all(layout.rows_per_rank(i) == (layout.slots[i].num_rows,) for i in range(len(shapes)))


@pytest.mark.xfail(strict=True, reason="_place treats the buffer end N*S as a shard boundary")
def test_single_rank_minimal_counterexample():
    """N=1 has no boundaries, so S should be the aligned end (6 here: offsets 0 and 2). The first
    trial S=4 makes (1, 3) at offset 2 "cross" the buffer end at 4, so it is pushed to 4, the
    buffer overflows (end 7) and S grows to 8; at S=8 the param sits at 2 again (padding 4, not 2)."""
    layout = plan_layout([(1,), (1, 3)], 1, align=2)
    check_layout(layout, [(1,), (1, 3)], 1, 2)
    assert [s.offset for s in layout.slots] == [0, 2]
    assert layout.shard_numel == 6


def test_handwritten_single_rank_no_padding_when_aligned():
    shapes = [(4, 4), (8,), (2, 2, 2)]  # sizes 16, 8, 8: all multiples of align, so T = 32 is reachable
    layout = plan_layout(shapes, 1, align=4)
    check_layout(layout, shapes, 1, 4)
    assert layout.shard_numel == brute_min_shard(shapes, 1, 4) == 32 and layout.padding_numel == 0


@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_handwritten_zero_size_param(world_size):
    shapes = [(4, 3), (0, 7), (5,)]
    layout = plan_layout(shapes, world_size, align=4)
    check_layout(layout, shapes, world_size, 4)
    assert layout.shard_numel == brute_min_shard(shapes, world_size, 4)
    for r in range(world_size):
        p = layout.piece(1, r)
        assert p.numel == 0 and p.num_rows == 0
    assert layout.rows_per_rank(1) == (0,) * world_size


def test_handwritten_only_empty_params():
    layout = plan_layout([(0, 7), (0,)], 4, align=8)
    check_layout(layout, [(0, 7), (0,)], 4, 8)
    assert layout.shard_numel == brute_min_shard([(0, 7), (0,)], 4, 8) == 8  # S > 0, a multiple of align


def test_handwritten_scalar_param():
    layout = plan_layout([(), (6,)], 2, align=1)
    check_layout(layout, [(), (6,)], 2, 1)
    assert layout.shard_numel == brute_min_shard([(), (6,)], 2, 1)
    assert layout.rows_per_rank(0) in {(1, 0), (0, 1)}


def test_zero_size_trailing_dim_rows_sum_to_num_rows():
    # A (5, 0) param has 5 rows of 0 elements; a row-sharded DTensor of global shape (5, 0) needs
    # per-rank row counts summing to 5 (every piece used to report 0 rows).
    layout = plan_layout([(5, 0), (4,)], 2, align=1)
    assert sum(layout.rows_per_rank(0)) == 5


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("shapes", [[(5, 0), (4,)], [(4, 3), (5, 0)], [(6, 3), (2, 0, 4), (7,)], [(3, 0)]])
def test_zero_size_trailing_dims_every_rank_count_sums_to_dim0(shapes, world_size):
    layout = plan_layout(shapes, world_size, align=4)
    check_layout(layout, shapes, world_size, 4)
    for i, shape in enumerate(shapes):
        if math.prod(shape) == 0:
            rows = layout.rows_per_rank(i)
            assert sum(rows) == shape[0] and sorted(rows)[:-1] == [0] * (world_size - 1), rows


# ------------------------------------------------------------------------------------------------
# Padding bound with the multiple recomputed from the result: counterexamples
# ------------------------------------------------------------------------------------------------
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
# 4. Minimality by brute force on every small case
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
