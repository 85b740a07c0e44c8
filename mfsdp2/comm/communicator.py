"""The one place that issues collectives and hands back waitable handles.

The scheduler above never branches on the device: it calls :meth:`Communicator.all_gather` /
:meth:`Communicator.reduce_scatter` and later ``handle.wait()``.

* CUDA: each kind of collective runs on its own side stream (all-gather, reduce-scatter, and one
  for the HSDP all-reduce), created at high priority as FSDP2's are (so the copies around them are
  not queued behind compute kernels). Before the side stream touches parameter or gradient memory
  it waits on the current stream: without that wait an async all-gather can read a shard the
  optimizer is still writing (the root cause of a convergence divergence in Megatron-FSDP2).
  ``wait()`` makes the current stream wait on an event recorded after the collective.
  A *stream-ordered* backend (NCCL: :func:`stream_ordered_backend`) is called with
  ``async_op=False`` inside the side stream: the call only enqueues work there, so the host goes on
  at once. Any other backend with CUDA tensors (gloo, which stages through host memory) is called
  with ``async_op=True`` and its work object is waited at ``wait()``: with ``async_op=False`` such
  a call blocks the host until the data has moved, so nothing would overlap.
* CPU (gloo): the same calls with ``async_op=True``; gloo runs them on its own threads, so the
  main thread's compute really overlaps them. ``wait()`` blocks on the work handle.

All traffic is counted in :data:`comm_stats` (bytes of each collective's output and call counts)
so the demo, the benchmarks and the tests can report volume per step.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..base import compat
from .devices import group_backend, reduce_op_support
from .handle import CollectiveError, CommHandle, _wait_work, set_collective_timeout

__all__ = [
    "CommStats",
    "comm_stats",
    "CommHandle",
    "Communicator",
    "CollectiveError",
    "set_collective_timeout",
    "set_collective_checks",
    "tensors_overlap",
    "host_tensor",
    "stream_ordered_backend",
]

# Opt-in: before each of the runtime's collectives, the ranks compare what they are about to issue
# (one small all-gather each time), so a rank that took another path through the model is named
# before gloo sees mismatched sizes (which it answers by terminating the process).
_check_collectives: bool = os.environ.get("MFSDP2_CHECK_COLLECTIVES", "0") == "1"
_labels: dict[int, str] = {}


def set_collective_checks(enabled: bool) -> None:
    """Compare every collective's kind, unit and size across ranks before issuing it (a debugging
    aid: one extra small all-gather per collective). Also ``MFSDP2_CHECK_COLLECTIVES=1``."""
    global _check_collectives
    _check_collectives = bool(enabled)


def host_tensor(values, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of facts the host already knows (e.g. which parameters had a gradient), to be
    agreed over a :meth:`Communicator.host` group. Reading it back is no device synchronisation;
    the mark lets ``tests/runtime/test_host_sync.py`` tell it from tensors whose reads would be."""
    t = torch.tensor(values, dtype=dtype)
    t._mfsdp2_host_metadata = True
    return t


def device_ints(values, device: torch.device) -> torch.Tensor:
    """``values`` (ints the host knows: sizes, segment lengths) as an int64 tensor on ``device``.
    On CUDA through page-locked memory with a non-blocking copy: ``torch.tensor(values,
    device="cuda")`` copies from pageable memory and waits for the copy, a host synchronisation
    (torch's caching host allocator keeps the page-locked block until the copy is done)."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# gloo reduce-scatters of inputs below this many bytes all-reduce the input in place (it is the
# caller's scratch, see Communicator.reduce_scatter): one collective on gloo's thread instead of 2(n-1) point-to-point
# operations whose posting blocks the main thread while another collective holds the pair
# (measured at world size 2 with an all-gather in flight: 16 KiB 1.0 vs 2.3 ms per pair of
# collectives, 256 KiB 2.3 vs 3.0 ms; from 1 MiB up the point-to-point exchange is faster).
SMALL_REDUCE_SCATTER_BYTES = 256 * 1024

# Gloo twins of device groups, by their ranks: created once per rank set and default process
# group (see Communicator.host). After ``destroy_process_group()`` and a new
# ``init_process_group()`` the twins of the old one are destroyed groups, never handed out again.
_host_groups: dict = {}
_host_world: list = [None]  # the default group the twins were made under


# Backends whose collectives on CUDA tensors are enqueued on the calling stream and return at once
# (the work object only orders streams): NCCL (RCCL reports itself as "nccl"), and Intel's XCCL.
STREAM_ORDERED_BACKENDS = frozenset({"nccl", "xccl"})


def stream_ordered_backend(name: str, device_type: str) -> bool:
    """Whether collectives of backend ``name`` on ``device_type`` tensors are ordered on the calling
    CUDA stream without blocking the host (then :class:`Communicator` calls them with
    ``async_op=False`` inside its side streams and records an event; otherwise with
    ``async_op=True``, waiting on the work)."""
    return device_type == "cuda" and name in STREAM_ORDERED_BACKENDS


@dataclass
class CommStats:
    """Bytes and call counts per collective kind since the last :meth:`reset`."""

    all_gather_bytes: int = 0
    all_gather_calls: int = 0
    reduce_scatter_bytes: int = 0
    reduce_scatter_calls: int = 0
    all_reduce_bytes: int = 0
    all_reduce_calls: int = 0
    # Sharded groups reduced as their share of a bucketed all-reduce (mfsdp2.groups.grad_buckets) instead
    # of a reduce-scatter of their own: with ``reduce_scatter_calls``, one per unit reduction.
    reduce_scatters_in_buckets: int = 0
    all_reduce_buckets: int = 0  # of ``all_reduce_calls``: the bucketed gradient all-reduces

    def reset(self) -> None:
        for k in self.as_dict():
            setattr(self, k, 0)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


comm_stats = CommStats()


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the memory ranges of ``a`` and ``b`` intersect (same storage)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0 = a.data_ptr()
    b0 = b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


_DONE = CommHandle()


def _rank_order_sum(parts: list, out: torch.Tensor, op) -> None:
    """``out = ((parts[0] + parts[1]) + parts[2]) + ...`` (divided by their count for AVG): every
    rank adds its chunk's terms in rank order whatever its own rank, so a gradient element's
    sum depends only on the values, not on where the layout put it. ``out`` may be one of the
    first two terms (``a + b`` and ``b + a`` are the same float, and ``torch.add`` reads each
    element before writing it), never a later one."""
    torch.add(parts[0], parts[1], out=out)
    for p in parts[2:]:
        out.add_(p)
    if op == dist.ReduceOp.AVG:
        out.div_(len(parts))


class Communicator:
    """Collectives over one process group on one device."""

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device):
        # group=None: this rank alone (the shard group of ``no_shard``, where every rank holds
        # everything); every collective is then a local copy or nothing.
        self.group = group
        self.device = device
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        # The backend that runs this group's collectives on ``device`` (a group may hold one per
        # device type: ``init_process_group()`` gives cpu:gloo,cuda:nccl), see mfsdp2.comm.devices.
        self.backend = (group_backend(group, device.type) or dist.get_backend(group)) if group is not None else "local"
        self._premul, self._native_avg = reduce_op_support(self.backend)
        cuda = device.type == "cuda"
        # See the module docstring: NCCL-like backends only enqueue on the calling stream.
        self.stream_ordered = stream_ordered_backend(self.backend, device.type)
        # High priority, as FSDP2's (torch.cuda.Stream(priority=-1)): the collectives and the
        # copies queued around them are not held up behind the compute stream's kernels.
        self.ag_stream = torch.cuda.Stream(device, priority=-1) if cuda else None
        self.rs_stream = torch.cuda.Stream(device, priority=-1) if cuda else None
        self.ar_stream = torch.cuda.Stream(device, priority=-1) if cuda else None
        self._subgroups: dict = {}
        self._host: Optional["Communicator"] = None
        # gloo has no native reduce-scatter (it all-reduces): use the point-to-point exchange.
        # MFSDP2_GLOO_P2P_REDUCE_SCATTER=0 turns it off.
        self.p2p_reduce_scatter = (
            not cuda
            and self.backend == "gloo"
            and os.environ.get("MFSDP2_GLOO_P2P_REDUCE_SCATTER", "1") != "0"
        )

    def premul_sum(self, factor: float):
        """NCCL's PREMUL_SUM (scale by ``factor`` inside the reduction), or None where the backend
        has none (gloo: the caller pre-scales while packing instead)."""
        if self._premul:
            return dist._make_nccl_premul_sum(factor)
        return None

    def share_streams(self, other: "Communicator") -> None:
        """Issue this communicator's collectives on ``other``'s side streams (``share_comm_ctx``:
        several roots, e.g. pipeline stages, that should not each hold three streams)."""
        if other.device != self.device:
            raise ValueError(f"mfsdp2: cannot share the streams of a {other.device} communicator "
                             f"with a {self.device} one")
        self.ag_stream, self.rs_stream, self.ar_stream = other.ag_stream, other.rs_stream, other.ar_stream

    def subgroup(self, size: int) -> "Communicator":
        """The communicator of this rank's block of ``size`` consecutive ranks of the group.

        Collective: every rank of the group must call it (``dist.new_group`` for every block, in
        the same order). Cached, so later calls are local.
        """
        key = ("sub", size)
        if key not in self._subgroups:
            if size < 1 or self.world_size % size:
                raise ValueError(f"subgroup size {size} must divide the group size {self.world_size}")
            ranks = dist.get_process_group_ranks(self.group)
            mine = None
            for start in range(0, self.world_size, size):
                g = dist.new_group(ranks[start : start + size])
                if start <= self.rank < start + size:
                    mine = g
            self._subgroups[key] = Communicator(mine, self.device)
        return self._subgroups[key]

    def host(self) -> "Communicator":
        """A communicator over the same ranks for host metadata (:func:`host_tensor`).

        Why: agreeing on facts the host knows over the device group (NCCL) would copy them to
        the device and read the result back -- a host synchronisation on every step. A CPU run's
        group already is a gloo group on the host, so it is its own; otherwise a gloo twin is
        created once, at the first use, which every member reaches together (a collective point
        of the step). ``use_local_synchronization``: only the member ranks take part, so each
        block of an HSDP mesh can create its own."""
        if self.group is None or self.device.type == "cpu":
            return self
        if self._host is None:
            ranks = tuple(dist.get_process_group_ranks(self.group))
            if _host_world[0] is not dist.group.WORLD:
                _host_groups.clear()
                _host_world[0] = dist.group.WORLD
            if ranks not in _host_groups:
                _host_groups[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
            self._host = Communicator(_host_groups[ranks], torch.device("cpu"))
        return self._host

    def _launch(self, stream, fn, label: str = "", after: Optional[CommHandle] = None) -> CommHandle:
        """Issue ``fn(async_op)``: on CPU asynchronously (its work waited at ``wait()``); on CUDA
        inside ``stream`` after it waited on the current stream, with ``async_op=False`` on a
        stream-ordered backend (the call only enqueues) and ``async_op=True`` on any other (gloo:
        its work is waited too, which orders the current stream after the data moved).

        ``after``: a collective whose output this one reads. On a stream it is ordered on the
        device (the side stream waits on its event: neither the host nor the compute stream
        stalls); without streams, or when ``after`` has no event, the host waits for it first."""
        if stream is None:
            if after is not None:
                after.wait()
            return CommHandle(work=fn(True), label=label)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            if after.event is not None:
                stream.wait_event(after.event)
            else:
                after.wait()
        with torch.cuda.stream(stream):
            work = None if self.stream_ordered else fn(True)
            if self.stream_ordered:
                fn(False)
            event = torch.cuda.Event()
            event.record(stream)
        return CommHandle(work=work, event=event, label=label)

    def verify(self, label: str, numel: int) -> None:
        """With collective checks on (:func:`set_collective_checks`): raise CollectiveError on every
        rank, naming what each rank was about to issue, when the ranks disagree."""
        if not _check_collectives or self.world_size == 1:
            return
        h = zlib.crc32(label.encode()) & 0x7FFFFFFF
        _labels[h] = label
        mine = torch.tensor([h, numel], dtype=torch.int64, device=self.device)
        every = torch.empty(self.world_size * 2, dtype=torch.int64, device=self.device)
        work = compat.all_gather_single(every, mine, group=self.group, async_op=True)
        _wait_work(work, f"collective check before the {label}")
        rows = every.view(self.world_size, 2).tolist()
        if any(r != rows[self.rank] for r in rows):
            seen = "; ".join(
                f"rank {i}: {_labels.get(r[0], f'a collective unknown here (#{r[0]:x})')} ({r[1]} elements)"
                for i, r in enumerate(rows)
            )
            raise CollectiveError(
                f"mfsdp2 E33: the ranks are about to issue different collectives: {seen}. Every rank must run "
                "the same units in the same order (same branches, same skipped modules)"
            )

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, label: str = "") -> CommHandle:
        """Gather equal shards into ``out``; ``inp`` may be (and in our buffers is) ``out``'s slice.

        ``label`` (every collective method takes one) names the collective in errors and in the
        cross-rank check of :func:`set_collective_checks`."""
        comm_stats.all_gather_calls += 1
        comm_stats.all_gather_bytes += out.numel() * out.element_size()
        if self.world_size == 1:
            if inp.data_ptr() != out.data_ptr():
                out.copy_(inp)
            return _DONE
        self.verify(label, out.numel())
        return self._launch(
            self.ag_stream,
            lambda a: compat.all_gather_single(out, inp, group=self.group, async_op=a),
            label,
        )

    def _p2p_path(self, op, input_bytes: int) -> bool:
        if not (self.p2p_reduce_scatter and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)):
            return False
        return input_bytes >= SMALL_REDUCE_SCATTER_BYTES

    def _all_to_all_path(self, op, input_bytes: int) -> bool:
        """gloo, more than two ranks, inputs below :data:`SMALL_REDUCE_SCATTER_BYTES`: one
        ``all_to_all_single`` and a rank-order sum (:meth:`_all_to_all_reduce_scatter`)."""
        return (
            self.world_size > 2
            and self.p2p_reduce_scatter
            and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
            and not self._p2p_path(op, input_bytes)
        )

    def reduce_scatter_is_all_reduce(self, op, input_bytes: int) -> bool:
        """Whether a reduction of ``input_bytes`` may share a bucketed all-reduce with other
        groups' (``mfsdp2.groups.grad_buckets``): gloo, below :data:`SMALL_REDUCE_SCATTER_BYTES`,
        where one collective per bucket beats one per group. At two ranks :meth:`reduce_scatter`
        is such an all-reduce itself (no extra bytes); above two it is an all-to-all of half the
        bytes, so a bucket trades bytes for collectives there."""
        return (
            self.world_size > 1
            and self.p2p_reduce_scatter
            and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
            and not self._p2p_path(op, input_bytes)
        )

    def reduce_scatter_scratch_numel(self, shard_numel: int, op=dist.ReduceOp.AVG, itemsize: int = 4) -> int:
        """Elements of receive scratch :meth:`reduce_scatter` wants for a ``shard_numel`` output
        of ``itemsize``-byte elements (0 unless a gloo point-to-point or all-to-all path runs), so callers can
        take it from their allocator."""
        if self.world_size > 1 and self._p2p_path(op, shard_numel * self.world_size * itemsize):
            return (self.world_size - 2) * shard_numel  # one received chunk lands in the output itself
        if self._all_to_all_path(op, shard_numel * self.world_size * itemsize):
            return self.world_size * shard_numel  # every rank's chunk, this rank's own included
        return 0

    @property
    def reduces_alone(self) -> bool:
        """Whether a reduce-scatter over this group is the identity (a group of one rank): then
        :meth:`reduce_scatter` takes its input as its output (``out is inp``) and copies nothing,
        so a caller may pack the input where the result belongs."""
        return self.world_size == 1

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        op=dist.ReduceOp.AVG,
        scratch: Optional[torch.Tensor] = None,
        label: str = "",
    ) -> CommHandle:
        """Reduce ``inp`` over ranks and scatter equal pieces into ``out``, which must not alias it.

        ``inp`` is the caller's scratch (the runtime's flat gradient buffers, never read after
        their reduction): on gloo one below :data:`SMALL_REDUCE_SCATTER_BYTES` is all-reduced in
        place at two ranks. ``scratch`` (optional, :meth:`reduce_scatter_scratch_numel` elements)
        receives the other ranks' chunks on the gloo point-to-point and all-to-all paths; it must
        stay untouched until ``wait()``. On gloo with SUM / AVG every element is summed in rank
        order at every size and world size (at two ranks either order is the same float)."""
        if out is inp and self.reduces_alone:  # the identity: nothing to copy
            comm_stats.reduce_scatter_calls += 1
            comm_stats.reduce_scatter_bytes += inp.numel() * inp.element_size()
            return _DONE
        if tensors_overlap(out, inp):
            raise RuntimeError(
                "mfsdp2 E19: reduce_scatter output overlaps its input: a collective that writes into the buffer "
                "it is still reading silently corrupts gradients; pass a separate output tensor"
            )
        comm_stats.reduce_scatter_calls += 1
        comm_stats.reduce_scatter_bytes += inp.numel() * inp.element_size()
        if self.world_size == 1:
            out.copy_(inp)
            return _DONE
        self.verify(label, inp.numel())
        if self._p2p_path(op, inp.numel() * inp.element_size()):
            return self._p2p_reduce_scatter(out, inp, op, scratch, label)
        if self._all_to_all_path(op, inp.numel() * inp.element_size()):
            return self._all_to_all_reduce_scatter(out, inp, op, scratch, label)
        if self.p2p_reduce_scatter and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return self._in_place_reduce_scatter(out, inp, op, label)
        return self._launch(
            self.rs_stream,
            lambda a: compat.reduce_scatter_single(out, inp, op=op, group=self.group, async_op=a),
            label,
        )

    def _in_place_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op, label: str) -> CommHandle:
        """gloo, small inputs the caller gave up: all-reduce (SUM) ``inp`` in place, then copy
        this rank's chunk into ``out`` at ``wait()`` (divided by the world size for AVG). The same
        sum as gloo's own reduce-scatter (an all-reduce of a clone) without the clone."""
        n, r, S = self.world_size, self.rank, out.numel()
        work = dist.all_reduce(inp, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

        def take() -> None:
            chunk = inp.view(n, S)[r]
            if op == dist.ReduceOp.AVG:
                torch.div(chunk, n, out=out)
            else:
                out.copy_(chunk)

        return CommHandle(work=work, then=take, label=label)

    def _all_to_all_reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op, scratch: Optional[torch.Tensor], label: str
    ) -> CommHandle:
        """gloo, more than two ranks, small inputs: every rank's chunk for this rank in one
        ``all_to_all_single`` (a single collective on gloo's thread, (n-1)/n of the input's bytes),
        summed in rank order at ``wait()``. Why not gloo's all-reduce, as at two ranks: its ring
        sums chunk ``c`` starting from rank ``c - 1``, so an element's order of additions would
        depend on which rank's rows hold it, i.e. on the layout; in rank order it depends on
        nothing, as on the point-to-point path above this size (measured at four ranks, 16 KiB
        to 1 MiB: 2.7-5x faster than the in-place all-reduce, and faster than the posts)."""
        n, S = self.world_size, out.numel()
        recv = scratch.view(n, S) if scratch is not None else torch.empty((n, S), dtype=inp.dtype, device=inp.device)
        work = dist.all_to_all_single(recv, inp, group=self.group, async_op=True)
        return CommHandle(work=work, then=lambda: _rank_order_sum(list(recv), out, op), label=label)

    def _p2p_reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op, scratch: Optional[torch.Tensor], label: str
    ) -> CommHandle:
        """gloo only: reduce-scatter from point-to-point sends (gloo runs ``reduce_scatter_tensor``
        as a full all-reduce, twice the bytes; ``benchmarks/ring_reduce_scatter.py`` measured this
        2-3x faster). Every rank posts all its sends and receives at once, so the whole exchange
        runs on gloo's threads like a collective; the sum (in rank order, so every run is
        bitwise reproducible) happens at ``wait()``."""
        n, r, S = self.world_size, self.rank, out.numel()
        chunks = inp.view(n, S)
        # Received chunks only; this rank's own chunk is read in place, and the lowest-ranked
        # peer's chunk is received straight into ``out`` (so world size 2 needs no scratch): it is
        # one of the first two terms of the rank-order sum, which ``torch.add(.., out=out)`` reads
        # before writing each element. The other n-2 go to ``scratch``.
        peers = [s for s in range(n) if s != r]
        if n > 2:
            rest = (scratch.view(n - 2, S) if scratch is not None
                    else torch.empty((n - 2, S), dtype=inp.dtype, device=inp.device))
        into = {src: (out if i == 0 else rest[i - 1]) for i, src in enumerate(peers)}
        works = []
        for k in range(1, n):  # staggered peers so every pair exchanges at once
            dst, src = (r + k) % n, (r - k) % n
            works.append(dist.isend(chunks[dst], group=self.group, group_dst=dst))
            works.append(dist.irecv(into[src], group=self.group, group_src=src))

        def reduce() -> None:
            _rank_order_sum([chunks[r] if s == r else into[s] for s in range(n)], out, op)

        return CommHandle(work=works, then=reduce, label=label)

    def all_reduce(
        self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None, label: str = "",
        after: Optional[CommHandle] = None,
    ) -> CommHandle:
        """All-reduce in place. ``AVG`` works on every backend: gloo has no AVG all-reduce, so
        there it is a SUM followed by a division when the handle is waited on."""
        group = group or self.group
        n = dist.get_world_size(group) if group is not None else 1
        comm_stats.all_reduce_calls += 1
        comm_stats.all_reduce_bytes += tensor.numel() * tensor.element_size()
        if n == 1:
            if after is not None:
                after.wait()
            return _DONE
        if group is self.group:
            self.verify(label, tensor.numel())
        native_avg = (self._native_avg if group is self.group
                      else reduce_op_support(group_backend(group, self.device.type))[1])
        emulate_avg = op == dist.ReduceOp.AVG and not native_avg
        wire_op = dist.ReduceOp.SUM if emulate_avg else op
        handle = self._launch(
            self.ar_stream, lambda a: dist.all_reduce(tensor, op=wire_op, group=group, async_op=a), label, after
        )
        if not emulate_avg:
            return handle
        return CommHandle(inner=handle, then=lambda: tensor.div_(n), label=label)
