"""Torch-version compatibility: the few torch APIs mfsdp2 uses that older releases lack.

mfsdp2 is developed against torch 2.13 (the Makefile's venv) and supports torch >= 2.11 (setup.py;
our CUDA test machine has torch 2.11). Two things differ:

* ``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` (torch 2.13) are called
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` before (same arguments).
  :func:`all_gather_single` / :func:`reduce_scatter_single` call whichever exists. The function is
  looked up on ``torch.distributed`` at *call* time, not import time, so code that replaces
  ``dist.all_gather_single`` on the module (the tests' and benchmarks' collective spies and
  counters) still sees every call; :func:`all_gather_name` / :func:`reduce_scatter_name` say which
  attribute a spy has to replace on the running torch.
* ``UntypedStorage._swap_data_ptr_`` re-points a storage at memory it does not own: the buffers'
  gathered weights then live in blocks from mfsdp2's own allocator (see ``buffer.py``). Without it
  (:data:`HAS_STORAGE_SWAP` false) the buffers fall back to torch FSDP2's ``storage.resize_``.
  ``MFSDP2_NO_STORAGE_SWAP=1`` forces that fallback on any torch (to test it).
* DTensor's sharding rules: torch 2.11 has none for many element-wise ``_foreach`` ops that 2.13
  runs (``_foreach_sign_`` of ``Rprop``, ``_foreach_lerp_.ScalarList`` / ``_foreach_rsqrt_`` of
  ``Adafactor``, ...). :func:`dtensor_has_rule` says whether DTensor can propagate an op on the
  running torch (a registered strategy or rule, or 2.13's decomposition path);
  :mod:`mfsdp2.dtensors.dtensor_ops` runs the element-wise ones it cannot on the local pieces of our
  parameters.
* ``torch._C._storage_Use_Count``: how many holders a storage has (tensors over it, Python
  storage objects). :func:`storage_use_count` returns None where torch lacks it, and the caller
  then takes the path that needs no count.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = [
    "HAS_STORAGE_SWAP",
    "dtensor_has_rule",
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_name",
    "reduce_scatter_name",
    "storage_use_count",
    "RESIZE_IN_PLACE_DEVICES",
]

#: Whether buffers re-point their storage at allocator blocks (else: ``resize_``, see buffer.py).
#: Read when a buffer is built: setting it to False before building a model forces the fallback.
HAS_STORAGE_SWAP: bool = hasattr(torch.UntypedStorage, "_swap_data_ptr_") and os.environ.get(
    "MFSDP2_NO_STORAGE_SWAP", "0"
) != "1"


#: Device types whose storages mfsdp2 empties and refills in place (``UntypedStorage.resize_``):
#: the CPU, and CUDA, where FSDP2 frees its unsharded parameters so. Elsewhere (meta tensors of
#: the memory estimate, other accelerators) blocks are dropped and allocated afresh instead.
RESIZE_IN_PLACE_DEVICES = frozenset({"cpu", "cuda"})


def storage_use_count(storage: torch.UntypedStorage):
    """The number of holders of ``storage``'s C++ object (every tensor over it and every Python
    storage object, ``storage`` itself included), or None where this torch cannot say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count(storage._cdata) if count is not None else None


def all_gather_name() -> str:
    """The ``torch.distributed`` attribute :func:`all_gather_single` calls on this torch."""
    return "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def reduce_scatter_name() -> str:
    """The ``torch.distributed`` attribute :func:`reduce_scatter_single` calls on this torch."""
    return "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's equal-size ``inp`` into ``out`` (rank order); ``dist.all_gather_single``
    where torch has it, else ``dist.all_gather_into_tensor``.

    One-byte float types (the float8 family: float8 *parameters* of a frozen, quantised model)
    travel as ``uint8`` views: a gather only moves bytes, so the view is exact, and gloo (and
    older NCCL) reject float8 tensors ("Invalid scalar type")."""
    if out.dtype.is_floating_point and out.dtype.itemsize == 1:
        out, inp = out.view(torch.uint8), inp.view(torch.uint8)
    return getattr(dist, all_gather_name())(out, inp, group=group, async_op=async_op)


def reduce_scatter_single(
    out: torch.Tensor, inp: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False
):
    """Reduce ``inp`` over ranks and scatter equal pieces into ``out``; ``dist.reduce_scatter_single``
    where torch has it, else ``dist.reduce_scatter_tensor``."""
    return getattr(dist, reduce_scatter_name())(out, inp, op=op, group=group, async_op=async_op)


def dtensor_has_rule(op) -> bool:
    """Whether DTensor's sharding propagation on this torch can handle ``op`` (an ``OpOverload``):
    a registered op strategy, single-dim strategy or rule, or a decomposition DTensor propagates
    through (torch >= 2.13's fallback). False: DTensor raises "does not have a sharding strategy
    registered" for it."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    for registry in ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules"):
        if op in (getattr(prop, registry, None) or ()):
            return True
    decomp = getattr(prop, "decomp_strategy", None)
    has_decomp = getattr(type(decomp), "has_decomp", None) if decomp is not None else None
    return bool(has_decomp is not None and has_decomp(op))
