"""Zero-copy gathered weights on CUDA: parameter views follow the unsharded storage.

The unsharded storage of a ``DataParallelBuffer`` is re-pointed at allocator blocks
(``_swap_data_ptr_``), so the parameter views -- including those autograd saved in forward --
read the new block in backward, after the old one was handed back to the allocator, filled with
NaN and held (so a stale read shows up as NaN). Checked on one buffer and on a sharded model
trained against an unsharded reference; torch without ``_swap_data_ptr_`` skips these. The
``storage.resize_`` fallback of older torch (forced here on any torch) must keep the same views
and saved views valid and return the bytes to the caching allocator on reshard.

Needs a GPU (skipped elsewhere): the blocks are CUDA memory, observed with
``torch.cuda.memory_allocated``, in a fresh single-rank NCCL process per test
(``tests/system/_cuda_process.py``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from mfsdp2.base import compat
from mfsdp2.memory.allocator import DynamicAllocator

from ..models import build, loss_fn, make_opt
from ._cuda_process import _dev, _net_data, run_cuda

# Needs a CUDA GPU (NCCL, CUDA storage re-pointing); the gloo tests cover the CPU.
pytestmark = pytest.mark.cuda
# The zero-copy tests below check where the allocator's blocks go; without _swap_data_ptr_ (torch
# before 2.13) gathered weights come from storage.resize_ instead, tested by the resize_ test.
needs_storage_swap = pytest.mark.skipif(
    not compat.HAS_STORAGE_SWAP, reason="needs UntypedStorage._swap_data_ptr_ (torch >= 2.13)"
)


class _PoisoningAllocator(DynamicAllocator):
    """Fresh memory for every request; a released block is filled with NaN and kept (so it is never
    handed out again) until the test drops it after the optimizer step. Any read of a gathered
    weight, gradient or reduce-scatter buffer after its release then shows up as NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.quarantine: list[torch.Tensor] = []

    def _release(self, key, tensor):
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        self.quarantine.append(tensor)


def _small_buffer():
    """A one-rank buffer of a (64, 32) weight and a (32,) bias, its shard filled with random
    values: ``(device, layout, buffer, values, weight view, bias view, unsharded storage)``."""
    from mfsdp2.memory.buffer import DataParallelBuffer
    from mfsdp2.comm.communicator import Communicator
    from mfsdp2.memory.layout import plan_layout

    dev = _dev()
    comm = Communicator(dist.group.WORLD, dev)
    layout = plan_layout([(64, 32), (32,)], 1)
    buf = DataParallelBuffer(layout, torch.float32, dev, comm)
    values = torch.randn(layout.shard_numel, device=dev)
    buf.shard.copy_(values)
    w, b = buf.param_views()
    storage = buf._storage
    return dev, layout, buf, values, w, b, storage


def _zero_copy_buffer():
    dev, layout, buf, values, w, b, storage = _small_buffer()
    buf.free_unsharded()  # the storage's own first allocation
    assert not buf.is_unsharded and storage.nbytes() == 0
    alloc = _PoisoningAllocator()
    nbytes = buf.nbytes

    base = torch.cuda.memory_allocated(dev)
    buf.all_gather(alloc, "k").wait()
    assert buf.is_unsharded and storage.nbytes() == nbytes
    assert torch.cuda.memory_allocated(dev) - base >= nbytes, "the block must come from the CUDA allocator"
    ptr0 = alloc._live["k"].data_ptr()  # the block itself is owned by the allocator only
    assert storage.data_ptr() == ptr0 and w.data_ptr() == ptr0 and w.untyped_storage().data_ptr() == ptr0
    expect_w = buf.param_view(values, 0).clone()
    assert torch.equal(w, expect_w) and torch.equal(b, buf.param_view(values, 1))

    # autograd saves the view w (mul saves the other operand for x's gradient)
    x = torch.randn(64, 32, device=dev, requires_grad=True)
    y = (x * w).sum()

    buf.free_unsharded()
    assert not buf.is_unsharded and storage.nbytes() == 0
    # The allocator got the block back; it fills it with NaN and holds it, so the next gather
    # lands elsewhere and a view still reading the old block would read NaN.
    assert [t.data_ptr() for t in alloc.quarantine] == [ptr0] and alloc.quarantine[0].isnan().all()

    buf.all_gather(alloc, "k").wait()
    block1 = alloc._live["k"]
    assert w.data_ptr() == block1.data_ptr() != ptr0
    assert torch.equal(w, expect_w)
    y.backward()  # reads the saved view: must see the new block, and no version-counter error
    ok = torch.equal(x.grad, expect_w)
    # writes through the parameter views land in the allocator's block (true zero copy)
    with torch.no_grad():
        b.fill_(3.0)
    shared = bool((buf.param_view(block1, 1) == 3.0).all())
    del block1
    # The storage does not own the block: once the allocator drops it, the memory is gone.
    alloc.quarantine.clear()
    before = torch.cuda.memory_allocated(dev)
    buf.free_unsharded()
    alloc.quarantine.clear()
    released = before - torch.cuda.memory_allocated(dev) >= nbytes
    return ok, shared, released


@needs_storage_swap
def test_cuda_zero_copy_buffer_saved_views_follow_the_storage():
    ok, writes_shared, released = run_cuda(_zero_copy_buffer)
    assert ok, "the view saved in forward did not read the re-pointed block in backward"
    assert writes_shared, "parameter views and the allocator block are not the same memory"
    assert released, "the block's memory was not returned after reshard + allocator release"


def _resize_buffer():
    """The fallback without _swap_data_ptr_ (forced here on any torch): unshard/reshard resize the
    storage in place; the allocator is not asked, the views (and one autograd saved) follow the
    storage into its new memory, and a reshard returns the bytes to torch's caching allocator."""
    compat.HAS_STORAGE_SWAP = False  # read when a buffer is built (this spawned process only)
    dev, layout, buf, values, w, b, storage = _small_buffer()
    buf.free_unsharded()
    assert not buf.is_unsharded and storage.nbytes() == 0
    alloc = _PoisoningAllocator()
    nbytes = buf.nbytes

    buf.all_gather(alloc, "k").wait()
    assert buf.is_unsharded and storage.nbytes() == nbytes and buf._storage is storage
    assert not alloc._live and not alloc.quarantine, "the runtime allocator must not serve the weights"
    ptr0 = storage.data_ptr()
    assert w.data_ptr() == ptr0 and w.untyped_storage().data_ptr() == ptr0
    expect_w = buf.param_view(values, 0).clone()
    assert torch.equal(w, expect_w) and torch.equal(b, buf.param_view(values, 1))

    x = torch.randn(64, 32, device=dev, requires_grad=True)
    y = (x * w).sum()  # autograd saves the view w

    before = torch.cuda.memory_allocated(dev)
    buf.free_unsharded()
    released = before - torch.cuda.memory_allocated(dev) >= nbytes
    assert not buf.is_unsharded and storage.nbytes() == 0
    # The freed block goes to whoever asks next (same size, same stream): fill it with NaN and hold
    # it, so the next unshard lands elsewhere and a view still reading the old memory reads NaN.
    junk = torch.full((layout.total_numel,), float("nan"), device=dev)
    buf.all_gather(alloc, "k").wait()
    assert w.data_ptr() == storage.data_ptr() != junk.data_ptr() and torch.equal(w, expect_w)
    y.backward()  # reads the saved view: must see the new memory, and no version-counter error
    ok = torch.equal(x.grad, expect_w)
    with torch.no_grad():
        b.fill_(3.0)
    shared = bool((buf.param_view(buf._writer, 1) == 3.0).all())
    del junk
    return ok, shared, released


def test_cuda_resize_fallback_saved_views_follow_the_storage():
    ok, writes_shared, released = run_cuda(_resize_buffer)
    assert released, "reshard did not return the bytes to the CUDA caching allocator"
    assert ok, "the view saved in forward did not read the resized storage in backward"
    assert writes_shared, "parameter views and the unsharded storage are not the same memory"


def _zero_copy_model(steps):
    """Every block's forward gather is released (and poisoned) after forward; backward's unshard
    gets new memory, and the views autograd saved in forward must read it."""
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp2 import fully_shard

    dev = _dev()
    mesh = init_device_mesh("cuda", (1,))
    ref = build("net").to(dev)
    ref_opt = make_opt("adamw", ref.parameters())
    model = build("net").to(dev)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    alloc = _PoisoningAllocator()
    fully_shard(model, mesh=mesh, allocator=alloc)
    opt = make_opt("adamw", model.parameters())
    fwd_ptrs: list[int] = []
    bwd_ptrs: list[int] = []

    def record(m, i, o):
        # forward: where the gathered weights are now; backward (fc1's output gradient, after the
        # unit's pre-backward unshard): where they are then
        fwd_ptrs.append(m.weight.untyped_storage().data_ptr())
        o.register_hook(lambda g: bwd_ptrs.append(m.weight.untyped_storage().data_ptr()))

    for blk in model.blocks:
        blk.fc1.register_forward_hook(record)
    losses, ref_losses, moved, poisoned = [], [], 0, 0
    for step in range(steps):
        x, y = _net_data(step, dev)
        fwd_ptrs.clear()
        bwd_ptrs.clear()
        loss = loss_fn(model(x), y)
        assert len(fwd_ptrs) == len(model.blocks) and all(fwd_ptrs)
        for blk in model.blocks:
            for g in blk._mfsdp2_state.groups:
                assert not g.is_unsharded and g.weights._storage.nbytes() == 0, "not resharded after forward"
        held = {t.data_ptr() for t in alloc.quarantine}
        assert set(fwd_ptrs) <= held, "the forward blocks were not released to the allocator after forward"
        loss.backward()
        assert len(bwd_ptrs) == len(model.blocks)
        moved += sum(p not in held for p in bwd_ptrs)
        opt.step()
        opt.zero_grad()
        poisoned += len(alloc.quarantine)
        alloc.quarantine.clear()
        losses.append(loss.item())
        rloss = loss_fn(ref(x), y)
        rloss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(rloss.item())
    params = {k: p.to_local().detach().cpu() for k, p in model.named_parameters()}
    ref_params = {k: p.detach().cpu() for k, p in ref.named_parameters()}
    return losses, ref_losses, params, ref_params, moved, poisoned


@needs_storage_swap
def test_cuda_zero_copy_model_backward_reads_regathered_blocks():
    losses, ref_losses, params, ref_params, moved, poisoned = run_cuda(_zero_copy_model, 4)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert math.isfinite(a) and abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs reference {b}"
    for name, ref in ref_params.items():
        err = (params[name] - ref).abs().max().item()
        assert math.isfinite(err) and err <= 1e-5 * max(ref.abs().max().item(), 1e-3), f"{name}: max err {err:.3e}"
    assert moved == 4 * 3, "backward should have gathered into new memory (the old blocks were held)"
    assert poisoned >= 4 * 3, poisoned
