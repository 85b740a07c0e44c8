"""Training on CUDA matches an unsharded reference trained in the same process.

Skipped on machines without a GPU. Every test trains in its own spawned process, a single rank of
an NCCL group (``tests/system/_cuda_process.py``), and compares with the reference it trained
there. What is covered:

* ``fully_shard``-ed models (a small MLP, a tiny Llama) train like the unsharded model: fp32, and
  bf16 compute with fp32 main weights and grads against a reference doing the same casts, over
  the three allocators; losses and final parameters are compared, and the reference must train;
* CPU offload (``CPUOffloadPolicy``) on CUDA: a model kept on the CPU (or moved to the GPU
  first) trains like the unsharded model on the GPU, with parameters, gradients, optimizer states
  and state-dict entries on the CPU (pinned when asked), the root's buffer moved to the GPU, and
  the gradients complete when ``backward()`` returns although the GPU runs 0.1 s behind the host
  (a non-blocking control copy shows the lag, so a missing synchronisation cannot pass unseen).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ..models import build, loss_fn, make_opt
from ._cuda_process import SLEEP_CYCLES, _dev, _net_data, run_cuda

# Needs a CUDA GPU (NCCL, CUDA compute, pinned host memory); the gloo tests cover the CPU.
pytestmark = pytest.mark.cuda

STEPS = 10


# --------------------------------------------------------------------------------------------
# training parity on CUDA
# --------------------------------------------------------------------------------------------


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
# CPU offload on CUDA (CPUOffloadPolicy): main state in host memory, optimizer on the CPU
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
