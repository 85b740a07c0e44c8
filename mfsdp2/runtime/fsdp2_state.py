"""FSDP2's names for a unit's state: what ``fully_shard.state(module)`` returns answers them.

torch FSDP2 exposes its per-module state object as ``fully_shard.state(module)`` (a function
attribute set by its ``@contract`` decorator; ``None`` for a module ``fully_shard`` was not applied
to), and code written for FSDP2 -- torch's own tests, debugging and memory tools, trainers that
peek at the parameter groups -- reads a handful of its *private* attributes. mfsdp2's
``fully_shard.state(module)`` returns mfsdp2's own :class:`~mfsdp2.runtime.state.FSDPState`; this mixin
gives it those names, each answered from mfsdp2's state with FSDP2's meaning:

======================================  ===========================================================
FSDP2 name                              mfsdp2's answer
======================================  ===========================================================
``_modules``                            the unit's modules (one, or those of ``fully_shard([a, b])``)
``_device``, ``_mp_policy``             the compute device, the unit's ``MixedPrecisionPolicy``
``_is_root``                            ``None`` before lazy init, then whether it is the root
``_lazy_init()``                        makes it the root of its subtree (what its first forward does)
``_state_ctx.all_states``               the units under its root, pre-order (``[]`` before lazy init)
``_training_state``                     torch FSDP2's ``TrainingState`` member of the same name
``_pre_forward_hook_handle`` /          the handles of the unit's forward hooks (one
``_post_forward_hook_handle``           ``_MultiHandle`` for a multi-module unit, as in FSDP2)
``_fsdp_param_groups``                  ``[one group view]`` (``[]`` for a unit without parameters)
``_fsdp_param_group``                   that view, or ``None``
======================================  ===========================================================

A *group view* is the unit's parameters as one FSDP2 parameter group, whatever number of
mfsdp2 :class:`~mfsdp2.groups.param_group.ParameterGroup` s (one per dtype / ``requires_grad``) hold
them: FSDP2 keeps one group per unit, so code reading ``_fsdp_param_group`` would otherwise meet
several where FSDP2 has one. It has ``fsdp_params`` (per parameter: ``sharded_param`` -- the
optimizer-facing DTensor parameter object itself --, ``_param_fqn`` from the root, ``_orig_size``,
``sharded_size``, ``fsdp_placement``, ``unsharded_param`` / ``_unsharded_param`` and
``all_gather_outputs``, whose storages hold 0 bytes while the unit is resharded, as FSDP2's do),
``_module_fqn``, ``mesh_info`` (``mesh``, ``shard_mesh_size``, ``shard_mesh_rank``,
``shard_process_group``, ``replicate_mesh_size``), ``_training_state``, ``is_sharded`` and
``is_unsharded``. mfsdp2's own groups stay at ``state.groups``.

Calls that drive the runtime: ``_pre_forward`` / ``_post_forward`` (what torch's
``register_fsdp_forward_method`` wraps a method in) run the unit's forward hooks, and the two
calls torch's pipeline stages make at the schedule's REDUCE_GRAD
action: a group view's ``post_backward()`` reduces the unit's gradients accumulated with gradient
sync off (:func:`mfsdp2.runtime.external_backward.reduce_accumulated`), and the state's
``_root_post_backward_final_callback()`` finishes every reduction under the root and reshards
(:func:`mfsdp2.runtime.external_backward.finish_backward`), so torch's own ``PipelineStage`` reduces an mfsdp2
stage once per step, as it does an FSDP2 one.

``_comm_ctx`` is a token naming the unit's streams: torch's ``share_comm_ctx`` reads one root's
and assigns it to the others', which makes their collectives use those streams.

Not provided (reading them raises ``AttributeError``): the rest of what drives FSDP2's machinery --
``post_forward_mesh_info``, padded sizes and all-gather input buffers.
Writing them would change nothing in mfsdp2, so they are absent rather than silently ignored.

The actions live above this file in the import order; ``fully_shard`` passes them in
(:func:`bind_runtime`), as ``RootContext`` is passed its schedule.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.autograd.graph import _MultiHandle

try:  # FSDP2's enum, so ``state._training_state == TrainingState.IDLE`` reads as under FSDP2
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState as _TorchTrainingState
except ImportError:  # pragma: no cover - a torch without FSDP2's module layout
    _TorchTrainingState = None

__all__ = ["FSDP2StateNames", "ParamGroupView", "ParamView", "bind_runtime"]

logger = logging.getLogger(__name__)

_RUNTIME: dict[str, Callable] = {}


def bind_runtime(**actions: Callable) -> None:
    """Called with the runtime's actions: by :mod:`mfsdp2.frontend.fully_shard` (``lazy_init``,
    ``reduce_accumulated``, ``finish_backward``, ``pre_forward``, ``post_forward``) and by
    :mod:`mfsdp2.runtime.backward` (``pre_backward``, ``post_backward``, ``in_backward``)."""
    _RUNTIME.update(actions)


def _fsdp2_training_state(ours):
    if _TorchTrainingState is None:
        return ours
    return getattr(_TorchTrainingState, ours.name, ours)


class _StateContext:
    """FSDP2's ``FSDPStateContext`` fields, read from the root's context."""

    def __init__(self, state):
        ctx = state.ctx
        self.all_states = list(ctx.states) if ctx is not None else []
        self.is_last_backward = ctx.root.is_last_backward if ctx is not None else True
        self.post_optim_event = ctx.post_optim_event if ctx is not None else None
        self.iter_forward_root = ctx.root if ctx is not None else None

    def __repr__(self) -> str:
        return f"_StateContext({len(self.all_states)} states)"


class _MeshInfo:
    """FSDP2's ``FSDPMeshInfo`` fields of a group's mesh (the unit's, or a parameter's own from
    ``shard_placement_fn``)."""

    def __init__(self, state, group):
        self.mesh = group.mesh
        self.shard_mesh_dim = group.config.shard_dim
        self.shard_mesh_size = group.comm.world_size
        self.shard_mesh_rank = group.comm.rank
        self.shard_process_group = group.comm.group
        self.replicate_mesh_size = group.replicate_comm.world_size if group.replicate_comm is not None else 1
        self.replicate_mesh_dim = None if group.mesh.ndim == 1 else 0


class _ModuleInfo:
    """FSDP2's ``ParamModuleInfo``: where the parameter is registered (first owner, then the others)."""

    def __init__(self, owners):
        self.module = owners[0].owner
        self.param_name = owners[0].attr
        self.shared_modules = [o.owner for o in owners[1:]]
        self.shared_param_names = [o.attr for o in owners[1:]]


class ParamView:
    """One parameter of a unit, with FSDP2's ``FSDPParam`` attribute names."""

    def __init__(self, state, group, index: int):
        self._state, self._group, self._index = state, group, index

    @property
    def sharded_param(self) -> nn.Parameter:
        return self._group.dist_params[self._index]

    @property
    def _sharded_param_data(self):
        return self.sharded_param._local_tensor

    @property
    def unsharded_param(self) -> nn.Parameter:
        return self._group.unsharded_params[self._index]

    _unsharded_param = unsharded_param

    @property
    def all_gather_outputs(self) -> list:
        return [self.unsharded_param.data]

    @property
    def _orig_size(self):
        """The size ``fully_shard`` sharded: a tensor-parallel parameter's TP-local size, as FSDP2's."""
        return torch.Size(self._group.layout.slots[self._index].shape)

    @property
    def sharded_size(self):
        return self.sharded_param._local_tensor.shape

    @property
    def fsdp_placement(self):
        """The data-parallel placement: on the shard dimension of the group's mesh, or the last of a
        tensor-parallel parameter's ``(tp, dp)`` placements (its first is the TP placement)."""
        if self._group.tp_specs[self._index] is not None:
            return self.sharded_param.placements[-1]
        return self.sharded_param.placements[self._group.config.shard_dim or 0]

    @property
    def mesh_info(self) -> _MeshInfo:
        return _MeshInfo(self._state, self._group)

    @property
    def _module_info(self) -> _ModuleInfo:
        return _ModuleInfo(self._group.infos[self._index])

    @property
    def _param_fqn(self) -> Optional[str]:
        """The name from the root module (FSDP2 sets it at lazy init: ``None`` before)."""
        ctx = self._state.ctx
        if ctx is None:
            return None
        info = self._group.infos[self._index][0]
        for path, m in ctx.root.module.named_modules():
            if m is info.owner:
                return f"{path}.{info.attr}" if path else info.attr
        return None

    def __repr__(self) -> str:
        return f"ParamView(fqn={self._param_fqn}, orig_size={tuple(self._orig_size)})"


class ParamGroupView:
    """A unit's parameters as one FSDP2 ``FSDPParamGroup`` (see the module docstring)."""

    def __init__(self, state):
        self._state = state

    @property
    def fsdp_params(self) -> list[ParamView]:
        return [ParamView(self._state, g, i) for g in self._state.groups for i in range(len(g.dist_params))]

    @property
    def _module_fqn(self) -> Optional[str]:
        """The unit's module paths from the root, joined by ``", "`` (FSDP2's form for a
        multi-module unit); ``None`` before lazy init."""
        ctx = self._state.ctx
        if ctx is None:
            return None
        paths = {id(m): path for path, m in ctx.root.module.named_modules()}
        return ", ".join(paths.get(id(m), "?") for m in self._state.modules)

    @property
    def mesh_info(self) -> _MeshInfo:
        return _MeshInfo(self._state, self._state.groups[0])

    @property
    def _training_state(self):
        return _fsdp2_training_state(self._state.training_state)

    @property
    def is_sharded(self) -> bool:
        return self._state.shard_state.name == "SHARDED"

    @property
    def is_unsharded(self) -> bool:
        return self._state.shard_state.name == "UNSHARDED"

    def pre_backward(self, *unused: Any) -> None:
        """FSDP2's: the unit's pre-backward (gather, prefetch). The runtime calls the unit's through
        this method once code has replaced it on the view (torch's ``FSDPMemTracker`` wraps it to
        take memory snapshots), so the replacement sees every call, as on FSDP2."""
        _RUNTIME["pre_backward"](self._state)

    def post_backward(self, *unused: Any) -> None:
        """FSDP2's. Inside a backward: the unit's post-backward (reshard, reduce), which the runtime
        calls through this method once code has replaced it on the view (as :meth:`pre_backward`).
        Outside one: reduce the gradients the unit accumulated with gradient sync off, now (torch's
        pipeline stages call it at REDUCE_GRAD, then the root's final callback)."""
        if _RUNTIME["in_backward"]():
            _RUNTIME["post_backward"](self._state)
        else:
            _RUNTIME["reduce_accumulated"](self._state)

    def __repr__(self) -> str:
        return f"ParamGroupView({self._state.name!r}, {len(self.fsdp_params)} params)"


class CommContext:
    """FSDP2's ``_comm_ctx``, as far as code outside FSDP2 uses it: a token naming the streams of
    one communicator, handed from one root's state to another's (torch's ``share_comm_ctx``)."""

    def __init__(self, comm) -> None:
        self.comm = comm


class FSDP2StateNames:
    """Mixin of :class:`mfsdp2.runtime.state.FSDPState`: FSDP2's private state names (module docstring)."""

    @property
    def _modules(self) -> tuple:
        return tuple(self.modules)

    @property
    def _device(self):
        return self.comm.device

    @property
    def _mp_policy(self):
        return self.mp

    @property
    def _is_root(self) -> Optional[bool]:
        return None if self.ctx is None else self.ctx.root is self

    @property
    def _training_state(self):
        return _fsdp2_training_state(self.training_state)

    @property
    def _state_ctx(self) -> _StateContext:
        return _StateContext(self)

    @property
    def _fsdp_param_groups(self) -> list[ParamGroupView]:
        return [self.group_view()] if any(g.dist_params for g in self.groups) else []

    @property
    def _fsdp_param_group(self) -> Optional[ParamGroupView]:
        groups = self._fsdp_param_groups
        return groups[0] if groups else None

    def group_view(self) -> ParamGroupView:
        """The unit's one group view, made once: attributes code sets on it (a method wrapped by
        torch's ``FSDPMemTracker``) stay, as on FSDP2's group object."""
        if self.fsdp2_view is None:
            self.fsdp2_view = ParamGroupView(self)
        return self.fsdp2_view

    def patched_view(self) -> Optional[ParamGroupView]:
        """The group view if code replaced its ``pre_backward`` / ``post_backward`` (the runtime
        then calls the unit's backward hooks through it), else None."""
        view = self.fsdp2_view
        if view is not None and ("pre_backward" in view.__dict__ or "post_backward" in view.__dict__):
            return view
        return None

    @property
    def _pre_forward_hook_handle(self):
        return self._hook_handle(0)

    @_pre_forward_hook_handle.setter
    def _pre_forward_hook_handle(self, handle) -> None:
        self._set_hook_handle(0, handle)

    @property
    def _post_forward_hook_handle(self):
        return self._hook_handle(1)

    @_post_forward_hook_handle.setter
    def _post_forward_hook_handle(self, handle) -> None:
        self._set_hook_handle(1, handle)

    def _set_hook_handle(self, which: int, handle) -> None:
        """FSDP2's handles are plain attributes that tools replace after removing the hooks and
        registering their own (torch's ``FSDPMemTracker`` wraps ``_pre_forward`` /
        ``_post_forward`` so): the new handle stands for the unit's hook from now on."""
        self.hooks_taken_over = True  # the tool's hooks must see every call (runtime.quiet_units)
        pairs = self.forward_hook_handles or [(None, None)]
        first = list(pairs[0])
        first[which] = handle
        self.forward_hook_handles = [tuple(first)] + [p for p in pairs[1:]]

    def _hook_handle(self, which: int):
        """FSDP2's: a module's own handle, or one ``_MultiHandle`` of every hook of a multi-module unit."""
        handles = self.forward_hook_handles
        if len(handles) == 1:
            return handles[0][which]
        return _MultiHandle(tuple(h for pair in handles for h in pair))

    @property
    def _comm_ctx(self) -> "CommContext":
        """FSDP2's per-root streams; torch's ``share_comm_ctx`` reads the first root's and assigns
        it to the others'."""
        return CommContext(self.comm)

    @_comm_ctx.setter
    def _comm_ctx(self, ctx: "CommContext") -> None:
        """Issue the collectives of this unit and of every unit inside it on ``ctx``'s streams
        (torch's ``share_comm_ctx``, which sets the roots' contexts: FSDP2's is per root)."""
        states = {id(sub._mfsdp2_state): sub._mfsdp2_state for m in self.modules for sub in m.modules()
                  if getattr(sub, "_mfsdp2_state", None) is not None}
        for state in states.values():
            for comm in state.communicators():
                base = getattr(comm, "base", comm)  # a user's custom collectives wrap the communicator
                if base.device == ctx.comm.device and base is not ctx.comm:
                    base.share_streams(ctx.comm)

    def communicators(self) -> list:
        """Every communicator the unit's collectives go through (each once)."""
        found = {id(c): c for g in self.groups for c in (g.comm, g.replicate_comm, g.weights.comm) if c is not None}
        found.setdefault(id(self.comm), self.comm)
        return list(found.values())

    def _root_post_backward_final_callback(self) -> None:
        """FSDP2's end of a backward, which torch's pipeline stages call at REDUCE_GRAD after each
        group's ``post_backward()``: finish every reduction under this unit's root, expose the
        gradients, reshard per the units' flags. Nothing to do before the first forward."""
        if self.ctx is not None:
            _RUNTIME["finish_backward"](self.ctx)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        """FSDP2's pre-forward of ``module`` (one of the unit's modules): gather, cast the inputs;
        returns ``(args, kwargs)``. torch's ``register_fsdp_forward_method`` calls it around a
        method other than ``forward`` (e.g. ``generate``)."""
        return _RUNTIME["pre_forward"](module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """FSDP2's post-forward: reshard (per the unit's flags), cast the output, hook the backward.
        FSDP2's signature has no keyword arguments; mfsdp2's post-forward reads none (the inputs,
        keyword ones included, were threaded for the backward by :meth:`_pre_forward`)."""
        return _RUNTIME["post_forward"](module, args, {}, output)

    def _lazy_init(self) -> None:
        """Make this unit the root of its subtree now (FSDP2's ``_lazy_init``; the first forward
        does it otherwise)."""
        _RUNTIME["lazy_init"](self)
