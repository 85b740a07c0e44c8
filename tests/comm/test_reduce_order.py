"""The order of additions of a gradient reduce-scatter on gloo, above two ranks.

mfsdp2's ``Communicator.reduce_scatter`` sums every element in rank order on both of its gloo
paths (all-to-all below ``SMALL_REDUCE_SCATTER_BYTES``, point-to-point above), so a gradient's
bits depend on the values only, not on the layout that placed it. gloo's own
``reduce_scatter_tensor`` (FSDP2's call) is a ring all-reduce whose order depends on the ring
chunk an element falls in; ``tests/_reduce_order.py`` predicts it, and this test checks that
prediction element by element -- what the comparisons with FSDP2 at four ranks rely on
(``tests/integrations/test_torchtitan_moe.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mfsdp2.comm.communicator import SMALL_REDUCE_SCATTER_BYTES, Communicator

from .._dist import run_ranks
from .._reduce_order import rank_order_reduce_scatter, ring_order_reduce_scatter

# below and above the threshold (the all-to-all and point-to-point paths); one shard of odd
# length, where gloo's ring chunks do not fall on the shard edges
NUMELS = [4 * 1001, SMALL_REDUCE_SCATTER_BYTES // 4 + 4 * 3001]


def _inputs(ws: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(numel)
    # magnitudes spread over many binades, so orders of addition show in the last bits
    return [torch.randn(numel, generator=g) * torch.exp(4 * torch.randn(numel, generator=g)) for _ in range(ws)]


def _rank(rank: int, ws: int) -> dict:
    comm = Communicator(dist.group.WORLD, torch.device("cpu"))
    out = {}
    for numel in NUMELS:
        xs = _inputs(ws, numel)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            S = numel // ws
            mine = torch.empty(S)
            n_scratch = comm.reduce_scatter_scratch_numel(S, op, 4)
            scratch = torch.empty(n_scratch) if n_scratch else None
            comm.reduce_scatter(mine, xs[rank].clone(), op, scratch).wait()
            out[(numel, str(op))] = (mine, n_scratch)
        theirs = torch.empty(numel // ws)
        dist.reduce_scatter_tensor(theirs, xs[rank].clone())
        out[(numel, "gloo")] = theirs
    return out


def test_gloo_reduce_scatter_sums_in_rank_order_and_gloos_own_in_ring_order():
    ws = 4
    for rank, out in enumerate(run_ranks(_rank, ws)):
        for numel in NUMELS:
            xs = _inputs(ws, numel)
            S = numel // ws
            rank_order = rank_order_reduce_scatter(xs, rank)
            mine, n_scratch = out[(numel, str(dist.ReduceOp.SUM))]
            assert torch.equal(mine, rank_order), (rank, numel)
            avg, _ = out[(numel, str(dist.ReduceOp.AVG))]
            assert torch.equal(avg, rank_order / ws), (rank, numel)
            small = numel * 4 < SMALL_REDUCE_SCATTER_BYTES
            assert n_scratch == (ws * S if small else (ws - 2) * S), (numel, n_scratch)
            ring = ring_order_reduce_scatter(xs, rank)
            assert torch.equal(out[(numel, "gloo")], ring), (rank, numel)
            # the two orders really differ on these values: the comparison has signal
            assert not torch.equal(ring, rank_order), (rank, numel)
