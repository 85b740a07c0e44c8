"""Noticing that the main weights changed, including writes that bump no version counter.

Strategies that keep full model weights between steps (ZeRO-1/2, no_shard) re-cast main -> model
weights and re-gather only when the weights changed; ZeRO-3 units kept gathered across forwards
(``set_reshard_after_backward(False)``, an in-flight ``unshard(async_op=True)``) re-gather on the
same signal. Version counters alone miss the writes users make through ``.data`` (an EMA copied
in for an eval pass, ``torch.nn.init.*_(p.data)``, loaders): ``p.data`` is a new tensor with its
own counter. So a group counts as changed when any of these says so:

* **an optimizer step** ran: one process-wide ``register_optimizer_step_post_hook`` marks every
  live group (every rank steps, so every rank marks: no agreement needed for this signal);
* **an announced write**: ``FSDPModule.mark_weights_changed()``, ``load_state_dict``,
  ``mfsdp2.materialize``;
* a **version counter** of the main weights moved (in-place ops on the parameters);
* the main shard's **content fingerprint** (:func:`fingerprint`) differs from the one taken at the
  last gather: the catch-all for silent writes.

The last two are local facts -- a rank holding no rows of a parameter sees nothing -- so the
root's forward agrees on them with the existing per-forward all-reduce (``hooks._agree_on_gathers``).
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["fingerprint", "watch"]

logger = logging.getLogger(__name__)

_groups: "weakref.WeakSet" = weakref.WeakSet()
_hook_handle = None

# Elements per step of the fingerprint: bounds its int64 temporaries (2 x 8 bytes per element,
# 64 MiB at this size) while keeping the kernel count per shard small.
_CHUNK = 1 << 22


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` as a flat integer tensor (int32 where the bytes allow, else narrower)."""
    flat = t.detach().reshape(-1)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        try:
            return flat.view(dtype)
        except RuntimeError:  # size or storage offset not a multiple of the wider word
            continue
    raise TypeError(f"mfsdp2: cannot fingerprint a {t.dtype} tensor")


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A device-side digest of ``t``'s bits: ``[sum w_i, sum (i+1) w_i]`` over its integer words
    ``w_i``, in int64 arithmetic wrapping modulo 2^64 (what CPU and CUDA integer kernels do;
    modular sums are exact, so the result does not depend on the reduction order).

    Why this and not a float sum: a write of different values changes some word by a nonzero
    ``d`` with ``|d| < 2^33``, so a single changed word always changes the first sum, and several
    changed words go unseen only if both sums cancel at once -- never for one element, vanishingly
    rarely otherwise -- whereas a float sum loses small changes to rounding. One elementwise pass,
    no host read: the comparison with the previous fingerprint stays on the device until the
    agreement all-reduce."""
    words = _words(t)
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for lo in range(0, words.numel(), _CHUNK):
        w = words[lo : lo + _CHUNK]
        pos = torch.arange(lo + 1, lo + 1 + w.numel(), dtype=torch.int64, device=t.device)
        out[0] += w.sum(dtype=torch.int64)
        out[1] += (w.to(torch.int64) * pos).sum()
    return out


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    for g in list(_groups):
        g.mark_changed()


def watch(group) -> None:
    """Register a :class:`~mfsdp2.param_group.ParameterGroup` for the optimizer-step signal; the
    hook is installed once per process and holds the groups weakly."""
    global _hook_handle
    _groups.add(group)
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_post_hook(_on_optimizer_step)
