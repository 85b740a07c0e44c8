"""Dequantising a gathered float8 block on an accelerator in a number of kernels set by the block's
size, not by its ranks and pieces.

Why: the reference dequantise (:func:`mfsdp2.precision.native.dequantise_fp8` without the extension, which
is what runs on a GPU) launches a cast, a divide and a copy per parameter piece of every rank's
shard: ``3 * ranks * parameters`` small kernels per unit and gather (a llama block at 64 ranks:
~1300 launches, each a few microseconds of host time and a GPU bubble). Here the gathered block
``[ranks, shard]`` is cut into *tiles* of at most :data:`TILE` elements (whole ranks where a shard
fits, else column ranges of one rank); each tile is dequantised by five kernels over all its
pieces at once:

1. the scale of each *cover entry* (a piece, or the padding between pieces, whose scale is 1) by
   one ``index_select`` from the scales with a ones entry appended;
2. those scales spread to one per element by ``repeat_interleave`` (given its output size: no
   host synchronisation);
3. the float8 bytes cast to float32, 4. divided by the spread scales in place, 5. copied (cast)
   into the unsharded buffer.

The arithmetic per element is the reference's (float8 value as float32, divided by the
segment's float32 scale, cast to the buffer's dtype), so the result is bit for bit the
reference's on every element of a piece. Padding elements become ``0 / 1 = 0`` (the quantise
writes 0 bytes there) where the reference leaves the buffer's padding as it was (uninitialised
allocator memory: nothing reads it). The cover is built on the host once per group; the
transient memory is two float32 tiles (``8 * TILE`` bytes).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .native import Segments

__all__ = ["GatheredDequantise", "TILE"]

TILE = 1 << 24  # elements per tile: 128 MiB of float32 transients at most


class _Tile:
    __slots__ = ("ranks", "cols", "lengths", "index", "numel")

    def __init__(self, ranks: tuple[int, int], cols: tuple[int, int], lengths: list[int], index: list[int]):
        self.ranks, self.cols = ranks, cols
        self.lengths = torch.tensor(lengths, dtype=torch.int64)
        self.index = torch.tensor(index, dtype=torch.int64)
        self.numel = (ranks[1] - ranks[0]) * (cols[1] - cols[0])


def _cover(pieces: Segments, lo: int, hi: int, pad: int) -> tuple[list[int], list[int]]:
    """``(lengths, scale index)`` of consecutive runs covering columns ``[lo, hi)`` of one rank's
    shard: each piece's run (its segment index) and the gaps between them (``pad``)."""
    lengths, index, at = [], [], lo
    for i, (o, n) in enumerate(zip(pieces.offsets, pieces.lengths)):
        a, b = max(o, lo), min(o + n, hi)
        if n == 0 or a >= b:
            continue
        if a > at:
            lengths.append(a - at)
            index.append(pad)
        lengths.append(b - a)
        index.append(i)
        at = b
    if hi > at:
        lengths.append(hi - at)
        index.append(pad)
    return lengths, index


class GatheredDequantise:
    """The tiles of one group's gathered block (``ranks x shard`` elements, rank ``r``'s pieces at
    ``rank_pieces[r]``), built once; :meth:`__call__` dequantises a gathered block into the
    group's unsharded buffer."""

    def __init__(self, rank_pieces: Sequence[Segments], shard: int, n_segments: int, tile: int = TILE):
        self.shard = shard
        self.n_segments = n_segments
        self.tiles: list[_Tile] = []
        self._device_tiles: dict = {}
        ranks = len(rank_pieces)
        if shard == 0:
            return
        per_tile = max(1, tile // shard)  # whole ranks per tile (at least one)
        for r0 in range(0, ranks, per_tile):
            r1 = min(ranks, r0 + per_tile)
            col_step = shard if r1 - r0 > 1 else min(shard, tile)
            for c0 in range(0, shard, col_step):
                c1 = min(shard, c0 + col_step)
                lengths, index = [], []
                for r in range(r0, r1):
                    ln, ix = _cover(rank_pieces[r], c0, c1, n_segments)
                    lengths += ln
                    index += ix
                self.tiles.append(_Tile((r0, r1), (c0, c1), lengths, index))

    def _on(self, device: torch.device) -> list[tuple[_Tile, torch.Tensor, torch.Tensor]]:
        if device not in self._device_tiles:
            self._device_tiles[device] = [
                (t, t.lengths.to(device, non_blocking=True), t.index.to(device, non_blocking=True)) for t in self.tiles
            ]
        return self._device_tiles[device]

    def kernels(self) -> int:
        """Kernel launches per dequantise (five per tile, one to extend the scales)."""
        return 5 * len(self.tiles) + 1

    def __call__(self, rows: torch.Tensor, dst: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        """``rows``: the gathered bytes, ``[ranks, >= shard]`` uint8 (this group's bytes in the
        first ``shard`` columns); ``dst``: the unsharded buffer, ``ranks * shard`` elements."""
        S = self.shard
        if S == 0:
            return
        ext = torch.cat([scales.to(torch.float32), scales.new_ones(1, dtype=torch.float32)])
        out = dst.view(-1, S)
        for t, lengths, index in self._on(rows.device):
            (r0, r1), (c0, c1) = t.ranks, t.cols
            spread = torch.repeat_interleave(ext.index_select(0, index), lengths, output_size=t.numel)
            vals = rows[r0:r1, c0:c1].view(dtype).to(torch.float32)
            vals.view(-1).div_(spread)
            out[r0:r1, c0:c1].copy_(vals)
