"""Orders of addition of a gradient reduce-scatter on gloo, for comparisons with FSDP2 above two ranks.

At two ranks every reduction is one addition, ``a + b == b + a``: FSDP2 and mfsdp2 give the same
floats whatever the layout. Above two ranks the order matters, and the two runtimes differ:

* **FSDP2** calls gloo's ``reduce_scatter_tensor``, which gloo runs as a ring all-reduce
  (``gloo/allreduce.cc``, ``ring``): the input is cut into ``2n`` segments (n ranks; more above
  gloo's maximum segment size, which these inputs never reach) of
  ``ceil(bytes / 2n)`` bytes rounded up to the element size, two per *ring chunk*; chunk ``c``
  starts at rank ``c - 1``, which sends it to ``c - 2``, each adding its own term, so it ends as
  ``((x[c-1] + x[c-2]) + ...) + x[c]``. Which chunk an element falls in depends on where FSDP2's
  layout puts it (each parameter split in ``torch.chunk`` pieces, one per rank).
* **mfsdp2** sums every element in rank order, ``((x[0] + x[1]) + x[2]) + ...``, whatever its
  layout (``mfsdp2.comm.communicator``: point-to-point or all-to-all, then the sum).

:func:`ring_order_reduce_scatter` predicts gloo's result from every rank's input, so a test can
check, element by element, that FSDP2's output is exactly that: the proof that the only
difference from mfsdp2 is the order of additions. :class:`RankOrderReduceScatter` is torch's
``ReduceScatter`` interface summing in rank order (from an all-gather of the inputs, nothing of
mfsdp2): installed in FSDP2, it is FSDP2 with mfsdp2's order, which mfsdp2 must then match bit
for bit at any world size.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

try:  # torch's interface for set_custom_reduce_scatter
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - an older torch: a plain base class serves
    ReduceScatter = object


def _fold(terms: list) -> torch.Tensor:
    out = terms[0] + terms[1]
    for t in terms[2:]:
        out = out + t
    return out


class RankOrderReduceScatter(ReduceScatter):
    """Reduce-scatter (SUM or AVG) with each element summed in rank order; records calls into
    ``records`` as :class:`GlooReduceScatter` does."""

    def __init__(self):
        self.records: Optional[list] = None

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        everyone = torch.empty(n * input_tensor.numel(), dtype=input_tensor.dtype)
        dist.all_gather_into_tensor(everyone, input_tensor.contiguous().view(-1), group=group)
        mine = everyone.view(n, n, -1)[:, r]
        out = _fold(list(mine))
        if op == dist.ReduceOp.AVG:
            out = out / n
        output_tensor.copy_(out.view_as(output_tensor))
        if self.records is not None:
            self.records.append((tuple(dist.get_process_group_ranks(group)), input_tensor.detach().clone(),
                                 output_tensor.detach().clone()))
        return None


class GlooReduceScatter(ReduceScatter):
    """FSDP2's own call (``dist.reduce_scatter_tensor``, as torch's default object makes it), recording
    step-1 calls into ``records`` when it is a list: (the group's ranks, the input, the output)."""

    def __init__(self):
        self.records: Optional[list] = None

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if self.records is not None:
            inp = input_tensor.detach().clone()
        work = dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if self.records is not None:
            if work is not None:
                work.wait()
            self.records.append((tuple(dist.get_process_group_ranks(group)), inp, output_tensor.detach().clone()))
        return work


def ring_chunks(numel: int, world_size: int, itemsize: int) -> list[int]:
    """The ring chunk of each element of a gloo all-reduce of ``numel`` elements (see the module
    docstring): ``2 * world_size`` segments of ``ceil(bytes / (2 * world_size))`` bytes rounded up
    to the element size, two segments per chunk."""
    total = numel * itemsize
    segments = 2 * world_size
    seg_bytes = -(-total // segments)
    seg_bytes += (-seg_bytes) % itemsize
    per_chunk = 2 * seg_bytes // itemsize
    return [i // per_chunk for i in range(numel)]


def ring_order_reduce_scatter(inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """gloo's ``reduce_scatter_tensor`` (SUM) output on ``rank`` predicted from every rank's
    ``inputs``: each element of this rank's chunk summed in the ring order of the ring chunk it
    falls in."""
    n = len(inputs)
    numel = inputs[0].numel()
    S = numel // n
    chunk_of = torch.tensor(ring_chunks(numel, n, inputs[0].element_size()))
    out = torch.empty(S, dtype=inputs[0].dtype)
    lo = rank * S
    mine = chunk_of[lo : lo + S]
    for c in mine.unique().tolist():
        order = [(c - 1 - k) % n for k in range(n)]  # c-1, c-2, ..., c
        sel = (mine == c).nonzero().flatten()
        out[sel] = _fold([inputs[s].flatten()[lo:lo + S][sel] for s in order])
    return out


def rank_order_reduce_scatter(inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """The rank-order sum of this rank's chunk of ``inputs``."""
    n = len(inputs)
    S = inputs[0].numel() // n
    return _fold([x.flatten()[rank * S : (rank + 1) * S] for x in inputs])
