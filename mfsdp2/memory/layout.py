"""Row-aligned flat buffer layout: which elements of a unit's flat buffer belong to which rank.

Pure functions and frozen dataclasses only: no ``torch.distributed``, no tensors. Everything else
(buffers, parameter groups, state dicts) derives its offsets from a :class:`BufferLayout`, so the
layout is the single source of truth for "which rows of parameter *i* does rank *r* hold".

The problem
-----------
A unit's parameters are laid out param-major in one flat buffer of ``N * S`` elements (``N`` ranks,
``S`` elements per rank). Rank ``r`` owns the contiguous slice ``[r*S, (r+1)*S)``. Gathering the
buffer is one ``all_gather_into_tensor`` and the gathered buffer *is* the parameters' storage (every
parameter is a contiguous view into it: zero copy).

The optimizer sees each parameter as a DTensor sharded on dim 0, so every rank's piece of every
parameter must be a whole number of dim-0 rows (possibly zero). A shard boundary ``b = m*S`` that
falls strictly inside parameter ``p`` (starting at ``o``, rows of ``row`` elements) must satisfy
``(b - o) % row == 0``. (A parameter sharded on another dim ``d`` -- ``shard_placement_fn`` --
is planned as its storage, ``d`` first, whose rows are its slices along ``d``: see
:mod:`mfsdp2.dtensors.shard_dim`; the planner only sees the storage shape.)

How the plan meets that with little padding
-------------------------------------------
* A parameter that crosses **one** boundary only needs its *start* shifted so the boundary lands on
  a row edge: at most ``lcm(row, align) - 1`` padding elements, paid once.
* A parameter that crosses **two or more** boundaries additionally needs ``S % row == 0`` (two
  boundaries are ``S`` apart). Only those parameters' row sizes are folded into the multiple that
  ``S`` is rounded to; we never align every parameter to the LCM of all row sizes (Megatron-FSDP's
  ``chunk_size_factor``), which wastes up to that LCM per parameter.
* ``S`` is at least the longest row of any parameter, so every row fits inside one shard. A
  parameter whose single row is longer than ``T / N`` (``T`` = total elements) is therefore placed
  whole on one rank and ``S`` grows to hold it; :attr:`BufferLayout.notes` says so, because the
  padding this costs is a property of the model, not of the planner.
* Parameter starts and ``S`` are multiples of ``align`` elements (callers pass 16 bytes' worth of
  the narrowest dtype that will use the layout) so vectorised kernels see aligned pointers.

Padding bound (tested): ``padding <= sum_i (lcm(row_i, align) - 1) + N * multiple`` where
``multiple`` is the final rounding multiple of ``S`` (``align`` folded with the row sizes of the
parameters that span two or more boundaries), plus ``N * align`` when the longest row sets ``S``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = ["ParamSlot", "ShardPiece", "BufferLayout", "plan_layout", "row_numel_of"]


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _moved(shape: Sequence[int], dim: int) -> tuple[int, ...]:
    shape = tuple(int(x) for x in shape)
    return shape if dim == 0 else (shape[dim],) + shape[:dim] + shape[dim + 1 :]


def row_numel_of(shape: Sequence[int]) -> tuple[int, int]:
    """``(num_rows, row_numel)`` of a parameter shape; a 0-d shape counts as one row of one element."""
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), math.prod(int(s) for s in shape[1:])


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat (unsharded) buffer.

    ``shard_dim``: the parameter's dimension whose slices are the slot's rows (0 unless
    ``shard_placement_fn`` asked for another): the slot holds the parameter with that dimension
    moved to the front, ``storage_shape`` (see :mod:`mfsdp2.dtensors.shard_dim`)."""

    index: int
    shape: tuple[int, ...]
    offset: int  # first element in the flat buffer
    numel: int
    num_rows: int
    row_numel: int
    shard_dim: int = 0

    @property
    def storage_shape(self) -> tuple[int, ...]:
        if self.shard_dim == 0:
            return self.shape
        d = self.shard_dim
        return (self.shape[d],) + self.shape[:d] + self.shape[d + 1 :]


@dataclass(frozen=True)
class ShardPiece:
    """What one rank holds of one parameter: rows ``[row_start, row_end)`` (possibly empty)."""

    param_index: int
    rank: int
    row_start: int
    row_end: int
    shard_offset: int  # where the piece starts inside the rank's shard (elements)
    numel: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class BufferLayout:
    """A planned flat buffer: ``world_size`` equal shards of ``shard_numel`` elements."""

    world_size: int
    shard_numel: int
    align: int
    slots: tuple[ParamSlot, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def total_numel(self) -> int:
        return self.world_size * self.shard_numel

    @property
    def param_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def padding_numel(self) -> int:
        return self.total_numel - self.param_numel

    @property
    def padding_fraction(self) -> float:
        return self.padding_numel / self.total_numel if self.total_numel else 0.0

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def piece(self, param_index: int, rank: int) -> ShardPiece:
        slot = self.slots[param_index]
        lo_b, hi_b = self.shard_range(rank)
        if slot.numel == 0 and slot.num_rows:
            # Rows of zero elements (shape (5, 0)): they take no bytes, but the row-sharded
            # DTensor's per-rank row counts must still sum to the global dim 0. All of them go to
            # the rank whose shard holds the slot's offset (the last rank for one at the very end).
            owner = min(slot.offset // self.shard_numel, self.world_size - 1) if self.shard_numel else 0
            row = 0 if rank <= owner else slot.num_rows
            end = slot.num_rows if rank == owner else row
            return ShardPiece(param_index, rank, row, end, max(min(slot.offset - lo_b, self.shard_numel), 0), 0)
        lo = min(max(slot.offset, lo_b), slot.offset + slot.numel)
        hi = max(min(slot.offset + slot.numel, hi_b), lo)
        if hi == lo or slot.row_numel == 0:
            # Empty piece: report the row where this rank's range would start, for offsets.
            row = 0 if lo <= slot.offset else slot.num_rows
            return ShardPiece(param_index, rank, row, row, max(lo - lo_b, 0), 0)
        r0 = (lo - slot.offset) // slot.row_numel
        r1 = (hi - slot.offset) // slot.row_numel
        return ShardPiece(param_index, rank, r0, r1, lo - lo_b, hi - lo)

    def rows_per_rank(self, param_index: int) -> tuple[int, ...]:
        """Rows of the parameter on every rank. Only the ranks whose shard overlaps its slot get
        any: those few are computed, the rest are zeros (at 1024 ranks a parameter usually spans
        one or two shards; asking every rank made ``fully_shard`` O(parameters x ranks) in Python)."""
        slot = self.slots[param_index]
        S = self.shard_numel
        if slot.numel == 0 or slot.row_numel == 0 or S == 0:  # rows of zero elements: piece() decides
            return tuple(self.piece(param_index, r).num_rows for r in range(self.world_size))
        rows = [0] * self.world_size
        off, end, row = slot.offset, slot.offset + slot.numel, slot.row_numel
        first, last = off // S, min((end - 1) // S, self.world_size - 1)
        # piece(): rank r holds rows [edge(r), edge(r + 1)) with edge(r) = (clamp(r S) - off) // row.
        # One comprehension over the overlapping ranks (a unit of a 405B layer overlaps all 1024).
        edges = [(min(max(r * S, off), end) - off) // row for r in range(first, last + 2)]
        rows[first : last + 1] = [b - a for a, b in zip(edges, edges[1:])]
        return tuple(rows)

    def describe(self) -> str:
        return (
            f"{len(self.slots)} params, {self.param_numel} elements, world {self.world_size}: "
            f"shard {self.shard_numel}, padding {self.padding_numel} ({100 * self.padding_fraction:.3f} %)"
        )


class _NeedsMultiple(Exception):
    def __init__(self, row_numel: int):
        self.row_numel = row_numel


def _place(rows: list[tuple[int, int]], S: int, align: int) -> tuple[list[int], int]:
    """Place parameters in order for shard size ``S``; returns offsets and the end of the last one.

    Raises :class:`_NeedsMultiple` when a parameter spans two or more boundaries and ``S`` is not a
    multiple of its row size.
    """
    offsets: list[int] = []
    cursor = 0
    for num_rows, row in rows:
        n = num_rows * row
        o = _align_up(cursor, align)
        if n == 0:
            offsets.append(o)
            continue
        b = (o // S + 1) * S  # first boundary strictly after o
        if b < o + n and (b - o) % row:
            step = row * align // math.gcd(row, align)
            o = b - ((b - o) // step) * step  # shift so b falls on a row edge (or start at b)
            b = (o // S + 1) * S
        # Still cut mid-row (o landed on the old boundary), or cut twice with S not a row multiple.
        if (b < o + n and (b - o) % row) or (b + S < o + n and S % row):
            raise _NeedsMultiple(row)
        offsets.append(o)
        cursor = o + n
    return offsets, cursor


def plan_layout(
    shapes: Sequence[Sequence[int]], world_size: int, align: int = 4, dims: Optional[Sequence[int]] = None
) -> BufferLayout:
    """Plan a row-aligned flat buffer for ``shapes`` split over ``world_size`` equal shards.

    Deterministic: the same arguments always give the same layout. ``align`` is in elements.
    ``dims``: per parameter, the dimension whose slices are its rows (default 0 for all).
    """
    if world_size < 1:
        raise ValueError(f"mfsdp2 E27: world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1 element, got {align}")
    dims = [int(d) for d in dims] if dims is not None else [0] * len(shapes)
    rows = [row_numel_of(_moved(s, d)) for s, d in zip(shapes, dims)]
    total = sum(r * c for r, c in rows)
    notes: list[str] = []
    longest = max((c for r, c in rows if r * c), default=0)
    natural = -(-total // world_size)
    multiple = align
    S = _align_up(max(natural, longest, 1), multiple)
    if longest > natural:
        notes.append(
            f"a row of {longest} elements is longer than an even share ({natural}); the parameter "
            "holding it is kept whole on one rank and the shard grows to fit it"
        )
    while True:
        try:
            offsets, end = _place(rows, S, align)
        except _NeedsMultiple as e:
            multiple = multiple * e.row_numel // math.gcd(multiple, e.row_numel)
            S = _align_up(S, multiple)
            continue
        if end <= world_size * S:
            break
        S = _align_up(S + -(-(end - world_size * S) // world_size), multiple)
    slots = tuple(
        ParamSlot(i, tuple(int(x) for x in shapes[i]), offsets[i], r * c, r, c, dims[i])
        for i, (r, c) in enumerate(rows)
    )
    if multiple != align:
        notes.append(f"shard size rounded to a multiple of {multiple} for parameters spanning several shards")
    return BufferLayout(world_size, S, align, slots, tuple(notes))
