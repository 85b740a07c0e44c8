"""Grad-mode guards for the gradient path's bookkeeping ops (packing, re-pointing views).

Why a helper: those ops (``copy_`` into a flat buffer, ``set_`` on a gradient view) must not be
recorded by autograd, so they run under ``torch.no_grad()``. But they run once per unit per step,
mostly from the post-backward hooks, where autograd's engine has already turned grad mode off
(it is on only for ``backward(create_graph=True)``), and entering a ``torch.no_grad()`` costs
about as much as one of the ops it guards. :func:`no_grad` returns a shared do-nothing context
when grad mode is already off, and a real ``torch.no_grad()`` otherwise: the same ops run in the
same mode either way.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

__all__ = ["no_grad"]

# Re-entrant and stateless: one instance serves every caller.
_ALREADY_OFF = contextlib.nullcontext()


def no_grad() -> ContextManager:
    """``torch.no_grad()`` where grad mode is on, else a shared no-op context (see module docstring)."""
    return torch.no_grad() if torch.is_grad_enabled() else _ALREADY_OFF
