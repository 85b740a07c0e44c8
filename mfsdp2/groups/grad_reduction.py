"""The gradient-reduction path of a :class:`~mfsdp2.groups.param_group.ParameterGroup`: pack the
unsharded gradients into one flat buffer, issue its reduction (reduce-scatter over the shard
group -- ZeRO-1's too, into its rows of the full-size main gradient -- or all-reduce for no_shard;
HSDP's all-reduce across replicas as a second stage),
accumulate the result into the main gradient and expose it as the DTensor
parameters' ``.grad``.

Why a file of its own: this is the half of a group that runs in backward and owns the reduction
buffers' lifetimes (see "Buffer lifetime rule" in docs/design.md); the other half (layout, main
and model weights, gathers) is :mod:`mfsdp2.groups.param_group`. ``GradientReduction`` is a mixin over
the group's state (``layout``, ``weights``, ``comm``, ``dist_params``, ``unsharded_params``,
``main_grad`` ...), all set up by ``ParameterGroup.__init__``; the main gradient's lifetime and
``.grad`` are its base :class:`~mfsdp2.groups.main_grad.MainGradient` (:mod:`mfsdp2.groups.main_grad`).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Hashable, Optional, Union

import torch
import torch.distributed as dist

from ..memory.allocator import BucketAllocator, BufferRole
from ..memory.offload import hold, release_held
from ..comm.communicator import CommHandle, comm_stats
from .grad_buckets import Bucket, BucketMemberHandle, GradientBuckets
from .grad_mode import no_grad
from .main_grad import MainGradient
from .reduce_plan import ReducePlan, divide, plan_reduction
from ..precision.te import detach_main_grads
from ..dtensors.tensor_parallel import local_grad
from ..dtensors.shard_dim import storage_flat

__all__ = ["GradientReduction", "PendingReduction", "ReduceStage"]

ReduceOp = Union[dist.ReduceOp, "dist.ReduceOp.RedOpType"]


def _write_run(full: torch.Tensor, run: list, start: int, stop: int) -> None:
    """``full[start:stop]`` = the flat gradients of ``run`` back to back (their sizes add up to
    ``stop - start``: ``cat`` then writes the slice in place, never resizes it)."""
    torch.cat(run, out=full if start == 0 and stop == full.numel() else full[start:stop])


class ReduceStage(enum.Enum):
    """Which collective of a pending reduction is in flight."""

    SHARD_GROUP = "shard group"  # the reduce-scatter (or a no_shard group's own all-reduce)
    REPLICAS = "replicas"  # the all-reduce across replicas (HSDP), or a bucket's shared all-reduce


@dataclass(slots=True)
class PendingReduction:
    """A group's reduction between its issue and its landing in the main gradient: what to wait
    for, where the result is, and what to do with it. One per group at a time."""

    handle: Union[CommHandle, BucketMemberHandle]
    direct: bool  # the collective wrote straight into the main gradient
    out: torch.Tensor  # the shard-group result (shard-size, or full-size for full-gradient strategies)
    has_grad: tuple[bool, ...]  # per parameter: whether this rank contributed a gradient
    key: Hashable  # the allocator key suffix of the reduction's buffers
    all_reduce: bool  # HSDP: all-reduce ``out`` across replicas when the shard-group part is done
    op: ReduceOp  # the replicate all-reduce's op
    stage: ReduceStage = ReduceStage.SHARD_GROUP
    bucket: Optional[Bucket] = None  # the reduction is its share of this bucket's all-reduce
    buckets: Optional[GradientBuckets] = None
    post_divide: Optional[float] = None  # divide the reduced result by this (ReducePlan.post_divide)
    # HSDP on stream-ordered backends: the shard group's collective, whose output the replicas'
    # all-reduce (``handle``) was chained to at issue; its buffers go back when both are done.
    chained: Optional[CommHandle] = None
    final: bool = True  # issued in the step's last backward (see GradientReduction.reduce_final)


class GradientReduction(MainGradient):
    """Backward half of a parameter group (mixed into :class:`~mfsdp2.groups.param_group.ParameterGroup`):
    packing, issuing and finishing the reductions; the main gradient they accumulate into and its
    exposure as ``.grad`` are :class:`~mfsdp2.groups.main_grad.MainGradient`'s.

    Owns (set up by :meth:`init_reduction`): the pending reduction, the HSDP partial sum, the
    unsynced micro-batch accumulator and its flags, which parameters had a local gradient, the
    listeners told about reductions and whether the next reduction is the step's last."""

    def init_reduction(self, n_params: int) -> None:
        """The reduction's per-group state, before any backward."""
        self.partial: Optional[torch.Tensor] = None  # HSDP shard-group sums awaiting the next all-reduce
        self._route_memo: Optional[tuple] = None  # (settings, weights' communicator, route): see _route
        self._pending_reduce: Optional[PendingReduction] = None
        # Micro-batches of backwards without gradient sync, summed in the reduce dtype (see
        # accumulate_unsynced), and which parameters they gave a grad.
        self.unsynced_grad: Optional[torch.Tensor] = None
        self.unsynced_flags: list[bool] = []
        self.grads_reduced_this_step = False
        # Which parameters had a local gradient in this backward's reductions (see expose_grads).
        self.local_grad_flags = [False] * n_params
        # Objects told when a reduction is about to start (``before_reduce(group)``, may raise) and
        # when one has landed in the main gradient (``grad_landed(group, final)``): an optimizer that
        # steps in backward (mfsdp2.optim.overlap). Set by them, never by the runtime.
        self.grad_listeners: tuple = ()
        # Whether the reduction about to be issued is the step's last for this group: set by the
        # post-backward hook (the root's is_last_backward, and no other forward pass of the unit
        # still waiting for its backward); carried by the reduction to its landing.
        self.reduce_final = True
        # CPU offload on CUDA: the event after the latest non-blocking copy into the main gradient.
        self.copy_out_event = None

    # -- gradients ----------------------------------------------------------------------------
    def has_unsharded_grads(self) -> bool:
        if self.fused_full is not None or self.unsynced_grad is not None:
            return True  # TE's fused wgrads, or micro-batches accumulated without sync
        return any(p.grad is not None for p in self.unsharded_params)

    def accumulate_unsynced(self) -> None:
        """A backward without gradient sync (``set_requires_gradient_sync(False)``): fold the
        unsharded grads into a flat accumulator in the reduce dtype and clear them.

        Why: autograd would otherwise accumulate the micro-batches in the compute dtype (bf16
        under a bf16/fp32 mixed-precision policy), rounding every partial sum to 8 bits -- torch
        FSDP2 upcasts and accumulates in the reduce dtype, and so do we (the same arithmetic: each
        grad converted exactly, then summed in fp32). Nothing to do when the two dtypes agree
        (autograd's own accumulation is then what FSDP2 does too) or when TE accumulates into
        its fused buffer. The synced backward's :meth:`_pack` adds its grads to this sum."""
        if self.reduce_dtype == self.compute_dtype or self.fused_full is not None:
            return
        if not any(up.grad is not None for up in self.unsharded_params):
            return
        layout = self.layout
        with no_grad():
            if self.unsynced_grad is None:
                self.unsynced_grad = torch.zeros(layout.total_numel, dtype=self.reduce_dtype, device=self.device)
                self.unsynced_flags = [False] * len(self.unsharded_params)
            for i, up in enumerate(self.unsharded_params):
                if up.grad is None:
                    continue
                slot = layout.slots[i]
                self.unsynced_grad[slot.offset : slot.offset + slot.numel].add_(
                    storage_flat(local_grad(up.grad, self.tp_specs[i]), slot.shard_dim)
                )
                up.grad = None
                self.unsynced_flags[i] = True

    def _reduce_plan(self) -> ReducePlan:
        """The reduce ops and divisions of this group's next reduction: FSDP2's rules for its
        reduce dtype, groups, divide factor and forced sum (:mod:`mfsdp2.groups.reduce_plan`)."""
        return self._route()[0]

    def _route(self) -> tuple:
        """``(ReducePlan, bucket communicator or None)`` of the next reduction, remade only when a
        setting they follow from changed. Why: both run at every unit's post-backward, and on a
        model of many small units re-deriving them (the plan twice) was a tenth of the hook.
        What may change after ``fully_shard`` is compared at each use (the divide factor, forced
        sum, a custom reduce-scatter, the replicas' all-reduce, the reduce dtype, the weights'
        communicator object); the communicators' sizes and backends do not change. The dynamic
        conditions (a TE-fused buffer, an HSDP partial sum) stay in :meth:`_bucket_comm`."""
        key = (self.divide_factor, self.force_sum, self.custom_reduce_scatter, self.requires_all_reduce,
               self.reduce_dtype)
        memo = self._route_memo
        if memo is not None and memo[0] == key and memo[1] is self.weights.comm:
            return memo[2]
        replicas = self.replicate_comm.world_size if self.replicate_comm is not None else 1
        plan = plan_reduction(self.reduce_dtype, self.comm.world_size, replicas, self.divide_factor,
                              self.force_sum, self.comm.premul_sum)
        route = (plan, self._static_bucket_comm(plan))
        self._route_memo = (key, self.weights.comm, route)
        return route

    def _pack(self, full: torch.Tensor, plan: ReducePlan) -> list[bool]:
        """Copy the unsharded grads into ``full`` (zeros where a parameter has none, and in the
        padding); TE-fused wgrads are already in place. Returns which parameters had one."""
        fused = self.fused_full is not None
        has_grad = None
        # Tensor-parallel gradients go parameter by parameter: local_grad may redistribute (a
        # collective), which must run once per gradient, in order, on every rank.
        if not fused and self.unsynced_grad is None and self.tp_specs.count(None) == len(self.tp_specs):
            has_grad = self._pack_runs(full)
        if has_grad is None:
            has_grad = self._pack_each(full, fused)
        if plan.pre_scale is not None:
            full.mul_(plan.pre_scale)
        divide(full, plan.pre_divide)
        if fused:
            detach_main_grads(self)
        self.fused_full = None
        return has_grad

    def _pack_runs(self, full: torch.Tensor) -> Optional[list[bool]]:
        """:meth:`_pack`'s common case (no TE-fused buffer, no unsynced micro-batches, no tensor
        parallelism): the same bytes in ``full``, written with one ``torch.cat`` per run of
        adjacent parameters that have a gradient and one ``zero_`` per stretch of padding or
        gradient-less parameters, instead of a slice and a ``copy_`` per parameter. A ``cat``
        into a slice of its exact size writes the slice in place, and copying is exact. None,
        with nothing written or cleared, where a gradient's dtype is not ``full``'s (a
        conversion: left to ``copy_``, as the general path does it) or its size is not its
        slot's: :meth:`_pack_each` then does it all."""
        dtype = full.dtype
        srcs = []
        for i, up in enumerate(self.unsharded_params):
            g = up.grad
            if g is not None:
                slot = self.layout.slots[i]
                g = storage_flat(g, slot.shard_dim)
                if g.dtype != dtype or g.numel() != slot.numel:
                    return None
            srcs.append(g)
        has_grad = []
        run: list = []  # adjacent gradients not written yet, from run_start
        run_start = end = 0
        zero_from = None  # start of a stretch to zero that is not written yet (it ends at the next gradient)
        for slot, g in zip(self.layout.slots, srcs):
            if slot.offset > end or g is None:  # padding before this slot, or a slot without a gradient
                if run:
                    _write_run(full, run, run_start, end)
                    run = []
                if zero_from is None:
                    zero_from = end
            if g is not None:
                if zero_from is not None:
                    full[zero_from : slot.offset].zero_()
                    zero_from = None
                if not run:
                    run_start = slot.offset
                run.append(g)
            has_grad.append(g is not None)
            end = slot.offset + slot.numel
        if run:
            _write_run(full, run, run_start, end)
        if zero_from is None and end < self.layout.total_numel:
            zero_from = end
        if zero_from is not None:
            full[zero_from:].zero_()
        for up in self.unsharded_params:
            up.grad = None
        return has_grad

    def _pack_each(self, full: torch.Tensor, fused: bool) -> list[bool]:
        """:meth:`_pack` parameter by parameter: TE-fused wgrads already in place, unsynced
        micro-batches to add, tensor-parallel gradients and gradients to convert."""
        layout = self.layout
        acc, self.unsynced_grad = self.unsynced_grad, None
        has_grad = []
        end = 0
        for i, up in enumerate(self.unsharded_params):
            slot = layout.slots[i]
            if slot.offset > end and not fused:
                full[end : slot.offset].zero_()
            view = full[slot.offset : slot.offset + slot.numel]
            if acc is not None and self.unsynced_flags[i]:
                view.copy_(acc[slot.offset : slot.offset + slot.numel])  # the unsynced micro-batches
                if up.grad is not None:
                    view.add_(storage_flat(local_grad(up.grad, self.tp_specs[i]), slot.shard_dim))
                    up.grad = None
                has_grad.append(True)
            elif fused and getattr(up, "grad_added_to_main_grad", False):
                up.grad = None  # TE's placeholder wgrad: the real one is already in the buffer
                up.grad_added_to_main_grad = False
                has_grad.append(True)
            elif up.grad is None:
                if not fused:
                    view.zero_()
                has_grad.append(False)
            else:
                view.copy_(storage_flat(local_grad(up.grad, self.tp_specs[i]), slot.shard_dim))
                up.grad = None
                has_grad.append(True)
            end = slot.offset + slot.numel
        if end < layout.total_numel and not fused:
            full[end:].zero_()
        return has_grad

    @property
    def all_reduces_full(self) -> bool:
        """Whether the group's own reduction is an all-reduce of the whole flat gradient (no_shard:
        a shard group of one rank) rather than a reduce-scatter into this rank's rows (the
        sharded strategies, and ZeRO-1, whose optimizer steps only its rows too; its full-size
        main gradient is kept for accumulation, not reduced whole)."""
        return self.full_grads and self.comm.world_size == 1

    def _bucket_comm(self, route: Optional[tuple] = None):
        """The communicator of the one all-reduce that reduces this group when that all-reduce may
        share a bucket with other groups' (:mod:`mfsdp2.groups.grad_buckets`): full-gradient strategies
        with a single stage -- ZeRO-1 over its shard group, no_shard over the replicas -- and
        sharded-gradient groups whose reduce-scatter is an all-reduce of the whole flat gradient
        anyway (gloo, small groups, two ranks: ``Communicator.reduce_scatter_is_all_reduce``; 64
        small units paid 64 collectives of ~1 ms each). None for two-stage reductions (HSDP, an
        HSDP partial sum waiting), TE's fused buffers, a user's custom reduce-scatter and groups
        with nobody to reduce with. ``route``: :meth:`_route`'s result, when the caller has it."""
        if self.fused_full is not None or self.partial is not None:
            return None
        return (route or self._route())[1]

    def _static_bucket_comm(self, plan: ReducePlan):
        """:meth:`_bucket_comm` from the settings alone (``plan``: the reduction's)."""
        if self.comm.world_size > 1:
            # A reduce-scatter (ZeRO-1/2/3) shares a bucket only where it is a whole all-reduce
            # anyway (gloo, small groups; ZeRO-1 thus keeps half an all-reduce's bytes otherwise).
            # ZeRO-2/3 at two ranks only: a two-term sum is the same float in either order, so the
            # bucketed all-reduce gives bit-identical gradients to the group's own one. With more
            # ranks, gloo's summation order depends on where the gradient sits in the buffer, i.e.
            # on the bucket plan (which a fresh or resumed model makes differently): a resumed run
            # would no longer repeat the uninterrupted one bit for bit, as FSDP2's does.
            if self.replicate_comm is not None or not (self.full_grads or self.comm.world_size == 2):
                return None
            nbytes = self.layout.total_numel * self.reduce_dtype.itemsize
            # weights.comm: the one the reduce-scatter would go through (a user's custom one included)
            return self.comm if self.weights.comm.reduce_scatter_is_all_reduce(plan.op, nbytes) else None
        if not self.full_grads:
            return None  # a one-rank shard group of a sharded strategy: reduced by its own path
        if self.replicate_comm is None:
            comm = self.comm
        elif self.requires_all_reduce:
            comm = self.replicate_comm
        else:
            return None
        return comm if comm.world_size > 1 else None

    def reduces_in_bucket(self, buckets: Optional[GradientBuckets]) -> bool:
        """Whether :meth:`reduce_grads` with these ``buckets`` packs into a shared bucket."""
        return buckets is not None and buckets.enabled and self._bucket_comm() is not None

    def reduce_grads(self, allocator: BucketAllocator, key, label: str = "",
                     buckets: Optional[GradientBuckets] = None) -> bool:
        """Pack the unsharded grads into a flat buffer and issue its reduction (async).

        Parameters with no local gradient contribute zeros so every rank issues the same
        collective; call :meth:`finish_reduce` to accumulate the result into ``main_grad``.
        Sharded-gradient strategies and ZeRO-1 reduce-scatter over the shard group; no_shard
        all-reduces; HSDP then all-reduces across replicas in :meth:`finish_reduce`.

        With ``buckets`` (the root's :class:`~mfsdp2.groups.grad_buckets.GradientBuckets`, enabled) a
        single-stage all-reduce packs into a slice of a shared bucket instead, issued with the
        bucket's other members; returns True then (the caller leaves its completion to the
        buckets), False when the group issued a collective of its own."""
        if not self.requires_grad:
            return False
        for listener in self.grad_listeners:
            listener.before_reduce(self)
        self.finish_reduce(allocator)  # one reduction per group in flight
        release_held(self)  # CPU offload: the last output a copy-out read, before its key is reused
        layout = self.layout
        route = self._route()  # once: the plan and the bucket communicator's static part
        plan = route[0]
        op, replicate_op = plan.op, plan.replicate_op
        comm = self._bucket_comm(route) if buckets is not None and buckets.enabled else None
        if comm is not None:
            self._reduce_into_bucket(buckets, comm, op if comm is self.comm else replicate_op, plan, key, label)
            return True
        all_reduce = self.replicate_comm is not None and self.requires_all_reduce
        # Nothing accumulated is visible (every grad None: first reduction since zero_grad), the
        # dtypes match, no HSDP partial sum waits and the main grad is compute memory (not CPU
        # offloaded): reduce straight into main_grad, no copy.
        direct = (
            not self.main.offloaded
            and self.reduce_dtype == self.grad_dtype
            and all(dp.grad is None for dp in self.dist_params)
            and (self.replicate_comm is None or (all_reduce and self.partial is None))
        )
        with no_grad():
            if self.fused_full is not None:
                full, direct = self.fused_full, False  # TE wrote into it: (BufferRole.GRAD, key)
            elif self.all_reduces_full and direct:
                self._ensure_main_grad(allocator, zero=False)
                full = self.main_grad_full
            elif direct and self.weights.comm.reduces_alone:
                # A reduce-scatter over one rank is the identity: pack where the result belongs
                # (ZeRO-2/3 on a shard group of one rank), no flat buffer and no copy out of it.
                self._ensure_main_grad(allocator, zero=False)
                full = self.main_grad
            else:
                full = allocator.allocate((BufferRole.GRAD, key), layout.total_numel, self.reduce_dtype, self.device)
            has_grad = self._pack(full, plan)
            if self.all_reduces_full:
                out = full
                handle = self.comm.all_reduce(full, op, label=label)
            else:
                if direct:
                    self._ensure_main_grad(allocator, zero=False)
                    out = self.main_grad
                else:
                    out = allocator.allocate((BufferRole.RS_OUT, key), layout.shard_numel, self.reduce_dtype,
                                             self.device)
                n_scratch = self.comm.reduce_scatter_scratch_numel(layout.shard_numel, op, full.element_size())
                scratch = (allocator.allocate((BufferRole.RS_RECV, key), n_scratch, self.reduce_dtype, self.device)
                           if n_scratch else None)
                handle = self.weights.reduce_scatter(full, out, op, scratch, label)
            if all_reduce and self.chains_all_reduce:
                # FSDP2's order: the replicas' all-reduce follows the reduce-scatter on the device at
                # once, not at the next drain behind the next unit's backward kernels.
                ar = self.replicate_comm.all_reduce(out, replicate_op,
                                                    label=f"all-reduce across replicas of {self.name}", after=handle)
                self._pending_reduce = PendingReduction(ar, direct, out, tuple(has_grad), key, all_reduce, replicate_op,
                                                        stage=ReduceStage.REPLICAS, post_divide=plan.post_divide,
                                                        final=self.reduce_final, chained=handle)
                return False
        self._pending_reduce = PendingReduction(handle, direct, out, tuple(has_grad), key, all_reduce, replicate_op,
                                              post_divide=plan.post_divide, final=self.reduce_final)
        return False

    def _reduce_into_bucket(self, buckets: GradientBuckets, comm, op, plan: ReducePlan, key, label: str) -> None:
        """Pack into this group's slice of a bucket (see :meth:`reduce_grads`). Direct when, as in
        the unbucketed path, nothing accumulated is visible, the dtypes match and the main
        gradient is compute memory (not CPU offloaded): the slice then *is* the main gradient from
        now on (no copy); otherwise the reduced slice is copied (offloaded: to host memory) or
        added into the main gradient when the bucket is done. A sharded-gradient group is never
        direct: its result is this rank's rows of the reduced slice (what the in-place
        reduce-scatter it replaces takes), copied into its own shard-size main gradient, so the
        bucket's block goes back as soon as the bucket is done."""
        sharded = not self.full_grads
        direct = (
            not sharded
            and not self.main.offloaded
            and self.reduce_dtype == self.grad_dtype
            and self.main_grad is None
            and all(dp.grad is None for dp in self.dist_params)
        )
        lane = (id(comm), self.reduce_dtype, self.device, self.divide_factor, self.force_sum)
        bucket, full = buckets.reserve(self, lane, comm, op, self.layout.total_numel, self.reduce_dtype, self.device,
                                       label)
        with no_grad():
            has_grad = self._pack(full, plan)
        if direct:
            self.main_grad_full, self.main_grad = self._bucket_slice(bucket.block, full)
            self._main_grad_bucket = (buckets, bucket)
        out = self.weights.local_slice(full) if sharded else full
        if sharded:
            comm_stats.reduce_scatters_in_buckets += 1
        self._pending_reduce = PendingReduction(
            BucketMemberHandle(buckets, bucket), direct, out, tuple(has_grad), key, False, op,
            stage=ReduceStage.REPLICAS, bucket=bucket, buckets=buckets, post_divide=plan.post_divide,
            final=self.reduce_final,
        )
        buckets.packed(bucket)

    @property
    def chains_all_reduce(self) -> bool:
        """Whether the replicas' all-reduce is issued right behind the shard group's collective
        (HSDP, no partial sum to add first, both collectives on stream-ordered backends: the
        device orders them, so nothing waits on the host)."""
        return (self.replicate_comm is not None and self.partial is None
                and self.comm.stream_ordered and self.replicate_comm.stream_ordered)

    @property
    def reduce_chained(self) -> bool:
        """Whether the pending reduction's all-reduce across replicas was issued with it."""
        return self._pending_reduce is not None and self._pending_reduce.chained is not None

    @property
    def reduce_bucket(self):
        """The bucket holding this group's pending reduction (None: none, or its own collective)."""
        return self._pending_reduce.bucket if self._pending_reduce is not None else None

    def _partial_key(self) -> tuple:
        return (BufferRole.PARTIAL, self.unit_name, self.name)

    @staticmethod
    def _free_reduce_buffers(allocator: BucketAllocator, key) -> None:
        for role in (BufferRole.GRAD, BufferRole.RS_RECV):
            if allocator.is_live((role, key)):
                allocator.free((role, key))

    def _free_out(self, allocator: BucketAllocator, p: PendingReduction) -> None:
        if not p.direct and not self.all_reduces_full:
            allocator.free((BufferRole.RS_OUT, p.key))
        if self.all_reduces_full:
            self._free_reduce_buffers(allocator, p.key)  # out was the ("grad", key) buffer

    def abort(self, allocator: BucketAllocator) -> None:
        """Drop this step's gradient work after an exception: wait for (never free under) an
        in-flight reduction, discard it, and drop unsharded gradients. A reduction that failed
        and may still run (:meth:`CommHandle.settle`) gets its buffers leaked, not freed."""
        self.settle_copy_out()
        if self._pending_reduce is not None:
            p = self._pending_reduce
            self._pending_reduce = None
            if p.bucket is not None:
                self._abort_bucketed(p)
            elif p.handle.settle():
                self._free_reduce_buffers(allocator, p.key)
                self._free_out(allocator, p)
            else:
                self._leak_reduce_buffers(allocator, p)
        if self.fused_full is not None:
            self.fused_full = None
            self._free_reduce_buffers(allocator, self.fused_key)
        for up in self.unsharded_params:
            up.grad = None

    def _abort_bucketed(self, p: PendingReduction) -> None:
        """Drop a reduction pending in a bucket: its slice was this step's partial sum (never
        exposed); a bucket whose collective may still run is leaked whole."""
        if p.handle.settle():
            if p.direct:
                self.drop_main_grad()
            else:
                p.buckets.release(p.bucket, self)
            return
        p.buckets.leak(p.bucket, f"the {p.handle.label or 'bucketed all-reduce'} failed and may still be running")
        if p.direct:
            self.main_grad = None
            self.main_grad_full = None
            self._main_grad_bucket = None
            for dp in self.dist_params:
                dp.grad = None

    def _leak_reduce_buffers(self, allocator: BucketAllocator, p: PendingReduction) -> None:
        """Every buffer the unfinished reduction ``p`` may still read or write: its input, receive
        scratch and output -- the main gradient itself when it reduced straight into it."""
        why = f"the {p.handle.label or 'reduction'} failed and may still be running"
        for role in (BufferRole.GRAD, BufferRole.RS_RECV, BufferRole.RS_OUT):
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
        if p.chained is not None:  # the shard group's collective ended before the all-reduce
            p.chained.wait()
            p.chained = None
            if not self.all_reduces_full:
                self._free_reduce_buffers(allocator, p.key)
        out = p.out
        with no_grad():
            if p.stage is ReduceStage.SHARD_GROUP:
                if not self.all_reduces_full:
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
                    p.stage = ReduceStage.REPLICAS
                    return False
            self._pending_reduce = None
            if self.all_reduce_hook is not None:  # FSDP2's place: after the reduction, before the post-divide
                self.all_reduce_hook(out)
            divide(out, p.post_divide)
            copying = self._accumulate(allocator, out) if not p.direct else None
            release = None
            if p.bucket is not None:
                if not p.direct:  # its slice was scratch: the bucket may go back
                    release = functools.partial(p.buckets.release, p.bucket, self)
            else:
                release = functools.partial(self._free_out, allocator, p)
            if release is not None and copying is not None:
                # CPU offload on CUDA: the copy-out stream still reads ``out``; freed once the
                # current stream waited on the copy (memory.offload.hold).
                hold(self, copying, self.device, release)
            elif release is not None:
                release()
        self.local_grad_flags = [a or b for a, b in zip(self.local_grad_flags, p.has_grad)]
        self.expose_grads(p.has_grad)
        self.run_post_accumulate_grad_hooks(p.has_grad)
        self.grads_reduced_this_step = True
        for listener in self.grad_listeners:
            listener.grad_landed(self, p.final)
        return True

