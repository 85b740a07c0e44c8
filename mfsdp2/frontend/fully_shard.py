"""``fully_shard``: make a module (or a list of modules) one *unit* of sharded parameters.

The unit's own parameters (those of its modules' subtrees minus nested units and
``ignored_params``) are grouped by (dtype, requires_grad) into
:class:`~mfsdp2.groups.param_group.ParameterGroup` s, replaced on the modules by row-sharded DTensor
parameters for the optimizer, and every module's class becomes ``FSDP<Cls>`` (the
:class:`~mfsdp2.frontend.module.FSDPModule` methods). Every keyword of torch 2.13's ``fully_shard`` is
accepted; what each does in mfsdp2 is in docs/design.md ("FSDP2's API surface").
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import OffloadPolicy
from torch.distributed.tensor import DTensor, Replicate

from ..comm import devices
from ..memory.allocator import BucketAllocator
from ..comm.communicator import Communicator
from ..comm.registry import communicator_for
from ..runtime.fsdp2_state import bind_runtime
from ..runtime.hooks import lazy_init
from ..runtime.external_backward import finish_backward, reduce_accumulated
from ..precision.mixed_precision import MixedPrecisionPolicy
from .module import _EAGER_POST_FORWARD, _EAGER_PRE_FORWARD, FSDPModule
from .torch_identity import register_torch_state
from ..memory.offload import MainMemory, main_memory_for
from ..groups.param_group import GroupConfig, ParameterGroup, ParamInfo
from ..groups.subclass_gather import split_subclass_params, subclass_unit
from ..groups.subclass_params import has_all_gather_extension
from ..base.compile_cache import protect_compile_caches
from ..dtensors.shard_dim import InvalidShardDimError, shard_dims  # noqa: F401  (InvalidShardDimError: re-exported)
from ..runtime.shared_params import adopt_shared, mark_owned
from ..runtime.state import FSDPState, unit_state
from ..checkpoint.state_dict import register_state_dict_hooks
from ..base.strategy import ShardingStrategy, Topology
from ..dtensors.tensor_parallel import TPSpec, tp_spec_of
from . import param_meshes
from .param_grouping import MeshComms, group_indices, mesh_comms, refuse_partial_reshard

__all__ = ["fully_shard"]

logger = logging.getLogger(__name__)

_class_cache: dict[type, type] = {}


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("mfsdp2 E12: mfsdp2.fully_shard needs torch.distributed initialised "
                           "(dist.init_process_group)")
    accelerator = "cuda" if torch.cuda.is_available() else None
    device_type = devices.default_mesh_device_type(accelerator, dist.get_backend_config())
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _communicator(mesh: DeviceMesh, dim: Optional[int]) -> Communicator:
    """The (cached) communicator of mesh dimension ``dim``; ``None``: this rank alone."""
    device = devices.mesh_compute_device(mesh)
    group = mesh.get_group(dim) if dim is not None else None
    return communicator_for(group, device)


def _collect(
    modules: list[nn.Module], device: torch.device, mesh: DeviceMesh, ignored: set[int],
    main: Optional[MainMemory] = None
) -> tuple[list[list[ParamInfo]], list[nn.Parameter], dict[int, TPSpec]]:
    """This unit's own parameters (skipping nested units and ``ignored``, ids of the
    ``ignored_params``), deduplicated, in registration order, and the ids of those that are
    DTensors (tensor or expert parallel; their specs are checked later, against the mesh each one
    is sharded over). Parameters must be on the mesh's device, or on the
    main device under CPU offload (``main``): a model kept on the CPU is sharded from there."""
    module = modules[0]
    infos: dict[int, list[ParamInfo]] = {}
    params: dict[int, nn.Parameter] = {}
    specs: dict[int, Optional[TPSpec]] = {}

    def visit(m: nn.Module, prefix: str) -> None:
        for attr, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = prefix + attr
            if isinstance(p, DTensor):
                specs[id(p)] = None
            elif type(p) is not nn.Parameter and not isinstance(p, DTensor) and not has_all_gather_extension(p, fqn):
                raise ValueError(
                    f"mfsdp2 E44: parameter {fqn!r} of {type(module).__name__} is a {type(p).__name__}, a tensor "
                    "subclass (a lazy module's uninitialised parameter, or a quantised weight such as "
                    "TransformerEngine's Float8Tensor/MXFP8Tensor); mfsdp2 shards plain tensors, "
                    "tensor-parallel DTensors and subclasses defining FSDP2's fsdp_pre_all_gather / "
                    "fsdp_post_all_gather (torchao's). Run a forward to initialise lazy modules, build TE models "
                    "without fp8_model_init, and gather in float8 with MixedPrecisionPolicy(all_gather_dtype=...)"
                )
            if p.device.type == "meta":  # sharded now, values later: mfsdp2.materialize(model)
                pass
            elif p.device != device and not (p.device.type == device.type == "cpu") and not (
                main is not None and p.device.type == main.device.type
            ):
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

    for i, m in enumerate(modules):
        visit(m, "" if len(modules) == 1 else f"[{i}].")
    keys = list(params)
    return [infos[k] for k in keys], [params[k] for k in keys], specs


def _own_modules(modules: list[nn.Module]):
    """The unit's own modules: ``modules`` and their subtrees, minus nested units (which keep
    their own parameters and buffers)."""
    def own(m: nn.Module):
        yield m
        for child in m.children():
            if not isinstance(child, FSDPModule):
                yield from own(child)

    for m in modules:
        yield from own(m)


def _move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    """Under CPU offload a unit's modules may stay on the CPU (only their shards are kept, in
    host memory); their buffers move to the compute device, as FSDP2 moves every unit's buffers
    (``_move_states_to_device``). Nested units' buffers are theirs to move."""
    for sub in _own_modules(modules):
        for name, b in sub._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                sub._buffers[name] = b.to(device)


def _tp_local(p: nn.Parameter) -> nn.Parameter:
    """A TP DTensor parameter's local tensor as the parameter the data-parallel layer shards."""
    local = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
    for k, v in p.__dict__.items():
        if not k.startswith("_"):
            setattr(local, k, v)
    return local


class AlreadyShardedError(ValueError, AssertionError):
    """``fully_shard`` applied again to a module: a ``ValueError`` (mfsdp2's type) and an
    ``AssertionError`` (what FSDP2 raises for it), so either ``except`` catches it."""


def _as_modules(module) -> list[nn.Module]:
    """``module`` or the list of modules that form one unit (FSDP2's ``fully_shard([a, b])``)."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("mfsdp2 E80: fully_shard got an empty list of modules; pass a module or a non-empty list")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"mfsdp2 E81: fully_shard expects an nn.Module or a list of them, got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise AlreadyShardedError(
                f"mfsdp2 E01: fully_shard was already applied to this {type(m).__name__}; apply it once per module"
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            # Nothing would ever call the unit's forward hooks: its parameters would stay sharded
            # DTensors inside the children's forwards (as FSDP2, which refuses these too).
            raise ValueError(
                f"mfsdp2 E45: fully_shard got a {type(m).__name__}, a container without a forward of its own; "
                "apply it to each module in it, or to the parent module that calls them"
            )
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("mfsdp2 E82: fully_shard got the same module twice in its list; pass each module once")
    return modules


def _dp_mesh(mesh: DeviceMesh, dims, strategy: ShardingStrategy, where: str) -> tuple[DeviceMesh, ShardingStrategy]:
    """torch 2.13's ``dp_mesh_dims``: ``mesh`` is the whole SPMD mesh and ``dims`` names its
    data-parallel dimensions (several names are flattened into one). mfsdp2's equivalent is the
    data-parallel sub-mesh itself: 1-D (shard), 2-D (replicate, shard) for HSDP, or the replicate
    dims alone with ``no_shard`` (DDP). A mesh with other dims (tensor parallelism) is refused with
    mfsdp2's way of combining TP: TP DTensors on the sibling sub-mesh."""
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"mfsdp2 E83: dp_mesh_dims for {where} needs a mesh with mesh_dim_names; "
                         "build it with init_device_mesh(..., mesh_dim_names=(...))")
    shard, rep = tuple(dims.shard_names), tuple(dims.replicate_names)
    for n in shard + rep:
        if n not in names:
            raise ValueError(f"mfsdp2 E84: dp_mesh_dims names {n!r} for {where}, "
                             f"which is not one of the mesh's dims {names}")
    others = [n for n in names if n not in shard + rep]
    if others:
        raise ValueError(
            f"mfsdp2 E85: dp_mesh_dims for {where} leaves mesh dims {others} that are not data-parallel; "
            "mfsdp2 does not take parameters that are DTensors on the whole SPMD mesh. Parallelise with "
            f"the sub-mesh of those dims (parallelize_module(block, mesh[{others[0]!r}], ...)) and call "
            f"fully_shard(block, mesh=mesh[{shard or rep}]) without dp_mesh_dims"
        )

    def sub(ns: tuple) -> DeviceMesh:
        return mesh[ns[0]] if len(ns) == 1 else mesh[ns]._flatten("_".join(ns))

    if not shard:  # replicate only: DDP
        if strategy not in (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM_GRADS_PARAMS):
            raise ValueError(
                f"mfsdp2 E86: dp_mesh_dims for {where} has no shard dim (DDP) but "
                f"sharding_strategy={strategy.value!r}; "
                "name a shard dim, or use sharding_strategy='no_shard'"
            )
        return sub(rep), ShardingStrategy.NO_SHARD
    if not rep:
        return sub(shard), strategy
    return DeviceMesh._concatenate([sub(rep), sub(shard)]), strategy


def _plain_spmd_params(modules: list[nn.Module], spmd_mesh: DeviceMesh, where: str) -> None:
    """With ``dp_mesh_dims``, FSDP2 takes DTensors replicated over the (data-parallel) SPMD mesh:
    their local tensors are the full parameters, which is what mfsdp2 shards."""
    for sub in _own_modules(modules):  # nested units keep their sharded DTensors
        for attr, p in list(sub._parameters.items()):
            if isinstance(p, DTensor) and p.device_mesh == spmd_mesh:
                if not all(isinstance(pl, Replicate) for pl in p.placements):
                    raise ValueError(
                        f"mfsdp2 E87: parameter {attr!r} of {type(sub).__name__} in {where} is a DTensor with "
                        f"{p.placements} on the dp_mesh_dims mesh; FSDP2 and mfsdp2 need Replicate() there"
                    )
                sub._parameters[attr] = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Union[bool, int, None] = None,
    shard_placement_fn: Optional[Callable] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # or torch.distributed.fsdp's
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[set[nn.Parameter]] = None,
    dp_mesh_dims=None,
    allocator: Union[str, BucketAllocator, None] = None,
    sharding_strategy: Union[str, ShardingStrategy] = "optim_grads_params",
):
    """Shard ``module``'s own parameters over ``mesh`` and make it an :class:`FSDPModule`.

    Apply to children first and the root last. ``module`` may be a list of modules: they form one
    unit (one all-gather, one reduction per backward pass of its parameters), every module becomes
    an ``FSDPModule`` and the list is returned. ``reshard_after_forward``: ``None`` (default, FSDP2's):
    ``True`` below the root, ``False`` for the root (its backward needs the parameters first);
    ``True`` frees the gathered parameters after forward (the root too when passed explicitly),
    ``False`` keeps them for backward, an int ``k`` (a divisor of the group size, e.g. ranks per
    node) keeps ``N/k`` shards so backward gathers only inside blocks of ``k`` consecutive ranks.

    ``mesh``: 1-D (the data-parallel ranks) or 2-D ``(replicate, shard)`` for HSDP; with
    ``dp_mesh_dims`` the whole SPMD mesh, of which those dims are used. Parameters that are already
    tensor-parallel DTensors are sharded over ``mesh`` and keep their TP placement.
    ``shard_placement_fn`` may return ``None`` / ``Shard(0)`` or ``Shard(d)`` per parameter: the
    parameter is then stored with dim ``d`` first so its rows are slices along ``d``
    (:mod:`mfsdp2.dtensors.shard_dim`; its gathered parameter is a strided view).
    ``offload_policy``: ``OffloadPolicy()``, or ``CPUOffloadPolicy(pin_memory=...)``: main
    weights, gradients and optimizer states in (pinned) host memory, the optimizer step on the
    CPU, compute on the mesh's device (:mod:`mfsdp2.memory.offload`; on a CPU mesh the same code path).
    ``ignored_params`` stay plain: not sharded, not moved, their gradients never reduced (each
    rank keeps its own), as in FSDP2.
    mfsdp2's own: ``allocator`` is read from the root only (``"caching"`` default, ``"dynamic"``,
    ``"trace_pool"`` or a :class:`~mfsdp2.memory.allocator.BucketAllocator`); ``sharding_strategy``:
    ``"optim_grads_params"`` (ZeRO-3, default), ``"optim_grads"`` (ZeRO-2), ``"optim"`` (ZeRO-1)
    or ``"no_shard"`` (DDP); see :mod:`mfsdp2.base.strategy`.
    """
    modules = _as_modules(module)
    if not (allocator is None or isinstance(allocator, BucketAllocator)
            or allocator in ("caching", "dynamic", "trace_pool")):
        raise ValueError(
            f"mfsdp2 E08: unknown allocator {allocator!r} for {type(modules[0]).__name__}: use 'caching', 'dynamic', "
            "'trace_pool' or a BucketAllocator instance"
        )
    where = type(modules[0]).__name__ if len(modules) == 1 else "[" + ", ".join(type(m).__name__ for m in modules) + "]"
    mp_policy = MixedPrecisionPolicy.coerce(mp_policy, where)
    given = reshard_after_forward is not None
    if reshard_after_forward is None:  # FSDP2: True below the root, False for the root (set at lazy init)
        reshard_after_forward = True
    strategy = ShardingStrategy.parse(sharding_strategy, where)
    mesh = mesh if mesh is not None else _default_mesh()
    if dp_mesh_dims is not None:
        spmd = mesh
        mesh, strategy = _dp_mesh(mesh, dp_mesh_dims, strategy, where)
        _plain_spmd_params(modules, spmd, where)
    topology = Topology.of(mesh.ndim, strategy, where)
    if mesh.get_coordinate() is None:
        raise ValueError("mfsdp2 E06: this rank is not part of the given mesh")
    comm = _communicator(mesh, topology.shard_dim)
    main = main_memory_for(offload_policy, comm.device, where)
    if main is not None and mp_policy.all_gather_dtype is not None:
        raise ValueError(
            f"mfsdp2 E51: all_gather_dtype (FP8 all-gather) with CPUOffloadPolicy for {where} is not supported: "
            "the FP8 scales are agreed and applied on the compute device, the offloaded main weights live "
            "in host memory; drop one of the two (offload_policy, or MixedPrecisionPolicy.all_gather_dtype)"
        )
    replicate = _communicator(mesh, topology.replicate_dim) if topology.replicate_dim is not None else None
    if mp_policy.all_gather_dtype is not None and not strategy.shards_params:
        raise ValueError(
            f"mfsdp2 E37: all_gather_dtype (FP8 all-gather) for {where} needs sharding_strategy="
            f"'optim_grads_params': {strategy.value!r} gathers the weights once per step and keeps them"
        )
    post_forward_comm = None
    partial_k = None  # reshard_after_forward=<int> that keeps blocks of k ranks
    is_int = isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool)
    if is_int and not strategy.shards_params:
        raise ValueError(
            f"mfsdp2 E36: reshard_after_forward={reshard_after_forward} for {where} applies to "
            f"sharding_strategy='optim_grads_params' only; {strategy.value!r} keeps the full weights"
        )
    if is_int:
        k = reshard_after_forward
        if k < 1 or comm.world_size % k:
            raise ValueError(
                f"mfsdp2 E07: reshard_after_forward={k} must be True, False or a divisor of the shard "
                f"group size {comm.world_size} (e.g. the number of ranks per node)"
            )
        # k == world size is a full reshard; k == 1 keeps everything (False), as in FSDP2.
        if k == comm.world_size or k == 1:
            reshard_after_forward = k == comm.world_size
        else:
            partial_k = k
    name = where  # renamed to its path under the root at the first forward
    ignored = {id(p) for p in ignored_params} if ignored_params else set()
    infos, params, specs = _collect(modules, comm.device, mesh, ignored, main)
    # Parameters whose tensor subclass defines FSDP2's all-gather extension (mfsdp2.groups.subclass_params).
    infos, params, sub_infos, sub_params = split_subclass_params(infos, params)
    if main is not None:
        _move_buffers(modules, comm.device)
    fqns = [info[0].fqn for info in infos]
    # Where each parameter is sharded (shard_placement_fn: a dimension, and maybe a mesh of its
    # own, mfsdp2.frontend.param_meshes); its model-parallel spec is checked against that mesh.
    placements = param_meshes.resolve(shard_placement_fn, params, fqns, where, mesh)
    unit_mesh = MeshComms(mesh, topology, comm, replicate)
    meshes = mesh_comms(placements, unit_mesh, strategy, where, _communicator)
    for i, p in enumerate(params):
        if id(p) in specs:
            specs[id(p)] = tp_spec_of(p, meshes[i].mesh, fqns[i], type(modules[0]).__name__)
    dims = shard_dims(param_meshes.answers(params, placements) if shard_placement_fn is not None else None, fqns,
                      params, where, topology.shard_dim is not None)
    if is_int:
        refuse_partial_reshard(k, meshes, where)
    if partial_k is not None:
        post_forward_comm = comm.subgroup(partial_k)  # collective: all ranks create the groups together
    # Tied to a parameter a wrapped child sharded: take it over (for a list, the child must be
    # inside the first module; anything else is refused with advice).
    adopt_shared(modules[0], infos, params)
    if specs and topology.shard_dim is None:
        raise ValueError(
            f"mfsdp2 E41: {where} has tensor-parallel parameters; sharding_strategy='no_shard' cannot "
            "combine with TP here: use a sharding strategy (e.g. 'optim_grads_params')"
        )
    metas = {p.is_meta for p in params}
    if len(metas) > 1:
        raise ValueError(
            f"mfsdp2 E30: {name} mixes parameters on the meta device with materialised ones; build the "
            "whole model under torch.device('meta') (then fully_shard and mfsdp2.materialize) or none of it"
        )
    # One group per (mesh, dtype policy): mfsdp2.frontend.param_grouping.
    by_key = group_indices(params, meshes, fqns, name, mp_policy.all_gather_dtype)
    groups = [
        ParameterGroup(
            name, [infos[i] for i in idx],
            [_tp_local(params[i]) if id(params[i]) in specs else params[i] for i in idx],
            meshes[idx[0]].mesh, meshes[idx[0]].comm, comm.device, mp_policy,
            GroupConfig(strategy, meshes[idx[0]].topology.shard_dim, meshes[idx[0]].replicate, key[3], main,
                        mesh_tag=meshes[idx[0]].tag_within(unit_mesh)),
            tp_specs=[specs.get(id(params[i])) for i in idx], shard_dims=[dims[i] for i in idx],
        )
        for key, idx in by_key.items()
    ]
    state = FSDPState(modules[0], name, mesh, comm, groups, mp_policy, reshard_after_forward, allocator)
    state.post_forward_comm = post_forward_comm
    state.subclass = subclass_unit(
        name, sub_infos, sub_params, mesh, comm, modules[0], mp_policy, shards_params=strategy.shards_params,
        offload=main is not None, hsdp=topology.replicate_dim is not None,
        partial_reshard=post_forward_comm is not None,
        shard_dims=shard_dims(shard_placement_fn, [i[0].fqn for i in sub_infos], sub_params, where,
                              topology.shard_dim is not None) if sub_params else None,
    )
    state.reshard_after_forward_given = given
    state.modules = modules
    state.forward_to_run = {id(m) for m in modules}
    mark_owned(state, [[params[i] for i in idx] for idx in by_key.values()])
    for g in groups:
        g.register(unsharded=False, check=False)  # replaces the user's original parameters

    for m in modules:
        _make_unit_module(m, state)
    protect_compile_caches(comm.world_size)  # torch.compile's shared caches (base/compile_cache.py)
    logger.debug("mfsdp2: %s -> %d groups: %s", name, len(groups), [g.layout.describe() for g in groups])
    return module


def _make_unit_module(module: nn.Module, state: FSDPState) -> None:
    """Swap ``module``'s class to ``FSDP<Cls>`` and hook its forward to ``state``'s unit."""
    cls = type(module)
    if cls not in _class_cache:
        _class_cache[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _class_cache[cls]
    module._mfsdp2_state = state
    register_torch_state(module, state)  # torch's own fully_shard.state(module) finds it
    # The hooks run eagerly even inside a compiled module (``block.compile()`` compiles
    # ``_call_impl``, hooks included): they issue collectives, swap parameters and read host
    # state (graph-task ids, version counters) that dynamo cannot trace. FSDP2's hooks are
    # skipped by dynamo the same way; the module's own forward is still compiled.
    state.forward_hook_handles.append((
        module.register_forward_pre_hook(_EAGER_PRE_FORWARD, prepend=True, with_kwargs=True),
        module.register_forward_hook(_EAGER_POST_FORWARD, always_call=False, with_kwargs=True),
    ))
    register_state_dict_hooks(module)  # state_dict() from / load_state_dict() into the main weights


def _state(module: nn.Module) -> Optional[FSDPState]:
    """FSDP2's ``fully_shard.state(module)``: the unit state ``fully_shard`` attached to
    ``module`` (the same object for every module of a ``fully_shard([a, b])`` unit), or ``None``
    for a module it was not applied to. It answers FSDP2's private state names too
    (:mod:`mfsdp2.runtime.fsdp2_state`)."""
    return unit_state(module)


fully_shard.state = _state
bind_runtime(lazy_init=lazy_init, reduce_accumulated=reduce_accumulated, finish_backward=finish_backward,
             pre_forward=_EAGER_PRE_FORWARD, post_forward=_EAGER_POST_FORWARD)
