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
was ``(B + 8) M``. With ``allocator="trace_pool"`` each phase of the step has a pool of its own,
that phase's peak of the buffers it serves (the plan reaches the max-live lower bound), held
during that phase only; the main gradients, which outlive the backward, are not pooled.

The step's peak over *every* tensor against the schedule's own bound (torch's memory tracker,
:mod:`mfsdp2.memory.memory_bound`) is checked at the end of this file, and the backward's in-group gather
of ``reshard_after_forward=<int>`` (no staging copy) before that.
On a torch without storage swapping (``compat.HAS_STORAGE_SWAP``) gathered weights take torch's
memory (``storage.resize_``): the allocator counts them, so the peak is the same, and the pools
hold only the rest.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from mfsdp2 import fully_shard
from mfsdp2.base import compat
from mfsdp2.memory.allocator import CachingAllocator
from mfsdp2.memory.buffer import DataParallelBuffer
from mfsdp2.comm.communicator import CommHandle
from mfsdp2.memory.layout import plan_layout

from .._allocators import KeepEverything
from .._dist import run_ranks

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
        out["pools"] = {pk[2]: p.numel * 4 for pk, p in model.allocator._pools.items()}
    return out


@pytest.mark.parametrize("allocator", ["caching", "trace_pool"])
def test_step_peak_is_what_the_schedule_needs(allocator):
    for r in run_ranks(_peak, 2, allocator):
        W, M = r["W"], r["M"]
        assert W == 2 * M, r  # no padding at these sizes
        assert r["grad_buffers"] == 1 and r["scratch"] == 0, r
        assert r["peak"] == (B + 4) * M, (r, (B + 4) * M)
        if allocator == "trace_pool":
            # One pool per phase, each that phase's peak of the buffers it serves: forward, a
            # unit's weights and the next one's; backward, the same plus a flat gradient in
            # flight. The main gradients are not pooled (they outlive the backward).
            if compat.HAS_STORAGE_SWAP:
                assert r["pools"] == {0: 2 * W, 1: 3 * W}, r
            else:  # gathered weights come from torch's allocator (storage.resize_): counted, not
                # pooled; the forward serves nothing else, the backward one flat gradient at a time
                assert r["pools"] == {1: W}, r


# -- reshard_after_forward=<int>: the backward's in-group gather needs no staging copy -------------
class _Allocations(TorchDispatchMode):
    """Bytes of every tensor a factory op creates while active (on the CPU nothing else allocates)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name in ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::clone"):
            self.sizes.append(out.numel() * out.element_size())
        return out


class _GroupGather:
    """A block of ``k`` ranks whose all-gather concatenates the members' inputs in rank order
    (what every backend's all_gather_into_tensor does), with the other members' pieces given."""

    def __init__(self, k, rank, pieces):
        self.world_size, self.rank, self.pieces = k, rank, pieces

    def all_gather(self, out, inp, label=""):
        got = list(self.pieces)
        got[self.rank] = inp
        out.copy_(torch.cat(got))
        return CommHandle(label=label)


@pytest.mark.parametrize("N,k", [(4, 2), (8, 4), (8, 2), (6, 3)])
def test_in_group_gather_writes_the_buffer_without_a_full_size_staging_copy(N, k):
    """After forward each rank keeps 1/k of the gathered buffer; the backward unshard rebuilds it
    with one gather inside the block of k ranks. Its memory is the buffer plus the kept piece: the
    gather writes the buffer itself (before: a full-size staging tensor beside it, then a copy)."""
    layout = plan_layout([(N * 3, 5), (N, 2)], N)
    full = torch.randn(layout.total_numel)
    pieces = {}
    bufs = []
    for r in range(N):
        buf = DataParallelBuffer(layout, torch.float32, torch.device("cpu"), _Fake(N, r))
        buf.materialize()
        buf._writer.copy_(full)
        pieces[r] = buf.keep_for_group(k)
        bufs.append(buf)
    nbytes = layout.total_numel * 4
    for r, buf in enumerate(bufs):
        assert not buf.is_unsharded and pieces[r].numel() * k == layout.total_numel
        block = r - r % k
        sub = _GroupGather(k, r % k, [pieces[block + j] for j in range(k)])
        with _Allocations() as seen:
            h = buf.all_gather_in_group(pieces[r], sub, CachingAllocator(), ("weight", "u", 0))
            h.wait()
        assert torch.equal(buf._writer, full), (N, k, r)
        # One full-size block (the buffer's own memory), nothing else of that size. Without storage
        # swapping the buffer's bytes come from ``storage.resize_``, which no factory op sees.
        assert sorted(seen.sizes) == ([nbytes] if compat.HAS_STORAGE_SWAP else []), (seen.sizes, nbytes)
        buf.free_unsharded()


class _Fake:
    def __init__(self, world_size, rank):
        self.world_size, self.rank = world_size, rank


# -- the step's peak against the schedule's own bound (torch's memory tracker, every tensor) -------
def _tracked(rank, ws, allocator):
    from mfsdp2.memory.memory_bound import StepMemoryTracker

    torch.manual_seed(0)
    model = _Stack()
    mesh = init_device_mesh("cpu", (ws,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh, allocator=KeepEverything() if allocator == "keep_everything" else allocator)
    model.set_all_reduce_bucket_cap_mb(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, D, generator=g) for _ in range(6)]

    def step(x):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for x in xs[:4]:  # the order is recorded in step 0; the trace pool plans after step 2
        step(x)
    tracker = StepMemoryTracker(model, opt, *xs[4:])
    with tracker:
        for x in xs[4:]:
            step(x)
            tracker.reset_mod_stats()  # per-module stats only (torch's tracker needs it per step)
    return tracker.result().as_dict()


def test_step_peak_equals_the_schedules_bound_exactly():
    """World size 2, every tensor counted (torch's MemTracker): with blocks this small the caching
    allocator gives every free block back to torch (malloc) at once and main gradients at the next
    forward, so the step's peak *is* its bound -- to the byte. The allocator as it was (every block
    cached for good) is measured above it by exactly what it held idle at its peak."""
    for r in run_ranks(_tracked, 2, "caching"):
        assert r["peak_bytes"] == r["bound_bytes"] > 0, r
        assert r["peak_allocator_idle_bytes"] == 0 and r["bound_allocator_idle_bytes"] == 0, r
    for r in run_ranks(_tracked, 2, "keep_everything"):
        assert r["peak_bytes"] > r["bound_bytes"], r
        assert r["peak_bytes"] - r["peak_allocator_idle_bytes"] <= r["bound_bytes"], r
