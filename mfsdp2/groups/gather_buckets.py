"""All-gathers bucketed across units: persistent weights (ZeRO-1 ``optim``, ZeRO-2
``optim_grads``) always, small ZeRO-3 units when asked (``set_all_gather_bucket_cap_mb``).

Why: these strategies keep the full model weights between steps and re-gather them once per
change of the main weights (after each optimizer step), one all-gather per unit, issued by the
unit's pre-forward. With many small units (64 ``Linear(64, 64)`` blocks) that is dozens of
collectives of a few KiB each, each paying the backend's fixed latency (about 0.8 ms on gloo):
ZeRO-1's forward took 56 ms where torch DDP's takes 1 ms. Here the stale small groups share
**buckets**, one all-gather each, issued from the root's forward so the first units' compute
overlaps the later buckets. A ZeRO-3 unit pays the same latency twice per step (its forward and
its backward gather): with a cap set, the small sharded groups of the units about to gather join
buckets too, planned at the root's forward in the recorded order and again at the first
pre-backward of each backward in its reverse (``mfsdp2.runtime.unshard.plan_bucketed_gathers``
picks the units). Off by default: FSDP2 gathers each unit alone, and a bucket holds its
members' gathered rows before their units run (at most ``max_in_flight`` buckets of the cap).

The plan is made at every root forward, after the ranks agreed which persistent groups are stale
(:func:`mfsdp2.groups.weight_watch.agree_on_gathers`), from facts every rank shares: the schedule's
recorded forward order (every rank runs the same units in the same order), the agreed stale
flags, the groups' sizes and the bucket cap. Eligible: persistent, not FP8, a shard group of more
than one rank, stale, and smaller than both the cap and :data:`SMALL_GATHER_BYTES` (1 MiB: a
larger group keeps gathering straight into its own buffer, no copy, overlapping its neighbours'
compute); a sharded group must also not be gathered already, nor offloaded, nor stepped in
backward. Groups that can share a collective (same process group, compute dtype and
device, and both persistent or both sharded) are cut greedily, in plan order, into buckets of at
most the cap; a bucket of one group is dropped (the group gathers itself as before). So every
rank makes the same plan and issues the same collectives in the same order.

A bucket's all-gather input is its members' shards side by side; its output (an allocator block,
role ``"gather_bucket"``) is laid out rank-major, ``[rank 0: A, B, ...][rank 1: A, B, ...]``, so a
member's rows are one strided ``(world size, shard)`` block of it. The bucket's first wait
(:class:`MemberGather`) copies every member that has a buffer to fill -- persistent groups, and
sharded groups whose units took their handles (such a buffer gets its allocator block then, as its
own gather would) -- in one batched copy, and those members are done: their units unshard on the
fast path. A sharded member taken later is copied at its own wait. The block goes back to the
allocator once every member was copied out. At most :attr:`GatherBuckets.max_in_flight`
buckets hold blocks at a time: the next is issued when one is emptied (program order, the same on
every rank). A member waited on before its bucket was issued (the forward order changed) issues
it -- and every bucket before it -- first, so no wait ever blocks on a collective never started.

A group counts as stale while its rows are still to come (``ParameterGroup.pending_gather``), so
its unit's ``unshard`` always hands out the member's handle -- unless its weights were written
since the bucket was issued (announced, or for a sharded group a moved version counter): then it
gathers afresh. The root's post-forward (and a backward's final callback) finishes the plan:
issued buckets are waited and copied out (persistent groups of units that did not run; a sharded
group whose unit never asked gets nothing), buckets never issued are dropped, their groups still
stale (they gather per unit when next used: nothing changed on any rank, so every rank does the
same). After an exception, ``reset`` settles what was issued and
marks members whose rows may be missing as changed (and ``hooks.reset`` every persistent group, on
every rank, so the ranks decide alike at the next root forward).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..memory.allocator import BucketAllocator, BufferRole
from ..comm.communicator import CommHandle
from ..base.profiling import trace_range
from .weight_watch import WatchMode, fingerprints, watch_mode

__all__ = ["GatherBuckets", "MemberGather"]

logger = logging.getLogger(__name__)

Group = Any  # a ParameterGroup (untyped: param_group is below this file's users, not above it)


class _Bucket:
    """Several units' persistent groups gathered by one all-gather."""

    __slots__ = ("index", "comm", "dtype", "device", "members", "offsets", "total", "key", "block",
                 "handle", "remaining", "label", "collected")

    def __init__(self, index: int, members: list, root_name: str, step: int):
        g0 = members[0]
        self.index = index
        self.comm = g0.comm
        self.dtype = g0.compute_dtype
        self.device = g0.device
        self.members = members
        self.offsets: list[int] = []
        total = 0
        for g in members:  # each shard is a multiple of 16 bytes (layout alignment): aligned slices
            self.offsets.append(total)
            total += g.layout.shard_numel
        self.total = total
        self.key = (BufferRole.GATHER_BUCKET, root_name, index)
        self.block: Optional[torch.Tensor] = None
        self.handle: Optional[CommHandle] = None  # None until issued
        self.remaining: dict = {}  # id(group) -> its MemberGather, until copied out
        self.collected = False  # its first wait copied out every member that had a buffer
        kind = "persistent-weight" if g0.persistent else "sharded-weight"
        self.label = (f"all-gather of {kind} bucket {index} ({len(members)} groups, "
                      f"{members[0].name} .. {members[-1].name}, step {step})")

    def rows(self, i: int) -> torch.Tensor:
        """Member ``i``'s shards in the gathered block: ``(world size, shard numel)``, strided."""
        n = self.members[i].layout.shard_numel
        return self.block.view(self.comm.world_size, self.total)[:, self.offsets[i] : self.offsets[i] + n]


class MemberGather:
    """What a planned group's ``unshard`` hands out: issues its bucket (and every earlier one)
    if that has not happened yet; ``wait`` waits for the bucket and copies the group's rows into
    its persistent buffer (idempotent, like :class:`~mfsdp2.comm.communicator.CommHandle`)."""

    __slots__ = ("gathers", "bucket", "index", "group", "done")

    def __init__(self, gathers: "GatherBuckets", bucket: _Bucket, index: int):
        self.gathers = gathers
        self.bucket = bucket
        self.index = index
        self.group = bucket.members[index]
        self.done = False

    @property
    def label(self) -> str:
        return self.bucket.label

    def issue(self) -> None:
        self.gathers.issue_through(self.bucket)

    def wait(self) -> None:
        if self.done:
            return
        self.issue()
        self.bucket.handle.wait()
        self.gathers.collect(self)

    def settle(self) -> bool:
        """Cleanup after an error (``hooks.reset``): True when no collective may still write the
        bucket's block. Rows that may be missing leave the group marked changed."""
        if self.done:
            return True
        return self.gathers.settle(self)


class GatherBuckets:
    """The gather buckets of one root's forward or backward (``RootContext.gathers``)."""

    def __init__(self, allocator: BucketAllocator, root_name: str):
        self.allocator = allocator
        self.root_name = root_name
        self.max_in_flight = 2
        self.backward_plan = False  # the current plan was made at a backward's start
        # Bucket cap of the sharded (ZeRO-3) groups' gathers; 0: each unit gathers alone (FSDP2's way).
        self.transient_cap_bytes = DEFAULT_TRANSIENT_CAP_BYTES
        self._buckets: list[_Bucket] = []
        self._next = 0  # index of the next bucket to issue
        self.issued_count = 0  # buckets issued since creation (tests, diagnostics)

    @property
    def planned(self) -> int:
        """How many buckets the plan of the running forward (or backward) holds, issued or not."""
        return len(self._buckets)

    # -- plan ---------------------------------------------------------------------------------
    def start(self, order: list, cap_bytes: int, step: int, transient: Optional[set] = None,
              persistent: bool = True) -> None:
        """Plan buckets over the small groups of the units in ``order`` and issue the first ones.

        At the root's forward, after the agreement: ``order`` is the recorded forward order, the
        stale small persistent groups join (``persistent``), and so do the small sharded groups
        of the units whose ids are in ``transient`` (ZeRO-3 units about to gather, chosen by the
        runtime from facts every rank shares). At a backward's start ``order`` is the reversed
        record, ``persistent`` is False and ``transient`` names the units whose backward will
        gather. Persistent groups are cut at ``cap_bytes``, sharded ones at
        :attr:`transient_cap_bytes` (their gathered rows are memory a ZeRO-3 step would not hold
        yet: a cap of their own)."""
        if self._buckets:  # a forward that never ended, or a backward run inside a forward
            self.finish()
        self.backward_plan = not persistent
        transient = transient or set()
        transient_cap_bytes = self.transient_cap_bytes
        if cap_bytes <= 0 and not transient:
            return
        lanes: dict = {}
        seen: set = set()
        pos = 0
        for s in order:
            if id(s) in seen:
                continue
            seen.add(id(s))
            joins = id(s) in transient
            for g in s.groups:
                if ((persistent and _bucketable(g, cap_bytes))
                        or (joins and _transient_bucketable(g, transient_cap_bytes))):
                    lanes.setdefault((id(g.comm.group), g.compute_dtype, g.device, g.persistent), []).append((pos, g))
                    pos += 1
        cut = []
        for lane, members in lanes.items():
            cap = cap_bytes if lane[-1] else transient_cap_bytes
            cur: list = []
            size = 0
            for p, g in members:
                if cur and size + g.weights.nbytes > cap:
                    cut.append(cur)
                    cur, size = [], 0
                cur.append((p, g))
                size += g.weights.nbytes
            cut.append(cur)
        cut = sorted((b for b in cut if len(b) > 1), key=lambda b: b[0][0])  # forward order
        for i, members in enumerate(cut):
            b = _Bucket(i, [g for _, g in members], self.root_name, step)
            for k, g in enumerate(b.members):
                g.pending_gather = b.remaining[id(g)] = MemberGather(self, b, k)
            self._buckets.append(b)
        self._pump()

    # -- collectives --------------------------------------------------------------------------
    def _pump(self) -> None:
        """Issue planned buckets while fewer than :attr:`max_in_flight` hold blocks."""
        live = sum(1 for b in self._buckets[: self._next] if b.block is not None)
        while self._next < len(self._buckets) and live < self.max_in_flight:
            self._issue(self._buckets[self._next])
            live += 1

    def issue_through(self, bucket: _Bucket) -> None:
        """Issue every planned bucket up to ``bucket`` (in plan order), if not yet issued."""
        while self._next <= bucket.index and self._next < len(self._buckets):
            self._issue(self._buckets[self._next])

    def _issue(self, b: _Bucket) -> None:
        self._next = b.index + 1
        N, r, T = b.comm.world_size, b.comm.rank, b.total
        with trace_range("mfsdp2.issue_gather_bucket"), torch.no_grad():
            b.block = self.allocator.allocate(b.key, N * T, b.dtype, b.device)
            mine = b.block[r * T : (r + 1) * T]
            checked = [g for g in b.members if g.wants_baseline and watch_mode(g) is WatchMode.CONTENT]
            fps = dict(zip(map(id, checked), fingerprints([g.main_weight for g in checked])))
            shards = []
            for g in b.members:
                g.begin_gather(fps.get(id(g)))  # cast main -> model shard, clear the flags, fingerprint
                g.weights.take_shard()  # offloaded: the current stream reads what the copy-in stream wrote
                shards.append(g.weights.shard.view(-1))
            torch.cat(shards, out=mine)  # the members' shards side by side, at their offsets: one copy
            b.handle = b.comm.all_gather(b.block, mine, b.label)
        self.issued_count += 1

    def collect(self, m: MemberGather) -> None:
        """``m``'s bucket was waited: copy rows out; free the block after the last member. The
        bucket's first wait copies out the rows of every member that has a buffer to fill, in
        one batched copy, and those members are done: a bucket serves dozens of small units,
        and a copy each (with its grad-mode and functorch guards) plus each unit's general
        gather path cost more host time than the bytes. A unit whose group is done unshards on
        the fast path (:func:`mfsdp2.runtime.unshard.nothing_to_gather`); one written again since
        the bucket was issued is stale and re-gathers on its own, as it would have if its rows
        had been copied at its own wait. Persistent groups always have a buffer; a sharded
        group's rows go into its unsharded buffer once its unit took them (the buffer was given
        its block then), at its own wait when that comes later; a unit that never asked (it did
        not run) gets none."""
        b = m.bucket
        placed = [x for x in (b.remaining.values() if not b.collected else (m,)) if _has_buffer(x.group)]
        b.collected = True
        if placed:
            # As a unit's own gather: outside grad mode and torch.func's transforms (the rows are
            # written into buffers a transformed function captured).
            with torch.no_grad(), torch._C._DisableFuncTorch():
                torch._foreach_copy_([x.group.weights.rows_view() for x in placed],
                                     [b.rows(x.index) for x in placed])
        for x in placed:
            self._done(x)
        self._done(m)  # placed, or a unit that never asked: it gets none
        if not b.remaining:
            self.allocator.free(b.key)
            b.block = None
            self._pump()

    def _done(self, m: MemberGather) -> None:
        m.done = True
        m.bucket.remaining.pop(id(m.group), None)
        if m.group.pending_gather is m:
            m.group.pending_gather = None

    # -- end of the forward, errors -----------------------------------------------------------
    def finish(self) -> None:
        """The root's post-forward: buckets never issued are dropped (their groups stay stale and
        gather per unit when next used); issued ones are waited and every member still waiting
        (a unit that did not run) is copied out."""
        issued, dropped = self._buckets[: self._next], self._buckets[self._next :]
        self._buckets = issued  # nothing more is issued from here on
        for b in dropped:
            for m in list(b.remaining.values()):
                self._done(m)
        for b in issued:
            for m in list(b.remaining.values()):
                m.wait()
        self._buckets, self._next = [], 0
        self.backward_plan = False

    def finish_backward(self) -> None:
        """A backward's final callback: finish the plan its first pre-backward made (a forward's
        plan, of a backward run inside that forward, is the root's post-forward's to finish)."""
        if self.backward_plan:
            self.finish()

    def settle(self, m: MemberGather) -> bool:
        b = m.bucket
        if b.handle is None:  # never issued: the group's flags were never cleared
            self._done(m)
            return True
        if b.handle.settle():
            self.collect(m)
            return True
        m.group.changed = True  # rows may be missing: re-gather (hooks.reset marks every rank's groups too)
        self._done(m)
        return False

    def abort(self) -> None:
        """After an exception (``hooks.reset``, before it settles the units' own handles): settle
        every member still waiting; a bucket whose collective may still run is leaked, never
        reused. Nothing new is issued."""
        issued, dropped = self._buckets[: self._next], self._buckets[self._next :]
        self._buckets = issued
        for b in dropped:
            for m in list(b.remaining.values()):
                self._done(m)
        for b in issued:
            for m in list(b.remaining.values()):
                self.settle(m)
            if b.block is not None:  # a member's rows could not be collected: the block may be written still
                self.allocator.leak(b.key, f"the {b.label} failed and may still be running")
                b.block = None
        self._buckets, self._next = [], 0
        self.backward_plan = False


# The sharded groups' bucket cap unless set (``set_all_gather_bucket_cap_mb``).
DEFAULT_TRANSIENT_CAP_BYTES = 0

# Groups from this size up gather alone even below the cap: their collective is no longer
# latency-bound, and a bucket would cost them the zero-copy gather and the per-unit overlap (a
# unit waits for its whole bucket). Measured on the Llama demo (ZeRO-2, units of a few MiB,
# world size 2, gloo): 1.06-1.12x tuned FSDP2's step with its units bucketed, 0.90-0.91x alone.
SMALL_GATHER_BYTES = 1 << 20


def _has_buffer(g: Group) -> bool:
    """A member whose rows can be copied out now: persistent, or sharded and gathered by its unit."""
    return g.persistent or g.weights.is_unsharded


def _bucketable(g: Group, cap_bytes: int) -> bool:
    """A persistent group whose gather can share a bucket this forward (see the module docstring)."""
    return (g.persistent and g.fp8 is None and g.allocated and g.comm.world_size > 1
            and g.pending_gather is None and g.stale and g.weights.nbytes < min(cap_bytes, SMALL_GATHER_BYTES))


def _transient_bucketable(g: Group, cap_bytes: int) -> bool:
    """A sharded (ZeRO-3) group of a unit about to gather whose gather can share a bucket: small,
    not gathered already, main weights in compute memory (no CPU offload), no FP8 bytes and no
    optimizer stepping it in backward (gather listeners)."""
    return (not g.persistent and g.fp8 is None and g.allocated and g.comm.world_size > 1
            and not g.main.offloaded and not g.grad_listeners and g.pending_gather is None
            and not g.weights.is_unsharded and g.weights.nbytes < min(cap_bytes, SMALL_GATHER_BYTES))
