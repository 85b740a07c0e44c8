"""torchao models whose weights are tensor subclasses with FSDP2's all-gather extension, trained
the same way on torch FSDP2 and on mfsdp2 (same model, data, ranks), for the parity tests and
the benchmark.

Each case builds a small model (two blocks, then the root), runs 3 optimizer steps and records
per step: the loss, the gradients after backward (full tensors of the DTensor gradients), and
the all-gather traffic of the step (bytes and calls, counted at ``torch.distributed``'s
all-gather entry point, which both runtimes call); after the last step the parameters (each
rank's local inner tensors, which both runtimes shard alike with ``torch.chunk``, for subclass
parameters; full tensors for plain ones).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

STEPS = 3
D = 64


def _nf4_block(d: int = 128) -> nn.Module:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

    class LoRALinear(nn.Module):
        """A frozen NF4 base weight with trainable LoRA adapters (torchtune's FrozenNF4Linear + LoRA)."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(to_nf4(torch.randn(d, d) / d**0.5, 64, 64), requires_grad=False)
            self.lora_a = nn.Parameter(torch.randn(8, d) * 0.1)
            self.lora_b = nn.Parameter(torch.randn(d, 8) * 0.01)

        def forward(self, x):
            return linear_nf4(x, self.weight) + F.linear(F.linear(x, self.lora_a), self.lora_b)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.q = LoRALinear()
            self.o = LoRALinear()

        def forward(self, x):
            return x + self.o(torch.relu(self.q(self.norm(x))))

    return Block()


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def build(case: str) -> tuple[nn.Module, int]:
    """The model of ``case`` (seeded: every call builds the same weights) and its width."""
    torch.manual_seed(0)
    if case == "nf4":
        d = 128
        model = nn.Sequential(_nf4_block(d), _nf4_block(d), nn.LayerNorm(d))
        return model, d
    d = D
    model = nn.Sequential(_Block(d), _Block(d), nn.LayerNorm(d))
    linears = lambda m, fqn: isinstance(m, nn.Linear)  # noqa: E731
    if case.startswith("float8"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    elif case == "int8_weight_only":
        from torchao.prototype.quantized_training import int8_weight_only_quantized_training
        from torchao.quantization import quantize_

        quantize_(model, int8_weight_only_quantized_training(), filter_fn=linears)
    elif case == "int8_mixed_precision":
        from torchao.prototype.quantized_training import int8_mixed_precision_training
        from torchao.quantization import quantize_

        quantize_(model, int8_mixed_precision_training(), filter_fn=linears)
    elif case == "bitnet":
        from torchao.prototype.quantized_training import bitnet_training
        from torchao.quantization import quantize_

        quantize_(model, bitnet_training(), filter_fn=linears)
    elif case in ("moe_float8", "moe_mxfp8"):
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig, MXFP8TrainingOpConfig
        from torchao.prototype.moe_training.conversion_utils import _swap_params
        from torchao.quantization.quantize_.common import KernelPreference

        cfg = (Float8TrainingOpConfig() if case == "moe_float8"
               else MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED))
        for blk in model[:2]:
            _swap_params(blk.up, config=cfg)
            _swap_params(blk.down, config=cfg)
    elif case != "plain":
        raise ValueError(case)
    return model, d


class GatherCounter:
    """Counts all-gather bytes (output size) and calls at ``torch.distributed``'s entry points."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self._orig = {}

    def __enter__(self):
        for name in self.NAMES:
            if not hasattr(dist, name):
                continue
            orig = getattr(dist, name)
            self._orig[name] = orig

            def wrapped(out, inp, *a, _orig=orig, **k):
                self.bytes += out.numel() * out.element_size()
                self.calls += 1
                return _orig(out, inp, *a, **k)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """A (possibly subclass) tensor's plain inner tensors, recursively, in a fixed order."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return [t.detach()]
    names, _ = t.__tensor_flatten__()
    out = []
    for n in names:
        out += inner_tensors(getattr(t, n))
    return out


def train(case: str, runtime: str, rank: int, ws: int, steps: int = STEPS, precompute: bool = False,
          mesh=None, bf16: bool = False, accum: bool = False, ac: bool = False) -> dict:
    """Shard ``case``'s model with ``runtime`` ("fsdp2" or "mfsdp2"), train ``steps`` steps and
    return what the parity tests compare."""
    from torch.distributed.device_mesh import init_device_mesh

    if runtime == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from mfsdp2 import fully_shard
    mesh = mesh or init_device_mesh("cpu", (ws,))
    model, d = build(case)
    kw = {}
    if bf16:  # compute in bfloat16, reduce gradients in float32 (FSDP2's policy, the same fields in both)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if ac:  # activation checkpointing around each block (torchtune's QLoRA recipe), then FSDP
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i in range(2):
            model[i] = checkpoint_wrapper(model[i])
    for blk in model[:2]:
        fully_shard(blk, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    rec = {"loss": [], "grads": [], "ag_bytes": [], "ag_calls": []}
    for step in range(steps):
        x = torch.randn(ws * 32, d, generator=g)[rank * 32 : (rank + 1) * 32]
        if precompute and step > 0:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        with GatherCounter() as c:
            if accum:  # a first micro-batch without gradient sync, then the synced one
                model.set_requires_gradient_sync(False)
                model(torch.flip(x, (0,))).float().pow(2).mean().backward()
                model.set_requires_gradient_sync(True)
            loss = model(x).float().pow(2).mean()
            loss.backward()
        rec["ag_bytes"].append(c.bytes)
        rec["ag_calls"].append(c.calls)
        t = loss.detach().clone()
        dist.all_reduce(t)
        rec["loss"].append(t.item() / ws)
        rec["grads"].append({n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    rec["locals"] = {n: inner_tensors(p.to_local()) for n, p in model.named_parameters()
                     if hasattr(p.to_local(), "fsdp_pre_all_gather")}
    rec["full"] = {n: p.full_tensor().detach() for n, p in model.named_parameters()
                   if not hasattr(p.to_local(), "fsdp_pre_all_gather")}
    rec["types"] = {n: type(p.to_local()).__name__ for n, p in model.named_parameters()}
    rec["model"] = model
    rec["opt"] = opt
    return rec
