"""FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``: the user's collective
objects, called with mfsdp2's own buffers.

A :class:`CustomCommunicator` wraps a unit's :class:`~mfsdp2.comm.communicator.Communicator` for that unit's
buffers only (communicators are shared by every unit on a process group, a custom collective is
per unit). It forwards everything else to the wrapped one, so labels, traffic counters, the
collective checks and the CUDA side streams stay the same. What differs from FSDP2:

* ``comm.allocate`` is never called: the gathered buffer is the unit's zero-copy storage (its
  parameters are fixed views of it) and the gradient buffers come from mfsdp2's allocator; the
  object receives those buffers.
* the reduce-scatter is called with ``ReduceOp.SUM`` and mfsdp2 divides the result afterwards
  (``ParameterGroup.force_sum``): AVG / PREMUL_SUM exist on NCCL only, and the object may run
  anywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .communicator import CommHandle, Communicator, comm_stats, tensors_overlap

__all__ = ["CustomCommunicator"]


class CustomCommunicator:
    """``base`` with ``all_gather`` and/or ``reduce_scatter`` issued through user objects following
    torch's ``AllGather`` / ``ReduceScatter`` call signatures (``async_op=True`` on CPU, where the
    returned work is waited later; on CUDA they run on the side stream and return nothing to wait)."""

    def __init__(self, base: Communicator, all_gather=None, reduce_scatter=None):
        self.base = base
        self.custom_all_gather = all_gather
        self.custom_reduce_scatter = reduce_scatter

    def __getattr__(self, name):
        return getattr(self.base, name)

    def reduce_scatter_is_all_reduce(self, op, input_bytes: int) -> bool:
        """A custom reduce-scatter is the user's to call: never folded into a bucketed all-reduce."""
        return self.custom_reduce_scatter is None and self.base.reduce_scatter_is_all_reduce(op, input_bytes)

    def _issue(self, stream, fn, label: str) -> CommHandle:
        base = self.base
        if stream is None:
            work = fn(True)
            return CommHandle(work=work, label=label) if work is not None else CommHandle(label=label)
        return base._launch(stream, fn, label)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, label: str = "") -> CommHandle:
        if self.custom_all_gather is None:
            return self.base.all_gather(out, inp, label)
        comm_stats.all_gather_calls += 1
        comm_stats.all_gather_bytes += out.numel() * out.element_size()
        self.base.verify(label, out.numel())
        fn = self.custom_all_gather
        return self._issue(self.base.ag_stream, lambda a: fn(out, inp, self.base.group, async_op=a), label)

    @property
    def reduces_alone(self) -> bool:
        # The user's reduce-scatter is called at every reduction, one rank or not (as FSDP2 calls it).
        return self.custom_reduce_scatter is None and self.base.reduces_alone

    def reduce_scatter_scratch_numel(self, shard_numel: int, op=dist.ReduceOp.AVG, itemsize: int = 4) -> int:
        if self.custom_reduce_scatter is None:
            return self.base.reduce_scatter_scratch_numel(shard_numel, op, itemsize)
        return 0

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op=dist.ReduceOp.SUM, scratch=None,
                       label: str = "") -> CommHandle:
        if self.custom_reduce_scatter is None:
            return self.base.reduce_scatter(out, inp, op, scratch, label)
        if tensors_overlap(out, inp):
            raise RuntimeError("reduce_scatter output overlaps its input; pass a separate output tensor")
        comm_stats.reduce_scatter_calls += 1
        comm_stats.reduce_scatter_bytes += inp.numel() * inp.element_size()
        self.base.verify(label, inp.numel())
        fn = self.custom_reduce_scatter
        return self._issue(self.base.rs_stream, lambda a: fn(out, inp, self.base.group, op, async_op=a), label)
