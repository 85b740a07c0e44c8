"""``torch.save`` / ``torch.load`` of state dicts holding our DTensors (``torch.save(model.state_dict())``).

Why: our parameters' local tensors are views into one flat main-weight shard, so all but the
first of a group start at a nonzero storage offset, and ``DTensor.from_local`` gives the DTensor
wrapper that same offset. torch pickles a tensor subclass through its wrapper only when the
wrapper's ``data_ptr()`` is 0; with an offset it is not, torch takes the wrapper for a plain tensor
and reads its (absent) storage: "Attempted to access the data pointer on an invalid python
storage". FSDP2's parameters each own their storage (offset 0), so the same script works there.

So pickling a DTensor whose wrapper has a nonzero offset (or whose local tensor carries Python
attributes of ours) pickles an equal DTensor rebuilt around a copy of its local tensor (offset 0) --
torch's own format, which loads without mfsdp2 (only
``RowShard`` must be importable, and it is registered as a safe global for ``weights_only``
loads). Every other DTensor pickles as before. ``copy.deepcopy`` is unaffected (tensors define
``__deepcopy__``, which takes precedence over the pickling registry).
"""

from __future__ import annotations

import copyreg
import logging

import torch
from torch.distributed.tensor import DTensor

from ..dtensors.placement import RowShard

__all__ = ["install"]

logger = logging.getLogger(__name__)


def _reduce_dtensor(t: DTensor):
    if t.storage_offset() == 0 and not t._local_tensor.__dict__:
        return t.__reduce_ex__(2)
    # A fresh copy: offset 0 (so is the wrapper's), and none of the local tensor's Python
    # attributes (an empty piece carries DCP's ``__create_write_items__`` hook, a function of
    # ours: a file naming it could not be loaded with ``weights_only`` or without mfsdp2).
    local = t._local_tensor.detach().clone()
    return DTensor(local, t._spec, requires_grad=t.requires_grad).__reduce_ex__(2)


def install() -> None:
    """Register the DTensor reducer and ``RowShard`` as a ``weights_only`` safe global (idempotent)."""
    if copyreg.dispatch_table.get(DTensor) is not _reduce_dtensor:
        copyreg.pickle(DTensor, _reduce_dtensor)
    torch.serialization.add_safe_globals([RowShard])


install()
