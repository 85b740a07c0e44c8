"""TransformerEngine's gradient-accumulation-fusion contract, and TE as an optional extra.

TE modules built with ``fuse_wgrad_accumulation=True`` do not return a weight gradient: their
backward GEMM writes it into ``weight.main_grad`` (accumulating, or overwriting when
``weight.overwrite_main_grad`` is True), then sets ``weight.grad_added_to_main_grad = True`` when
the attribute exists and hands autograd a placeholder (zeros or uninitialised memory) as the
gradient. Megatron's optimizers read ``main_grad``; ours read the sharded ``.grad`` -- so the
runtime must give TE a ``main_grad`` that is already *its* reduction buffer and never count the
placeholder:

* at a unit's pre-backward, every unsharded parameter of a group that has a fusing owner module
  gets ``main_grad`` = a view of the group's flat gradient buffer (zeroed once, then accumulated
  into by TE, so a weight used twice is summed), ``grad_added_to_main_grad = False`` and
  ``overwrite_main_grad = False``;
* at post-backward, a flagged parameter's ``.grad`` (the placeholder) is dropped, the others'
  gradients are copied in beside it, and the buffer is reduced as usual
  (:meth:`mfsdp2.groups.param_group.ParameterGroup._pack`). The buffer outlives micro-batches that skip
  gradient sync, so fused wgrads accumulate there like ordinary ones.

``pip install 'mfsdp2[te]'`` installs TransformerEngine; nothing here imports it: the contract is
attribute-based, so a module that follows TE's protocol works without TE installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..memory.allocator import BucketAllocator, BufferRole

# A mfsdp2.groups.param_group.ParameterGroup; not imported, since that module imports this one (a
# lower file must not import a higher one).
Group = Any

__all__ = ["fuses_wgrad", "attach_main_grads", "detach_main_grads", "transformer_engine"]


def transformer_engine():
    """``transformer_engine.pytorch`` if installed, else None (imported lazily, on demand)."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError:
        return None


def fuses_wgrad(group: Group) -> bool:
    """True when a module owning one of the group's parameters fuses wgrad accumulation."""
    return group.requires_grad and any(
        getattr(info.owner, "fuse_wgrad_accumulation", False) for owners in group.infos for info in owners
    )


def attach_main_grads(group: Group, allocator: "BucketAllocator", key) -> None:
    """Before the group's backward: point each unsharded parameter's ``main_grad`` into the flat
    gradient buffer the reduction will read. Idempotent within a backward; a buffer left from a
    micro-batch without gradient sync is reused, so its contents accumulate."""
    if group.fused_full is None:
        n = group.layout.total_numel
        group.fused_full = allocator.allocate((BufferRole.GRAD, key), n, group.reduce_dtype, group.device)
        group.fused_full.zero_()
        group.fused_key = key
    full = group.fused_full
    for i, up in enumerate(group.unsharded_params):
        up.main_grad = group.weights.param_view(full, i)
        if not getattr(up, "grad_added_to_main_grad", False):
            up.grad_added_to_main_grad = False
        up.overwrite_main_grad = False


def detach_main_grads(group: Group) -> None:
    """After the reduction consumed the buffer: no ``main_grad`` may outlive it."""
    for up in group.unsharded_params:
        if hasattr(up, "main_grad"):
            del up.main_grad
