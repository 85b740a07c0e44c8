"""The gradient DTensors a group exposes as ``.grad``: views of its main gradient, kept across steps.

Why a cache: building a DTensor (and its spec) per parameter per step was most of
``GradientReduction.expose_grads``' cost on models of many small parameters. Why re-pointing: the
main gradient goes back to torch at the next forward (it is dead until the next backward, and held
memory is memory the forward's activations cannot use), so the next backward's main gradient is new
memory. A cached DTensor still viewing the old block would keep that block alive through the
forward -- the memory would not be given back at all. So when the main gradient is released,
every cached DTensor that nobody else holds has its local tensor emptied (``set_()``: the block's
last reference goes), and the next exposure points the same local tensor at its rows of the new
main gradient (``set_(storage, offset, size, stride)``: no new DTensor).

A DTensor somebody else still holds (the user kept ``p.grad`` past ``zero_grad``, or a C++ owner
such as another tensor's ``.grad``) is never touched: it keeps its values and its memory, as a
gradient kept past ``zero_grad`` does in torch, and the cache makes a new one. "Nobody else" is
decided by reference counts against the counts measured when the DTensor was made, by the same
function (:func:`_refs`), so the check does not depend on how a Python version counts
temporaries. Torch counts C++ holders of a tensor in its Python reference count (a ``.grad`` slot
holding the tensor adds one), which this relies on.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

__all__ = ["GradViews"]


def _alias(v: torch.Tensor) -> torch.Tensor:
    """A tensor over ``v``'s memory that is not a view of anything: a view keeps its base tensor
    -- here the whole main-gradient block -- alive through ``_base`` even after ``set_()``."""
    with torch.no_grad():
        return torch.empty(0, dtype=v.dtype, device=v.device).set_(
            v.untyped_storage(), v.storage_offset(), v.size(), v.stride())


def _refs(made: list, i: int) -> tuple[int, int]:
    """Reference counts of ``made[i]`` and of its local tensor (compared, never interpreted)."""
    g = made[i]
    return sys.getrefcount(g), sys.getrefcount(g._local_tensor)


class GradViews:
    """Parameter ``i``'s gradient DTensor over its rows of one main gradient (see module docstring)."""

    __slots__ = ("key", "made", "base", "stale")

    def __init__(self, n: int) -> None:
        self.key = None  # the main gradient's memory the DTensors view; None: none (detached)
        self.made: list = [None] * n
        self.base: list = [None] * n  # _refs when made: nobody else held it then
        self.stale: set[int] = set()  # detached: emptied, to be re-pointed at the next main gradient

    def follow(self, key: tuple) -> None:
        """The main gradient about to be exposed is ``key``: DTensors of another live one are
        dropped (new ones are made), detached ones are re-pointed as they are used."""
        if key == self.key:
            return
        if self.key is not None:  # viewing other memory that may still be in use: start afresh
            self.made = [None] * len(self.made)
            self.base = [None] * len(self.made)
            self.stale.clear()
        self.key = key

    def get(self, i: int, make: Callable[[torch.Tensor], torch.Tensor],
            rows: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Parameter ``i``'s DTensor: cached (re-pointed at ``rows()`` if detached), or ``make(local)``
        over a local tensor aliasing ``rows()`` (:func:`_alias`)."""
        if self.made[i] is None:  # no local name for it before _refs (see detach)
            self.made[i] = make(_alias(rows()))
            self.base[i] = _refs(self.made, i)
            self.stale.discard(i)
            return self.made[i]
        g = self.made[i]
        if i in self.stale:
            v = rows()
            with torch.no_grad():
                g._local_tensor.set_(v.untyped_storage(), v.storage_offset(), v.size(), v.stride())
            self.stale.discard(i)
        return g

    def detach(self) -> None:
        """The main gradient is being released: empty every DTensor only this cache holds (so the
        block's memory really goes back), forget the others (their holders keep them)."""
        for i in range(len(self.made)):  # no local name for a DTensor here: _refs must count as in get
            if self.made[i] is None or i in self.stale:
                continue
            if _refs(self.made, i) == self.base[i]:
                with torch.no_grad():
                    self.made[i]._local_tensor.set_()
                self.stale.add(i)
            else:
                self.made[i] = None
                self.base[i] = None
        self.key = None

    def cached(self, i: int) -> Optional[torch.Tensor]:
        return self.made[i]
