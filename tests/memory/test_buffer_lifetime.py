"""Buffer lifetime rule (docs/design.md): no buffer goes back to an allocator (or to torch) while a
collective may still read or write it.

The collectives here are test doubles whose work never completes (as after a gloo timeout, when
the backend's thread may still write), so every case is deterministic on CPU:

* the shards kept by a partial reshard stay referenced by the gather's handle until it is waited;
* a failed wait leaves the handle failed (a second wait raises again, not "done");
* after a failed reduction or gather, ``reset()`` leaks the buffers instead of freeing them, and
  the allocator never hands their memory out again (caching and trace pool).
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import MixedPrecisionPolicy, TracePoolAllocator, fully_shard
from mfsdp2.memory.allocator import CachingAllocator
from mfsdp2.memory.buffer import DataParallelBuffer
from mfsdp2.comm.communicator import CollectiveError, CommHandle
from mfsdp2.memory.layout import plan_layout

from .._dist import run_ranks
from ..models import build


class HungWork:
    """A torch Work stand-in whose wait times out (raises) until ``done`` is set, as gloo's does."""

    def __init__(self):
        self.done = False

    def wait(self, timeout=None):
        if not self.done:
            raise RuntimeError("[gloo] Timed out waiting for the peer (test double)")
        return True

    def is_completed(self):
        return self.done


# -- CommHandle ---------------------------------------------------------------------------------
def test_failed_wait_stays_failed_and_settle_reports_whether_it_ended():
    work = HungWork()
    h = CommHandle(work=work, label="all-gather of unit 'x'")
    with pytest.raises(CollectiveError):
        h.wait()
    # Old code cleared the work before waiting: a second wait returned as if it had finished.
    with pytest.raises(CollectiveError):
        h.wait()
    assert h.settle() is False  # still running on the backend's thread: its buffers must stay
    work.done = True
    assert h.settle() is True  # completed (with an error): now they may be freed


def test_then_of_a_failed_collective_never_runs():
    ran = []
    inner = CommHandle(work=HungWork())
    h = CommHandle(inner=inner, then=lambda: ran.append(1))
    with pytest.raises(CollectiveError):
        h.wait()
    assert not h.settle() and ran == []


# -- partial unshard: the kept shards ------------------------------------------------------------
class _FakeComm:
    def __init__(self, world_size, rank, work=None):
        self.world_size, self.rank, self.work = world_size, rank, work

    def all_gather(self, out, inp, label=""):
        # Like a CUDA side-stream launch: the handle holds an event, not the tensors.
        return CommHandle(work=self.work, label=label)


def test_partial_unshard_keeps_its_input_alive_until_the_gather_is_waited():
    """reshard_after_forward=<int>: ``kept`` is the gather's input. Nothing but the handle may keep
    it: returned to the allocator (on CUDA, to the current stream's pool) it could be reused
    while the side stream still reads it."""
    layout = plan_layout([(8, 4)], 2)
    buf = DataParallelBuffer(layout, torch.float32, torch.device("cpu"), _FakeComm(2, 0))
    alloc = CachingAllocator()
    buf.materialize(alloc, "w")
    work = HungWork()
    kept = buf.keep_for_group(2)
    ref = weakref.ref(kept)
    h = buf.all_gather_in_group(kept, _FakeComm(2, 0, work), alloc, "w")
    del kept
    gc.collect()
    assert ref() is not None, "the kept shards were released while their gather was in flight"
    work.done = True
    h.wait()
    gc.collect()
    assert ref() is None  # released once waited: no leak on the normal path
    buf.free_unsharded()


# -- allocators: a leaked block is never handed out again ------------------------------------------
def test_caching_allocator_never_reuses_a_leaked_block(caplog):
    a = CachingAllocator()
    t = a.allocate(("grad", "u", 0), 64, torch.float32, "cpu")
    with caplog.at_level(logging.WARNING, logger="mfsdp2.memory.allocator"):
        a.leak(("grad", "u", 0), "test")
        assert "('grad', 'u', 0)" in caplog.text and "leaked" in caplog.text
    t2 = a.allocate(("grad", "u", 0), 64, torch.float32, "cpu")
    assert t2.data_ptr() != t.data_ptr()
    assert a.stats.leaked_buffers == 1 and a.stats.leaked_bytes == 256 and a.stats.live_buffers == 1


def test_trace_pool_never_hands_out_a_slot_overlapping_a_leaked_block():
    a = TracePoolAllocator(debug=True)
    for _ in range(2):  # trace, then plan
        a.mark_step("train")
        a.allocate("g", 64, torch.float32, "cpu")
        a.free("g")
    a.mark_step("train")
    hits = a.trace_stats.pool_hits
    t = a.allocate("g", 64, torch.float32, "cpu")
    assert a.trace_stats.pool_hits == hits + 1  # served from its planned slot
    a.leak("g", "test")
    a.mark_step("train")
    t2 = a.allocate("g", 64, torch.float32, "cpu")
    assert t2.data_ptr() != t.data_ptr()
    assert a.stats.leaked_buffers == 1


# -- reset() after a failed collective: leak, never free ------------------------------------------
def _model(mesh, **kw):
    model = build("net")
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _spy_frees(alloc):
    freed = []
    orig = alloc.free

    def free(key):
        freed.append(key)
        orig(key)

    alloc.free = free
    return freed


def _failed_reduce(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    model = _model(mesh)
    x = torch.randn(2, 12)
    model(x).sum().backward()  # a normal step first: the allocator exists, main grads are live
    # Two reduction inputs alive (default one: the first hung reduction would be waited before the
    # second is issued), so the failure finds two reductions in flight.
    model.set_reduce_scatter_max_input_buffers(2)
    ctx = model._mfsdp2_state.ctx
    for p in model.parameters():
        p.grad = None  # the next reductions go straight into fresh main grads
    works = []

    def hung_reduce_scatter(out, inp, op=None, scratch=None, label=""):
        works.append(HungWork())
        return CommHandle(work=works[-1], label=label)

    for s in ctx.states:
        for g in s.groups:
            g.comm.reduce_scatter = hung_reduce_scatter
    y = model(x)  # the root's forward releases the cleared main grads (no collective on them)
    freed = _spy_frees(ctx.allocator)
    try:
        y.sum().backward()
        raise AssertionError("the hung reduction did not fail")
    except CollectiveError:
        pass
    model.reset()
    grad_like = [k for k in freed if k[0] in ("grad", "rs_out", "rs_recv", "main_grad")]
    stats = ctx.allocator.stats
    leaked_ptrs = {t.data_ptr() for t in ctx.allocator._leaked}
    return grad_like, stats.leaked_buffers, len(leaked_ptrs), len(works)


def test_reset_after_a_failed_reduction_leaks_its_buffers_instead_of_freeing_them():
    """Old code: the failed wait cleared the work, reset() waited "successfully" and freed the
    flat gradient (and the main gradient it reduced into) while gloo's thread could still write."""
    ((freed, leaked, distinct, issued),) = run_ranks(_failed_reduce, 1, timeout=120)
    assert issued >= 2, issued
    assert freed == [], f"freed under an unfinished reduction: {freed}"
    assert leaked >= issued and distinct == leaked


def _failed_gather(rank, ws, fp8=False, swap=True):
    from mfsdp2.base import compat

    compat.HAS_STORAGE_SWAP = compat.HAS_STORAGE_SWAP and swap  # False: storage.resize_ (buffer.py)
    mesh = init_device_mesh("cpu", (ws,))
    # FP8: the block's float8 group carries its bf16 group (norm, biases) in one all-gather
    # into an "fp8" block; neither group's weight block is taken before that gather ends.
    # Otherwise bfloat16 compute: at one rank, float32 units compute with their main weights and
    # gather nothing.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather_dtype=torch.float8_e4m3fn if fp8 else None)
    model = _model(mesh, mp_policy=mp)
    x = torch.randn(2, 12)
    model(x).sum().backward()
    ctx = model._mfsdp2_state.ctx
    blk = model.blocks[1]._mfsdp2_state
    work = HungWork()
    comm = blk.groups[0].comm
    real = comm.all_gather

    def all_gather(out, inp, label=""):
        if "blocks.1" in label:
            return CommHandle(work=work, label=label)
        return real(out, inp, label)

    comm.all_gather = all_gather
    freed = _spy_frees(ctx.allocator)
    try:
        model(x)
        raise AssertionError("the hung gather did not fail")
    except CollectiveError as e:
        msg = str(e)
    model.reset()
    weight_frees = [k for k in freed
                    if (k[0] == "weight" and k[1] == blk.name) or (k[0] == "fp8" and k[1][1] == blk.name)]
    leaked = getattr(ctx.allocator.stats, "leaked_buffers", None)
    # Training goes on after a healthy gather.
    del comm.all_gather
    out = model(x).sum()
    out.backward()
    return weight_frees, leaked, "blocks.1" in msg, bool(torch.isfinite(out))


@pytest.mark.parametrize("fp8,swap", [(False, True), (True, True), (False, False)])
def test_reset_after_a_failed_gather_leaks_the_gathered_block(fp8, swap):
    """Without storage swapping the storage keeps its bytes for good (torch's memory, counted by the
    allocator): leaked the same way in the statistics."""
    ((weight_frees, leaked, named, finite),) = run_ranks(_failed_gather, 1, fp8, swap, timeout=120)
    assert named
    assert weight_frees == [], f"gathered block freed under an unfinished all-gather: {weight_frees}"
    assert leaked == 1 and finite
