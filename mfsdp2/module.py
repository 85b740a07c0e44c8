"""``fully_shard`` and the ``FSDPModule`` mixin it swaps into a module's class.

``fully_shard(module)`` makes ``module`` a *unit*: its own parameters (not those of units nested
below it, which must be wrapped first) are grouped by (dtype, requires_grad) into
:class:`~mfsdp2.param_group.ParameterGroup` s, replaced on the module by row-sharded DTensor
parameters for the optimizer, and the module's class becomes ``FSDP<Cls>`` so the FSDP2 methods
(``unshard``, ``reshard``, ``set_requires_gradient_sync``, ...) are available on it.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from . import dtensor_ops  # noqa: F401  (copy_ into RowShard parameters)
from .allocator import BucketAllocator
from .comm import Communicator
from .hooks import lazy_init, post_forward, pre_forward, reset, reshard, unshard_async, wait_unshard
from .mixed_precision import MixedPrecisionPolicy
from .param_group import GroupConfig, ParameterGroup, ParamInfo
from .shared_params import adopt_shared, mark_owned
from .state import FSDPState
from .state_dict import register_state_dict_hooks
from .strategy import ShardingStrategy, Topology
from .tensor_parallel import TPSpec, tp_spec_of

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle"]

logger = logging.getLogger(__name__)

_communicators: dict = {}
_class_cache: dict[type, type] = {}


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard."""

    def __init__(self, state: FSDPState):
        self._state = state

    def wait(self) -> None:
        wait_unshard(self._state)


class FSDPModule:
    """Mixin added to every module ``fully_shard`` was applied to (FSDP2's method names)."""

    _mfsdp2_state: FSDPState

    def _units(self, recurse: bool):
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [m._mfsdp2_state for m in mods if isinstance(m, FSDPModule)]

    def _apply(self, fn, recurse: bool = True):
        """``to_empty`` / ``.to()`` / ``.double()`` / ``.cuda()`` ... after ``fully_shard``: convert
        this rank's rows and have the groups adopt them (see :mod:`mfsdp2.conversion`)."""
        from .conversion import apply_to_unit

        return apply_to_unit(self, fn, recurse, super()._apply)

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this unit's parameters now (e.g. to overlap with work before forward)."""
        state = self._mfsdp2_state
        unshard_async(state)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered parameters and put the sharded ones back on the module."""
        reshard(self._mfsdp2_state)

    def reset(self) -> None:
        """After an exception in forward or backward: wait for in-flight collectives, drop this
        step's partial gradients and reshard every unit under the root, so training can go on."""
        state = self._mfsdp2_state
        if state.ctx is not None:
            reset(state.ctx)

    def mark_weights_changed(self, *, recurse: bool = True) -> None:
        """Announce a write to the weights made outside the optimizer (``p.data.copy_(ema)``,
        ``torch.nn.init.*_(p.data)``, a custom loader): the next forward re-casts and re-gathers
        them. Optional -- such writes are also found by a content fingerprint at the root's
        forward -- but it makes the next gather certain and skips that comparison. Call it on
        every rank (like the write itself)."""
        for s in self._units(recurse):
            for g in s.groups:
                g.mark_changed()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: accumulate unsharded gradients locally (no reduce-scatter) until set back to True."""
        for s in self._units(recurse):
            s.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False skips the all-reduce across replicas (gradient accumulation with only the
        reduce-scatter); the shard-group results are summed and all-reduced at the next backward
        with it True. No effect without a replicate dimension."""
        for s in self._units(recurse):
            for g in s.groups:
                g.requires_all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: Optional[float], *, recurse: bool = True) -> None:
        """Divide the summed gradients by ``factor`` instead of averaging over the data-parallel
        ranks: ``1.0`` sums (per-token-loss training, where the loss is already normalised by the
        global token count), ``None`` restores the mean. NCCL applies it inside the reduction
        (PREMUL_SUM); other backends pre-scale while packing the gradients."""
        if factor is not None and not factor > 0:
            raise ValueError(f"mfsdp2: gradient divide factor must be > 0 or None, got {factor!r}")
        for s in self._units(recurse):
            for g in s.groups:
                g.divide_factor = None if factor is None else float(factor)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for s in self._units(recurse):
            s.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        for s in self._units(recurse):
            s.reshard_after_forward = reshard_after_forward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step (FSDP2's meaning).
        False: the final callback leaves the last reductions in flight -- they overlap the next
        micro-batch's forward and finish at its backward -- and skips the end-of-backward
        gradient-presence all-reduce, so ``.grad`` is not complete yet. True (default): every
        reduction is finished and every gradient exposed. Like FSDP2's flag it is model-wide:
        every rank must pass the same value."""
        state = self._mfsdp2_state
        for s in state.ctx.states if state.ctx is not None else self._units(True):
            s.is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        self._mfsdp2_state.forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        self._mfsdp2_state.backward_prefetch = [_state_of(m) for m in modules]

    def set_prefetch_depth(self, depth: int) -> None:
        """How many units ahead the recorded-order prefetch gathers (root only; default 1)."""
        state = self._mfsdp2_state
        lazy_init(state)
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        state.ctx.schedule.prefetch_depth = depth

    def memory_stats(self) -> dict[str, int]:
        """Bytes the runtime owns on this rank for the units under this root.

        Persistent memory by kind, each byte counted once (the main weights of ``optim`` /
        ``optim_grads`` / ``no_shard`` in the model dtype are a slice of the model weights and
        count there): ``model_weight_bytes`` (model-dtype shards, or the full weights the
        strategy keeps), ``main_weight_bytes``, ``main_grad_bytes`` (while they exist: from the
        first reduction to the forward after ``zero_grad(set_to_none=True)``), ``fp8_bytes``
        (quantised shards) and ``partial_grad_bytes`` (HSDP sums waiting for an all-reduce);
        ``persistent_bytes`` = model + main + fp8. ``transient_peak_bytes`` /
        ``transient_live_bytes``: what the shared allocator serves -- unsharded weights,
        gradient buffers and main grads -- peak since the last ``stats.reset_peak()``;
        ``cached_bytes``: memory the allocator holds for reuse while no buffer uses it.
        """
        seen: list[tuple[int, int]] = []

        def distinct(t: Optional[torch.Tensor]) -> int:
            if t is None or t.numel() == 0:
                return 0
            lo = t.data_ptr()
            hi = lo + t.numel() * t.element_size()
            if any(a <= lo and hi <= b for a, b in seen):
                return 0
            seen.append((lo, hi))
            return hi - lo

        out = dict.fromkeys(("model_weight_bytes", "main_weight_bytes", "main_grad_bytes", "fp8_bytes", "partial_grad_bytes"), 0)
        groups = [g for s in self._units(True) for g in s.groups]
        for g in groups:
            shard = g.weights.shard if g.weights.shard.dtype == g.compute_dtype else None  # else: cast per gather
            out["model_weight_bytes"] += distinct(g.weights.unsharded if g.persistent else shard)
        for g in groups:
            out["main_weight_bytes"] += distinct(g.main_weight)
            out["main_grad_bytes"] += distinct(g.main_grad_full if g.main_grad_full is not None else g.main_grad)
            out["fp8_bytes"] += distinct(g.fp8.bytes.shard if g.fp8 is not None else None)
            out["partial_grad_bytes"] += distinct(g.partial)
        out["persistent_bytes"] = out["model_weight_bytes"] + out["main_weight_bytes"] + out["fp8_bytes"]
        stats = self.allocator.stats
        out.update(
            transient_peak_bytes=stats.peak_bytes,
            transient_live_bytes=stats.live_bytes,
            cached_bytes=self.allocator.cached_bytes() if hasattr(self.allocator, "cached_bytes") else 0,
        )
        return out

    @property
    def allocator(self) -> BucketAllocator:
        """The allocator shared by every unit under this unit's root (after the first forward)."""
        state = self._mfsdp2_state
        lazy_init(state)
        return state.ctx.allocator


_EAGER_PRE_FORWARD = torch._dynamo.disable(pre_forward, recursive=True)
_EAGER_POST_FORWARD = torch._dynamo.disable(post_forward, recursive=True)


def _state_of(m) -> FSDPState:
    if not isinstance(m, FSDPModule):
        raise TypeError(f"{type(m).__name__} is not an FSDP module: call fully_shard on it first")
    return m._mfsdp2_state


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("mfsdp2.fully_shard needs torch.distributed initialised (dist.init_process_group)")
    device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _communicator(mesh: DeviceMesh, dim: Optional[int]) -> Communicator:
    """The (cached) communicator of mesh dimension ``dim``; ``None``: this rank alone."""
    device = (
        torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    )
    group = mesh.get_group(dim) if dim is not None else None
    key = (id(group), str(device))
    if key not in _communicators:
        _communicators[key] = Communicator(group, device)
    return _communicators[key]


def _collect(
    module: nn.Module, device: torch.device, mesh: DeviceMesh
) -> tuple[list[list[ParamInfo]], list[nn.Parameter], dict[int, TPSpec]]:
    """This unit's own parameters (skipping nested units), deduplicated, in registration order,
    and the tensor-parallel spec of those that are TP DTensors (keyed by id)."""
    infos: dict[int, list[ParamInfo]] = {}
    params: dict[int, nn.Parameter] = {}
    specs: dict[int, TPSpec] = {}

    def visit(m: nn.Module, prefix: str) -> None:
        for attr, p in m._parameters.items():
            if p is None:
                continue
            fqn = prefix + attr
            if isinstance(p, DTensor) and id(p) not in specs:
                specs[id(p)] = tp_spec_of(p, mesh, fqn, type(module).__name__)
            elif type(p) is not nn.Parameter and not isinstance(p, DTensor):
                raise ValueError(
                    f"mfsdp2: parameter {fqn!r} of {type(module).__name__} is a {type(p).__name__}, a tensor "
                    "subclass (a lazy module's uninitialised parameter, or a quantised weight such as "
                    "TransformerEngine's Float8Tensor/MXFP8Tensor); mfsdp2 shards plain tensors and "
                    "tensor-parallel DTensors. Run a forward to initialise lazy modules, build TE models "
                    "without fp8_model_init, and gather in float8 with MixedPrecisionPolicy(all_gather_dtype=...)"
                )
            if p.device.type == "meta":  # sharded now, values later: mfsdp2.materialize(model)
                pass
            elif p.device != device and not (p.device.type == device.type == "cpu"):
                raise ValueError(
                    f"mfsdp2: parameter {fqn!r} is on {p.device} but the mesh computes on {device}; "
                    f"move the module with module.to({str(device)!r}) first"
                )
            infos.setdefault(id(p), []).append(ParamInfo(m, attr, fqn))
            params[id(p)] = p
        for name, child in m._modules.items():
            if child is None or isinstance(child, FSDPModule):
                continue
            visit(child, prefix + name + ".")

    visit(module, "")
    keys = list(params)
    return [infos[k] for k in keys], [params[k] for k in keys], specs


def _tp_local(p: nn.Parameter) -> nn.Parameter:
    """A TP DTensor parameter's local tensor as the parameter the data-parallel layer shards."""
    local = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
    for k, v in p.__dict__.items():
        if not k.startswith("_"):
            setattr(local, k, v)
    return local


def fully_shard(
    module: nn.Module,
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Union[bool, int] = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    allocator: Union[str, BucketAllocator, None] = None,
    sharding_strategy: Union[str, ShardingStrategy] = "optim_grads_params",
) -> nn.Module:
    """Shard ``module``'s own parameters over ``mesh`` and make it an :class:`FSDPModule`.

    Apply to children first and the root last. ``reshard_after_forward``: ``True`` frees the
    gathered parameters after forward, ``False`` keeps them for backward, an int ``k`` (a divisor
    of the group size, e.g. ranks per node) keeps ``N/k`` shards so backward gathers only inside
    blocks of ``k`` consecutive ranks. ``allocator`` is read from the root only
    (``"caching"`` default, ``"dynamic"``, ``"trace_pool"`` or a :class:`~mfsdp2.allocator.BucketAllocator`).

    ``mesh``: 1-D (the data-parallel ranks) or 2-D ``(replicate, shard)`` for HSDP. Parameters that
    are already tensor-parallel DTensors are sharded over ``mesh`` and keep their TP placement.
    ``sharding_strategy``: ``"optim_grads_params"`` (ZeRO-3, default), ``"optim_grads"``
    (ZeRO-2), ``"optim"`` (ZeRO-1) or ``"no_shard"`` (DDP); see :mod:`mfsdp2.strategy`.
    """
    if isinstance(module, FSDPModule):
        raise ValueError(
            f"mfsdp2: fully_shard was already applied to this {type(module).__name__}; apply it once per module"
        )
    if not (allocator is None or isinstance(allocator, BucketAllocator) or allocator in ("caching", "dynamic", "trace_pool")):
        raise ValueError(
            f"mfsdp2: unknown allocator {allocator!r} for {type(module).__name__}: use 'caching', 'dynamic', "
            "'trace_pool' or a BucketAllocator instance"
        )
    where = type(module).__name__
    strategy = ShardingStrategy.parse(sharding_strategy, where)
    mesh = mesh if mesh is not None else _default_mesh()
    topology = Topology.of(mesh.ndim, strategy, where)
    if mesh.get_coordinate() is None:
        raise ValueError("mfsdp2: this rank is not part of the given mesh")
    comm = _communicator(mesh, topology.shard_dim)
    replicate = _communicator(mesh, topology.replicate_dim) if topology.replicate_dim is not None else None
    if mp_policy.all_gather_dtype is not None and not strategy.shards_params:
        raise ValueError(
            f"mfsdp2: all_gather_dtype (FP8 all-gather) for {where} needs sharding_strategy="
            f"'optim_grads_params': {strategy.value!r} gathers the weights once per step and keeps them"
        )
    post_forward_comm = None
    is_int = isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool)
    if is_int and not strategy.shards_params:
        raise ValueError(
            f"mfsdp2: reshard_after_forward={reshard_after_forward} for {where} applies to "
            f"sharding_strategy='optim_grads_params' only; {strategy.value!r} keeps the full weights"
        )
    if is_int:
        k = reshard_after_forward
        if k < 1 or comm.world_size % k:
            raise ValueError(
                f"mfsdp2: reshard_after_forward={k} must be True, False or a divisor of the shard "
                f"group size {comm.world_size} (e.g. the number of ranks per node)"
            )
        # k == world size is a full reshard; k == 1 keeps everything (False), as in FSDP2.
        if k == comm.world_size or k == 1:
            reshard_after_forward = k == comm.world_size
        else:
            post_forward_comm = comm.subgroup(k)  # collective: all ranks create the groups together
    name = type(module).__name__  # renamed to its path under the root at the first forward
    infos, params, specs = _collect(module, comm.device, mesh)
    adopt_shared(module, infos, params)  # tied to a parameter a wrapped child sharded: take it over
    if specs and topology.shard_dim is None:
        raise ValueError(
            f"mfsdp2: {where} has tensor-parallel parameters; sharding_strategy='no_shard' cannot "
            "combine with TP here: use a sharding strategy (e.g. 'optim_grads_params')"
        )

    metas = {p.is_meta for p in params}
    if len(metas) > 1:
        raise ValueError(
            f"mfsdp2: {name} mixes parameters on the meta device with materialised ones; build the "
            "whole model under torch.device('meta') (then fully_shard and mfsdp2.materialize) or none of it"
        )
    by_key: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if p.dim() == 0:
            raise ValueError(
                f"mfsdp2: parameter {infos[i][0].fqn!r} of {name} is 0-dimensional; FSDP shards dim 0, "
                "so store it with shape (1,)"
            )
        fp8 = mp_policy.all_gather_dtype if p.dim() >= 2 and p.dtype.is_floating_point else None
        by_key.setdefault((p.dtype, p.requires_grad, fp8), []).append(i)
    groups = [
        ParameterGroup(
            name, [infos[i] for i in idx],
            [_tp_local(params[i]) if id(params[i]) in specs else params[i] for i in idx],
            mesh, comm, comm.device, mp_policy,
            GroupConfig(strategy, topology.shard_dim, replicate, key[2]),
            tp_specs=[specs.get(id(params[i])) for i in idx],
        )
        for key, idx in by_key.items()
    ]
    state = FSDPState(module, name, mesh, comm, groups, mp_policy, reshard_after_forward, allocator)
    state.post_forward_comm = post_forward_comm
    mark_owned(state, [[params[i] for i in idx] for idx in by_key.values()])
    for g in groups:
        g.register(unsharded=False, check=False)  # replaces the user's original parameters

    cls = type(module)
    if cls not in _class_cache:
        _class_cache[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _class_cache[cls]
    module._mfsdp2_state = state
    # The hooks run eagerly even inside a compiled module (``block.compile()`` compiles
    # ``_call_impl``, hooks included): they issue collectives, swap parameters and read host
    # state (graph-task ids, version counters) that dynamo cannot trace. FSDP2's hooks are
    # skipped by dynamo the same way; the module's own forward is still compiled.
    module.register_forward_pre_hook(_EAGER_PRE_FORWARD, prepend=True, with_kwargs=True)
    module.register_forward_hook(_EAGER_POST_FORWARD, always_call=False, with_kwargs=True)
    logger.debug("mfsdp2: %s -> %d groups: %s", name, len(groups), [g.layout.describe() for g in groups])
    register_state_dict_hooks(module)  # state_dict() from / load_state_dict() into the main weights
    return module
