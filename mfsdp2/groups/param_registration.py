"""The parameters of a :class:`~mfsdp2.groups.param_group.ParameterGroup` as the modules and the
optimizer see them, and the checks that keep them the group's.

A group makes two ``nn.Parameter`` objects per original parameter: the optimizer-facing DTensor
(this rank's rows of the main weights, placed ``RowShard``; :meth:`~ParameterRegistration.as_dtensor`)
and the unsharded compute parameter (a view of the gathered model weights). :meth:`register`
points every owner module's attribute at one or the other as the unit gathers and reshards.

Why the checks live here: the modules hold these objects, and users act on the ones they see.
Before each use the group refuses what it would otherwise lose silently -- a parameter replaced
after the first forward, ``p.data = new`` on a DTensor (the local tensor every op reads keeps the
old values), a conversion through a module that is not one of the unit's -- and carries over
what users set on the DTensor parameters: ``requires_grad`` and gradient hooks, which autograd
would only ever see on the unsharded parameters.

``ParameterRegistration`` is a mixin over the group's state set up by ``ParameterGroup.__init__``.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn as nn

from ..base import plan_epoch
from ..dtensors.placement import RowShard, data_parallel_dtensor, wrap_local
from ..dtensors.tensor_parallel import tp_dp_mesh, tp_dtensor
from .grad_views import GradViews

__all__ = ["ParameterRegistration"]


class _HookForwarder:
    """An unsharded parameter's gradient hook running its DTensor parameter's hooks (held weakly:
    the forwarder must not keep a dropped parameter alive). See
    :meth:`ParameterRegistration._forward_tensor_hooks`."""

    def __init__(self, dp: nn.Parameter):
        self._dp = weakref.ref(dp)

    def __call__(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        dp = self._dp()
        hooks = dp._backward_hooks if dp is not None else None
        if not hooks:
            return None
        changed = False
        for hook in tuple(hooks.values()):
            out = hook(grad)
            if out is not None:
                grad, changed = out, True
        return grad if changed else None


class ParameterRegistration:
    """The optimizer-facing and the unsharded parameters of a group, and which of them the modules
    hold (mixed into :class:`~mfsdp2.groups.param_group.ParameterGroup`)."""

    def _make_params(self, params: list[nn.Parameter]) -> None:
        views = self.weights.param_views()
        for i, p in enumerate(params):
            local = self.weights.piece_view(self.main_weight, i)
            spec = self.tp_specs[i]
            shape = spec.shape if spec is not None else p.shape  # global, from the DTensor
            dp = nn.Parameter(self.as_dtensor(local, i, shape), requires_grad=p.requires_grad)
            for k, v in p.__dict__.items():  # user tags (no-weight-decay flags, TP metadata, ...)
                if not k.startswith("_mfsdp2"):
                    setattr(dp, k, v)
            if p._backward_hooks:  # gradient hooks registered before fully_shard: the same dict,
                dp._backward_hooks = p._backward_hooks  # so the user's handles still remove them
            self.dist_params.append(dp)
            unsharded = tp_dtensor(views[i], spec) if spec is not None else views[i]
            up = nn.Parameter(unsharded, requires_grad=p.requires_grad)
            self.unsharded_params.append(up)
        self._grad_views = GradViews(len(self.dist_params))

    def as_dtensor(self, local: torch.Tensor, index: int, shape) -> torch.Tensor:
        """This rank's rows of parameter ``index`` as the optimizer-facing DTensor (``shape``:
        global; a TP parameter's lives on the (tp, dp) mesh, see :mod:`mfsdp2.dtensors.tensor_parallel`)."""
        placement = self._row_shards.get(index)
        if placement is None:  # one per parameter: its rows never change (O(world size) to build)
            slot = self.layout.slots[index]
            placement = self._row_shards[index] = RowShard(slot.shard_dim, self.layout.rows_per_rank(index))
        spec = self.tp_specs[index]
        if spec is None:
            return data_parallel_dtensor(local, self.mesh, placement, shape, self.config.shard_dim)
        mesh = tp_dp_mesh(spec.mesh, self.mesh)
        placements = spec.placements + (placement,)
        return wrap_local(local, mesh, placements, spec.shape, spec.stride())  # offloaded: the host rows themselves

    def register(self, unsharded: bool, check: bool = True) -> None:
        """Point every owner module's attribute at the unsharded (compute) or sharded (DTensor) params.

        A parameter shared by several modules of this unit (tied weights) has several owners.
        ``check``: the attribute must still hold one of ours; a parameter the user assigned after
        ``fully_shard`` would otherwise be overwritten here without a word, and never trained.
        """
        dist, full = self.dist_params, self.unsharded_params
        params = full if unsharded else dist
        if unsharded:
            self._check_before_use(check)
        # One flat pass over (place, index): this runs at every gather and reshard of the unit.
        for info, i in self._places():
            slots = info.owner._parameters
            if check:
                cur = slots.get(info.attr)
                if cur is not dist[i] and cur is not full[i]:
                    raise RuntimeError(
                        f"mfsdp2 E14: parameter {info.fqn!r} of unit {self.unit_name!r} was replaced (or deleted) "
                        "after fully_shard and the first forward; the runtime owns it now. Change its values "
                        "in place (with torch.no_grad(): param.copy_(...), or load_state_dict) instead of "
                        "assigning a new Parameter, or assign it before the first forward (a DTensor like "
                        "the parameter, as FSDP2 takes it)"
                    )
            slots[info.attr] = params[i]
        if not unsharded and not check:
            # (Re)built parameters (fully_shard, conversions, regrouping): not every reshard, so
            # an assignment made while the unit was gathered is still caught at its next forward.
            self._record_storages()

    def _places(self) -> tuple:
        """Every ``(ParamInfo, parameter index)`` of the group, flat, in ``infos`` order. Built
        once per ``infos`` list (set when the group is made, never changed in place: a regrouping
        makes a new group); the ``ParamInfo`` objects themselves are read at each use."""
        cached = self.__dict__.get("_places_cache")
        if cached is None or cached[0] is not self.infos:
            cached = (self.infos, tuple((info, i) for i, owners in enumerate(self.infos) for info in owners))
            self._places_cache = cached
        return cached[1]

    def _record_storages(self) -> None:
        """Remember each DTensor parameter's storage and local tensor (see
        :meth:`_refuse_assigned`, :meth:`converted_elsewhere`)."""
        self._dp_storages = [dp.untyped_storage()._cdata for dp in self.dist_params]
        self._dp_locals = [id(dp._local_tensor) for dp in self.dist_params]

    def converted_elsewhere(self, i: int) -> bool:
        """Whether parameter ``i``'s object got new contents behind the group's back: torch's
        ``_apply`` (``.to`` / ``to_empty`` / ``.half()``) run on a module inside the unit that is
        not one of its modules swaps a new DTensor into it (``swap_tensors``), whose local tensor
        is no view of the group's rows."""
        recorded = getattr(self, "_dp_locals", None)
        return recorded is not None and id(self.dist_params[i]._local_tensor) != recorded[i]

    def _check_before_use(self, check: bool) -> None:
        """What every registration of the unsharded parameters checks, per parameter in one
        pass (a unit registers at each gather: one loop over its parameters instead of three):
        the wrapper's storage (:meth:`_refuse_assigned`; ``check``), the ``requires_grad`` flag
        (:meth:`_follow_requires_grad`) and the gradient hooks (:meth:`_forward_tensor_hooks`).
        Each reads an attribute or two; the work runs only where something differs."""
        recorded = self._dp_storages if check else None
        full = self.unsharded_params
        for i, dp in enumerate(self.dist_params):
            if recorded is not None and dp.untyped_storage()._cdata != recorded[i]:
                self._refuse_assigned(i)
            up = full[i]
            if up.requires_grad != dp.requires_grad:
                self._follow_requires_grad(i, dp, up)
            if dp._backward_hooks:
                self._forward_tensor_hooks(i, dp, up)

    def _refuse_assigned(self, i: int) -> None:
        """``p.data = new`` on a DTensor parameter swaps the wrapper's storage but not the local
        tensor every DTensor op reads (``p._local_tensor``, a view of our main weights): the
        assignment is silently lost -- the optimizer, the gathers and ``state_dict`` all keep
        the old values (torch FSDP2 trains them without a word). The wrapper's storage is the
        one thing that changes, so :meth:`_check_before_use` compares it with the one recorded
        when the parameter was last registered (0.3 us per parameter per forward); parameter
        ``i``'s differs: refuse, naming it."""
        if self.converted_elsewhere(i):
            raise RuntimeError(
                f"mfsdp2 E58: parameter {self.infos[i][0].fqn!r} of unit {self.unit_name!r} was converted "
                "(.to / to_empty / .half ...) after the first forward through a module inside the unit "
                "that is not one of the modules passed to fully_shard; its shard keeps the old values. "
                "Convert the unit's module (or the whole model), which converts its shards"
            )
        raise RuntimeError(
            f"mfsdp2 E53: parameter {self.infos[i][0].fqn!r} of unit {self.unit_name!r} had its .data "
            "assigned after fully_shard (p.data = ...); a DTensor parameter ignores that (its "
            "shard keeps the old values, which would be trained and saved). Write the values "
            "in place instead: with torch.no_grad(): p.copy_(new) (or p.data.copy_(new))"
        )

    def _unfreeze(self, i: int) -> None:
        """Parameter ``i`` of a group sharded frozen was made trainable (``requires_grad_(True)``
        after ``fully_shard``: a backbone frozen for the first steps, progressive unfreezing), which
        torch FSDP2 trains from the next backward. The group becomes trainable in place.

        Why that is all it takes: a frozen group differs from a trainable one in its flag and, under
        a policy with ``main_params_dtype`` / ``main_grads_dtype``, in the dtypes of its optimizer
        weights and main gradient (a frozen group keeps the parameters' own). The reduction's state
        is made for every group at init, and the main gradient, the reductions and their buckets at
        the first backward that gives the group gradients; the unit's step plan is rebuilt (the
        caller's epoch bump). Its other parameters stay frozen, as any parameter frozen inside a
        trainable group (they reduce zeros and keep ``grad = None``). Where the dtypes differ the
        optimizer-facing parameter would change dtype under the optimizer that holds it: refused."""
        if self.trainable_dtypes != (self.main_dtype, self.grad_dtype):
            main, grad = self.trainable_dtypes
            raise RuntimeError(
                f"mfsdp2 E101: parameter {self.infos[i][0].fqn!r} of unit {self.unit_name!r} was made trainable "
                "(requires_grad_(True)) after fully_shard, but it was sharded frozen in "
                f"{str(self.main_dtype).replace('torch.', '')} and a trainable one keeps "
                f"{str(main).replace('torch.', '')} main weights ({str(grad).replace('torch.', '')} gradients) "
                "under this MixedPrecisionPolicy's main_params_dtype / main_grads_dtype; call "
                "requires_grad_(True) before fully_shard (freezing after it is fine), or pass "
                "MixedPrecisionPolicy(main_params_dtype=None) to keep the parameters' own dtype"
            )
        self.requires_grad = True

    def _forward_tensor_hooks(self, i: int, dp: nn.Parameter, up: nn.Parameter) -> None:
        """Make the gradient hooks users register on the parameters they see
        (``p.register_hook(lambda g: g * mask)``: masking rows of an embedding, scaling, clipping)
        run. Autograd computes the gradient of the unsharded parameter, never of the DTensor one,
        so a hook on the DTensor is never called -- under torch FSDP2 too, silently.

        A parameter with hooks (``dp``, parameter ``i``) gets one forwarding hook on its
        unsharded parameter ``up``, which runs the DTensor parameter's current hooks (added or
        removed since included) on the unsharded gradient of each backward, before the
        reduction: what the hooks see and do is what they see and do in single-process or DDP
        code (a full-shape plain tensor, this rank's gradient), and hooks that are linear in the
        gradient (masks, scales) give exactly the unsharded model's result."""
        if self._hooks_forwarded_to.get(i) is up or not up.requires_grad:
            return
        up.register_hook(_HookForwarder(dp))
        self._hooks_forwarded_to[i] = up

    def _follow_requires_grad(self, i: int, dp: nn.Parameter, up: nn.Parameter) -> None:
        """The module computes with the unsharded parameters, but users freeze (or unfreeze) the
        ones they see, the DTensors (``block.requires_grad_(False)`` after ``fully_shard``, as with
        FSDP2). Parameter ``i``'s flags differ: copy the DTensor's over before the use, or a
        frozen layer would still get gradients and the optimizer would keep training it."""
        if dp.requires_grad and not self.requires_grad:
            self._unfreeze(i)
        up.requires_grad_(dp.requires_grad)
        # Which groups reduce is part of the unit's step plan (mfsdp2.runtime.step_plan).
        plan_epoch.bump(plan_epoch.PlanChange.REQUIRES_GRAD)
