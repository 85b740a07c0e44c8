"""ParameterGroup: one unit's parameters of one (dtype, requires_grad), sharded in flat buffers.

A group owns three flat buffers planned by one :class:`~mfsdp2.layout.BufferLayout`:

* the **main weights** (``main_weight``, shard only, fp32 by default): what the optimizer updates;
* the **model weights** (a :class:`~mfsdp2.buffer.DataParallelBuffer` in the compute dtype): its
  unsharded storage is what forward and backward compute with; its shard *is* the main shard, cast
  to the compute dtype as it is copied into each gather (no bf16 copy is kept between gathers, as
  in FSDP2). Persistent buffers (ZeRO-1/2, no_shard) hold the full weights and are cast into
  their local slice once per optimizer step;
* the **main gradients** (``main_grad``, shard only, fp32 by default): where reduce-scattered
  gradients accumulate.

To the optimizer it exposes one ``nn.Parameter`` per original parameter: a DTensor with the
original global shape and a :class:`~mfsdp2.placement.RowShard` placement, whose local tensor is a
view of this rank's rows in ``main_weight`` and whose ``.grad`` is a view into ``main_grad``. A rank
that holds no rows of a parameter still gives it a gradient (an empty local tensor), as torch FSDP2
does: code that walks the gradients (``clip_grad_norm_`` reduces a norm per DTensor grad, loss
scalers, ``p.grad.to_local()`` loops) must see the same parameters on every rank.

Strategies (:mod:`mfsdp2.strategy`): with ``no_shard`` / ``optim`` / ``optim_grads`` the model
weights are a *persistent* buffer (gathered once per optimizer step; the main weights are its local
slice when the dtypes match), and with ``no_shard`` / ``optim`` the main gradient is full-size
and reduced by all-reduce. HSDP adds an all-reduce of the shard-group result across replicas.

Change detection (:mod:`mfsdp2.weight_watch`): persistent weights are re-cast and re-gathered
when the main weights changed -- an optimizer step (a process-wide step hook), an announced write
(``mark_weights_changed``, ``load_state_dict``), a moved version counter, or a different content
fingerprint of the main shard, which catches writes through ``.data`` that bump no counter. The
root's forward agrees on the local signals across ranks. No user call is needed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .allocator import BucketAllocator
from .buffer import DataParallelBuffer
from .comm import CommHandle, Communicator
from .fp8 import Float8Gather
from .layout import BufferLayout, plan_layout
from .mixed_precision import MixedPrecisionPolicy
from .placement import RowShard, data_parallel_dtensor
from .strategy import ShardingStrategy
from .weight_watch import fingerprint, watch
from .te import detach_main_grads, fuses_wgrad  # TE's attribute protocol; TE itself is never imported
from .tensor_parallel import TPSpec, local_grad, tp_dp_mesh, tp_dtensor

__all__ = ["ParamInfo", "GroupConfig", "ParameterGroup"]

logger = logging.getLogger(__name__)


@dataclass
class ParamInfo:
    """One place an original parameter is registered: ``owner._parameters[attr]``; ``fqn`` for messages."""

    owner: nn.Module
    attr: str
    fqn: str


@dataclass(frozen=True)
class GroupConfig:
    """How a unit shards: strategy, the mesh dimension that shards (None: ``no_shard``) and the
    replicate group's communicator (HSDP, ``no_shard``; None for plain FSDP)."""

    strategy: ShardingStrategy = ShardingStrategy.OPTIM_GRADS_PARAMS
    shard_dim: Optional[int] = 0
    replicate_comm: Optional[Communicator] = None
    fp8: Optional[torch.dtype] = None  # gather as this float8 dtype with per-parameter scales (mfsdp2.fp8)


@dataclass
class _PendingReduce:
    handle: CommHandle
    direct: bool  # the collective wrote straight into the main gradient
    out: torch.Tensor  # the shard-group result (shard-size, or full-size for full-gradient strategies)
    has_grad: tuple
    key: object
    all_reduce: bool  # HSDP: all-reduce ``out`` across replicas when the shard-group part is done
    op: object  # the replicate all-reduce's op
    stage: str = "rs"  # "rs": the shard-group collective is in flight; "ar": the replicate all-reduce


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
        config: GroupConfig = GroupConfig(),
        tp_specs: Optional[list[Optional[TPSpec]]] = None,
        layout: Optional[BufferLayout] = None,
    ):
        self.unit_name = unit_name
        # Per parameter: its tensor-parallel spec (``params`` then holds the TP-local tensors).
        self.tp_specs = list(tp_specs) if tp_specs is not None else [None] * len(params)
        self.config = config
        self.strategy = config.strategy
        self.replicate_comm = config.replicate_comm if config.replicate_comm is not None and config.replicate_comm.world_size > 1 else None
        self.full_grads = not config.strategy.shards_grads
        self.divide_factor: Optional[float] = None  # None: mean over every data-parallel rank
        self.force_sum = False  # SUM collectives, divided after the last one (set_force_sum_reduction_for_comms)
        self.all_reduce_hook = None  # called on the reduced shard before it is accumulated (set_all_reduce_hook)
        self.requires_all_reduce = True  # HSDP: False accumulates shard-group results (set_requires_all_reduce)
        self.partial: Optional[torch.Tensor] = None  # those accumulated results, until the next all-reduce
        self.infos = infos
        self.mesh = mesh
        self.comm = comm
        self.device = device
        self.rank = comm.rank
        self.orig_dtype = params[0].dtype
        self.requires_grad = params[0].requires_grad
        self.compute_dtype = mp.compute_dtype(self.orig_dtype)
        self.main_dtype = mp.main_dtype(self.orig_dtype, self.requires_grad)
        self.grad_dtype = mp.grad_dtype(self.orig_dtype, self.requires_grad)
        self.reduce_dtype = mp.wire_reduce_dtype(self.compute_dtype)
        tags = ("" if self.requires_grad else ",frozen") + (",fp8" if config.fp8 else "")
        self.name = f"{unit_name}[{str(self.orig_dtype).replace('torch.', '')}{tags}]"

        itemsize = min(torch.finfo(d).bits if d.is_floating_point else torch.iinfo(d).bits
                       for d in (self.compute_dtype, self.main_dtype)) // 8
        # ``layout``: keep an existing group's rows (a dtype conversion after fully_shard, see conversion.py).
        self.layout = layout or plan_layout([tuple(p.shape) for p in params], comm.world_size, align=max(16 // itemsize, 1))

        S = self.layout.shard_numel
        same = self.main_dtype == self.compute_dtype
        self.persistent = not config.strategy.shards_params
        if self.persistent:
            # Full model weights for the buffer's life; the main weights are its local slice
            # when the dtypes match (one copy of this rank's rows, not two).
            self.weights = DataParallelBuffer(self.layout, self.compute_dtype, device, comm, persistent=True)
            self.main_weight = self.weights.shard if same else torch.zeros(S, dtype=self.main_dtype, device=device)
        else:
            self.main_weight = torch.zeros(S, dtype=self.main_dtype, device=device)
            self.weights = DataParallelBuffer(self.layout, self.compute_dtype, device, comm, shard=self.main_weight)
        self._needs_cast = not same and self.persistent  # ZeRO-3 casts inside each gather instead
        # Persistent weights: the ranks' agreed answer to "did the weights change on any rank since
        # the last gather" (set at the root's forward, see hooks._agree_on_gathers).
        self.agreed_stale = False
        # An optimizer step or an announced write since the last gather (the same on every rank).
        self.changed = True
        self._gathered_fp: Optional[torch.Tensor] = None  # fingerprint of the main shard at the last gather
        self.fp8 = None
        if config.fp8:
            self.fp8 = Float8Gather(self, config.fp8)

        self._cast_pending = False  # the model shard lags the main weights: cast at the next gather
        self.casts = 0  # main -> model casts into a persistent buffer (tests: once per optimizer step)
        self.gathered_version = -1
        self.kept: Optional[torch.Tensor] = None  # shards kept by a partial reshard (int reshard_after_forward)
        self.main_grad: Optional[torch.Tensor] = None  # from the first reduction to the release
        self.main_grad_full: Optional[torch.Tensor] = None  # full-gradient strategies: main_grad is its slice
        self.fused_full: Optional[torch.Tensor] = None  # TE wgrad fusion: param.main_grad views into it
        self.fused_key = None  # its allocator key's suffix (the unit's reduction key)
        self._main_grad_alloc: Optional[BucketAllocator] = None
        self.dist_params: list[nn.Parameter] = []
        self.unsharded_params: list[nn.Parameter] = []
        self._pending_reduce: Optional[_PendingReduce] = None
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
        self.te_fused = fuses_wgrad(self)
        self.weights.free_unsharded()
        self.refresh_model_shard()
        watch(self)

    # -- parameters ---------------------------------------------------------------------------
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
            self.dist_params.append(dp)
            unsharded = tp_dtensor(views[i], spec) if spec is not None else views[i]
            up = nn.Parameter(unsharded, requires_grad=p.requires_grad)
            self.unsharded_params.append(up)

    def as_dtensor(self, local: torch.Tensor, index: int, shape) -> torch.Tensor:
        """This rank's rows of parameter ``index`` as the optimizer-facing DTensor (``shape``:
        global; a TP parameter's lives on the (tp, dp) mesh, see :mod:`mfsdp2.tensor_parallel`)."""
        rows = self.layout.rows_per_rank(index)
        spec = self.tp_specs[index]
        if spec is None:
            return data_parallel_dtensor(local, self.mesh, rows, shape, self.config.shard_dim)
        mesh = tp_dp_mesh(spec.mesh, self.mesh)
        placements = spec.placements + (RowShard(0, rows),)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=spec.shape, stride=spec.stride())

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

    def refresh_model_shard(self) -> None:
        """Cast main -> model weights into a persistent buffer's local slice (persistent groups
        whose compute dtype differs; at construction, materialisation and every re-gather)."""
        if not self._needs_cast:
            return
        with torch.no_grad():
            self.weights.shard.copy_(self.main_weight)
        self._cast_pending = False
        self.casts += 1

    def mark_changed(self) -> None:
        """The main weights were (or may have been) written: re-cast and re-gather before the
        next use. Called on every rank (optimizer-step hook, ``mark_weights_changed``, loading)."""
        self.changed = True

    def changed_flag(self, one: torch.Tensor) -> torch.Tensor:
        """0-dim device float: 1 when this rank sees a change since the last gather. Host facts
        (a step, an announced write, a moved version counter) answer without touching the device;
        otherwise the main shard's fingerprint is compared on the device (no host read here)."""
        if self.changed or self.main_version() != self.gathered_version or self._gathered_fp is None:
            return one
        return (fingerprint(self.main_weight) != self._gathered_fp).any().to(one.dtype)

    # -- unshard / reshard --------------------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.weights.is_unsharded

    def unshard(self, allocator: Optional[BucketAllocator] = None, key=None, label: str = "") -> Optional[CommHandle]:
        """Gather the model weights into a block from ``allocator`` (keyed ``key``); None when
        the weights are persistent and no rank stepped since the last gather (nothing to do)."""
        if self.persistent and not self.stale:
            return None
        if self._cast_pending:
            self.refresh_model_shard()
        self._cast_pending = self._needs_cast  # the next gather happens because the main weights changed
        self.gathered_version = self.main_version()
        self.changed = self.agreed_stale = False
        if self.persistent:
            self._gathered_fp = fingerprint(self.main_weight)
        with torch.no_grad():
            if self.fp8 is not None:
                return self.fp8.all_gather(allocator, key, label)
            return self.weights.all_gather(allocator, key, label)

    @property
    def stale(self) -> bool:
        """True when the weights changed after the last gather.

        Persistent weights: the answer agreed at the root's forward (version counters and the
        fingerprint, MAX over ranks) or a signal every rank gets (optimizer step, announced write).
        Local version counters are not consulted between root forwards: a rank holding no rows
        would decide differently and the ranks would issue different collectives. ZeRO-3 groups
        ask this only while gathered (kept across a step, or an in-flight ``unshard``)."""
        if self.persistent:
            return self.agreed_stale or self.changed
        return self.changed or self.main_version() != self.gathered_version

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
        if self.fused_full is not None:
            return True  # TE wrote (or will have written) wgrads into the fused buffer
        return any(p.grad is not None for p in self.unsharded_params)

    def _reduce_ops(self) -> tuple[Optional[float], object, object]:
        """``(prescale, first collective's op, replicate all-reduce's op)`` for the divide factor.

        Mean over every data-parallel rank (default): AVG in each stage (a mean of equal-size
        means is the mean; gloo's all-reduce emulates AVG). A custom factor ``D``: NCCL scales
        inside the first collective (PREMUL_SUM); elsewhere the gradients are multiplied by
        ``1/D`` while they are packed (in the reduce dtype, before any sum: no bf16 overflow),
        then summed."""
        avg, total = dist.ReduceOp.AVG, dist.ReduceOp.SUM
        D = self.divide_factor
        if self.force_sum:
            return None, total, total  # divided by _post_divisor() once the reduction is done
        if D is None:
            return None, avg, avg
        premul = self.comm.premul_sum(1.0 / D) if self.comm.world_size > 1 else None
        if premul is not None:
            return None, premul, total
        return (None if D == 1 else 1.0 / D), total, total

    def _post_divisor(self) -> float:
        """With ``force_sum``: what the summed result is divided by (the divide factor, else every
        data-parallel rank: the shard group times the replicas)."""
        if self.divide_factor is not None:
            return self.divide_factor
        return float(self.comm.world_size * (self.replicate_comm.world_size if self.replicate_comm is not None else 1))

    def _pack(self, full: torch.Tensor, prescale: Optional[float]) -> list[bool]:
        """Copy the unsharded grads into ``full`` (zeros where a parameter has none, and in the
        padding); TE-fused wgrads are already in place. Returns which parameters had one."""
        layout = self.layout
        fused = self.fused_full is not None
        has_grad = []
        end = 0
        for i, up in enumerate(self.unsharded_params):
            slot = layout.slots[i]
            if slot.offset > end and not fused:
                full[end : slot.offset].zero_()
            view = full[slot.offset : slot.offset + slot.numel]
            if fused and getattr(up, "grad_added_to_main_grad", False):
                up.grad = None  # TE's placeholder wgrad: the real one is already in the buffer
                up.grad_added_to_main_grad = False
                has_grad.append(True)
            elif up.grad is None:
                if not fused:
                    view.zero_()
                has_grad.append(False)
            else:
                view.copy_(local_grad(up.grad, self.tp_specs[i]).reshape(-1))
                up.grad = None
                has_grad.append(True)
            end = slot.offset + slot.numel
        if end < layout.total_numel and not fused:
            full[end:].zero_()
        if prescale is not None:
            full.mul_(prescale)
        if fused:
            detach_main_grads(self)
        self.fused_full = None
        return has_grad

    def reduce_grads(self, allocator: BucketAllocator, key, label: str = "") -> None:
        """Pack the unsharded grads into a flat buffer and issue its reduction (async).

        Parameters with no local gradient contribute zeros so every rank issues the same
        collective; call :meth:`finish_reduce` to accumulate the result into ``main_grad``.
        Sharded-gradient strategies reduce-scatter over the shard group; full-gradient ones
        all-reduce; HSDP then all-reduces across replicas in :meth:`finish_reduce`."""
        if not self.requires_grad:
            return
        self.finish_reduce(allocator)  # one reduction per group in flight
        layout = self.layout
        prescale, op, replicate_op = self._reduce_ops()
        all_reduce = self.replicate_comm is not None and self.requires_all_reduce
        # Nothing accumulated is visible (every grad None: first reduction since zero_grad), the
        # dtypes match and no HSDP partial sum waits: reduce straight into main_grad, no copy.
        direct = (
            self.reduce_dtype == self.grad_dtype
            and all(dp.grad is None for dp in self.dist_params)
            and (self.replicate_comm is None or (all_reduce and self.partial is None))
        )
        with torch.no_grad():
            if self.fused_full is not None:
                full, direct = self.fused_full, False  # TE wrote into it: ("grad", key)
            elif self.full_grads and direct:
                self._ensure_main_grad(allocator, zero=False)
                full = self.main_grad_full
            else:
                full = allocator.allocate(("grad", key), layout.total_numel, self.reduce_dtype, self.device)
            has_grad = self._pack(full, prescale)
            if self.full_grads:
                out = full
                handle = self.comm.all_reduce(full, op, label=label)
            else:
                if direct:
                    self._ensure_main_grad(allocator, zero=False)
                    out = self.main_grad
                else:
                    out = allocator.allocate(("rs_out", key), layout.shard_numel, self.reduce_dtype, self.device)
                n_scratch = self.comm.reduce_scatter_scratch_numel(layout.shard_numel, op)
                scratch = allocator.allocate(("rs_recv", key), n_scratch, self.reduce_dtype, self.device) if n_scratch else None
                handle = self.weights.reduce_scatter(full, out, op, scratch, label)
        self._pending_reduce = _PendingReduce(handle, direct, out, tuple(has_grad), key, all_reduce, replicate_op)

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
        n = self.layout.total_numel if self.full_grads else self.layout.shard_numel
        block = allocator.allocate(self._main_grad_key(), n, self.grad_dtype, self.device)
        if zero:
            block.zero_()
        if self.full_grads:
            self.main_grad_full = block
            self.main_grad = self.weights.local_slice(block)
        else:
            self.main_grad = block
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
        self.main_grad_full = None
        self._main_grad_alloc.free(self._main_grad_key())
        self._main_grad_alloc = None

    def _partial_key(self) -> tuple:
        return ("partial", self.unit_name, self.name)

    @staticmethod
    def _free_reduce_buffers(allocator: BucketAllocator, key) -> None:
        if allocator.is_live(("grad", key)):
            allocator.free(("grad", key))
        if allocator.is_live(("rs_recv", key)):
            allocator.free(("rs_recv", key))

    def _free_out(self, allocator: BucketAllocator, p: _PendingReduce) -> None:
        if not p.direct and not self.full_grads:
            allocator.free(("rs_out", p.key))
        if self.full_grads:
            self._free_reduce_buffers(allocator, p.key)  # out was the ("grad", key) buffer

    def abort(self, allocator: BucketAllocator) -> None:
        """Drop this step's gradient work after an exception: wait for (never free under) an
        in-flight reduction, discard it, and drop unsharded gradients. A reduction that failed
        and may still run (:meth:`CommHandle.settle`) gets its buffers leaked, not freed."""
        if self._pending_reduce is not None:
            p = self._pending_reduce
            self._pending_reduce = None
            if p.handle.settle():
                self._free_reduce_buffers(allocator, p.key)
                self._free_out(allocator, p)
            else:
                self._leak_reduce_buffers(allocator, p)
        if self.fused_full is not None:
            self.fused_full = None
            self._free_reduce_buffers(allocator, self.fused_key)
        for up in self.unsharded_params:
            up.grad = None

    def _leak_reduce_buffers(self, allocator: BucketAllocator, p: _PendingReduce) -> None:
        """Every buffer the unfinished reduction ``p`` may still read or write: its input, receive
        scratch and output -- the main gradient itself when it reduced straight into it."""
        why = f"the {p.handle.label or 'reduction'} failed and may still be running"
        for role in ("grad", "rs_recv", "rs_out"):
            if allocator.is_live((role, p.key)):
                allocator.leak((role, p.key), why)
        if p.direct or p.out is self.main_grad or p.out is self.main_grad_full:
            if self.main_grad is not None and self._main_grad_alloc.is_live(self._main_grad_key()):
                self._main_grad_alloc.leak(self._main_grad_key(), why)
            self.main_grad = None
            self.main_grad_full = None
            self._main_grad_alloc = None
            for dp in self.dist_params:
                dp.grad = None

    def abandon_gather(self, why: str) -> None:
        """Reshard after a gather that did not provably end: its blocks are leaked, not freed."""
        self.weights.abandon_unsharded(why)
        if self.fp8 is not None:
            self.fp8.bytes.abandon_unsharded(why)
        self.kept = None

    @property
    def reduce_pending(self) -> bool:
        return self._pending_reduce is not None

    def finish_reduce(self, allocator: BucketAllocator) -> None:
        """Wait for the in-flight reduction (both stages) and accumulate it into ``main_grad``."""
        while self._pending_reduce is not None:
            self.advance_reduce(allocator)

    def advance_reduce(self, allocator: BucketAllocator) -> bool:
        """Finish the in-flight reduction's current stage; True when nothing is pending any more.

        HSDP has two stages: when the shard-group reduction is done, the all-reduce across
        replicas is *issued* (async, its own CUDA stream) and waited only at the next drain, so it
        overlaps the next unit's backward instead of stalling the compute stream behind it. With
        ``set_requires_all_reduce(False)`` the shard-group result goes into the partial sum."""
        p = self._pending_reduce
        if p is None:
            return True
        p.handle.wait()
        out = p.out
        with torch.no_grad():
            if p.stage == "rs":
                if not self.full_grads:
                    self._free_reduce_buffers(allocator, p.key)
                if self.replicate_comm is not None and not p.all_reduce:
                    # set_requires_all_reduce(False): keep the shard-group sum for the next all-reduce.
                    if self.partial is None:
                        self.partial = allocator.allocate(self._partial_key(), out.numel(), out.dtype, self.device)
                        self.partial.copy_(out)
                    else:
                        self.partial.add_(out)
                    self._free_out(allocator, p)
                    self._pending_reduce = None
                    self.local_grad_flags = [a or b for a, b in zip(self.local_grad_flags, p.has_grad)]
                    return True
                if self.replicate_comm is not None:
                    if self.partial is not None:
                        out.add_(self.partial)
                        self.partial = None
                        allocator.free(self._partial_key())
                    label = f"all-reduce across replicas of {self.name}"
                    p.handle = self.replicate_comm.all_reduce(out, p.op, label=label)
                    p.stage = "ar"
                    return False
            self._pending_reduce = None
            if self.all_reduce_hook is not None:  # FSDP2's place: after the reduction, before the post-divide
                self.all_reduce_hook(out)
            if self.force_sum and self._post_divisor() != 1:
                out.div_(self._post_divisor())
            if not p.direct:
                self._accumulate(allocator, out)
            self._free_out(allocator, p)
        self.local_grad_flags = [a or b for a, b in zip(self.local_grad_flags, p.has_grad)]
        self.expose_grads(p.has_grad)
        self.grads_reduced_this_step = True
        return True

    def _accumulate(self, allocator: BucketAllocator, out: torch.Tensor) -> None:
        """main_grad += out, restarting at zero the parameters whose grad the user cleared."""
        self._ensure_main_grad(allocator, zero=True)
        dst = self.main_grad_full if self.full_grads else self.main_grad
        view = self.weights.param_view if self.full_grads else self.weights.piece_view
        overwrite = [dp.grad is None for dp in self.dist_params]
        if all(overwrite):
            dst.copy_(out)
            return
        # optimizer.zero_grad() (set_to_none) clears some grads: their pieces restart at 0.
        for i, dp in enumerate(self.dist_params):
            if overwrite[i]:
                view(dst, i).zero_()
            elif dp.grad._local_tensor.data_ptr() != self.weights.piece_view(self.main_grad, i).data_ptr():
                # The user assigned a grad of their own: fold it in before accumulating.
                self.weights.piece_view(self.main_grad, i).copy_(dp.grad._local_tensor)
        dst.add_(out)

    def expose_grads(self, flags) -> None:
        """Give ``dp.grad`` (a view of main_grad; empty where this rank holds no rows) to every
        flagged parameter.

        Called with this rank's flags after each reduction, then with the flags of *all* ranks
        at the end of backward (``hooks._sync_grad_presence``): a parameter used on some ranks only
        (an MoE expert that got no tokens here) has a nonzero reduced gradient on every rank's rows,
        so every rank must step it, while a parameter no rank used keeps ``grad = None`` (the
        optimizer skips it, as it would unsharded). Empty pieces get an empty gradient, never
        ``None``: a rank whose list of gradients differs from the others' issues different
        collectives in ``clip_grad_norm_`` (gloo aborts). torch's foreach and fused optimizers
        step empty tensors without touching their neighbours (tests/test_empty_grads.py)."""
        if self.main_grad is None:
            return
        for i, dp in enumerate(self.dist_params):
            if flags[i] and dp.grad is None:
                local = self.weights.piece_view(self.main_grad, i)
                dp.grad = self.as_dtensor(local, i, dp.shape)
