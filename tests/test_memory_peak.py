"""Peak transient memory of a training step, in bytes, against what the schedule provably needs.

Model: ``B`` identical blocks (fp32, no parameters of the root), ZeRO-3 at world size 2, prefetch
depth 1. Per block: ``W`` = its gathered weights (total elements x 4 bytes), the flat gradient the
same size, ``M = W / 2`` its main-gradient shard. The schedule needs, at its worst moment (block 1's
backward begins): block 1's weights, block 0's prefetched weights, block 2's reduction input still
in flight (overlapping block 1's backward) and the main gradients of blocks 2 .. B-1:
``2 W + W + (B - 2) M = (B + 4) M``. Every other moment needs less (forward: weights only, the
main gradients were released after ``zero_grad``; block 0's backward: ``(B + 3) M``; after it:
``(B + 2) M``).

The allocator's peak live bytes must equal that exactly: one reduction input alive at a time
(FSDP2's default; before, two), the weights given back before the gradients are packed, and no
receive scratch at world size 2 (the received chunk lands in the output). Before these the peak
was ``(B + 8) M``. With ``allocator="trace_pool"`` the planned pool -- all the allocator holds --
equals it too: the plan reaches the max-live lower bound of the recorded step. On a torch without
storage swapping (``compat.HAS_STORAGE_SWAP``) gathered weights take torch's memory
(``storage.resize_``): the allocator counts them, so the peak is the same, and the pool holds the
max live bytes of what it serves, the rest.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import compat, fully_shard
from mfsdp2.pool_plan import Interval, max_live

from ._dist import run_ranks

B = 5
D, H = 32, 64


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)) for _ in range(B))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _peak(rank, ws, allocator):
    torch.manual_seed(0)
    model = _Stack()
    mesh = init_device_mesh("cpu", (ws,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh, allocator=allocator)
    # The per-unit schedule's peak is what this checks: small units at two ranks on gloo would hold
    # their flat gradients in a shared all-reduce bucket instead (up to its cap).
    model.set_all_reduce_bucket_cap_mb(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    stats = None
    for step in range(6):  # the order is recorded in step 0; the trace pool plans after step 2
        if step == 5:
            stats = model.allocator.stats
            stats.reset_peak()
        x = torch.randn(4, D, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    grp = model.blocks[0]._mfsdp2_state.groups[0]
    out = {
        "peak": stats.peak_bytes,
        "W": grp.layout.total_numel * 4,
        "M": grp.layout.shard_numel * 4,
        "grad_buffers": stats.peak_by_role.get("grad", 0),
        "scratch": stats.peak_by_role.get("rs_recv", 0),
    }
    if allocator == "trace_pool":
        a = model.allocator
        out["pool"] = sum(p.tensor.numel() * p.tensor.element_size() for p in a._pools.values())
        # The lower bound of what the pool serves: the recorded step's max live bytes
        opened, ivs = {}, []
        for i, ev in enumerate(a._plans[("train", True)].events):
            if ev[0] == "a":
                opened[ev[1]] = (i, ev[2] * ev[3].itemsize)
            elif ev[1] in opened:
                start, nbytes = opened.pop(ev[1])
                ivs.append(Interval(start, i, nbytes))
        out["served_max_live"] = max_live(ivs, 64)
    return out


@pytest.mark.parametrize("allocator", ["caching", "trace_pool"])
def test_step_peak_is_what_the_schedule_needs(allocator):
    for r in run_ranks(_peak, 2, allocator):
        W, M = r["W"], r["M"]
        assert W == 2 * M, r  # no padding at these sizes
        assert r["grad_buffers"] == 1 and r["scratch"] == 0, r
        assert r["peak"] == (B + 4) * M, (r, (B + 4) * M)
        if allocator == "trace_pool":
            assert r["pool"] == r["served_max_live"], r
            if compat.HAS_STORAGE_SWAP:
                assert r["pool"] == r["peak"], r
            else:  # gathered weights come from torch's allocator (storage.resize_): counted, not pooled
                assert r["pool"] < r["peak"], r
