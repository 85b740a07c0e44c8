"""The offsets torch's RNG tracker gets for RowShard pieces (mfsdp2/dtensors/random_offsets.py).

On CUDA, DTensor random ops draw each rank's piece from one global stream starting at the offset
the tracker computes; for FSDP2's ``torch.chunk`` pieces that is the piece's offset in the full
tensor, so its sharded init equals the unsharded one. These tests call the tracker's offset
computation itself (it needs no GPU; only its instances do) on mfsdp2's parameters at world
sizes 2 and 4: every piece must start at its first row's element offset in the full tensor, and
where mfsdp2's rows equal ``torch.chunk``'s the offsets equal FSDP2's for the same parameter.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor._random import OffsetBasedRNGTracker

from .._dist import run_ranks


class _Tracker:
    """Stands for a tracker instance (only its shard-index helper is used)."""

    def _calc_shard_linear_idx(self, coord, size):
        from torch.distributed.tensor._random import _calc_shard_linear_idx

        return _calc_shard_linear_idx(coord, size)


def _offsets(rank: int, ws: int) -> list:
    import mfsdp2
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    out = []
    for shape in ((8, 12), (10, 4), (3, 16), (64,)):
        torch.manual_seed(0)
        ours = nn.Linear(1, 1)
        ours.weight = nn.Parameter(torch.zeros(shape))
        theirs = nn.Linear(1, 1)
        theirs.weight = nn.Parameter(torch.zeros(shape))
        mfsdp2.fully_shard(ours, mesh=mesh)
        fully_shard(theirs, mesh=mesh)
        dp = ours.weight
        pl = dp.placements[0]
        start, end = OffsetBasedRNGTracker._compute_rng_offsets(_Tracker(), dp._spec)
        t_start, t_end = OffsetBasedRNGTracker._compute_rng_offsets(_Tracker(), theirs.weight._spec)
        stock = OffsetBasedRNGTracker._compute_rng_offsets._torch(_Tracker(), dp._spec)[0]
        chunk_rows = [c.shape[0] for c in torch.chunk(torch.empty(shape[0]), ws)] + [0] * ws
        out.append(dict(shape=shape, rows=list(pl.rows), start=start, end=end, fsdp2=(t_start, t_end),
                        same_rows=list(pl.rows) == chunk_rows[:ws], stock=stock))
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_rowshard_pieces_start_at_their_rows(ws):
    stock_wrong = 0
    for rank, cases in enumerate(run_ranks(_offsets, ws)):
        for c in cases:
            inner = math.prod(c["shape"][1:])
            expected = (sum(c["rows"][:rank]) * inner + 3) // 4 * 4
            assert c["start"] == expected, (rank, c)
            assert c["end"] == (math.prod(c["shape"]) + 3) // 4 * 4
            if c["same_rows"]:
                assert (c["start"], c["end"]) == c["fsdp2"], (rank, c)
            stock_wrong += c["stock"] != expected
    if ws == 4:  # torch's own formula (rank r at r times rank 0's piece) misplaces unequal rows
        assert stock_wrong > 0
