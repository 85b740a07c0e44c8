"""Bucketed gradient all-reduce for ``no_shard``, and for groups whose reduce-scatter is a whole
all-reduce anyway (gloo, small groups: ``Communicator.reduce_scatter_is_all_reduce``): ZeRO-1's
(its full-size main gradient may be the bucket's slice) and ZeRO-2/3's at two ranks (which take
their rows of the result).

Why: these strategies reduce every unit's whole flat gradient with one all-reduce. With many small
units (64 ``Linear(64, 64)`` blocks) a step is then dozens of collectives of a few KiB, each paying
the backend's fixed latency (about 1 ms on gloo): torch DDP, which all-reduces 25 MiB buckets,
was ten times faster on such a model. Here consecutive units' gradients (in backward order) share
one **bucket**: one allocator block holding their flat gradients side by side, reduced by one
asynchronous all-reduce as soon as its last member is packed, so it overlaps the rest of the
backward.

How a bucket is laid out without guessing: each backward records the order in which full-gradient
groups were packed (per *lane*: groups that can share a collective -- same communicator, dtype,
device and reduction op). The next backward follows a **plan** made from that record: the recorded
sequence cut greedily into buckets of at most ``cap_bytes`` (a group larger than that is a bucket
by itself; a group that appears twice -- a unit run twice -- starts a new bucket). While the groups
arrive in the planned order, each packs straight into its planned slice of its bucket's block, and
the bucket is issued the moment its last member is packed. The first departure from the plan
(another unit, another size) issues what the open bucket holds and turns the rest of that backward
into one bucket per group (the unbucketed behaviour); the new record becomes the next plan. Every
rank runs the same units in the same order, so every rank makes the same plan and issues the same
collectives. The first backward has no plan: one bucket per group.

Waits: a bucket not yet issued is issued before anyone waits on one of its members
(:class:`BucketMemberHandle`), so a wait can never block on a collective that was never started.
At most :attr:`GradientBuckets.max_in_flight` buckets are in flight; issuing one more completes
the oldest. The root's final backward callback issues the open buckets and (unless
``set_is_last_backward(False)``) completes them all.

Memory: the first reduction after ``zero_grad(set_to_none=True)`` of a group in the reduce dtype is
*direct*: the group's full-size main gradient becomes its slice of the bucket (no copy), and the
block is given back when every member has released its main gradient (at the root's next
forward). Other members (gradients kept from earlier backwards, a bf16 reduce into fp32 main
grads) add their reduced slice into their own main gradient and stop holding the block. A planned
bucket whose members all let go of their slices *in place* (keeping the slices and their gradient
DTensors, none held by anyone else) is emptied in place instead (``resize_(0)``) when nothing but
those tensors views it, and the next backward's bucket at the same plan position with the same
members refills the same block: the members take their slices back, their ``.grad`` DTensors
valid as they were (see :mod:`mfsdp2.groups.main_grad` for why).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..memory.allocator import BucketAllocator, BufferRole
from ..comm.communicator import CommHandle, comm_stats
from ..base.profiling import trace_range

__all__ = ["GradientBuckets", "BucketMemberHandle", "DEFAULT_BUCKET_CAP_MB"]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_CAP_MB = 25.0  # torch DDP's default bucket_cap_mb

Group = Any  # a ParameterGroup (untyped: param_group imports this file's users, not the reverse)


class Bucket:
    """One block of the allocator holding several groups' flat gradients, all-reduced at once."""

    __slots__ = ("lane", "index", "alloc_key", "block", "comm", "op", "members", "offsets", "used",
                 "capacity", "handle", "holders", "completed", "planned_size", "last_label", "in_place")

    def __init__(self, lane: "_Lane", index: Optional[int], comm, op, capacity: int):
        self.lane = lane
        self.index = index  # position in the lane's plan; None: a bucket of one group off the plan
        self.alloc_key = None
        self.block: Optional[torch.Tensor] = None
        self.comm = comm
        self.op = op
        self.members: list = []
        self.offsets: list[int] = []
        self.used = 0
        self.capacity = capacity
        self.planned_size = 0  # members the plan puts in it (0: off the plan)
        self.handle: Optional[CommHandle] = None  # None until issued
        self.holders: set = set()  # groups whose reduction is pending in it or whose main grad is its slice
        self.completed = False
        self.last_label = ""  # the label of the member packed last
        # Members that let go of their slice in place (group -> tensors over the block it keeps):
        # see GradientBuckets._empty.
        self.in_place: dict = {}

    @property
    def label(self) -> str:
        """The collective's name in errors and traces; built when read (at the launch, or when a
        wait fails), not at each member's packing."""
        index = self.index if self.index is not None else "-"
        return f"all-reduce of gradient bucket {index} ({len(self.members)} group(s), last {self.last_label})"

    @property
    def issued(self) -> bool:
        return self.handle is not None

    @property
    def full(self) -> bool:
        return self.planned_size > 0 and len(self.members) == self.planned_size


class _Lane:
    """Groups that can share one collective: the record of this backward, the plan from the last."""

    __slots__ = ("key", "name", "record", "plan", "pos", "diverged", "open", "serial", "emptied")

    def __init__(self, key: tuple, name: str):
        self.key = key
        self.name = name
        self.record: list = []  # (group, numel) in packing order, this backward
        self.plan: list[list] = []  # buckets of (group, numel), from the last backward that reduced
        self.pos = (0, 0)  # (bucket, member) of the next expected group in the plan
        self.diverged = False
        self.open: Optional[Bucket] = None
        self.serial = 0
        # plan position -> (block, allocator key, members): blocks emptied in place at the
        # forward, refilled by this backward's bucket at that position if it has those members.
        self.emptied: dict = {}


class BucketMemberHandle:
    """What a group waits on for its reduction inside a bucket: issues the bucket first if it was
    not issued yet, then waits for its collective (idempotent, like :class:`CommHandle`)."""

    __slots__ = ("buckets", "bucket")

    def __init__(self, buckets: "GradientBuckets", bucket: Bucket):
        self.buckets = buckets
        self.bucket = bucket

    @property
    def label(self) -> str:
        return self.bucket.label

    def wait(self) -> None:
        if not self.bucket.issued:
            self.buckets.issue(self.bucket)
        self.bucket.handle.wait()

    def settle(self) -> bool:
        """Cleanup after an error: True when no collective may still use the bucket's block
        (never issued, or provably ended)."""
        return True if not self.bucket.issued else self.bucket.handle.settle()


class GradientBuckets:
    """The buckets of one root (``RootContext.buckets``)."""

    def __init__(self, allocator: BucketAllocator, root_name: str, cap_mb: float = DEFAULT_BUCKET_CAP_MB):
        self.allocator = allocator
        self.root_name = root_name
        self.cap_bytes = int(cap_mb * 2**20)
        self.max_in_flight = 2
        self._lanes: dict[tuple, _Lane] = {}
        self._in_flight: list[Bucket] = []
        self.issued_count = 0  # buckets issued since creation (tests, diagnostics)

    @property
    def enabled(self) -> bool:
        return self.cap_bytes > 0

    def set_cap_mb(self, mb: float) -> None:
        """Bucket size in MiB (0: off, every group all-reduces alone as it is packed). Takes effect
        at the next plan, i.e. from the backward after the next one."""
        if not mb >= 0:
            raise ValueError(f"mfsdp2 E48: all-reduce bucket size must be >= 0 MiB, got {mb!r}")
        self.cap_bytes = int(mb * 2**20)
        for lane in self._lanes.values():
            lane.plan = []

    # -- packing ------------------------------------------------------------------------------
    def reserve(self, group: Group, lane_key: tuple, comm, op, numel: int, dtype: torch.dtype,
                device: torch.device, label: str) -> tuple[Bucket, torch.Tensor]:
        """The slice of a bucket ``group`` packs its ``numel``-element flat gradient into; call
        :meth:`packed` after packing it."""
        lane = self._lanes.get(lane_key)
        if lane is None:
            lane = self._lanes[lane_key] = _Lane(lane_key, f"{dtype}".replace("torch.", "") + f"#{len(self._lanes)}")
        lane.record.append((group, numel))
        bucket = self._planned_slot(lane, group, numel, comm, op, dtype, device)
        if bucket is None:  # off the plan (or no plan yet): a bucket of its own
            bucket = Bucket(lane, None, comm, op, numel)
            bucket.planned_size = 1
            self._allocate(bucket, numel, dtype, device)
        offset = bucket.used
        bucket.members.append(group)
        bucket.offsets.append(offset)
        bucket.used = offset + numel
        bucket.holders.add(group)
        bucket.last_label = label
        return bucket, bucket.block[offset : offset + numel]

    def _planned_slot(self, lane: _Lane, group: Group, numel: int, comm, op, dtype, device) -> Optional[Bucket]:
        if lane.diverged or not lane.plan:
            return None
        b, m = lane.pos
        expected = lane.plan[b][m] if b < len(lane.plan) else None
        if expected is None or expected[0] is not group or expected[1] != numel:
            lane.diverged = True
            if lane.open is not None:  # what it holds is issued now; the rest goes one group per bucket
                self.issue(lane.open)
            return None
        if m == 0:
            members = lane.plan[b]
            # Members side by side: every group's flat size is already a multiple of 16 bytes
            # (layout alignment), so each starts aligned and the block is exactly their sum.
            cap = sum(n for _, n in members)
            bucket = Bucket(lane, b, comm, op, cap)
            bucket.planned_size = len(members)
            self._allocate(bucket, cap, dtype, device)
            lane.open = bucket
        bucket = lane.open
        lane.pos = (b, m + 1) if m + 1 < len(lane.plan[b]) else (b + 1, 0)
        return bucket

    def _allocate(self, bucket: Bucket, numel: int, dtype, device) -> None:
        lane = bucket.lane
        if bucket.index is not None and self._refill(bucket, numel, dtype, device):
            return
        base = (BufferRole.GRAD_BUCKET, self.root_name, lane.name,
                bucket.index if bucket.index is not None else "single")
        k = 0
        while self.allocator.is_live(base + (k,)):  # a block of an earlier step still holds main grads
            k += 1
        bucket.alloc_key = base + (k,)
        bucket.block = self.allocator.allocate(bucket.alloc_key, numel, dtype, device)

    def packed(self, bucket: Bucket) -> None:
        """A member finished packing: issue the bucket once its last planned member is in."""
        if bucket.full:
            if bucket.lane.open is bucket:
                bucket.lane.open = None
            self.issue(bucket)

    # -- collectives --------------------------------------------------------------------------
    def issue(self, bucket: Bucket) -> None:
        """Start the bucket's all-reduce over what it holds (async); keep at most
        :attr:`max_in_flight` issued buckets unfinished."""
        if bucket.issued:
            return
        if bucket.lane.open is bucket:
            bucket.lane.open = None
            if not bucket.full:  # issued before its plan completed: the rest of the pass is off-plan
                bucket.lane.diverged = True
        with trace_range("mfsdp2.issue_bucket"):
            flat = bucket.block[: bucket.used]
            bucket.handle = bucket.comm.all_reduce(flat, bucket.op, label=bucket.label)
        self.issued_count += 1
        comm_stats.all_reduce_buckets += 1
        self._in_flight.append(bucket)
        while len(self._in_flight) > self.max_in_flight:
            self.complete(self._in_flight[0])

    def complete(self, bucket: Bucket) -> None:
        """Wait for the bucket's all-reduce and finish every member whose reduction is still
        pending in it (accumulate, expose ``.grad``)."""
        if bucket in self._in_flight:
            self._in_flight.remove(bucket)
        if bucket.completed:
            return
        with trace_range("mfsdp2.finish_bucket"):
            BucketMemberHandle(self, bucket).wait()
            bucket.completed = True
            for g in list(bucket.members):
                if g.reduce_bucket is bucket:
                    g.finish_reduce(self.allocator)
        self._maybe_free(bucket)

    def flush(self) -> None:
        """Issue every open bucket (the end of a backward, or a wait that needs them)."""
        for lane in self._lanes.values():
            if lane.open is not None:
                self.issue(lane.open)

    def complete_all(self) -> None:
        self.flush()
        while self._in_flight:
            self.complete(self._in_flight[0])

    def end_backward(self) -> None:
        """The root's final callback: the lanes' records become the next plans."""
        for lane in self._lanes.values():
            lane.emptied.clear()  # what this backward did not refill will not be (empty blocks)
            if lane.record:
                lane.plan = _plan(lane.record, self.cap_bytes // _itemsize(lane.key))
            lane.record = []
            lane.pos = (0, 0)
            lane.diverged = False
            lane.open = None

    # -- block lifetime -----------------------------------------------------------------------
    def release(self, bucket: Bucket, group: Group, in_place: Optional[int] = None) -> None:
        """``group`` no longer uses its slice (reduction finished without keeping it, or its main
        gradient was released); the block goes back when nobody does. ``in_place``: the group
        keeps its slice and this many tensors over the block's storage, for the block to be
        emptied in place and refilled (:meth:`_empty`)."""
        bucket.holders.discard(group)
        if in_place is not None:
            bucket.in_place[group] = in_place
        self._maybe_free(bucket)

    def _maybe_free(self, bucket: Bucket) -> None:
        if bucket.holders or bucket.block is None:
            return
        if bucket.issued and not bucket.completed and not bucket.handle.settle():
            return  # still running: its completion frees it (or abort leaks it)
        block = bucket.block
        if bucket.in_place and self._empty(bucket):
            bucket.block = None
            return
        for g in bucket.in_place:  # they kept slices of a block that is freed: let go of them
            g.forget_bucket_slice(block)
        bucket.in_place = {}
        if self.allocator.is_live(bucket.alloc_key):
            self.allocator.free(bucket.alloc_key)
        bucket.block = None

    # -- blocks emptied in place ----------------------------------------------------------------
    def _empty(self, bucket: Bucket) -> bool:
        """Give a planned bucket's block back by emptying its storage in place (``resize_(0)``)
        rather than freeing it, when every tensor over it is one the members that let go in
        place declared: their slices and gradient DTensors then stay valid for the next
        backward's bucket of the same plan position and members, which refills the block
        (:meth:`_refill`) -- what :mod:`mfsdp2.groups.main_grad` does for a main gradient of its
        own, and why. Same moments, same bytes to and from torch; False (nothing changed) where
        the allocator may not (:meth:`BucketAllocator.free_in_place
        <mfsdp2.memory.allocator.BucketAllocator.free_in_place>`: among others, a holder of the
        storage nobody declared, such as a view or ``detach()`` of a gradient the user kept)."""
        block = bucket.block
        if bucket.index is None:
            return False
        if not all(g.keeps_bucket_slice(block) for g in bucket.in_place):
            return False  # a member moved on (reduced into another bucket since): its count is stale
        done = self.allocator.free_in_place(bucket.alloc_key, block, 1 + sum(bucket.in_place.values()))
        if done is None:
            return False
        if done:
            ends = bucket.offsets[1:] + [bucket.used]
            members = tuple(zip(bucket.members, (e - o for o, e in zip(bucket.offsets, ends))))
            bucket.lane.emptied[bucket.index] = (block, bucket.alloc_key, members)
        else:  # the allocator kept the block: the members let go of their slices
            for g in bucket.in_place:
                g.forget_bucket_slice(block)
        bucket.in_place = {}
        return True

    def _refill(self, bucket: Bucket, numel: int, dtype, device) -> bool:
        """Give ``bucket`` (planned, its first member arriving) the block emptied at its plan
        position, refilled from torch and live again under its key, if the plan puts the same
        members there and the block still fits; False (allocate afresh) otherwise."""
        lane = bucket.lane
        kept = lane.emptied.pop(bucket.index, None)
        if kept is None:
            return False
        block, key, members = kept
        if (members != tuple(lane.plan[bucket.index]) or block.numel() != numel or block.dtype != dtype
                or block.device != device or not self.allocator.refill(key, block)):
            return False
        bucket.alloc_key, bucket.block = key, block
        return True

    def leak(self, bucket: Bucket, why: str) -> None:
        """The bucket's collective failed and may still write its block: never reuse it."""
        if bucket.block is not None and self.allocator.is_live(bucket.alloc_key):
            self.allocator.leak(bucket.alloc_key, why)
        bucket.block = None

    def abort(self) -> None:
        """After an exception: forget open buckets and the current record (the groups drop their
        pending reductions themselves, see ``GradientReduction.abort``)."""
        for lane in self._lanes.values():
            lane.open = None
            lane.emptied.clear()
            lane.record = []
            lane.pos = (0, 0)
            lane.diverged = False
        self._in_flight.clear()


def _itemsize(lane_key: tuple) -> int:
    dtype = lane_key[1]
    return torch.empty((), dtype=dtype).element_size()


def _plan(record: list, cap_numel: int) -> list[list]:
    """Cut a recorded packing sequence into buckets of at most ``cap_numel`` elements, in order
    (a group larger than that is a bucket of its own); a group never appears twice in one bucket."""
    plan: list[list] = []
    cur: list = []
    in_cur: set = set()  # ids of cur's groups: one look-up per group, not a scan of the bucket
    size = 0
    for group, numel in record:
        if cur and (size + numel > cap_numel or id(group) in in_cur):
            plan.append(cur)
            cur, size, in_cur = [], 0, set()
        cur.append((group, numel))
        in_cur.add(id(group))
        size += numel
    if cur:
        plan.append(cur)
    return plan
