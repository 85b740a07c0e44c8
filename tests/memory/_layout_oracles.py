"""Independent checks of a :class:`BufferLayout` and exact optimum oracles for the layout tests.

:func:`check_layout` asserts every documented guarantee of a layout against quantities recomputed
here from the slots (offsets, shapes) and the shard size ``S``; :meth:`BufferLayout.piece` /
:meth:`BufferLayout.rows_per_rank` are compared with that recomputation instead of being
trusted. :func:`padding_bound` is the documented padding bound.

The oracles know nothing of the planner: :func:`brute_min_shard` enumerates every admissible
shard size and every placement (small cases only); :func:`exact_optimal_shard` is a faster exact
search (needed for the Llama table) that the small cases check against the brute force, and
:func:`optimal_layout` builds the layout it finds so that it can be checked like a planned one.
"""

from __future__ import annotations

import math
import re

import pytest

from mfsdp2.memory.layout import BufferLayout, ParamSlot, ShardPiece


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
    ``test_handwritten_long_row_kept_whole`` in test_layout_planner.py).

    NOTE: the stricter reading "multiple = lcm(align, rows of the params that span >= 2 boundaries
    *in the result*)" is false, see ``test_result_multiple_bound_*`` in test_layout_optimality.py.
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
