"""The benchmark models and how each framework runs them: the models (``mlp``, ``llama``, ``tiny``),
their batches and losses, the precision configs, torch FSDP2's candidate configurations and the
tuned one, sharding a model with a framework, the optimizer and one training step, and the
compute floor (the same model unsharded, no collectives).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from _ranks import REPO


class MLPBlock(nn.Module):
    def __init__(self, d: int = 1024, hidden: int = 4096):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Stack(nn.Module):
    """``blocks`` applied in order; the root owns no parameters."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


MODELS = ("mlp", "llama", "tiny")


def build_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":  # 8 x (Linear(1024,4096)-GELU-Linear(4096,1024)): 67.1M params
        return Stack([MLPBlock(1024, 4096) for _ in range(8)])
    if name == "tiny":  # 64 x Linear(64,64): framework overhead
        return Stack([nn.Linear(64, 64) for _ in range(64)])
    if name == "llama":
        from mfsdp2.models.llama import LlamaConfig, Transformer

        return Transformer(LlamaConfig.demo())
    raise ValueError(f"unknown model {name!r}")


def units(model: nn.Module) -> list[nn.Module]:
    """The modules wrapped before the root: the blocks / decoder layers."""
    return list(model.layers) if hasattr(model, "layers") else list(model.blocks)


# global batch per model: mlp/tiny rows, llama sequences of LLAMA_SEQ tokens
GLOBAL_BATCH = {"mlp": 16, "tiny": 16, "llama": 8}
LLAMA_SEQ = 128


def make_batch(name: str, step: int, rank: int, world_size: int, global_batch: Optional[int] = None,
               seed: int = 1234):
    """This rank's slice of the global batch of ``step`` (the same on every rank and framework)."""
    gb = global_batch or GLOBAL_BATCH[name]
    per = gb // world_size
    if name == "llama":
        from mfsdp2.models.llama import LlamaConfig, SyntheticTokens

        data = SyntheticTokens(LlamaConfig.demo().vocab_size, seed=seed)
        x, y = data.batch(step, gb, LLAMA_SEQ)
    else:
        d = 1024 if name == "mlp" else 64
        g = torch.Generator().manual_seed(seed * 1000 + step)
        x = torch.randn(gb, d, generator=g)
        y = torch.randn(gb, d, generator=g)
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def loss_fn(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "llama":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
    return F.mse_loss(out.float(), y)


def items_per_step(name: str, global_batch: Optional[int] = None) -> tuple[int, str]:
    gb = global_batch or GLOBAL_BATCH[name]
    return (gb * LLAMA_SEQ, "tokens") if name == "llama" else (gb, "samples")


CONFIGS = ("fp32", "bf16", "fp32_no_reshard")


def config_options(config: str) -> dict:
    """``param_dtype``, ``reduce_dtype``, ``reshard_after_forward`` of a config name."""
    if config == "fp32":
        return {"param_dtype": None, "reduce_dtype": None, "reshard_after_forward": True}
    if config == "bf16":
        return {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "reshard_after_forward": True}
    if config == "fp32_no_reshard":
        return {"param_dtype": None, "reduce_dtype": None, "reshard_after_forward": False}
    raise ValueError(f"unknown config {config!r}")


# --------------------------------------------------------------------------------------------
# torch FSDP2 at its best
# --------------------------------------------------------------------------------------------


# Candidate FSDP2 configurations (torch 2.13's API; benchmarks/fsdp2_tuning.py times them against
# each other). ``prefetch``: explicit ``set_modules_to_forward_prefetch`` /
# ``set_modules_to_backward_prefetch`` of the next ``k`` units on every unit (the root included);
# ``async``: ``_set_unshard_async_op(True)`` (the pre-forward / pre-backward all-gathers and the
# prefetches issued with ``async_op=True``: on CPU the only way FSDP2's gathers leave the main
# thread, since its CPU "streams" are stubs and ``async_op=False`` blocks).
FSDP2_TUNINGS = {
    "default": {},
    "prefetch1": {"prefetch": 1},
    "async": {"async": True},
    "async_prefetch1": {"async": True, "prefetch": 1},
    "async_prefetch2": {"async": True, "prefetch": 2},
}
# The fastest of the candidates per backend when no tuning run was recorded (CPU: from the runs in
# docs/benchmarks.md "The FSDP2 baseline"). CUDA's collectives already run on side streams with
# ``async_op=False``; there explicit prefetch is the documented overlap knob (not measured here).
FSDP2_TUNED = {"cpu": "async_prefetch1", "cuda": "prefetch1"}  # cpu: fsdp2_tuning.json of 2026-11-24
# A recorded ``benchmarks/fsdp2_tuning.py --json`` run overrides the CPU choice with its measured
# winner (``make bench-record`` records it first), so "tuned" is always the fastest measured here.
TUNING_JSON = os.path.join(REPO, "benchmarks", "results", "fsdp2_tuning.json")
FRAMEWORKS = ("mfsdp2", "fsdp2", "fsdp2_tuned")


def fsdp2_tuned(device_type: str = "cpu") -> str:
    """The tuned FSDP2 configuration for a device type: the recorded tuning run's winner on CPU
    when ``TUNING_JSON`` exists, else :data:`FSDP2_TUNED`."""
    if device_type == "cpu" and os.path.exists(TUNING_JSON):
        import json

        with open(TUNING_JSON) as f:
            winner = json.load(f).get("winner")
        if winner in FSDP2_TUNINGS:
            return winner
    return FSDP2_TUNED[device_type]


def fsdp2_tuning_name(framework: str, device_type: str = "cpu") -> Optional[str]:
    """The FSDP2 configuration a framework name stands for: ``fsdp2`` = "default",
    ``fsdp2_tuned`` = the backend's tuned one, ``fsdp2:<name>`` = a candidate; None for others."""
    if framework == "fsdp2":
        return "default"
    if framework == "fsdp2_tuned":
        return fsdp2_tuned(device_type)
    if framework.startswith("fsdp2:"):
        name = framework.split(":", 1)[1]
        if name not in FSDP2_TUNINGS:
            raise ValueError(f"unknown FSDP2 tuning {name!r}; one of {sorted(FSDP2_TUNINGS)}")
        return name
    return None


def tune_fsdp2(model: nn.Module, tuning: str) -> nn.Module:
    """Apply FSDP2 candidate configuration ``tuning`` (a key of :data:`FSDP2_TUNINGS`) to a model
    sharded by :func:`shard` (every unit, then the root). The root stays unsharded between forward
    and backward (its default, as in every configuration)."""
    opts = FSDP2_TUNINGS[tuning]
    us = units(model)
    k = opts.get("prefetch", 0)
    if k:
        # Forward: the root runs first, then the units in order; backward the reverse.
        order = [model] + us
        for i, m in enumerate(order):
            nxt = [u for u in order[i + 1:i + 1 + k]]
            if nxt:
                m.set_modules_to_forward_prefetch(nxt)
        for i, u in enumerate(us):
            prev = list(reversed(us[max(0, i - k):i]))
            if prev:
                u.set_modules_to_backward_prefetch(prev)
        model.set_modules_to_backward_prefetch(list(reversed(us[-k:])))
    if opts.get("async"):
        model._set_unshard_async_op(True)  # recurses into every FSDPModule
    return model


def set_accumulation_flags(model: nn.Module, framework: str, sync: bool) -> None:
    """Per micro-batch flags of gradient accumulation: every sharded framework skips the gradient
    reduction until the last micro-batch; mfsdp2 and tuned FSDP2 also keep the gathered weights
    after each non-syncing backward (``set_reshard_after_backward(False)``, FSDP2's documented way
    not to re-gather between micro-batches)."""
    model.set_requires_gradient_sync(sync)
    if framework == "mfsdp2" or (framework != "fsdp2" and fsdp2_tuning_name(framework) is not None):
        model.set_reshard_after_backward(sync)


def shard(model: nn.Module, framework: str, config: str, mesh, sharding_strategy: Optional[str] = None,
          all_gather_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """``fully_shard`` every unit, then the root, with ``framework``: "mfsdp2", "fsdp2" (torch's
    defaults), "fsdp2_tuned" (:data:`FSDP2_TUNED` for the mesh's device) or "fsdp2:<tuning>".

    ``sharding_strategy`` / ``all_gather_dtype`` (mfsdp2 only) go to every ``fully_shard`` call and
    into the ``MixedPrecisionPolicy``; None keeps mfsdp2's defaults (ZeRO-3, no FP8)."""
    o = config_options(config)
    extra: dict = {}
    tuning = fsdp2_tuning_name(framework, mesh.device_type)
    if framework == "mfsdp2":
        from mfsdp2 import MixedPrecisionPolicy, fully_shard

        if sharding_strategy is not None:
            extra["sharding_strategy"] = sharding_strategy
    elif tuning is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if sharding_strategy is not None or all_gather_dtype is not None:
            raise ValueError("sharding_strategy / all_gather_dtype are mfsdp2 options")
    else:
        raise ValueError(framework)
    mp_kw = {"all_gather_dtype": all_gather_dtype} if all_gather_dtype is not None else {}
    mp = MixedPrecisionPolicy(param_dtype=o["param_dtype"], reduce_dtype=o["reduce_dtype"], **mp_kw)
    for u in units(model):
        fully_shard(u, mesh=mesh, mp_policy=mp, reshard_after_forward=o["reshard_after_forward"], **extra)
    # The root keeps its parameters from forward to backward in both runtimes when its
    # reshard_after_forward is left at the default (None); an explicit True makes either all-gather
    # the root twice per step.
    root_kw = {} if o["reshard_after_forward"] else {"reshard_after_forward": False}
    fully_shard(model, mesh=mesh, mp_policy=mp, **root_kw, **extra)
    if tuning is not None:
        tune_fsdp2(model, tuning)
    return model


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, name: str, x, y) -> torch.Tensor:
    loss = loss_fn(name, model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class ComputeFloor:
    """The same model unsharded in this process (compute dtype), this rank's batch, no collectives,
    and the optimizer over fp32 tensors of one rank's shard size (what each rank updates)."""

    def __init__(self, ref: nn.Module, name: str, config: str, world_size: int, loss=None):
        import copy

        o = config_options(config)
        self.loss = loss or functools.partial(loss_fn, name)
        self.model = copy.deepcopy(ref)
        if o["param_dtype"] is not None:
            self.model.to(o["param_dtype"])
        self.name = name
        self.dtype = o["param_dtype"]
        self.shards = []
        for p in ref.parameters():
            rows = -(-p.shape[0] // world_size)
            t = torch.zeros((rows,) + tuple(p.shape[1:]), device=p.device, requires_grad=True)
            t.grad = torch.randn_like(t) * 1e-3
            self.shards.append(t)
        self.opt = make_optimizer(self.shards)

    def __call__(self, x, y) -> None:
        if self.dtype is not None and x.is_floating_point():
            x = x.to(self.dtype)
        loss = self.loss(self.model(x), y)
        loss.backward()
        for p in self.model.parameters():
            p.grad = None
        self.opt.step()
