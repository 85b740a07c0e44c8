"""``nn.Module._apply`` conversions after ``fully_shard``: ``to_empty``, ``.to(device/dtype)``,
``.double()``, ``.float()``, ``.half()``, ``.cuda()``.

Why this exists: torch's ``_apply`` replaces every parameter's *contents* (``swap_tensors`` for a
DTensor). Our optimizer-facing DTensor parameters are views into a group's main-weight shard, so
after a plain ``_apply`` they would point at fresh tensors no unshard ever reads: FSDP2's meta-init
recipe (build on meta, ``fully_shard``, ``model.to_empty(device=...)``, ``reset_parameters()``)
would initialise and train orphans while the model computes with the old, never-updated shards.
And DTensor's own conversion of a ``RowShard`` tensor goes through sharding propagation, which
knows only ``torch.chunk`` splits.

What we do instead (torch FSDP2 re-points its sharded parameters after ``_apply``; ours is built
around our groups): :func:`apply_to_unit` runs torch's ``_apply`` with each own parameter
registered as a *plain* parameter over this rank's rows (the local tensor, and the local rows of
``.grad``), so ``fn`` converts local tensors only -- no DTensor dispatch, no collective. Then each
group adopts the results:

* same dtype (``to_empty`` on the mesh's device, ``.to(same)``): the converted rows are copied
  into the main-weight shard (a no-op when ``fn`` returned the same memory). Which dtype the
  conversion asks for is what ``fn`` makes of the model's own dtype (probed on an empty tensor),
  not of the dtype the parameters show -- the main weights', fp32 for a bf16 model by default:
  ``to_empty`` of a bf16 model keeps a bf16 model (it used to rebuild it as an fp32 one, which
  then computed in fp32), while ``.float()`` of it still makes an fp32 one;
* new dtype (``model.to(torch.float64)``, ``.half()``): the group is rebuilt for the new dtype on
  the *same* layout (so every rank keeps its rows; the layout's alignment was planned for the old
  dtype, which only matters for speed), the converted rows are copied in, and each DTensor
  parameter object gets the new group's contents through ``swap_tensors`` so its identity (held by
  an optimizer, by user code) is kept; converted gradients move into the new main gradient.

* part of a group: ``fn`` reaches only the parameters registered under the module it was called
  on -- one module of a unit of several (``model.to_empty`` meets ``fully_shard([norm, output])``
  once per module), or a sub-module converted alone (``model.norm.to_empty(...)``). Those values
  are staged: written in place when they fit the group, else held by their parameter objects
  until the rest of the group agrees, then taken in (:mod:`mfsdp2.runtime.param_adoption`). A group left
  with parameters on the meta device, or in two dtypes, is refused at its next gather, naming
  them, as FSDP2 refuses them.

The DTensor parameter objects registered on the modules are never replaced. A device other than
the mesh's (or, under ``CPUOffloadPolicy``, the CPU where the main shards live) is refused.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn as nn

from ..base import plan_epoch
from ..runtime.param_adoption import (
    adopt_replaced, asked_dtype, check_device, probe_dtype, put_grads, rebuilt, same_memory, settle, stage,
)
from ..runtime.state import ShardState, TrainingState

__all__ = ["apply_to_unit"]

logger = logging.getLogger(__name__)


def _check_idle(state) -> None:
    busy = state.training_state is not TrainingState.IDLE or any(
        g.reduce_pending or g.partial is not None for g in state.groups)
    if busy or (state.ctx is not None and state.ctx.callback_queued):
        raise RuntimeError(
            f"mfsdp2: module conversion (.to / to_empty / _apply) of unit {state.name!r} during a training "
            "step; convert the model before training or between steps (after backward and optimizer.step)"
        )


def apply_to_unit(module: nn.Module, fn: Callable, recurse: bool, super_apply: Callable) -> nn.Module:
    """``module._apply(fn, recurse)`` for an FSDP unit; ``super_apply`` is ``nn.Module._apply``
    bound to it (nested units run their own :func:`apply_to_unit` through the recursion).

    Only the parameters ``fn`` reaches are converted: those registered on ``module`` (and, with
    ``recurse``, on its subtree). A unit of several modules (``fully_shard([norm, output])``) is
    met once per module, so a conversion may reach part of a group; those values are staged
    (:func:`mfsdp2.runtime.param_adoption.stage`) and the group takes them in once its parameters agree."""
    from ..runtime.unshard import reshard

    state = module._mfsdp2_state
    _check_idle(state)
    if state.shard_state is not ShardState.SHARDED:
        reshard(state)  # the sharded parameters are the registered ones, as in FSDP2
    # A parameter assigned since fully_shard is converted as the new one (FSDP2 converts the
    # registered object too); after the first forward that assignment is refused instead.
    adopt_replaced(state)
    reached = {id(m) for m in module.modules()} if recurse else {id(module)}
    touched: list[tuple] = []  # (group, index, the owner fn reaches it through)
    for g in state.groups:
        for i, owners in enumerate(g.infos):
            info = next((o for o in owners if id(o.owner) in reached), None)
            if info is None:
                continue
            dp = g.dist_params[i]
            lp = nn.Parameter(dp._local_tensor, requires_grad=dp.requires_grad)
            if dp.grad is not None:
                lp.grad = dp.grad._local_tensor
            for o in owners:
                o.owner._parameters[o.attr] = lp
            touched.append((g, i, info))
    try:
        out = super_apply(fn, recurse)
        # Read what _apply left on the owner it went through: with overwrite-on-conversion it
        # registers a new Parameter instead of changing ours.
        converted = [info.owner._parameters[info.attr] for _, _, info in touched]
    finally:
        for g in state.groups:
            g.register(unsharded=False, check=False)
    per_group: dict[int, list] = {}
    for (g, i, _), p in zip(touched, converted):
        per_group.setdefault(id(g), []).append((i, p.detach(), p.grad.detach() if p.grad is not None else None))
    probes: dict = {}

    def asked(g, i: int, value: torch.Tensor) -> torch.dtype:
        """The original dtype the conversion asks for: what fn makes of the parameter's own one
        (the parameters show the main weights' dtype, which may not be the model's)."""
        src = g.pending.get(i, g.orig_dtype)
        if src not in probes:
            probes[src] = probe_dtype(fn, src)
        return probes[src] or asked_dtype(g, value.dtype)

    for gi, g in enumerate(list(state.groups)):
        items = per_group.get(id(g))
        if not items:
            continue
        if len(items) == len(g.dist_params) and not g.pending:
            items.sort(key=lambda t: t[0])
            new = _adopt(state, g, [v for _, v, _ in items], [gr for _, _, gr in items], asked(g, 0, items[0][1]))
        else:  # part of the group (one module of several, or a sub-module only)
            for i, v, gr in items:
                stage(state, g, i, v, gr, asked(g, i, v))
            new = settle(state, g)
        if new is not g:
            state.groups[gi] = new
            plan_epoch.bump(plan_epoch.PlanChange.PARAMETERS)
        new.register(unsharded=False, check=False)  # storages changed: record them again
    state.unsettled = any(g.pending for g in state.groups)
    return out


@torch.no_grad()
def _adopt(state, g, values: list[torch.Tensor], grads: list, dtype: torch.dtype) -> "object":
    """Make group ``g`` hold ``values`` (this rank's converted rows of every one of its
    parameters), as parameters of original dtype ``dtype``; returns the group to keep."""
    dtypes = {v.dtype for v in values}
    devices = {v.device for v in values}
    if len(dtypes) != 1 or len(devices) != 1:
        raise RuntimeError(f"mfsdp2: the conversion gave the parameters of {g.name} different dtypes/devices "
                           f"{dtypes} {devices}")
    device = devices.pop()
    same = dtype == g.orig_dtype
    if device.type == "meta":
        if g.allocated:
            raise ValueError(f"mfsdp2: cannot move the shards of {g.name} to the meta device after fully_shard")
        # Still on meta (a meta-built model converted before its init, e.g. .to(float64)):
        # stays there, as FSDP2's does; only the dtype changes.
        return g if same else rebuilt(state, g, dtype)
    check_device(state, g, device)
    target = g if same else rebuilt(state, g, dtype)
    target.allocate()  # a meta-built group gets its memory here (FSDP2's to_empty recipe)
    for i, v in enumerate(values):
        piece = target.weights.piece_view(target.main_weight, i)
        if not same_memory(piece, v):
            piece.copy_(v.reshape(piece.shape))
    target.needs_init = False
    target.mark_changed()  # the values were written behind the version counters: re-gather
    if target is not g:
        # Converted gradients go into the new main gradient when the old group had one (from its
        # allocator), else stay on their parameters, as the user's own gradients would.
        put_grads(target, {i: gr for i, gr in enumerate(grads) if gr is not None}, g.drop_main_grad())
    else:
        for i, (dp, gr) in enumerate(zip(g.dist_params, grads)):
            if gr is not None and dp.grad is not None and not same_memory(dp.grad._local_tensor, gr):
                dp.grad._local_tensor.copy_(gr.reshape(dp.grad._local_tensor.shape))
    logger.debug("mfsdp2: %s adopted converted parameters (%s on %s)", target.name, dtype, device)
    return target
