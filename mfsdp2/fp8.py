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
:mod:`mfsdp2.native`'s kernels on CPU, their bit-identical PyTorch references elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch

from . import native
from .buffer import DataParallelBuffer
from .comm import CommHandle


# A mfsdp2.param_group.ParameterGroup; not imported, since that module imports this one (a
# lower file must not import a higher one).
Group = Any

__all__ = ["Float8Gather", "FP8_DTYPES"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class Float8Gather:
    """The float8 side of one :class:`~mfsdp2.param_group.ParameterGroup`: a uint8 buffer on
    the group's layout (its shard is the quantised main shard), the agreed scales, and the
    gather that dequantises into the group's compute-dtype unsharded buffer."""

    def __init__(self, group: Group, dtype: torch.dtype):
        self.group = group
        self.dtype = dtype
        self.max = torch.finfo(dtype).max
        n = len(group.layout.slots)
        device = group.main_weight.device  # meta until a meta-built group is allocated
        self.bytes = DataParallelBuffer(group.layout, torch.uint8, device, group.comm)
        self.bytes.free_unsharded()
        self.scales = torch.ones(n, dtype=torch.float32, device=device)
        self.agreed = False  # scales agreed by some all-reduce yet (the root's forward, or a first unshard)
        self._local_amax = torch.zeros(n, dtype=torch.float32, device=device)
        self.quantisations = 0  # tests: one per gather
        w = group.weights
        pieces = [group.layout.piece(i, w.rank) for i in range(n)]
        self._pieces = native.Segments([p.shard_offset for p in pieces], [p.numel for p in pieces])
        self._slots = native.Segments([s.offset for s in group.layout.slots], [s.numel for s in group.layout.slots])

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
        scales = torch.where(amax > 0, self.max / amax.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
        self.scales.copy_(scales)
        self.agreed = True

    def _quantise(self) -> None:
        with torch.no_grad():  # padding bytes are 0
            native.quantise_fp8(self.group.main_weight, self.bytes.shard, self._pieces, self.scales, self.dtype)
        self.quantisations += 1

    def all_gather(self, allocator, key, label: str) -> CommHandle:
        """Gather the float8 bytes, then (at ``wait()``) dequantise them into the unsharded
        compute-dtype buffer, which is where the module's parameters live."""
        g = self.group
        if not self.agreed:
            # First gather, before any root forward agreed on scales (an explicit unshard()):
            # agree now, inside this group. Every rank is here for the same reason.
            amax = self.local_amax().clone()
            g.comm.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, label=f"fp8 amax of {g.name}").wait()
            self.set_global_amax(amax)
        self._quantise()
        bkey = ("fp8", key)
        h = self.bytes.all_gather(allocator, bkey, label)

        def dequantise() -> None:
            h.wait()
            w = g.weights
            w.materialize(allocator, key)
            with torch.no_grad():
                native.dequantise_fp8(self.bytes._writer, w._writer, self._slots, self.scales, self.dtype)
            self.bytes.free_unsharded()

        return CommHandle(then=dequantise, inner=h, label=label)  # inner: settle() sees the gather's work


def agree_scales(groups: list[Group], amax: torch.Tensor, offset: int) -> int:
    """Hand each FP8 group its slice of the all-reduced amax vector; returns the next offset."""
    for g in groups:
        n = len(g.layout.slots)
        g.fp8.set_global_amax(amax[offset : offset + n])
        offset += n
    return offset
