"""Gradient reduction of the parameters with FSDP2's all-gather extension.

Autograd gives each trainable subclass parameter's unsharded parameter a plain gradient (torchao's
float8, int8 and BitNet weights compute ``grad_weight`` in high precision). These are reduced as
torch 2.13's ``foreach_reduce`` reduces them, so the optimizer sees FSDP2's gradient:

* in the parameter's dtype policy: the reduce dtype is ``MixedPrecisionPolicy.reduce_dtype``,
  else the gradients' own dtype (all of a unit's must agree, as FSDP2 asserts), and the result is
  cast to the parameter's dtype;
* packed by ``torch._chunk_cat`` (each gradient cut into ``N`` dim-0 chunks of
  ``ceil(rows / N)`` rows, zero padded: FSDP2's ``chunk_cat`` layout, matching the ``torch.chunk``
  shards of :mod:`mfsdp2.groups.subclass_params`), reduce-scattered with ``AVG`` over the shard
  group by the communicator every mfsdp2 reduction uses;
* exposed as ``Shard(0)`` DTensor ``.grad`` over this rank's rows of the output, or added to the
  ``.grad`` already there (accumulation across steps without ``zero_grad``).

One such reduction is in flight at a time across the root's units, as FSDP2 keeps one
reduce-scatter input alive: issued at a unit's post-backward, finished before the next unit's is
packed, or at the root's final callback. Without gradient sync
(``set_requires_gradient_sync(False)``) the gradients stay on the unsharded parameters, where
autograd accumulates them for the synced backward, as in FSDP2.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from ..comm.communicator import CommHandle
from ..memory.buffer import leaked_blocks
from ..dtensors.placement import wrap_local

__all__ = ["SubclassGrads"]


class SubclassGrads:
    """Mixin of :class:`~mfsdp2.groups.subclass_gather.SubclassUnit` (``params``, ``comm``)."""

    def __init__(self) -> None:
        self._pending: Optional[tuple] = None  # (handle, output, params) of the reduction in flight
        self.reductions = 0  # tests: reduce-scatters issued

    @property
    def requires_grad(self) -> bool:
        return any(p.dist_param.requires_grad for p in self.params)

    def has_unsharded_grads(self) -> bool:
        return any(p.accumulated is not None or (p.unsharded is not None and p.unsharded.grad is not None)
                   for p in self.params)

    @torch.no_grad()
    def accumulate_unsynced(self) -> None:
        """A backward without gradient sync: as FSDP2, a gradient in a dtype other than the
        reduce dtype (bf16 compute, fp32 reduction) moves into an accumulator in the reduce
        dtype, and later micro-batches add into it; otherwise autograd keeps accumulating on the
        unsharded parameter."""
        for p in self.params:
            up = p.unsharded
            if up is None or up.grad is None:
                continue
            if p.accumulated is not None:
                p.accumulated += up.grad
            elif p.reduce_dtype is not None and up.grad.dtype != p.reduce_dtype:
                p.accumulated = up.grad.to(p.reduce_dtype)
            else:
                continue
            up.grad = None

    def reduce_grads(self, label: str) -> None:
        """Pack, and issue the reduce-scatter of, every unsharded gradient (finishing the
        previous reduction first)."""
        self.finish_reduce()
        self.accumulate_unsynced()  # this backward's gradients join earlier micro-batches' (FSDP2's order)
        entries = [p for p in self.params
                   if p.accumulated is not None or (p.unsharded is not None and p.unsharded.grad is not None)]
        if not entries:
            return
        grads = []
        for p in entries:
            if p.accumulated is not None:
                grads.append(p.accumulated)
                p.accumulated = None
            else:
                grads.append(p.unsharded.grad)
                p.unsharded.grad = None
        dtypes = {g.dtype for g in grads}
        if len(dtypes) != 1:
            raise RuntimeError(
                f"mfsdp2: unit {self.unit_name!r}: the gradients of its subclass parameters "
                f"{[p.fqn for p in entries]} have dtypes {sorted(str(d) for d in dtypes)}; one reduce-scatter "
                "needs one dtype, as in FSDP2: give the parameters one compute dtype (MixedPrecisionPolicy.param_dtype)"
            )
        reduce_dtype = entries[0].reduce_dtype or grads[0].dtype
        N = self.comm.world_size
        grads = [g.to(reduce_dtype) if g.dtype != reduce_dtype else g for g in grads]
        chunk_numel = [-(-g.size(0) // N) * (g.numel() // max(g.size(0), 1)) for g in grads]
        with torch.no_grad():
            inp = torch.empty((N, sum(chunk_numel)), dtype=reduce_dtype, device=self.device)
            torch._chunk_cat(grads, 0, N, out=inp)
            del grads
            out = torch.empty(sum(chunk_numel), dtype=reduce_dtype, device=self.device)
            h = self.comm.reduce_scatter(out, inp.view(-1), dist.ReduceOp.AVG, label=label)
        self.reductions += 1
        self._pending = (CommHandle(inner=h, keep=(inp,), label=label), out, entries, chunk_numel)

    def finish_reduce(self) -> None:
        """Wait for the reduction in flight and hand each parameter its ``.grad``."""
        if self._pending is None:
            return
        h, out, entries, chunk_numel = self._pending
        self._pending = None
        h.wait()
        with torch.no_grad():
            off = 0
            for p, n in zip(entries, chunk_numel):
                rows = p.sharded_size[0]
                piece = out[off : off + n].view(p.padded_size)[:rows]
                off += n
                if piece.dtype != p.orig_dtype:
                    piece = piece.to(p.orig_dtype)
                dp = p.dist_param
                if dp.grad is None:
                    dp.grad = wrap_local(piece, p.mesh, (Shard(0),), p.orig_size, p.stride)
                else:
                    dp.grad._local_tensor += piece

    def abort_reduce(self) -> bool:
        """After an error: settle the reduction in flight (dropped); False if it may still run."""
        if self._pending is None:
            return True
        pending, self._pending = self._pending, None
        if pending[0].settle():
            return True
        leaked_blocks.append(pending)  # may still be written by the backend's thread: never freed
        return False

    def drop_unsharded_grads(self) -> None:
        for p in self.params:
            p.accumulated = None
            if p.unsharded is not None:
                p.unsharded.grad = None
