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

# Columns of the (rows, columns) view the fingerprint weights by position.
_COLS = 1024


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
    """A device-side digest of ``t``'s bits. Its integer words ``w`` are viewed as a matrix of
    ``_COLS`` columns (the tail words as one more, shorter row); the digest is
    ``[sum w, sum_r (r+1) R_r, sum_c (c+1) C_c]`` with ``R_r`` / ``C_c`` the row / column sums, all in
    int32 arithmetic wrapping modulo 2^32 (what CPU and CUDA integer kernels do; modular sums are
    exact, so the result does not depend on the reduction order).

    Why this and not a float sum: a write of different values changes some word by a nonzero ``d``
    with ``|d| < 2^32``, so a single changed word always changes the first sum; two words swapped
    move between rows or columns and change the weighted sums; several changed words go unseen
    only if all three cancel at once. Why int32 and row / column sums rather than one sum weighted
    by each word's position: an int64 position-weighted sum needs an int64 temporary per element
    and runs at about a hundredth of the speed of an int32 sum on CPU (180 ms vs 1.3 ms for the 8.4M
    words of one mlp unit, measured), and persistent strategies pay it at every gather: it made
    ``no_shard`` slower than DDP. Three reduction passes over the words, no host read: the
    comparison with the previous fingerprint stays on the device until the agreement all-reduce."""
    words = _words(t)
    n = words.numel()
    rows = n // _COLS
    main = words[: rows * _COLS].view(rows, _COLS)
    tail = words[rows * _COLS :]
    i32 = torch.int32
    row_sums = main.sum(dim=1, dtype=i32)
    col_sums = main.sum(dim=0, dtype=i32)
    tail_sum = tail.sum(dtype=i32)
    row_w = torch.arange(1, rows + 1, dtype=i32, device=t.device)
    col_w = torch.arange(1, _COLS + 1, dtype=i32, device=t.device)
    return torch.stack([
        row_sums.sum(dtype=i32) + tail_sum,
        (row_sums * row_w).sum(dtype=i32) + tail_sum * (rows + 1),
        (col_sums * col_w).sum(dtype=i32) + (tail.to(i32) * col_w[: tail.numel()]).sum(dtype=i32),
    ])


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
