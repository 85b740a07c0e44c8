"""ParameterGroup: one unit's parameters of one (dtype, requires_grad), sharded in flat buffers.

A group owns three flat buffers planned by one :class:`~mfsdp2.memory.layout.BufferLayout`:

* the **main weights** (``main_weight``, shard only, fp32 by default): what the optimizer updates;
* the **model weights** (a :class:`~mfsdp2.memory.buffer.DataParallelBuffer` in the compute dtype): its
  unsharded storage is what forward and backward compute with; its shard *is* the main shard, cast
  to the compute dtype as it is copied into each gather (no bf16 copy is kept between gathers, as
  in FSDP2). Persistent buffers (ZeRO-1/2, no_shard) hold the full weights and are cast into
  their local slice once per optimizer step;
* the **main gradients** (``main_grad``, shard only, fp32 by default): where reduce-scattered
  gradients accumulate.

To the optimizer it exposes one ``nn.Parameter`` per original parameter: a DTensor with the
original global shape and a :class:`~mfsdp2.dtensors.placement.RowShard` placement, whose local tensor is a
view of this rank's rows in ``main_weight`` and whose ``.grad`` is a view into ``main_grad``. A rank
that holds no rows of a parameter still gives it a gradient (an empty local tensor), as torch FSDP2
does: code that walks the gradients (``clip_grad_norm_`` reduces a norm per DTensor grad, loss
scalers, ``p.grad.to_local()`` loops) must see the same parameters on every rank.

Strategies (:mod:`mfsdp2.base.strategy`): with ``no_shard`` / ``optim`` / ``optim_grads`` the model
weights are a *persistent* buffer (gathered once per optimizer step; the main weights are its local
slice when the dtypes match), and with ``no_shard`` / ``optim`` the main gradient is full-size
and reduced by all-reduce. HSDP adds an all-reduce of the shard-group result across replicas.

Change detection (:mod:`mfsdp2.groups.weight_watch`): persistent weights are re-cast and re-gathered
when the main weights changed -- an optimizer step (a process-wide step hook), an announced write
(``mark_weights_changed``, ``load_state_dict``), a moved version counter, or a different content
fingerprint of the main shard, which catches writes through ``.data`` that bump no counter. The
root's forward agrees on the local signals across ranks. No user call is needed.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..memory.allocator import BucketAllocator
from ..memory.buffer import DataParallelBuffer
from ..comm.communicator import CommHandle, Communicator
from ..comm.custom import CustomCommunicator
from ..precision.fp8 import Float8Gather
from .grad_reduction import GradientReduction
from .grad_views import GradViews
from ..memory.layout import BufferLayout, plan_layout
from ..precision.mixed_precision import MixedPrecisionPolicy
from ..memory.offload import MainMemory
from .param_registration import ParameterRegistration
from ..dtensors.placement import RowShard, mark_write_nothing
from ..dtensors.shard_dim import rows_along
from ..base.strategy import ShardingStrategy
from .weight_changes import WeightChanges
from .weight_watch import watch
from ..precision.te import fuses_wgrad  # TE's attribute protocol; TE itself is never imported
from ..dtensors.tensor_parallel import TPSpec, tp_dtensor

__all__ = ["ParamInfo", "GroupConfig", "ParameterGroup", "swap_param", "mark_empty_pieces"]

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
    fp8: Optional[torch.dtype] = None  # gather as this float8 dtype with per-parameter scales (mfsdp2.precision.fp8)
    main_memory: Optional[MainMemory] = None  # where main weights/grads live (None: the compute device)
    mesh_tag: str = ""  # names a mesh other than the unit's (shard_placement_fn): in the group's name and keys


_LIVE = weakref.WeakSet()  # every ParameterGroup alive in the process (clip_grad finds params' groups)


def live_groups() -> list["ParameterGroup"]:
    """The parameter groups alive in this process (a parameter's group is found among them)."""
    return list(_LIVE)


def swap_param(old: nn.Parameter, new: nn.Parameter) -> None:
    """Give the parameter object ``old`` (held by modules, optimizers, user code) ``new``'s
    contents, keeping its identity, its attributes and those of its local tensor (DCP's
    write-nothing mark of an empty piece)."""
    attrs = dict(old.__dict__)
    if isinstance(old, DTensor) and isinstance(new, DTensor):
        new._local_tensor.__dict__.update(old._local_tensor.__dict__)
    old.grad = None  # a .grad reference blocks swap_tensors
    torch.utils.swap_tensors(old, new)
    old.__dict__.clear()
    old.__dict__.update(attrs)


def mark_empty_pieces(g: "ParameterGroup") -> None:
    """Empty pieces of the parameters themselves write nothing either (state_dict(keep_vars=True))."""
    for i, dp in enumerate(g.dist_params):
        if g.layout.piece(i, g.rank).numel == 0 and dp.numel() > 0:
            mark_write_nothing(dp)


class ParameterGroup(ParameterRegistration, WeightChanges, GradientReduction):
    """One unit's parameters of one (mesh, dtype policy, ``requires_grad``), sharded in flat
    buffers planned by one layout (the module docstring describes the buffers).

    Owns, here: the layout, the main-weight shard, the model-weight buffer and its gathers
    (``unshard`` / ``reshard``, the partial reshard of ``reshard_after_forward=<int>``), its
    allocation on the meta device and after it, and FP8's gather. Its parts own the rest, each
    with its state declared in its own initialiser: the parameters as modules and optimizers see
    them and the checks before each use (:class:`ParameterRegistration`), whether persistent
    weights changed since the last gather (:class:`WeightChanges`), and the gradient reduction
    with the main gradient it lands in (:class:`GradientReduction`, over
    :class:`~mfsdp2.groups.main_grad.MainGradient`)."""

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
        shard_dims: Optional[list[int]] = None,
    ):
        self.unit_name = unit_name
        # Per parameter: its tensor-parallel spec (``params`` then holds the TP-local tensors).
        self.tp_specs = list(tp_specs) if tp_specs is not None else [None] * len(params)
        self.config = config
        self.strategy = config.strategy
        self.replicate_comm = (config.replicate_comm
                               if config.replicate_comm is not None and config.replicate_comm.world_size > 1 else None)
        self.full_grads = not config.strategy.shards_grads
        self.divide_factor: Optional[float] = None  # None: mean over every data-parallel rank
        self.force_sum = False  # SUM collectives, divided after the last one (set_force_sum_reduction_for_comms)
        self.custom_reduce_scatter = False  # a user's reduce-scatter object (set_custom_comm): it gets SUM
        self.all_reduce_hook = None  # called on the reduced shard before it is accumulated (set_all_reduce_hook)
        self.requires_all_reduce = True  # HSDP: False accumulates shard-group results (set_requires_all_reduce)
        self.infos = infos
        self.mesh = mesh
        self.comm = comm
        self.device = device
        # Main weights and grads (so optimizer states and the step) live here: the compute device,
        # or the CPU with CPUOffloadPolicy (mfsdp2.memory.offload), where nothing aliases compute memory.
        self.main = config.main_memory or MainMemory(device)
        self.rank = comm.rank
        self.orig_dtype = params[0].dtype
        self.requires_grad = params[0].requires_grad
        self.compute_dtype = mp.compute_dtype(self.orig_dtype)
        self.main_dtype = mp.main_dtype(self.orig_dtype, self.requires_grad)
        self.grad_dtype = mp.grad_dtype(self.orig_dtype, self.requires_grad)
        self.reduce_dtype = mp.wire_reduce_dtype(self.compute_dtype)
        # The main weights' and gradients' dtypes were the group trainable: a group sharded frozen
        # is made trainable in place where they are its own (ParameterRegistration._unfreeze).
        self.trainable_dtypes = (mp.main_dtype(self.orig_dtype, True), mp.grad_dtype(self.orig_dtype, True))
        tags = ("" if self.requires_grad else ",frozen") + (",fp8" if config.fp8 else "") + (
            f",{config.mesh_tag}" if config.mesh_tag else "")
        self.name = f"{unit_name}[{str(self.orig_dtype).replace('torch.', '')}{tags}]"

        itemsize = min(torch.finfo(d).bits if d.is_floating_point else torch.iinfo(d).bits
                       for d in (self.compute_dtype, self.main_dtype)) // 8
        # ``layout``: keep an existing group's rows (a dtype conversion after fully_shard, see conversion.py).
        # ``shard_dims``: the dimension each parameter is sharded on (shard_placement_fn; mfsdp2.dtensors.shard_dim).
        self.layout = layout or plan_layout(
            [tuple(p.shape) for p in params], comm.world_size, align=max(16 // itemsize, 1), dims=shard_dims
        )

        # Main and model weights may share memory: same dtype, and the main state not offloaded.
        self._shares_main = self.main_dtype == self.compute_dtype and not self.main.offloaded
        # Persistent: the full buffer stays between steps (ShardingStrategy.keeps_full_weights).
        self.persistent = config.strategy.keeps_full_weights(comm.world_size, self._shares_main, bool(config.fp8))
        # The module computes with the main weights' own memory: a persistent buffer in the main
        # dtype on a shard group of one rank *is* the main weights. A gather of such a group has
        # nothing to copy, cast or collect, so a change of its weights (a step, a load, a write
        # through ``.data``) needs no re-gather: the module reads the new values where they were
        # written (WeightChanges.stale, fingerprinted). Fixed for the group's life, and read on
        # every unshard: an attribute, not a property.
        self.computes_on_main = self.persistent and self._shares_main and comm.world_size == 1
        # main -> model copy into a persistent buffer's slice; ZeRO-3 copies (and casts) inside each gather instead
        self._needs_cast = not self._shares_main and self.persistent
        # Built under torch.device("meta"): the layout needs shapes only. Like torch FSDP2, the
        # per-rank buffers (and so the DTensor parameters) stay on the meta device -- no bytes
        # -- until mfsdp2.materialize(model) or model.to_empty(device=...) allocates them
        # (:meth:`allocate`); the values come from the init that follows.
        self.needs_init = params[0].is_meta
        self._build_buffers(torch.device("meta") if self.needs_init else device)
        # Parameters whose object holds a value of its own, not yet in these buffers (a conversion
        # of part of the unit, a parameter replaced before the first forward), each with the
        # original dtype it asks the group for: mfsdp2.runtime.param_adoption.
        self.pending: dict[int, torch.dtype] = {}
        # Persistent weights: the root forward's answer to "did the weights change on any rank
        # since the last gather", the same on every rank (weight_watch.agree_on_gathers).
        self.agreed_stale = False
        # An optimizer step or an announced write since the last gather (the same on every rank).
        self.changed = True
        self._gathered_fp: Optional[torch.Tensor] = None  # fingerprint of the main shard at the last gather
        # Whether the next gather takes that fingerprint (the root forward's prediction, consumed
        # by the gather it plans), and how many root forwards in a row had a common fact
        # (weight_watch.agree_on_gathers predicts the one from the other).
        self.wants_baseline = True
        self.fact_streak = 0
        # Persistent weights planned into a cross-unit gather bucket at the root's forward
        # (mfsdp2.groups.gather_buckets): the handle that delivers this group's rows; counts as stale.
        self.pending_gather = None
        # Persistent weights: writes through ``.data`` are seen (a content check or a re-gather
        # at a forward without a common fact, weight_watch.watch_mode). Off: host facts only
        # (``FSDPModule.set_detect_data_writes``).
        self.content_check = True

        self.casts = 0  # main -> model casts into a persistent buffer (tests: once per optimizer step)
        self.gathered_version = -1
        self.kept: Optional[torch.Tensor] = None  # shards kept by a partial reshard (int reshard_after_forward)
        self.main_grad: Optional[torch.Tensor] = None  # from the first reduction to the release
        self.main_grad_full: Optional[torch.Tensor] = None  # full-gradient strategies: main_grad is its slice
        self.fused_full: Optional[torch.Tensor] = None  # TE wgrad fusion: param.main_grad views into it
        self.fused_key = None  # its allocator key's suffix (the unit's reduction key)
        self._main_grad_alloc: Optional[BucketAllocator] = None
        self._main_grad_bucket = None  # (buckets, bucket) when main_grad_full is a bucket's slice (grad_buckets)
        self._main_grad_host: Optional[torch.Tensor] = None  # CPU offload: the main grad's host memory
        # (allocator, block, main_grad) of a main gradient whose storage was emptied in place at
        # the last release, refilled by the next backward (MainGradient._empty_main_grad).
        self._emptied_main_grad: Optional[tuple] = None
        # (bucket block, main_grad_full, main_grad) of a bucket slice let go of in place
        # (MainGradient._empty_bucket_slice), taken back by the next direct reduction into it.
        self._emptied_bucket_slice: Optional[tuple] = None
        self.copy_outs = 0  # CPU offload: reductions copied out into the main grad (tests)
        self.dist_params: list[nn.Parameter] = []
        self._row_shards: dict[int, RowShard] = {}  # as_dtensor's placements, built once
        self._grad_views: Optional[GradViews] = None  # the gradient DTensors (grad_views.py), made with dist_params
        self._dp_storages: Optional[list[int]] = None  # see _refuse_assigned
        self._hooks_forwarded_to: dict[int, nn.Parameter] = {}  # see _forward_tensor_hooks
        self.unsharded_params: list[nn.Parameter] = []
        self.init_reduction(len(params))  # GradientReduction's state

        with torch.no_grad():
            for i, p in enumerate(params if not self.needs_init else []):
                piece = self.weights.piece_view(self.main_weight, i)
                lo = self.layout.piece(i, self.rank)
                src = p.detach().reshape(p.shape)
                piece.copy_(rows_along(src, self.layout.slots[i].shard_dim, lo.row_start, lo.row_end))
        self._make_params(params)
        _LIVE.add(self)
        self.te_fused = fuses_wgrad(self)
        self.weights.free_unsharded()
        watch(self)

    # -- memory ------------------------------------------------------------------------------
    def _build_buffers(self, device: torch.device) -> None:
        """The main-weight shard, the model-weight buffer and FP8's bytes, on ``device`` (meta:
        shapes only). The main weights live in the group's main memory: the compute device, or
        (pinned) host memory under CPU offload (:mod:`mfsdp2.memory.offload`) -- meta too while the
        group awaits its init."""
        S = self.layout.shard_numel
        main = MainMemory(device) if device.type == "meta" else self.main
        if self.persistent:
            # Full model weights for the buffer's life; the main weights are its local slice
            # when they can share it (one copy of this rank's rows, not two).
            self.weights = DataParallelBuffer(self.layout, self.compute_dtype, device, self.comm, persistent=True)
            self.main_weight = self.weights.shard if self._shares_main else main.zeros(S, self.main_dtype)
        else:
            self.main_weight = main.zeros(S, self.main_dtype)
            self.weights = DataParallelBuffer(self.layout, self.compute_dtype, device, self.comm,
                                              shard=self.main_weight)
        self.fp8 = Float8Gather(self, self.config.fp8) if self.config.fp8 else None

    @property
    def allocated(self) -> bool:
        """False while the group's buffers are on the meta device (a model built there)."""
        return not self.main_weight.is_meta

    def allocate(self) -> None:
        """Give a group built on the meta device its per-rank memory (zeros): model weights on the
        mesh's device, main weights in its main memory (pinned host memory under CPU offload).
        Called by ``mfsdp2.materialize`` and ``model.to_empty``. The DTensor parameter objects keep
        their identity (an optimizer built before holds them) and get views of the new shard."""
        if self.allocated:
            return
        self._build_buffers(self.device)
        views = self.weights.param_views()
        for i, dp in enumerate(self.dist_params):
            if i not in self.pending:  # a pending one keeps its own value until param_adoption.settle
                local = self.weights.piece_view(self.main_weight, i)
                swap_param(dp, nn.Parameter(self.as_dtensor(local, i, dp.shape), requires_grad=dp.requires_grad))
            spec = self.tp_specs[i]
            unsharded = tp_dtensor(views[i], spec) if spec is not None else views[i]
            self.unsharded_params[i] = nn.Parameter(unsharded, requires_grad=self.unsharded_params[i].requires_grad)
        self.weights.free_unsharded()
        self._record_storages()

    @property
    def main_comm(self) -> Communicator:
        """The shard group for sums of values computed from main state (gradient norms): the
        device group, or its gloo twin when that state lives in host memory."""
        return self.comm.host() if self.main.offloaded else self.comm

    # -- unshard / reshard --------------------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.weights.is_unsharded

    def unshard(self, allocator: Optional[BucketAllocator] = None, key=None, label: str = "",
                rider: Optional["ParameterGroup"] = None, rider_key=None) -> Optional[CommHandle]:
        """Gather the model weights into a block from ``allocator`` (keyed ``key``); None when
        the weights are persistent and no rank stepped since the last gather (nothing to do).
        ``rider`` (FP8 groups, :func:`mfsdp2.precision.fp8.gather_riders`): a ZeRO-3 group of the same unit
        gathered in this group's collective, into its own block (``rider_key``)."""
        if self.persistent and not self.stale:
            return None
        if self.pending_gather is not None:  # rows coming in a cross-unit bucket (gather_buckets)
            h, self.pending_gather = self.pending_gather, None
            h.issue()
            # Written again since its bucket was issued (announced; for sharded weights, any
            # in-place write a version counter shows): stale, with the handle taken.
            if not self.stale:
                if not self.persistent:  # the rows land in the unit's own buffer: its block now
                    self.weights.materialize(allocator, key)
                return h
            h.wait()  # gather afresh
        self.begin_gather()
        # ``torch.no_grad()`` without the context object (what it does: the thread's grad mode
        # off, then back): every ZeRO-3 unit runs this per gather, and the object's set-up cost
        # more host time than the gather of a small unit.
        grad_on = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if self.fp8 is not None:
                if rider is not None:
                    rider.begin_gather()
                return self.fp8.all_gather(allocator, key, label, rider, rider_key)
            return self.weights.all_gather(allocator, key, label)
        finally:
            torch._C._set_grad_enabled(grad_on)

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

    # -- user collectives ---------------------------------------------------------------------
    def set_custom_comm(self, what: str, obj) -> None:
        """Route this group's ``what`` (``"all_gather"`` / ``"reduce_scatter"``) collectives through
        a user's object (FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``), or back
        to mfsdp2's own with ``None``. A custom reduce-scatter gets ``SUM`` and the group divides
        afterwards: AVG and PREMUL_SUM are NCCL's, and the object may run on anything."""
        w = self.weights
        cur = w.comm if isinstance(w.comm, CustomCommunicator) else CustomCommunicator(w.comm)
        setattr(cur, f"custom_{what}", obj)
        w.comm = cur
        if what == "reduce_scatter":
            self.custom_reduce_scatter = obj is not None
            self.force_sum = self.force_sum or self.custom_reduce_scatter

    def set_force_sum(self, enable: bool) -> None:
        """SUM collectives divided afterwards (``set_force_sum_reduction_for_comms``); always on
        while a custom reduce-scatter is set."""
        self.force_sum = bool(enable) or self.custom_reduce_scatter

    def abandon_gather(self, why: str) -> None:
        """Reshard after a gather that did not provably end: its blocks are leaked, not freed."""
        self.weights.abandon_unsharded(why)
        if self.fp8 is not None:
            self.fp8.abandon(why)
        self.kept = None
