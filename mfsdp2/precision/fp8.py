"""FP8 all-gather: weights travel as float8 (e4m3) bytes with one scale per parameter.

Why: the all-gather of the weights is most of FSDP's traffic. Quantising each parameter's main
(fp32) shard to float8 as it goes into each gather halves those bytes against bf16; the module
still computes in ``param_dtype`` (the gathered bytes are dequantised into the unsharded buffer).

Nothing is cached between gathers: the amax is taken from the main shard at every root forward
and the shard is quantised at every unshard (one elementwise pass over the shard, the cost class
of the bf16 cast a ZeRO-3 gather does anyway). A cache keyed by version counters missed writes
through ``.data`` (an EMA swapped in, ``torch.nn.init`` on ``p.data``) and gathered old weights
with old scales; deciding from the values instead would need a device-to-host read per gather.

Scales must be identical on every rank -- a parameter's rows are spread over ranks, and rows
quantised with different scales cannot be dequantised with one. So each rank computes the amax of
its rows of every FP8 parameter, and the ranks take the maximum with **one all-reduce per step for
all units together** (:func:`agree_scales`, called from the root's forward together with the
persistent-weight staleness flags). ``scale = finfo.max / amax``; a parameter that is all zeros
gets scale 1.

Only parameters with two or more dimensions (matmul weights) are gathered in FP8: norms and
biases are small and sensitive, so ``fully_shard`` puts them in ordinary groups.

The quantise and the dequantise are one call each over the whole buffer and its segment table
(this rank's pieces in the shard; the parameters' slots in the gathered buffer):
:mod:`mfsdp2.precision.native`'s kernels on CPU (their bit-identical PyTorch references without the
extension). On an accelerator the gathered block is dequantised by a few kernels per tile of it
(:mod:`mfsdp2.precision.fp8_tiles`), not per rank and parameter, with the reference's arithmetic.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from . import native
from .fp8_tiles import GatheredDequantise
from ..memory.buffer import leaked_blocks
from ..comm.communicator import CommHandle
from ..memory.allocator import BufferRole


# A mfsdp2.groups.param_group.ParameterGroup; not imported, since that module imports this one (a
# lower file must not import a higher one).
Group = Any

__all__ = ["Float8Gather", "FP8_DTYPES", "gather_riders", "MERGE_GATHERS"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# One all-gather per FP8 group carrying the unit's compute-dtype group too (gather_riders);
# MFSDP2_FP8_MERGED_GATHER=0 gathers each group on its own (tests compare the two).
MERGE_GATHERS = os.environ.get("MFSDP2_FP8_MERGED_GATHER", "1") != "0"


class Float8Gather:
    """The float8 side of one :class:`~mfsdp2.groups.param_group.ParameterGroup`: the agreed scales, the
    quantise of the main shard into the gather's input and the dequantise of the gathered bytes
    into the group's compute-dtype unsharded buffer. The bytes live in an allocator block for
    the gather only (role ``"fp8"``): nothing of them is kept between gathers."""

    def __init__(self, group: Group, dtype: torch.dtype):
        self.group = group
        self.dtype = dtype
        self.max = torch.finfo(dtype).max
        n = len(group.layout.slots)
        device = group.main_weight.device  # meta until a meta-built group is allocated
        self.scales = torch.ones(n, dtype=torch.float32, device=device)
        self.agreed = False  # scales agreed by some all-reduce yet (the root's forward, or a first unshard)
        self._local_amax = torch.zeros(n, dtype=torch.float32, device=device)
        self.quantisations = 0  # tests: one per gather
        w = group.weights
        lay = group.layout
        pieces = [lay.piece(i, w.rank) for i in range(n)]
        self._pieces = native.Segments([p.shard_offset for p in pieces], [p.numel for p in pieces])
        # Rank r's pieces, offsets inside its shard: where the dequantise reads rank r's bytes.
        self._rank_pieces = [
            native.Segments([lay.piece(i, r).shard_offset for i in range(n)], [lay.piece(i, r).numel for i in range(n)])
            for r in range(lay.world_size)
        ]
        self._block: Optional[tuple[torch.Tensor, Any, Any]] = None  # the gathered bytes: (block, allocator, key)
        self._gathered: Optional[GatheredDequantise] = None  # the accelerator's tiles, built at first use
        self.tiled_on_cpu = False  # tests: run the accelerator's dequantise on the host

    def local_amax(self) -> torch.Tensor:
        """Max |w| over this rank's rows of each parameter (0 for an empty piece), computed from
        the current main shard on the device at every call (the root's forward). ``aminmax``
        reads the piece once with no temporary (``abs().max()`` writes an |w| copy first); the
        larger magnitude of its two ends is exactly max |w|, NaN included."""
        g = self.group
        with torch.no_grad():
            for i in range(len(g.layout.slots)):
                piece = g.weights.piece_view(g.main_weight, i)
                if piece.numel():
                    lo, hi = torch.aminmax(piece)
                    torch.maximum(lo.abs(), hi.abs(), out=self._local_amax[i])
                else:
                    self._local_amax[i] = 0.0
        return self._local_amax

    def set_global_amax(self, amax: torch.Tensor) -> None:
        """Scales from the all-reduced amax, on the device: ``finfo.max / amax`` (1 for all zeros)."""
        scales = torch.where(amax > 0, self.max / amax.clamp_min(torch.finfo(torch.float32).tiny),
                             torch.ones_like(amax))
        self.scales.copy_(scales)
        self.agreed = True

    def all_gather(self, allocator, key, label: str, rider: Optional[Group] = None, rider_key=None) -> CommHandle:
        """Gather the float8 bytes -- and, with ``rider``, that group's compute-dtype shard in the
        same collective -- then (at ``wait()``) dequantise into this group's unsharded buffer and
        copy the rider's bytes into its own.

        Each rank's input is ``[float8 shard (S bytes) | rider's shard (S' elements) | pad]``,
        ``R`` bytes in all (a multiple of 16); the gathered block is rank-major, ``N x R``.
        Why one collective: a unit's norms and biases are a second group (they stay in the
        compute dtype), and a second all-gather of a few KiB costs gloo's fixed ~1 ms latency
        and a second wait. The rider's bytes are the same cast of its main shard that its own
        gather makes (:meth:`DataParallelBuffer.all_gather`), so every weight is bit for bit the
        one the separate gathers give (``tests/precision/test_fp8_merged_gather.py``)."""
        g = self.group
        if not self.agreed:
            # First gather, before any root forward agreed on scales (an explicit unshard()):
            # agree now, inside this group. Every rank is here for the same reason.
            amax = self.local_amax().clone()
            g.comm.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, label=f"fp8 amax of {g.name}").wait()
            self.set_global_amax(amax)
        N, S = g.layout.world_size, g.layout.shard_numel
        start, end = S, S  # the rider's bytes in a rank's region
        if rider is not None:
            start = _align_up(S, 16)  # aligned for the rider's dtype
            end = start + rider.layout.shard_numel * rider.weights._writer.element_size()
        R = _align_up(end, 16)
        bkey = (BufferRole.FP8, key)
        if allocator is not None:
            block = allocator.allocate(bkey, N * R, torch.uint8, g.device)
        else:  # an explicit unshard() before the root's first forward: no allocator yet
            block = torch.empty(N * R, dtype=torch.uint8, device=g.device)
        self._block = (block, allocator, bkey)
        mine = block[g.weights.rank * R : (g.weights.rank + 1) * R]
        native.quantise_fp8(g.main_weight, mine[:S], self._pieces, self.scales, self.dtype)  # padding bytes are 0
        self.quantisations += 1
        if R > S:
            mine[S:start].zero_()
            if rider is not None:
                mine[start:end].view(rider.weights.dtype).copy_(rider.weights.shard)  # its gather's cast
            mine[end:].zero_()
        h = g.comm.all_gather(block, mine, label)

        def dequantise() -> None:
            h.wait()
            w = g.weights
            w.materialize(allocator, key)
            rows = block.view(N, R)
            with torch.no_grad():
                if w.device.type != "cpu" or self.tiled_on_cpu:
                    self._tiles()(rows, w._writer, self.scales, self.dtype)
                else:
                    self._dequantise_per_rank(rows, w)
                if rider is not None:
                    rw = rider.weights
                    rw.materialize(allocator, rider_key)
                    rw._writer.view(N, -1).copy_(rows[:, start:end].view(rw.dtype))
            self._free()

        return CommHandle(then=dequantise, inner=h, label=label)  # inner: settle() sees the gather's work

    def _dequantise_per_rank(self, rows: torch.Tensor, w) -> None:
        """The host path: the native lookup (or its reference) per rank's bytes and pieces."""
        N, S = self.group.layout.world_size, self.group.layout.shard_numel
        tables = native.dequantise_tables(self.scales, self.dtype, w.dtype) if N > 1 and native.available() else None
        for r in range(N):  # rank r's bytes, with rank r's pieces, the same lookup per byte
            native.dequantise_fp8(rows[r, :S], w._writer[r * S : (r + 1) * S], self._rank_pieces[r], self.scales,
                                  self.dtype, tables)

    def _tiles(self) -> GatheredDequantise:
        """The accelerator path (a few kernels per tile of the block, not per rank and piece)."""
        if self._gathered is None:
            lay = self.group.layout
            self._gathered = GatheredDequantise(self._rank_pieces, lay.shard_numel, len(lay.slots))
        return self._gathered

    def _free(self) -> None:
        block, alloc, key = self._block
        self._block = None
        if alloc is not None:
            alloc.free(key)

    def abandon(self, why: str) -> None:
        """The gather did not provably end: its block may still be written by the backend's
        thread, so it is leaked, never reused (see ``DataParallelBuffer.abandon_unsharded``)."""
        if self._block is None:
            return
        block, alloc, key = self._block
        self._block = None
        if alloc is not None:
            alloc.leak(key, why)
        else:
            leaked_blocks.append(block)


def gather_riders(groups: list[Group]) -> dict[int, int]:
    """Which group rides along in which FP8 group's all-gather (indices into ``groups``, a unit's):
    each FP8 group takes the first group not gathered in float8 that gathers on the same
    communicator and device at every unshard (ZeRO-3: not persistent). Every rank has the same
    groups, so every rank pairs them alike and issues the same collectives. Empty when
    :data:`MERGE_GATHERS` is off."""
    if not MERGE_GATHERS:
        return {}
    out: dict[int, int] = {}
    taken = set()
    for i, g in enumerate(groups):
        if g.fp8 is None:
            continue
        for j, r in enumerate(groups):
            if j in taken or r.fp8 is not None or r.persistent or r.comm is not g.comm or r.device != g.device:
                continue
            out[i] = j
            taken.add(j)
            break
    return out


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def agree_scales(groups: list[Group], amax: torch.Tensor, offset: int) -> int:
    """Hand each FP8 group its slice of the all-reduced amax vector; returns the next offset."""
    for g in groups:
        n = len(g.layout.slots)
        g.fp8.set_global_amax(amax[offset : offset + n])
        offset += n
    return offset
