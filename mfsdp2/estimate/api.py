"""``estimate_memory``: a training step's per-rank memory under mfsdp2, before launch.

Three parts, each in its own file: the layouts ``fully_shard`` would plan and the exact per-rank
bytes of the parameter categories (:mod:`.plan`), a fake-tensor forward / backward of the
unsharded model for activations, autograd's gradients and temporaries (:mod:`.trace`), and the
runtime's transient buffers replayed on the trace's unit boundaries (:mod:`.step`), with the
runtime's own allocator of the chosen kind deciding what is held (:mod:`.held`).
No process group is created and no parameter memory is
allocated: any world size or HSDP shape can be asked for from one process.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from ..base import compat
from ..precision.mixed_precision import MixedPrecisionPolicy
from ..base.strategy import ShardingStrategy
from .plan import OPTIMIZERS, UnitsArg, optimizer_temp_bytes, persistent_bytes, plan_units, resolve_units
from .report import AT_PEAK_ORDER, MemoryEstimate, _ROLE_CATEGORY
from .held import ALLOCATORS
from .step import StepConfig, default_marks, simulate, transient_at_peak
from .trace import trace_step

__all__ = ["estimate_memory"]

logger = logging.getLogger(__name__)


def _dtype_name(d: Optional[torch.dtype]) -> str:
    return "-" if d is None else str(d).replace("torch.", "")


def _default_inputs(model: nn.Module, batch_size: int, seq_len: Optional[int]) -> Callable[[], tuple]:
    """Token ids ``(batch, seq)`` when ``seq_len`` is given (the vocabulary of the first
    ``nn.Embedding``), else ``(batch, in_features)`` floats for the first ``nn.Linear``."""
    if seq_len is not None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        vocab = emb.num_embeddings if emb is not None else 2
        return lambda: (torch.randint(0, vocab, (batch_size, seq_len)),)
    lin = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if lin is None:
        raise ValueError("mfsdp2.estimate_memory: pass inputs= (a factory of the forward's arguments) or "
                         "seq_len= (token ids); the model has no nn.Linear to size a float input from")
    dtype = lin.weight.dtype if lin.weight.dtype.is_floating_point else torch.float32
    return lambda: (torch.randn(batch_size, lin.in_features, dtype=dtype),)


def estimate_memory(
    model: nn.Module,
    *,
    units: UnitsArg = None,
    mesh_shape: Union[int, Sequence[int]] = 1,
    sharding_strategy: Union[str, ShardingStrategy] = "optim_grads_params",
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    offload: bool = False,
    optimizer: str = "adamw",
    optimizer_impl: str = "auto",
    prefetch_depth: int = 1,
    reshard_after_forward: Union[bool, int] = True,
    root_reshard_after_forward: bool = False,
    batch_size: Optional[int] = None,
    seq_len: Optional[int] = None,
    inputs: Optional[Callable[[], Any]] = None,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    device: str = "cpu",
    allocator: str = "caching",
    hold_between_steps: bool = True,
    bucket_cap_mb: float = 25.0,
    rank: Optional[int] = None,
    shard_dims: Optional[Callable[[str, nn.Parameter], int]] = None,
    storage_swap: Optional[bool] = None,
    experts: Optional[Callable[[str, nn.Parameter], bool]] = None,
    expert_parallel: int = 1,
) -> MemoryEstimate:
    """Predict the per-rank memory of a training step of ``model`` sharded by mfsdp2.

    ``model``: built on the meta device (any device works; only shapes and dtypes are read).
    ``units``: the modules ``fully_shard`` is applied to before the root -- a list of them, a
    module class (every instance), or a predicate ``(path, module) -> bool``; the model itself is
    always the root. ``mesh_shape``: ``N`` / ``(N,)`` for one data-parallel dimension,
    ``(replicate, shard)`` for HSDP; no process is started, any size works.
    ``sharding_strategy``, ``mp_policy``, ``reshard_after_forward`` (non-root units; the root's is
    ``root_reshard_after_forward``, False as FSDP2's default), ``prefetch_depth`` and ``allocator``
    (``"caching"`` default, ``"trace_pool"``, ``"dynamic"``; ``hold_between_steps`` as given to
    ``CachingAllocator``, the trace pool's fallback too) as given to mfsdp2; ``offload``: as
    ``CPUOffloadPolicy`` (main weights, gradients and optimizer states in host memory).
    ``optimizer``: one of :data:`mfsdp2.estimate.plan.OPTIMIZERS` (``"adamw"``, ``"sgd"``,
    ``"sgd_momentum"``, ..., ``"mfsdp2_adamw"`` and ``"mfsdp2_adamw_bf16"`` for
    ``mfsdp2.optim.AdamW`` with float32 / bfloat16 moments), ``optimizer_impl``: ``"single"``,
    ``"foreach"``, ``"fused"`` or ``"auto"`` (torch's default: foreach on CUDA, the single-tensor
    loop on the CPU; ``mfsdp2.optim.AdamW`` makes no temporaries whatever it says).
    The step's input: ``inputs()`` returning the forward's arguments (called under fake tensors),
    or ``batch_size`` (per rank) with ``seq_len`` for token ids; ``loss_fn(output)`` (default: the
    float sum of the output); without any, activations are not estimated (a note says so).
    ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL): the collectives' buffers and where the
    optimizer's step counters live. ``rank``: the rank to report (default: the one holding most).
    ``storage_swap``: whether the training torch re-points the gathered weights' storage at the
    allocator's blocks (``UntypedStorage._swap_data_ptr_``, torch >= 2.13); False: they take
    torch's own memory (``storage.resize_``), which the allocator counts but does not hold, so
    it caches and pools only the rest. Default: what this torch does
    (:data:`mfsdp2.base.compat.HAS_STORAGE_SWAP`, ``MFSDP2_NO_STORAGE_SWAP=1`` included).
    ``shard_dims(fqn, param)``: the dimension ``shard_placement_fn`` shards each parameter on.
    Mixture-of-experts with expert parallelism (torchtitan's sharding): ``experts(fqn, param)``
    picks the routed experts' weights, ``expert_parallel`` (a divisor of the shard group) splits
    them on dim 0 over that many ranks, and each rank's local experts form their own group sharded
    over the remaining ``shard // expert_parallel`` ranks (``ShardPlacementResult`` per-parameter
    meshes); the activations are traced with every expert on one rank (the all-to-all's buffers
    are not counted).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"mfsdp2.estimate_memory: model must be an nn.Module, got {type(model).__name__}")
    shape = (int(mesh_shape),) if isinstance(mesh_shape, int) else tuple(int(x) for x in mesh_shape)
    if not shape or len(shape) > 2 or min(shape) < 1:
        raise ValueError("mfsdp2.estimate_memory: mesh_shape must be N or (replicate, shard) of positive sizes, "
                         f"got {mesh_shape!r}")
    strategy = ShardingStrategy.parse(sharding_strategy, "estimate_memory")
    if strategy is ShardingStrategy.NO_SHARD and len(shape) == 2:
        raise ValueError("mfsdp2.estimate_memory: sharding_strategy='no_shard' replicates over every rank: "
                         "pass a 1-D mesh_shape")
    if strategy is ShardingStrategy.NO_SHARD:
        shard_world, replicate = 1, shape[0]
    else:
        shard_world, replicate = shape[-1], (shape[0] if len(shape) == 2 else 1)
    mp = MixedPrecisionPolicy.coerce(mp_policy, "estimate_memory") if mp_policy is not None else MixedPrecisionPolicy()
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"mfsdp2.estimate_memory: unknown optimizer {optimizer!r}; one of {sorted(OPTIMIZERS)}")
    if optimizer_impl not in ("auto", "single", "foreach", "fused"):
        raise ValueError("mfsdp2.estimate_memory: optimizer_impl must be 'auto', 'single', 'foreach' or 'fused', "
                         f"got {optimizer_impl!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"mfsdp2.estimate_memory: device must be 'cpu' or 'cuda', got {device!r}")
    if allocator not in ALLOCATORS:
        raise ValueError(f"mfsdp2.estimate_memory: unknown allocator {allocator!r}; use one of {list(ALLOCATORS)}")
    if prefetch_depth < 0:
        raise ValueError(f"mfsdp2.estimate_memory: prefetch_depth must be >= 0, got {prefetch_depth}")
    raf = reshard_after_forward
    if not isinstance(raf, bool):
        if not strategy.shards_params or int(raf) < 1 or shard_world % int(raf):
            raise ValueError(f"mfsdp2.estimate_memory: reshard_after_forward={raf!r} must be a bool or (ZeRO-3) a "
                             f"divisor of the shard group size {shard_world}")
        raf = True if int(raf) == shard_world else (False if int(raf) == 1 else int(raf))
    if expert_parallel < 1 or shard_world % expert_parallel:
        raise ValueError(f"mfsdp2.estimate_memory: expert_parallel={expert_parallel} must divide "
                         f"the shard group size {shard_world}")
    if expert_parallel > 1:
        if experts is None:
            raise ValueError("mfsdp2.estimate_memory: expert_parallel > 1 needs experts= "
                             "(which parameters are the routed experts)")
        if not isinstance(raf, bool):
            raise ValueError(f"mfsdp2.estimate_memory: reshard_after_forward={reshard_after_forward!r} (an int) "
                             "with expert parallelism: units sharded over several meshes take True or False (E73)")
        odd = [n for n, p in model.named_parameters() if experts(n, p) and p.shape[0] % expert_parallel]
        if odd:
            raise ValueError(f"mfsdp2.estimate_memory: expert weights {odd[:3]} do not split over "
                             f"expert_parallel={expert_parallel} on dim 0")
    spec = OPTIMIZERS[optimizer]
    impl = optimizer_impl if optimizer_impl != "auto" else ("foreach" if device == "cuda" else "single")
    notes: list[str] = []

    named = resolve_units(model, units)
    plans = plan_units(named, shard_world, mp, shard_dims, experts, expert_parallel)
    if spec.flat:  # mfsdp2.optim.AdamW: counters beside the states; bfloat16 moments keep them on the host
        step_on_device = device == "cpu" or spec.state_dtype is None
    else:
        step_on_device = device == "cpu" or impl == "fused"

    def per_rank(r: int) -> dict[str, int]:
        return persistent_bytes(plans, strategy, offload, r, spec, step_on_device)

    if rank is None:
        # Ranks differ only in the optimizer's states (their rows); the last ones hold the padding.
        cands = sorted({0, shard_world - 1} | set(range(min(shard_world, 64))))
        rank = max(cands, key=lambda r: (per_rank(r)["optimizer_states"] + per_rank(r)["host_optimizer_states"], -r))
    elif not 0 <= rank < shard_world:
        raise ValueError(f"mfsdp2.estimate_memory: rank {rank} is outside the shard group of {shard_world}")
    static = per_rank(rank)
    temps = optimizer_temp_bytes(plans, rank, spec, impl, [id(p) for p in model.parameters()])
    if offload:
        temps_device, temps_host = 0, temps
    else:
        temps_device, temps_host = temps, 0

    if inputs is None and batch_size is not None:
        inputs = _default_inputs(model, batch_size, seq_len)
    if inputs is not None:
        owned = [[pid for g in u.groups for pid in g.param_ids] for u in plans]
        tr = trace_step(model, [p for p, _ in named], owned, mp, inputs, loss_fn)
        marks, input_bytes, buffer_bytes = tr.marks, tr.input_bytes, tr.buffer_bytes
    else:
        marks, input_bytes = default_marks(len(plans)), 0
        buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        notes.append("activations not estimated: pass inputs= or batch_size= (and seq_len=) for a fake-tensor step")
    if storage_swap is None:
        storage_swap = compat.HAS_STORAGE_SWAP
    cfg = StepConfig(strategy, shard_world, replicate, prefetch_depth, raf, root_reshard_after_forward,
                     "nccl" if device == "cuda" else "gloo", offload, int(bucket_cap_mb * 2**20),
                     storage_swap=bool(storage_swap))
    replay = simulate(plans, marks, cfg, temps_device, allocator, device, hold_between_steps)
    transient, point, held = transient_at_peak(replay)
    if replay.first_step_peak > transient:
        notes.append(f"the first step (no prefetch yet, plans being recorded) reaches {replay.first_step_peak:,} B "
                     "of the allocator and the trace alone, above the later steps")

    at_peak = dict.fromkeys(AT_PEAK_ORDER, 0)
    at_peak["model_weights"] = static["model_weights"]
    at_peak["main_weights"] = static["main_weights"]
    at_peak["optimizer_states"] = static["optimizer_states"]
    at_peak["buffers"] = buffer_bytes
    at_peak["inputs"] = input_bytes
    for role, nbytes in point.live.items():
        at_peak[_ROLE_CATEGORY.get(role, "reduction_buffers")] += nbytes
    at_peak["gathered_weights"] += point.extra
    at_peak["optimizer_temporaries" if point.label == "optimizer step" else "activations"] = point.act
    at_peak["allocator_slack"] = point.idle
    peak = sum(at_peak.values())

    largest = max(plans, key=lambda u: u.gathered_bytes())
    sizes = {
        "model_weights": static["model_weights"],
        "main_weights": static["main_weights"] + static["host_main_weights"],
        "main_grads": static["main_grads"] + static["host_main_grads"],
        "optimizer_states": static["optimizer_states"] + static["host_optimizer_states"],
        "optimizer_temporaries": temps,
        "largest_unit_gathered": largest.gathered_bytes(),
        "largest_unit_flat_grad": largest.flat_grad_bytes(),
        "allocator_held": held,
        "allocator_held_at_optimizer_step": next(p.held for p in reversed(replay.points)
                                                 if p.label == "optimizer step"),
        "activations_peak": max((m.peak for m in marks), default=0),
        "padding_elements": sum(g.layout.padding_numel for u in plans for g in u.groups),
    }
    host = {"main_weights": static["host_main_weights"], "main_grads": static["host_main_grads"],
            "optimizer_states": static["host_optimizer_states"], "optimizer_temporaries": temps_host}
    unit_rows = [{
        "name": u.name,
        "params": sum(g.layout.param_numel for g in u.groups),
        "shard_numel": sum(g.S for g in u.groups),
        "padding": sum(g.layout.padding_numel for g in u.groups),
        "gathered_bytes": u.gathered_bytes(),
        "flat_grad_bytes": u.flat_grad_bytes(),
        "groups": [{"dtype": _dtype_name(g.orig_dtype), "requires_grad": g.requires_grad, "shard_numel": g.S,
                    "total_numel": g.total, "compute": _dtype_name(g.compute_dtype), "main": _dtype_name(g.main_dtype),
                    "reduce": _dtype_name(g.reduce_dtype), "mesh": g.mesh or "unit", "world": g.world}
                   for g in u.groups],
    } for u in plans]
    if any(g.fp8 for u in plans for g in u.groups):
        notes.append("FP8 all-gather: the float8 bytes are counted from issue to wait; amax/scale tensors are not")
    if not strategy.shards_params:
        notes.append("persistent weights: the cross-unit gather buckets of small groups (< 1 MiB) are not counted")
    config = {
        "mesh_shape": list(shape), "shard_group": shard_world, "replicate": replicate, "strategy": strategy.value,
        "precision": f"param {_dtype_name(mp.param_dtype)} / reduce {_dtype_name(mp.reduce_dtype)} / main "
                     f"{_dtype_name(mp.main_params_dtype)}",
        "optimizer": f"{optimizer} ({impl})", "prefetch_depth": prefetch_depth,
        "reshard_after_forward": reshard_after_forward, "root_reshard_after_forward": root_reshard_after_forward,
        "allocator": allocator, "storage_swap": cfg.storage_swap, "device": device, "offload": offload,
        "units": len(plans), "params": sum(u["params"] for u in unit_rows), "expert_parallel": expert_parallel,
    }
    config["peak_step"] = point.step
    return MemoryEstimate(peak, at_peak, point.label, sizes, host, unit_rows, config, rank, notes)
