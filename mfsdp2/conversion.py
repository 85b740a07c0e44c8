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
  into the main-weight shard (a no-op when ``fn`` returned the same memory);
* new dtype (``model.to(torch.float64)``, ``.half()``): the group is rebuilt for the new dtype on
  the *same* layout (so every rank keeps its rows; the layout's alignment was planned for the old
  dtype, which only matters for speed), the converted rows are copied in, and each DTensor
  parameter object gets the new group's contents through ``swap_tensors`` so its identity (held by
  an optimizer, by user code) is kept; converted gradients move into the new main gradient.

The DTensor parameter objects registered on the modules are never replaced. A device other than
the mesh's (or, under ``CPUOffloadPolicy``, the CPU where the main shards live) is refused.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn as nn

from .state import ShardState, TrainingState

__all__ = ["apply_to_unit"]

logger = logging.getLogger(__name__)


def _check_idle(state) -> None:
    busy = state.training_state is not TrainingState.IDLE or any(g.reduce_pending or g.partial is not None for g in state.groups)
    if busy or (state.ctx is not None and state.ctx.callback_queued):
        raise RuntimeError(
            f"mfsdp2: module conversion (.to / to_empty / _apply) of unit {state.name!r} during a training "
            "step; convert the model before training or between steps (after backward and optimizer.step)"
        )


def apply_to_unit(module: nn.Module, fn: Callable, recurse: bool, super_apply: Callable) -> nn.Module:
    """``module._apply(fn, recurse)`` for an FSDP unit; ``super_apply`` is ``nn.Module._apply``
    bound to it (nested units run their own :func:`apply_to_unit` through the recursion)."""
    from .hooks import reshard

    state = module._mfsdp2_state
    _check_idle(state)
    if state.shard_state is not ShardState.SHARDED:
        reshard(state)  # the sharded parameters are the registered ones, as in FSDP2
    locals_: list[list[nn.Parameter]] = []
    for g in state.groups:
        row = []
        for i, dp in enumerate(g.dist_params):
            lp = nn.Parameter(dp._local_tensor, requires_grad=dp.requires_grad)
            if dp.grad is not None:
                lp.grad = dp.grad._local_tensor
            for info in g.infos[i]:
                info.owner._parameters[info.attr] = lp
            row.append(lp)
        locals_.append(row)
    try:
        out = super_apply(fn, recurse)
        # Read what _apply left on the (first) owner: with overwrite-on-conversion it registers a
        # new Parameter instead of changing ours.
        converted = [
            [g.infos[i][0].owner._parameters[g.infos[i][0].attr] for i in range(len(g.dist_params))] for g in state.groups
        ]
    finally:
        for g in state.groups:
            g.register(unsharded=False, check=False)
    for gi, g in enumerate(list(state.groups)):
        values = [p.detach() for p in converted[gi]]
        grads = [p.grad.detach() if p.grad is not None else None for p in converted[gi]]
        new = _adopt(state, g, values, grads)
        if new is not g:
            state.groups[gi] = new
            new.register(unsharded=False, check=False)
    return out


@torch.no_grad()
def _adopt(state, g, values: list[torch.Tensor], grads: list) -> "object":
    """Make group ``g`` hold ``values`` (this rank's converted rows); returns the group to keep."""
    dtypes = {v.dtype for v in values}
    devices = {v.device for v in values}
    if len(dtypes) != 1 or len(devices) != 1:
        raise RuntimeError(f"mfsdp2: the conversion gave the parameters of {g.name} different dtypes/devices {dtypes} {devices}")
    dtype, device = dtypes.pop(), devices.pop()
    if device.type == "meta":
        if g.allocated:
            raise ValueError(f"mfsdp2: cannot move the shards of {g.name} to the meta device after fully_shard")
        # Still on meta (a meta-built model converted before its init, e.g. .to(float64)):
        # stays there, as FSDP2's does; only the dtype changes.
        return g if dtype == g.orig_dtype else _rebuilt(state, g, dtype)
    # The values are copied into the main shards wherever they live: the mesh's device, or the
    # CPU under CPUOffloadPolicy, which also accepts the mesh's device (FSDP2's pinned offload
    # moves such parameters back to the CPU too).
    if not any(device == d or device.type == d.type == "cpu" for d in (g.device, g.main.device)):
        raise ValueError(
            f"mfsdp2: unit {state.name!r} keeps its shards on {g.main.device} (computes on {g.device}); "
            f"converting it to {device} after fully_shard is not supported: move the module (or build it) "
            f"on {g.device} before fully_shard, or use model.to_empty(device=<the mesh's device>)"
        )
    if dtype == g.orig_dtype:
        target = g
    else:
        target = _rebuilt(state, g, dtype)
    target.allocate()  # a meta-built group gets its memory here (FSDP2's to_empty recipe)
    for i, v in enumerate(values):
        piece = target.weights.piece_view(target.main_weight, i)
        if not _same_memory(piece, v):
            piece.copy_(v.reshape(piece.shape))
    target.needs_init = False
    target.mark_changed()  # the values were written behind the version counters: re-gather
    if target is not g:
        _move_grads(g, target, grads)
    elif g.main_grad is not None:
        for i, (dp, gr) in enumerate(zip(g.dist_params, grads)):
            if gr is not None and dp.grad is not None and not _same_memory(dp.grad._local_tensor, gr):
                dp.grad._local_tensor.copy_(gr)
    logger.debug("mfsdp2: %s adopted converted parameters (%s on %s)", target.name, dtype, device)
    return target


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == 0 or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype)


def _rebuilt(state, g, dtype: torch.dtype):
    """A new group like ``g`` for parameters of ``dtype``, on ``g``'s layout, whose DTensor
    parameter objects are ``g``'s (contents swapped in, identity and user attributes kept)."""
    from .param_group import ParameterGroup, swap_param

    shapes = [g.layout.slots[i].shape for i in range(len(g.dist_params))]
    metas = [nn.Parameter(torch.empty(s, dtype=dtype, device="meta"), requires_grad=g.requires_grad) for s in shapes]
    new = ParameterGroup(
        g.unit_name, g.infos, metas, g.mesh, g.comm, g.device, state.mp, g.config, tp_specs=g.tp_specs, layout=g.layout
    )
    new.divide_factor = g.divide_factor
    new.requires_all_reduce = g.requires_all_reduce
    for i, (old_dp, new_dp) in enumerate(zip(g.dist_params, new.dist_params)):
        swap_param(old_dp, new_dp)  # drops old_dp.grad: grads are moved after
        new.dist_params[i] = old_dp
    return new


def _move_grads(old, new, grads: list) -> None:
    """Converted gradients go into ``new``'s main gradient; ``old``'s is given back."""
    had = old.main_grad is not None
    alloc = old.drop_main_grad()  # None for an offloaded group's host main grad
    if not had or all(gr is None for gr in grads):
        return
    new._ensure_main_grad(alloc, zero=True)
    for i, (dp, gr) in enumerate(zip(new.dist_params, grads)):
        if gr is None or new.layout.piece(i, new.rank).numel == 0:
            continue
        local = new.weights.piece_view(new.main_grad, i)
        local.copy_(gr.reshape(local.shape))
        dp.grad = new.grad_view(local, i, dp.shape)
