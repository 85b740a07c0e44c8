"""ParameterGroup: one unit's parameters of one (dtype, requires_grad), sharded in flat buffers.

A group owns three flat buffers planned by one :class:`~mfsdp2.layout.BufferLayout`:

* the **main weights** (``main_weight``, shard only, fp32 by default): what the optimizer updates;
* the **model weights** (a :class:`~mfsdp2.buffer.DataParallelBuffer` in the compute dtype): its
  shard is cast from the main weights once per optimizer step (or *is* the main shard when the
  dtypes match) and its unsharded storage is what forward and backward compute with;
* the **main gradients** (``main_grad``, shard only, fp32 by default): where reduce-scattered
  gradients accumulate.

To the optimizer it exposes one ``nn.Parameter`` per original parameter: a DTensor with the
original global shape and a :class:`~mfsdp2.placement.RowShard` placement, whose local tensor is a
view of this rank's rows in ``main_weight`` and whose ``.grad`` is a view into ``main_grad``. A rank
that holds no rows of a parameter gives it ``grad = None``: fused multi-tensor optimizers handed
empty tensors corrupt the neighbouring parameters' updates.

Step detection: the optimizer's in-place update of a DTensor parameter bumps that parameter's
version counter (not ``main_weight``'s: the counters are not shared through the DTensor wrapper),
so the next unshard sees a new version sum and re-casts the model shard. No user call is needed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .allocator import BucketAllocator
from .buffer import DataParallelBuffer
from .comm import CommHandle, Communicator
from .layout import plan_layout
from .mixed_precision import MixedPrecisionPolicy
from .placement import row_sharded_dtensor

__all__ = ["ParamInfo", "ParameterGroup"]

logger = logging.getLogger(__name__)


@dataclass
class ParamInfo:
    """One place an original parameter is registered: ``owner._parameters[attr]``; ``fqn`` for messages."""

    owner: nn.Module
    attr: str
    fqn: str


class ParameterGroup:
    def __init__(
        self,
        unit_name: str,
        infos: list[list[ParamInfo]],
        params: list[nn.Parameter],
        mesh: DeviceMesh,
        comm: Communicator,
        device: torch.device,
        mp: MixedPrecisionPolicy,
    ):
        self.unit_name = unit_name
        self.infos = infos
        self.mesh = mesh
        self.comm = comm
        self.device = device
        self.rank = comm.rank
        self.orig_dtype = params[0].dtype
        self.requires_grad = params[0].requires_grad
        self.compute_dtype = mp.compute_dtype(self.orig_dtype)
        self.main_dtype = mp.main_dtype(self.orig_dtype, self.requires_grad)
        self.grad_dtype = mp.grad_dtype(self.orig_dtype)
        self.reduce_dtype = mp.wire_reduce_dtype(self.compute_dtype)
        self.name = f"{unit_name}[{str(self.orig_dtype).replace('torch.', '')}{'' if self.requires_grad else ',frozen'}]"

        itemsize = min(torch.finfo(d).bits if d.is_floating_point else torch.iinfo(d).bits
                       for d in (self.compute_dtype, self.main_dtype)) // 8
        self.layout = plan_layout([tuple(p.shape) for p in params], comm.world_size, align=max(16 // itemsize, 1))

        S = self.layout.shard_numel
        self.main_weight = torch.zeros(S, dtype=self.main_dtype, device=device)
        same = self.main_dtype == self.compute_dtype
        model_shard = self.main_weight if same else torch.zeros(S, dtype=self.compute_dtype, device=device)
        self.weights = DataParallelBuffer(self.layout, self.compute_dtype, device, comm, shard=model_shard)
        self._needs_cast = not same
        self._cast_version = -1
        self.casts = 0  # main -> model casts done (tests check: once per optimizer step)
        self.gathered_version = -1
        self.kept: Optional[torch.Tensor] = None  # shards kept by a partial reshard (int reshard_after_forward)
        self.main_grad: Optional[torch.Tensor] = None  # from the first reduction to the release
        self._main_grad_alloc: Optional[BucketAllocator] = None
        self.dist_params: list[nn.Parameter] = []
        self.unsharded_params: list[nn.Parameter] = []
        self._pending_reduce: Optional[tuple[CommHandle, torch.Tensor, tuple]] = None
        self.grads_reduced_this_step = False
        # Which parameters had a local gradient in this backward's reductions (see expose_grads).
        self.local_grad_flags = [False] * len(params)

        # Built under torch.device("meta"): the layout needs shapes only; the values come from
        # mfsdp2.materialize(model), one module at a time.
        self.needs_init = params[0].is_meta
        with torch.no_grad():
            for i, p in enumerate(params if not self.needs_init else []):
                piece = self.weights.piece_view(self.main_weight, i)
                lo = self.layout.piece(i, self.rank)
                src = p.detach().reshape(p.shape)
                piece.copy_(src[lo.row_start : lo.row_end] if p.dim() else src)
        self._make_params(params)
        self.weights.free_unsharded()
        self.refresh_model_shard(force=True)

    # -- parameters ---------------------------------------------------------------------------
    def _make_params(self, params: list[nn.Parameter]) -> None:
        views = self.weights.param_views()
        for i, p in enumerate(params):
            local = self.weights.piece_view(self.main_weight, i)
            rows = self.layout.rows_per_rank(i)
            dp = nn.Parameter(row_sharded_dtensor(local, self.mesh, rows, p.shape), requires_grad=p.requires_grad)
            for k, v in p.__dict__.items():  # user tags (no-weight-decay flags, TP metadata, ...)
                if not k.startswith("_mfsdp2"):
                    setattr(dp, k, v)
            self.dist_params.append(dp)
            up = nn.Parameter(views[i], requires_grad=p.requires_grad)
            self.unsharded_params.append(up)

    def register(self, unsharded: bool, check: bool = True) -> None:
        """Point every owner module's attribute at the unsharded (compute) or sharded (DTensor) params.

        A parameter shared by several modules of this unit (tied weights) has several owners.
        ``check``: the attribute must still hold one of ours; a parameter the user assigned after
        ``fully_shard`` would otherwise be overwritten here without a word, and never trained.
        """
        params = self.unsharded_params if unsharded else self.dist_params
        for i, (owners, p) in enumerate(zip(self.infos, params)):
            for info in owners:
                if check:
                    cur = info.owner._parameters.get(info.attr)
                    if cur is not self.dist_params[i] and cur is not self.unsharded_params[i]:
                        raise RuntimeError(
                            f"mfsdp2: parameter {info.fqn!r} of unit {self.unit_name!r} was replaced (or deleted) "
                            "after fully_shard; the runtime owns it now. Change its values in place "
                            "(with torch.no_grad(): param.copy_(...), or load_state_dict) instead of "
                            "assigning a new Parameter, or assign before calling fully_shard"
                        )
                info.owner._parameters[info.attr] = p

    def main_version(self) -> int:
        """Grows whenever anything writes the main weights in place (optimizer, loading)."""
        # DTensor ops bump the wrapper's counter, direct writes to a local bump the local's.
        return self.main_weight._version + sum(dp._version + dp._local_tensor._version for dp in self.dist_params)

    def refresh_model_shard(self, force: bool = False) -> None:
        """Cast main -> model weights when the optimizer changed the main shard (version counters)."""
        if not self._needs_cast:
            return
        v = self.main_version()
        if force or v != self._cast_version:
            with torch.no_grad():
                self.weights.shard.copy_(self.main_weight)
            self._cast_version = v
            self.casts += 1

    # -- unshard / reshard --------------------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.weights.is_unsharded

    def unshard(self, allocator: Optional[BucketAllocator] = None, key=None, label: str = "") -> CommHandle:
        """Gather the model weights into a block from ``allocator`` (keyed ``key``)."""
        self.refresh_model_shard()
        self.gathered_version = self.main_version()
        with torch.no_grad():
            return self.weights.all_gather(allocator, key, label)

    @property
    def stale(self) -> bool:
        """True when the optimizer changed the main weights after the last gather."""
        return self.main_version() != self.gathered_version

    def reshard(self) -> None:
        self.weights.free_unsharded()
        self.kept = None

    def reshard_to_group(self, sub: Communicator) -> None:
        """Keep what a gather inside ``sub`` (a block of consecutive ranks) needs; free the rest."""
        self.kept = self.weights.keep_for_group(sub.world_size)

    def unshard_from_group(
        self, sub: Communicator, allocator: Optional[BucketAllocator] = None, key=None, label: str = ""
    ) -> CommHandle:
        kept, self.kept = self.kept, None
        with torch.no_grad():
            return self.weights.all_gather_in_group(kept, sub, allocator, key, label)

    # -- gradients ----------------------------------------------------------------------------
    def has_unsharded_grads(self) -> bool:
        return any(p.grad is not None for p in self.unsharded_params)

    def reduce_grads(self, allocator: BucketAllocator, key, label: str = "") -> None:
        """Pack the unsharded grads into a flat buffer and issue its reduce-scatter (async).

        Parameters with no local gradient contribute zeros so every rank issues the same
        collective; call :meth:`finish_reduce` to accumulate the result into ``main_grad``.
        """
        if not self.requires_grad:
            return
        self.finish_reduce(allocator)  # one reduction per group in flight
        layout = self.layout
        full = allocator.allocate(("grad", key), layout.total_numel, self.reduce_dtype, self.device)
        has_grad = []
        with torch.no_grad():
            end = 0
            for i, up in enumerate(self.unsharded_params):
                slot = layout.slots[i]
                if slot.offset > end:
                    full[end : slot.offset].zero_()
                view = full[slot.offset : slot.offset + slot.numel]
                if up.grad is None:
                    view.zero_()
                    has_grad.append(False)
                else:
                    view.copy_(up.grad.reshape(-1))
                    up.grad = None
                    has_grad.append(True)
                end = slot.offset + slot.numel
            if end < layout.total_numel:
                full[end:].zero_()
            # Nothing accumulated is visible (every grad None: first reduction since zero_grad)
            # and the dtypes match: reduce straight into main_grad, no output buffer, no copy.
            direct = self.reduce_dtype == self.grad_dtype and all(dp.grad is None for dp in self.dist_params)
            if direct:
                self._ensure_main_grad(allocator, zero=False)
                out = self.main_grad
            else:
                out = allocator.allocate(("rs_out", key), layout.shard_numel, self.reduce_dtype, self.device)
            n_scratch = self.comm.reduce_scatter_scratch_numel(layout.shard_numel, dist.ReduceOp.AVG)
            scratch = allocator.allocate(("rs_recv", key), n_scratch, self.reduce_dtype, self.device) if n_scratch else None
            handle = self.weights.reduce_scatter(full, out, dist.ReduceOp.AVG, scratch, label)
        self._pending_reduce = (handle, direct, out, tuple(has_grad), key)

    # -- main grads ---------------------------------------------------------------------------
    def _main_grad_key(self) -> tuple:
        return ("main_grad", self.unit_name, self.name)

    def _ensure_main_grad(self, allocator: BucketAllocator, zero: bool) -> None:
        """main_grad lives from the first reduction after a ``zero_grad(set_to_none=True)`` to the
        next forward that finds all its grads cleared (:meth:`release_main_grad`): like FSDP2's
        sharded grads, it takes no memory through forward."""
        if self.main_grad is not None:
            return
        self._main_grad_alloc = allocator
        self.main_grad = allocator.allocate(self._main_grad_key(), self.layout.shard_numel, self.grad_dtype, self.device)
        if zero:
            self.main_grad.zero_()
        for dp in self.dist_params:
            dp.grad = None

    def release_main_grad(self) -> None:
        """Give main_grad back to the allocator when no parameter exposes it any more (the
        optimizer's ``zero_grad(set_to_none=True)`` ran); called at the root's next forward."""
        if self.main_grad is None or self._pending_reduce is not None:
            return
        if any(dp.grad is not None for dp in self.dist_params):
            return  # grads kept (zero_grad(set_to_none=False) or accumulation across steps)
        self.main_grad = None
        self._main_grad_alloc.free(self._main_grad_key())
        self._main_grad_alloc = None

    @staticmethod
    def _free_reduce_buffers(allocator: BucketAllocator, key) -> None:
        allocator.free(("grad", key))
        if allocator.is_live(("rs_recv", key)):
            allocator.free(("rs_recv", key))

    def abort(self, allocator: BucketAllocator) -> None:
        """Drop this step's gradient work after an exception: wait for (never free under) an
        in-flight reduce-scatter, discard it, and drop unsharded gradients."""
        if self._pending_reduce is not None:
            handle, direct, _, _, key = self._pending_reduce
            self._pending_reduce = None
            handle.wait()
            self._free_reduce_buffers(allocator, key)
            if not direct:
                allocator.free(("rs_out", key))
        for up in self.unsharded_params:
            up.grad = None

    @property
    def reduce_pending(self) -> bool:
        return self._pending_reduce is not None

    def finish_reduce(self, allocator: BucketAllocator) -> None:
        """Wait for the in-flight reduce-scatter and accumulate it into ``main_grad``."""
        if self._pending_reduce is None:
            return
        handle, direct, out, has_grad, key = self._pending_reduce
        self._pending_reduce = None
        handle.wait()
        self._free_reduce_buffers(allocator, key)
        with torch.no_grad():
            if not direct:
                self._ensure_main_grad(allocator, zero=True)
                overwrite = [dp.grad is None for dp in self.dist_params]
                if all(overwrite):
                    self.main_grad.copy_(out)
                else:
                    # optimizer.zero_grad() (set_to_none) clears some grads: their pieces restart at 0.
                    for i, dp in enumerate(self.dist_params):
                        if overwrite[i]:
                            self.weights.piece_view(self.main_grad, i).zero_()
                        elif dp.grad._local_tensor.data_ptr() != self.weights.piece_view(self.main_grad, i).data_ptr():
                            # The user assigned a grad of their own: fold it in before accumulating.
                            self.weights.piece_view(self.main_grad, i).copy_(dp.grad._local_tensor)
                    self.main_grad.add_(out)
                allocator.free(("rs_out", key))
        self.local_grad_flags = [a or b for a, b in zip(self.local_grad_flags, has_grad)]
        self.expose_grads(has_grad)
        self.grads_reduced_this_step = True

    def expose_grads(self, flags) -> None:
        """Give ``dp.grad`` (a view of main_grad) to every parameter flagged and holding rows here.

        Called with this rank's flags after each reduction, then with the flags of *all* ranks
        at the end of backward (``hooks._sync_grad_presence``): a parameter used on some ranks only
        (an MoE expert that got no tokens here) has a nonzero reduced gradient on every rank's rows,
        so every rank must step it, while a parameter no rank used keeps ``grad = None`` (the
        optimizer skips it, as it would unsharded)."""
        for i, dp in enumerate(self.dist_params):
            if flags[i] and dp.grad is None and self.layout.piece(i, self.rank).numel > 0:
                local = self.weights.piece_view(self.main_grad, i)
                dp.grad = row_sharded_dtensor(local, self.mesh, self.layout.rows_per_rank(i), dp.shape)
