"""``FSDPMemTracker``: torch's FSDP2 memory tracker, counting mfsdp2's buffers once and by role.

torch's ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` runs on mfsdp2 units (they
answer the FSDP2 names it instruments, :mod:`mfsdp2.runtime.fsdp2_state`), but it attributes
memory by *storage object* and by *when* a storage first appears in an op, and two of mfsdp2's
choices defeat that:

* **zero copy** (:mod:`mfsdp2.memory.buffer`): a unit's gathered storage is a non-owning alias of
  an allocator block. The tracker counts the block when it is created (as an activation or a
  temporary) and the alias again as the all-gather's output. Worse, a reshard points the alias
  at 0 bytes with ``_swap_data_ptr_``, which the tracker cannot see (it only follows
  ``UntypedStorage.resize_``), so every unit it ever saw gathered stays counted until the alias
  shows up in an op again;
* **buffers served by mfsdp2's allocator**: the flat gradient (the reduction's input), gloo's
  point-to-point reduce-scatter scratch and the main gradients are made inside the allocator, so
  the tracker files them by the phase they were made in (temporaries), and what the allocator or
  the runtime held before the tracker was entered (main weights in another dtype, main gradients
  until the next forward, cached blocks) is not counted at all.

This subclass keeps torch's class -- its constructor, methods, hooks, snapshots and
categories -- and changes what it counts, as :class:`~mfsdp2.memory.memory_bound.StepMemoryTracker`
does: gathered aliases are never counted (their bytes are the block's), every allocator block is
filed by the role of the buffer it serves (told by the allocator, :class:`AllocationObserver`),
and everything mfsdp2 holds is registered on entry (:func:`~mfsdp2.memory.memory_bound.mfsdp2_held`).
So its total counts the same storages as ``StepMemoryTracker`` at the same moments (every op):
the same peak, to the byte, split into FSDP2's categories:

=========================  ==========================================================================
FSDP2 category             mfsdp2's bytes
=========================  ==========================================================================
``Sharded Param``          main weights, model-dtype shards (the DTensor parameters view them)
``All Gather``             a gathered block (role ``weight``) until its unit's pre-forward or
                           pre-backward returns: FSDP2's all-gather output (a prefetch stays here
                           until its own unit's); FP8's ``fp8``, persistent ``gather_bucket``
``Unsharded Param``        that block from then until the reshard (FSDP2's unsharded parameters);
                           the full weights ZeRO-1/2 and ``no_shard`` keep (``persistent_weights``)
``Unsharded Grad``         autograd's gradients of the gathered weights; gradients summed without sync
``Reduce Scatter``         the flat gradient, reduction output and receive scratch, HSDP partial sums
``Sharded Grad``           main gradients (``.grad`` views them), all-reduce buckets holding them
``Temp``                   what the allocator held idle on entry (cached blocks, unused pools)
=========================  ==========================================================================

A storage holds one category at a time: an allocator block takes the role of the buffer it
serves each time it is served (a cached block reused for another role moves category), and a
trace pool (:mod:`mfsdp2.memory.trace_pool`), one storage for many buffers, is counted whole under
its latest buffer's role. torch's own post-backward hook then files the main gradients as
``Sharded Grad`` as on FSDP2. On torch FSDP2 units (no mfsdp2 unit under the module) it is torch's
class unchanged.

Use: replace ``from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker`` by
``from mfsdp2 import FSDPMemTracker``.
"""

from __future__ import annotations

from functools import wraps
from typing import Any, Callable, Hashable, Optional

import torch
import torch.nn as nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker as _TorchFSDPMemTracker
from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

from .allocator import BufferRole, role_of
from .memory_bound import _groups, mfsdp2_held

__all__ = ["FSDPMemTracker", "category_of"]

# mfsdp2's names for what it holds (allocator roles and mfsdp2_held's kinds) -> FSDP2's category.
_CATEGORY: dict[str, _FSDPRefType] = {
    "main_weight": _FSDPRefType.SHARDED_PARAM,
    "shard": _FSDPRefType.SHARDED_PARAM,
    "persistent_weights": _FSDPRefType.UNSHARDED_PARAM,
    BufferRole.WEIGHT.value: _FSDPRefType.ALL_GATHER,
    BufferRole.FP8.value: _FSDPRefType.ALL_GATHER,
    BufferRole.GATHER_BUCKET.value: _FSDPRefType.ALL_GATHER,
    "unsynced_grad": _FSDPRefType.UNSHARDED_GRAD,
    BufferRole.GRAD.value: _FSDPRefType.REDUCE_SCATTER,
    BufferRole.RS_OUT.value: _FSDPRefType.REDUCE_SCATTER,
    BufferRole.RS_RECV.value: _FSDPRefType.REDUCE_SCATTER,
    BufferRole.PARTIAL.value: _FSDPRefType.REDUCE_SCATTER,
    "partial": _FSDPRefType.REDUCE_SCATTER,
    BufferRole.MAIN_GRAD.value: _FSDPRefType.SHARDED_GRAD,
    BufferRole.GRAD_BUCKET.value: _FSDPRefType.REDUCE_SCATTER,
    "main_grad": _FSDPRefType.SHARDED_GRAD,
    "main_grad_full": _FSDPRefType.SHARDED_GRAD,
    "idle": _FSDPRefType.TEMP,
}


def category_of(what: Hashable) -> Optional[_FSDPRefType]:
    """FSDP2's category for an allocator key or role, or a kind of :func:`mfsdp2_held` (None:
    unknown, the tracker's own choice stands)."""
    return _CATEGORY.get(str(role_of(what)))


class FSDPMemTracker(_TorchFSDPMemTracker):
    """torch's ``FSDPMemTracker`` (same constructor, methods and context manager) that counts an
    mfsdp2 model's memory as :class:`~mfsdp2.memory.memory_bound.StepMemoryTracker` does: see the
    module docstring.

    Args:
        mod: the root unit (mfsdp2's or torch FSDP2's ``fully_shard``), after its first forward.
        optm: the optimizer, whose states are counted as ``OptState``.
    """

    def __init__(self, mod: nn.Module, optm: Optional[torch.optim.Optimizer] = None) -> None:
        super().__init__(mod, optm)
        self._mfsdp2 = bool(_groups(mod))
        self._aliases: dict = {}  # gathered storage's _cdata -> its DataParallelBuffer
        self._serving: Optional[_FSDPRefType] = None  # the category of the block being obtained
        self._observed = None

    # -- allocator observer: blocks are filed by the role of the buffer they serve ---------------
    def allocating(self, key: Hashable) -> None:
        self._serving = category_of(key)

    def allocated(self, key: Hashable, block: Optional[torch.Tensor]) -> None:
        self._serving = None
        cat = category_of(key)
        if block is not None and cat is not None:
            # A block served from a cache or pool was counted before, under its last role.
            self._update_and_maybe_create_winfos(block, cat)

    # -- gathered aliases are counted through their blocks ----------------------------------------
    def _aliased(self, t: torch.Tensor) -> bool:
        return bool(self._aliases) and any(st._cdata in self._aliases for st in get_untyped_storages(t))

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype: Any, update_existing: bool = False):
        if not self._aliased(t):
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)
        # torch files a unit's unsharded parameters (after its pre-forward) and the all-gather's
        # output by the tensors: here those are views of the alias, so the block it points at
        # takes the category (a resharded alias points at none).
        out = set()
        for st in get_untyped_storages(t):
            buf = self._aliases.get(st._cdata)
            if buf is not None and buf._block is not None:
                out |= super()._update_and_maybe_create_winfos(buf._block, reftype)
        return out

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        if self._aliased(t):
            return
        super()._track(self._serving or reftype, t)

    # -- pre-backward: a unit's gathered weights are its unsharded parameters -----------------------
    def _fsdp_param_group_pre_backward(self, fsdp_mod: nn.Module, orig: Callable) -> Callable:
        """FSDP2's unsharded parameters keep their storages from forward to backward, so after a
        unit's backward unshard its gathered bytes are ``Unsharded Param`` again while the
        all-gather output (a prefetch for the next unit) is ``All Gather``. mfsdp2's block is new
        at each unshard (filed ``All Gather`` by its role): it becomes the unit's unsharded
        parameters once its pre-backward returns, as after its pre-forward."""
        if not self._mfsdp2:
            return super()._fsdp_param_group_pre_backward(fsdp_mod, orig)

        @wraps(orig)
        def unshard_then_file(*args: Any, **kwargs: Any) -> None:
            orig(*args, **kwargs)
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            if group is not None:
                for p in group.fsdp_params:
                    self._update_and_maybe_create_winfos(p.unsharded_param, _FSDPRefType.UNSHARDED_PARAM)

        return super()._fsdp_param_group_pre_backward(fsdp_mod, unshard_then_file)

    # -- entry and exit ---------------------------------------------------------------------------
    def _register_mfsdp2(self) -> None:
        model = self._root_mod
        self._aliases = {g.weights._storage._cdata: g.weights for g in _groups(model)
                         if g.weights._swap and not g.weights.persistent}
        for what, t in mfsdp2_held(model):
            self._update_and_maybe_create_winfos(t, category_of(what) or _FSDPRefType.TEMP)
        for g in _groups(model):
            w = g.weights
            if not w.persistent and not w._swap:
                # Without storage swapping the gathered storage owns its bytes and is resized
                # (which the tracker follows): it is the all-gather output, not an activation.
                self._update_and_maybe_create_winfos(w.unsharded, _FSDPRefType.ALL_GATHER)
        self._observed = model.allocator
        self._observed.observers.append(self)

    def __enter__(self) -> "FSDPMemTracker":
        if self._depth == 0 and self._mfsdp2:
            self._register_mfsdp2()
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        if self._depth == 0 and self._observed is not None:
            self._observed.observers.remove(self)
            self._observed = None
            self._serving = None
