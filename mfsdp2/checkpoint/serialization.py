"""``torch.save`` / ``torch.load`` of state dicts holding our DTensors (``torch.save(model.state_dict())``).

Why: our parameters' local tensors are views into one flat main-weight shard, so all but the
first of a group start at a nonzero storage offset, and ``DTensor.from_local`` gives the DTensor
wrapper that same offset. torch pickles a tensor subclass through its wrapper only when the
wrapper's ``data_ptr()`` is 0; with an offset it is not, torch takes the wrapper for a plain tensor
and reads its (absent) storage: "Attempted to access the data pointer on an invalid python
storage". FSDP2's parameters each own their storage (offset 0), so the same script works there.

So pickling a DTensor whose wrapper has a nonzero offset (or that, or whose local tensor, carries
Python attributes of ours: a parameter's weak reference to the module parameter it replaced cannot
be pickled) pickles an equal DTensor rebuilt around a copy of its local tensor (offset 0), with the
user's attributes and parameter-ness -- torch's own format, which loads without mfsdp2 (only
``RowShard`` must be importable, and it is registered as a safe global for ``weights_only``
loads). Every other DTensor pickles as before. ``copy.deepcopy`` does not use this registry
(tensors define ``__deepcopy__``): state-dict entries have offset-0 wrappers for it
(``dtensors.placement.offset_free``); a deep copy of a parameter itself still fails so.
"""

from __future__ import annotations

import copyreg
import logging

import torch
from torch.distributed.tensor import DTensor

from ..dtensors.placement import RowShard

__all__ = ["install"]

logger = logging.getLogger(__name__)

_OURS = "_mfsdp2"  # the prefix of the runtime's own attributes on tensors (mfsdp2.base.markers)


def _reduce_dtensor(t: DTensor):
    ours = any(k.startswith(_OURS) for k in t.__dict__)
    if t.storage_offset() == 0 and not t._local_tensor.__dict__ and not ours:
        return t.__reduce_ex__(2)
    # A fresh copy: offset 0 (so is the wrapper's), and none of our Python attributes -- on the
    # local tensor (an empty piece carries DCP's ``__create_write_items__`` hook, a function of
    # ours: a file naming it could not be loaded with ``weights_only`` or without mfsdp2), nor on
    # the wrapper (a parameter's weak reference to the module parameter it replaced cannot be
    # pickled). The user's attributes and parameter-ness (``_is_param``) are kept.
    local = t._local_tensor.detach().clone()
    out = DTensor(local, t._spec, requires_grad=t.requires_grad)
    for k, v in t.__dict__.items():  # DTensor's own fields are slots: only Python attributes here
        if not k.startswith(_OURS):
            setattr(out, k, v)
    return out.__reduce_ex__(2)


def install() -> None:
    """Register the DTensor reducer and ``RowShard`` as a ``weights_only`` safe global (idempotent)."""
    if copyreg.dispatch_table.get(DTensor) is not _reduce_dtensor:
        copyreg.pickle(DTensor, _reduce_dtensor)
    torch.serialization.add_safe_globals([RowShard])


install()
