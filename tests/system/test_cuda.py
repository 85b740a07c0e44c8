"""CUDA tests: what the gloo suite cannot reach (NCCL, CUDA side streams, re-pointing CUDA storage).

Skipped on machines without a GPU. One GPU is enough: NCCL refuses two ranks on one device, so
every test runs in one spawned process holding a world-size-1 NCCL group (a fresh process per
test, so a CUDA error or a hang fails that test alone). What is covered:

* training parity on CUDA of ``fully_shard``-ed models with an unsharded reference trained in the
  same process (fp32; bf16 compute with fp32 main weights and grads against a reference doing the
  same casts), over the three allocators;
* the zero-copy gathered weights: the unsharded storage is re-pointed at allocator blocks
  (``_swap_data_ptr_``) and the parameter views autograd saved in forward read the new block in
  backward, after the old one was handed to someone else (or released) and filled with NaN (torch
  without ``_swap_data_ptr_``: skipped); the ``storage.resize_`` fallback of older torch (forced)
  keeps the same views and saved views valid;
* CPU offload (``CPUOffloadPolicy``) on CUDA: a model kept on the CPU (or moved to the GPU
  first) trains like the unsharded model on the GPU, with parameters, gradients, optimizer states
  and state-dict entries on the CPU (pinned when asked), the root's buffer moved to the GPU, and
  the gradients complete when ``backward()`` returns although the GPU runs 0.1 s behind the host
  (a non-blocking control copy shows the lag);
* the CUDA-only lines of ``Communicator._launch`` / ``CommHandle.wait``: a side stream waits on
  the current stream before touching memory, and ``wait()`` makes the current stream (not the
  host) wait on the collective. Each of these has a control that drops the synchronisation and
  must see stale data, so a sleep too short to expose the race fails the test instead of making
  it vacuous.
"""

from __future__ import annotations

import copy
import io
import math
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._dist import client_store, held_store
from mfsdp2.base import compat
from mfsdp2.memory.allocator import DynamicAllocator

from ..models import batch, build, loss_fn, make_opt

# Needs a CUDA GPU (NCCL, CUDA side streams, CUDA storage re-pointing); the gloo tests cover the CPU.
pytestmark = pytest.mark.cuda
# The zero-copy tests below check where the allocator's blocks go; without _swap_data_ptr_ (torch
# before 2.13) gathered weights come from storage.resize_ instead, tested by the resize_ test.
needs_storage_swap = pytest.mark.skipif(
    not compat.HAS_STORAGE_SWAP, reason="needs UntypedStorage._swap_data_ptr_ (torch >= 2.13)"
)

STEPS = 10
# About 0.1 s of GPU time at H100 clocks (torch.cuda._sleep spins for this many cycles): far
# longer than it takes the host to queue the work that races with it.
SLEEP_CYCLES = 200_000_000


# --------------------------------------------------------------------------------------------
# one spawned process with a world-size-1 NCCL group
# --------------------------------------------------------------------------------------------


def _entry(port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=client_store(port), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        out = fn(*args)
        torch.cuda.synchronize()
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((True, buf.getvalue()))
    except BaseException:
        queue.put((False, traceback.format_exc()))
    finally:
        import gc

        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_cuda(fn, *args, timeout: float = 240.0):
    """``fn(*args)`` in a spawned process with a 1-rank NCCL group on GPU 0; its result by value."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = held_store()  # the parent holds the port until the child is done (no xdist races)
    p = ctx.Process(target=_entry, args=(store.port, fn, args, queue))
    p.start()
    try:
        ok, payload = queue.get(timeout=timeout)
    except Exception as e:  # queue.Empty
        ok, payload = False, f"timed out after {timeout}s ({type(e).__name__})"
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join(5)
    if not ok:
        raise AssertionError(payload)
    return torch.load(io.BytesIO(payload), weights_only=False)


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


# --------------------------------------------------------------------------------------------
# (a) training parity on CUDA
# --------------------------------------------------------------------------------------------


def _net_data(step, dev):
    x, y = batch(step, 8, 12)
    return x.to(dev), y.to(dev)


def _llama_data(step, dev, cfg):
    from mfsdp2.models.llama import SyntheticTokens

    x, y = SyntheticTokens(cfg.vocab_size, seed=7).batch(step, 4, cfg.max_seq_len)
    return x.to(dev), y.to(dev)


def _build_model(kind: str, dev):
    if kind == "net":
        return build("net").to(dev)
    from mfsdp2.models.llama import LlamaConfig, Transformer

    torch.manual_seed(0)
    return Transformer(LlamaConfig.tiny()).to(dev)


def _units(model, kind):
    return list(model.blocks) if kind == "net" else list(model.layers)


def _loss(kind, out, y):
    if kind == "net":
        return loss_fn(out, y)
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def _data(kind, step, dev, model):
    return _net_data(step, dev) if kind == "net" else _llama_data(step, dev, model.cfg)


def _reference(kind: str, bf16: bool, steps: int):
    """Unsharded, same device. bf16: fp32 master weights updated by AdamW; each step they are cast
    into a bf16 copy of the model (parameters only, like the policy), which computes on inputs
    cast to bf16; its bf16 grads, converted to fp32, are the master grads."""
    dev = _dev()
    master = _build_model(kind, dev)
    opt = make_opt("adamw", master.parameters())
    work = None
    if bf16:
        work = copy.deepcopy(master)
        for p in work.parameters():
            p.data = p.data.to(torch.bfloat16)
    losses = []
    for step in range(steps):
        x, y = _data(kind, step, dev, master)
        if bf16:
            with torch.no_grad():
                for w, m in zip(work.parameters(), master.parameters()):
                    w.copy_(m)
            xin = x.to(torch.bfloat16) if x.is_floating_point() else x
            out = work(xin)
            assert out.dtype == torch.bfloat16
            loss = _loss(kind, out, y)
            loss.backward()
            for w, m in zip(work.parameters(), master.parameters()):
                m.grad = None if w.grad is None else w.grad.float()
                w.grad = None
        else:
            loss = _loss(kind, master(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in master.named_parameters()}


def _sharded(kind: str, bf16: bool, allocator: str, steps: int):
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp2 import FSDPModule, MixedPrecisionPolicy, fully_shard

    dev = _dev()
    mesh = init_device_mesh("cuda", (1,))
    model = _build_model(kind, dev)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for u in _units(model, kind):
        fully_shard(u, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, allocator=allocator)
    assert isinstance(model, FSDPModule)
    for name, p in model.named_parameters():
        assert hasattr(p, "placements") and p.device.type == "cuda", name
        assert p.to_local().dtype == torch.float32, name  # fp32 main weights in both cases
    groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._mfsdp2_state.groups]
    assert all(g.weights.dtype == (torch.bfloat16 if bf16 else torch.float32) for g in groups)
    opt = make_opt("adamw", model.parameters())
    losses = []
    for step in range(steps):
        x, y = _data(kind, step, dev, model)
        out = model(x)
        assert out.dtype == (torch.bfloat16 if bf16 else torch.float32) and out.is_cuda
        loss = _loss(kind, out, y)
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.to_local().dtype == torch.float32, name
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # World size 1: the local shard is the whole parameter.
    full = {}
    for k, p in model.named_parameters():
        local = p.to_local()
        assert tuple(local.shape) == tuple(p.shape), k
        full[k] = local.detach().cpu()
    return losses, full


def _parity(kind, bf16, allocator, steps):
    ref = _reference(kind, bf16, steps)
    torch.cuda.synchronize()
    return ref, _sharded(kind, bf16, allocator, steps)


PARITY = [
    # (model, bf16 compute, allocator)
    ("net", False, "caching"),
    ("net", False, "dynamic"),
    ("net", False, "trace_pool"),
    ("net", True, "caching"),
    ("net", True, "trace_pool"),
    ("llama", False, "caching"),
    ("llama", True, "caching"),
]


@pytest.mark.parametrize("kind,bf16,allocator", PARITY)
def test_cuda_training_parity_with_unsharded_reference(kind, bf16, allocator):
    (ref_losses, ref_params), (losses, full) = run_cuda(_parity, kind, bf16, allocator, STEPS)
    # fp32: same arithmetic as the reference; bf16: same casts, so only kernel choice may differ.
    rel = 1e-5 if not bf16 else 2e-3
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert math.isfinite(a) and abs(a - b) <= rel * abs(b), f"step {step}: loss {a} vs reference {b}"
    assert set(full) == set(ref_params)
    for name, ref in ref_params.items():
        got = full[name]
        assert got.shape == ref.shape and got.dtype == ref.dtype == torch.float32, name
        scale = max(ref.abs().max().item(), 1e-3)
        err = (got - ref).abs().max().item()
        assert err <= rel * scale, f"{name}: max err {err:.3e} > {rel:.0e} * {scale:.3e}"
    assert ref_losses[-1] < ref_losses[0], "the reference did not train: the comparison proves nothing"


# --------------------------------------------------------------------------------------------
# (a') CPU offload on CUDA (CPUOffloadPolicy): main state in host memory, optimizer on the CPU
# --------------------------------------------------------------------------------------------


class _WithBuffer(torch.nn.Module):
    """``build("net")`` and a float32 buffer its forward reads (ones: the arithmetic is unchanged;
    the output is float32 under any compute dtype), so a model kept on the CPU shows whether
    fully_shard moved the root unit's buffers to the GPU."""

    def __init__(self):
        super().__init__()
        self.net = build("net")
        self.register_buffer("gain", torch.ones(5))

    def forward(self, x):
        return self.net(x) * self.gain


def _lagging_probe(dev) -> torch.Tensor:
    """Make the GPU run ~0.1 s behind the host from here; the returned pinned probe is written by
    a *non-blocking* copy queued behind the sleep, so reading it at once shows 0 -- the control
    proving that a copy the host did not wait for would be read stale."""
    src = torch.zeros(1, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    src.fill_(1.0)
    probe = torch.zeros(1, pin_memory=True)
    probe.copy_(src, non_blocking=True)
    return probe


def _offload_run(bf16: bool, strategy: str, pin: bool, on_gpu: bool, steps: int):
    """The model built on the CPU (or moved to the GPU first: ``on_gpu``), sharded with
    CPUOffloadPolicy on a CUDA mesh of one rank, clipped with mfsdp2.clip_grad_norm_ and trained;
    the reference is the same model unsharded on the GPU, clipped by torch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    from mfsdp2 import MixedPrecisionPolicy, clip_grad_norm_, fully_shard

    dev = _dev()
    compute = torch.bfloat16 if bf16 else None
    torch.manual_seed(0)
    ref = _WithBuffer().to(dev)
    work = ref
    if bf16:  # parameters only, like the policy (the buffer stays float32)
        work = copy.deepcopy(ref)
        for p in work.parameters():
            p.data = p.data.to(compute)
    ref_opt = make_opt("adamw", ref.parameters())
    model = _WithBuffer()
    if on_gpu:
        model = model.to(dev)
    mp_policy = MixedPrecisionPolicy(param_dtype=compute)
    kw = dict(mesh=init_device_mesh("cuda", (1,)), mp_policy=mp_policy, sharding_strategy=strategy,
              offload_policy=CPUOffloadPolicy(pin_memory=pin))
    for b in model.net.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    facts = {"buffer": model.gain.device.type,
             "params": ({p.device.type for p in model.parameters()}
                        | {p.to_local().device.type for p in model.parameters()}),
             "pinned": {p.to_local().is_pinned() for p in model.parameters()},
             "state_dict": {v.to_local().device.type for v in model.state_dict().values() if hasattr(v, "to_local")}}
    opt = make_opt("adamw", model.parameters())
    losses, ref_losses, norms, ref_norms, lags = [], [], [], [], []
    for step in range(steps):
        x, y = _net_data(step, dev)
        if bf16:
            with torch.no_grad():
                for w, m in zip(work.parameters(), ref.parameters()):
                    w.copy_(m)
        rl = loss_fn(work(x.to(compute) if bf16 else x), y)
        rl.backward()
        if bf16:
            for w, m in zip(work.parameters(), ref.parameters()):
                m.grad, w.grad = w.grad.float(), None
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(rl.item())

        out = model(x)
        assert out.is_cuda and out.dtype == torch.float32
        loss = loss_fn(out, y)
        probe = _lagging_probe(dev)
        lags.append(probe.item() == 0.0)  # read at once: stale while the GPU lags
        loss.backward()  # its copy-outs must complete before it returns, however far the GPU lags
        facts.setdefault("grads", set()).update(p.grad.to_local().device.type for p in model.parameters())
        facts.setdefault("grads_pinned", set()).update(p.grad.to_local().is_pinned() for p in model.parameters())
        norms.append(clip_grad_norm_(model, 0.5).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    facts["states"] = {t.to_local().device.type for s in opt.state.values() for t in s.values()
                       if hasattr(t, "to_local")}
    facts["copy_outs"] = {g.copy_outs for m in model.modules() if hasattr(m, "_mfsdp2_state")
                          for g in m._mfsdp2_state.groups}
    full = {k: p.to_local().detach().clone() for k, p in model.named_parameters()}  # world size 1: the whole parameter
    return (losses, ref_losses, norms, ref_norms, lags, facts, full,
            {k: v.detach().cpu() for k, v in ref.named_parameters()})


OFFLOAD = [
    # (bf16 compute, strategy, pin_memory, model moved to the GPU before fully_shard)
    (False, "optim_grads_params", True, False),
    (True, "optim_grads_params", True, False),
    (False, "optim_grads_params", False, True),
    (True, "optim_grads", True, False),
    (False, "no_shard", True, False),
]


@pytest.mark.parametrize("bf16,strategy,pin,on_gpu", OFFLOAD)
def test_cuda_cpu_offload_parity_with_unsharded_reference(bf16, strategy, pin, on_gpu):
    losses, ref_losses, norms, ref_norms, lags, facts, full, ref_params = run_cuda(
        _offload_run, bf16, strategy, pin, on_gpu, STEPS)
    assert all(lags), ("control: the GPU did not lag the host, so an unsynchronised copy-out would go unseen "
                       "(raise SLEEP_CYCLES)")
    assert facts["buffer"] == "cuda", "the root unit's buffer was not moved to the compute device"
    assert facts["params"] == facts["grads"] == facts["states"] == facts["state_dict"] == {"cpu"}, facts
    assert facts["pinned"] == facts["grads_pinned"] == {pin}, facts
    assert facts["copy_outs"] == {STEPS}, facts
    # fp32: the optimizer steps on the CPU here, on the GPU in the reference (rounding only);
    # bf16: the same casts, so only kernel choice may differ.
    rel = 1e-5 if not bf16 else 2e-3
    for step, (a, b, na, nb) in enumerate(zip(losses, ref_losses, norms, ref_norms)):
        assert math.isfinite(a) and abs(a - b) <= rel * abs(b), f"step {step}: loss {a} vs reference {b}"
        assert abs(na - nb) <= rel * nb, f"step {step}: grad norm {na} vs reference {nb}"
    for name, ref in ref_params.items():
        got = full[name]
        assert got.device.type == "cpu" and got.shape == ref.shape and got.dtype == ref.dtype == torch.float32, name
        scale = max(ref.abs().max().item(), 1e-3)
        err = (got - ref).abs().max().item()
        assert err <= rel * scale, f"{name}: max err {err:.3e} > {rel:.0e} * {scale:.3e}"
    assert ref_losses[-1] < ref_losses[0], "the reference did not train: the comparison proves nothing"


# --------------------------------------------------------------------------------------------
# (b) zero-copy gathered weights on CUDA
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# (c) Communicator._launch side streams and CommHandle.wait on CUDA
# --------------------------------------------------------------------------------------------


def _launch_without_stream_wait(stream, fn):
    """Communicator._launch minus the side stream's wait on the current stream (the control)."""
    from mfsdp2.comm.communicator import CommHandle

    with torch.cuda.stream(stream):
        fn(False)
        ev = torch.cuda.Event()
        ev.record(stream)
    return CommHandle(event=ev)


def _side_stream_waits(collective: str):
    """The current stream sleeps, then writes the input; the launched fn reads it on the side stream."""
    from mfsdp2.comm.communicator import Communicator

    dev = _dev()
    comm = Communicator(dist.group.WORLD, dev)
    stream = comm.ag_stream if collective in ("copy", "all_gather") else comm.rs_stream
    assert stream is not None and stream != torch.cuda.current_stream(dev)
    n = 1 << 20
    src = torch.empty(n, device=dev)
    dst = torch.empty(n, device=dev)
    streams_seen = []
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def fn(async_op):
        streams_seen.append(torch.cuda.current_stream(dev))
        if collective == "copy":
            dst.copy_(src)
        elif collective == "all_gather":
            return ag(dst, src, group=comm.group, async_op=async_op)
        else:
            return rs(dst, src, op=dist.ReduceOp.AVG, group=comm.group, async_op=async_op)

    def trial(launch):
        src.fill_(1.0)
        dst.fill_(0.0)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # the current stream is busy ...
        src.fill_(7.0)  # ... and then writes what the side stream will read
        h = launch(stream, fn)
        h.wait()
        got = dst.clone()  # on the current stream, after wait()
        torch.cuda.synchronize()
        return got

    control = trial(_launch_without_stream_wait)
    real = trial(lambda s, f: comm._launch(s, f, "test"))
    assert all(s == stream for s in streams_seen), "fn did not run on the side stream"
    return bool((control == 7.0).all()), bool((real == 7.0).all()), bool((real == 1.0).any())


@pytest.mark.parametrize("collective", ["copy", "all_gather", "reduce_scatter"])
def test_cuda_side_stream_waits_on_current_stream(collective):
    control_ok, real_ok, real_stale = run_cuda(_side_stream_waits, collective)
    assert not control_ok, (
        "control without the stream wait saw fresh data: the race is not exposed, so this test "
        "could not catch a missing wait (raise SLEEP_CYCLES)"
    )
    assert real_ok and not real_stale, "the side stream read its input before the current stream wrote it"


def _handle_wait_orders_current_stream():
    """The launched fn writes on the side stream after a sleep; after wait() the current stream
    must see the write, and wait() must not have blocked the host."""
    from mfsdp2.comm.communicator import Communicator

    dev = _dev()
    comm = Communicator(dist.group.WORLD, dev)
    n = 1 << 20
    dst = torch.empty(n, device=dev)

    def fn(async_op):
        torch.cuda._sleep(SLEEP_CYCLES)
        dst.fill_(5.0)

    def trial(wait: bool):
        dst.fill_(0.0)
        torch.cuda.synchronize()
        h = comm._launch(comm.ag_stream, fn, "test")
        assert h.pending
        if wait:
            h.wait()
            assert not h.pending
        side_busy = not comm.ag_stream.query()  # the host returned before the side stream finished
        got = dst.clone()
        torch.cuda.synchronize()
        h.wait()  # idempotent
        return bool((got == 5.0).all()), side_busy

    control_fresh, _ = trial(wait=False)
    real_fresh, host_not_blocked = trial(wait=True)
    return control_fresh, real_fresh, host_not_blocked


def test_cuda_handle_wait_makes_current_stream_wait():
    control_fresh, real_fresh, host_not_blocked = run_cuda(_handle_wait_orders_current_stream)
    assert not control_fresh, "control without wait() saw the side stream's write: the race is not exposed"
    assert real_fresh, "after handle.wait() the current stream read the buffer before the side stream wrote it"
    assert host_not_blocked, "handle.wait() blocked the host: it should only order the current stream"
