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

Where the rows are: parameter ``i``'s rows of a main gradient are a fixed view geometry -- an
element offset from the main gradient's start, a size and a stride -- because the main gradient is
always a flat contiguous tensor of the same length (its layout never changes). The geometry is
read once from the group's own view of the rows (``rows(mg, i)``) and reused, so re-pointing
costs one ``set_`` instead of building a view per parameter per step. It is only ever applied to
the main gradient being exposed (its storage and offset are read at each exposure, never cached),
and only while that is flat, contiguous and of the length the geometry was read from; anything
else reads the rows afresh.

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
import weakref
from typing import Callable, Optional

import torch

from .grad_mode import no_grad

__all__ = ["GradViews"]


def _refs(made: list, i: int) -> tuple[int, int]:
    """Reference counts of ``made[i]`` and of its local tensor (compared, never interpreted)."""
    g = made[i]
    return sys.getrefcount(g), sys.getrefcount(g._local_tensor)


class GradViews:
    """Parameter ``i``'s gradient DTensor over its rows of one main gradient (see module docstring)."""

    __slots__ = ("key", "made", "base", "stale", "geom", "geom_numel", "dtype", "flat", "followed")

    def __init__(self, n: int) -> None:
        self.key = None  # the main gradient's memory the DTensors view; None: none (detached)
        self.made: list = [None] * n
        self.base: list = [None] * n  # _refs when made: nobody else held it then
        self.stale: set[int] = set()  # detached: emptied, to be re-pointed at the next main gradient
        # Per parameter: (offset from the main gradient's first element, size, stride) of its rows,
        # read from a main gradient of geom_numel elements (see module docstring).
        self.geom: list = [None] * n
        self.geom_numel: Optional[int] = None
        self.dtype: Optional[torch.dtype] = None  # the dtype of the local tensors made
        self.flat = False  # whether the main gradient followed is flat and contiguous
        # The main gradient tensor last followed (weakly: the cache must not keep it alive). The
        # same object again, with the key still set, is the same memory and geometry: every
        # exposure of a main gradient kept (or emptied and refilled) across steps asks.
        self.followed: Optional[weakref.ref] = None

    def follow(self, mg: torch.Tensor) -> None:
        """The main gradient about to be exposed is ``mg``: DTensors of another live one are dropped
        (new ones are made), detached ones are re-pointed as they are used -- unless its dtype
        differs from theirs (a local tensor's dtype is fixed)."""
        followed = self.followed
        if followed is not None and self.key is not None and followed() is mg:
            return
        self.followed = weakref.ref(mg)
        # The geometry applies to a flat contiguous main gradient of the length it was read from.
        n = mg.numel()
        self.flat = mg.dim() == 1 and mg.stride(0) == 1
        if self.flat and n != self.geom_numel:
            self.geom = [None] * len(self.geom)
            self.geom_numel = n
        # The storage object and the offset into it, not the address: a storage its owner emptied
        # and refilled in place (``resize_``) has new memory that every view of it follows.
        key = (mg.untyped_storage()._cdata, mg.storage_offset(), mg.dtype, n)
        if key == self.key:
            return
        if self.key is not None or (self.stale and mg.dtype != self.dtype):
            # Viewing other memory that may still be in use, or emptied tensors of another dtype:
            # start afresh.
            self.made = [None] * len(self.made)
            self.base = [None] * len(self.made)
            self.stale.clear()
        self.key = key
        self.dtype = mg.dtype

    def get(self, i: int, mg: torch.Tensor, make: Callable[[torch.Tensor, int], torch.Tensor],
            rows: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """Parameter ``i``'s DTensor over its rows of the main gradient ``mg`` (the one last passed
        to :meth:`follow`, which must precede every exposure): cached (re-pointed at its rows if
        detached), or ``make(local, i)`` over a new local tensor on those rows. ``rows(mg, i)``:
        the group's view of them, read once for their geometry. Call under
        :func:`~mfsdp2.groups.grad_mode.no_grad`."""
        g = self.made[i]
        if g is not None and i not in self.stale:
            return g
        where = self._geometry(i, mg, rows)
        if where is None:  # not a flat contiguous main gradient: its own view, as it is
            v = rows(mg, i)
            where = (v.untyped_storage(), v.storage_offset(), v.size(), v.stride())
        else:
            off, size, stride = where
            where = (mg.untyped_storage(), mg.storage_offset() + off, size, stride)
        if g is None:  # no local name for it before _refs (see detach)
            # A tensor over the rows that is not a view of anything: a view keeps its base tensor
            # -- here the whole main-gradient block -- alive through ``_base`` even after ``set_()``.
            self.made[i] = make(torch.empty(0, dtype=mg.dtype, device=mg.device).set_(*where), i)
            self.base[i] = _refs(self.made, i)
            self.stale.discard(i)
            return self.made[i]
        g._local_tensor.set_(*where)
        self.stale.discard(i)
        return g

    def _geometry(self, i: int, mg: torch.Tensor, rows) -> Optional[tuple]:
        """Parameter ``i``'s (offset, size, stride) in ``mg``; None where no geometry applies (a
        main gradient that is not flat and contiguous, rows that are not a view of it)."""
        if not self.flat:
            return None
        where = self.geom[i]
        if where is None:
            v = rows(mg, i)
            if v.untyped_storage()._cdata != mg.untyped_storage()._cdata:
                return None
            where = self.geom[i] = (v.storage_offset() - mg.storage_offset(), tuple(v.size()), tuple(v.stride()))
        return where

    def detach(self) -> None:
        """The main gradient is being released: empty every DTensor only this cache holds (so the
        block's memory really goes back), forget the others (their holders keep them)."""
        with no_grad():
            for i in range(len(self.made)):  # no local name for a DTensor here: _refs must count as in get
                if self.made[i] is None or i in self.stale:
                    continue
                if _refs(self.made, i) == self.base[i]:
                    self.made[i]._local_tensor.set_()
                    self.stale.add(i)
                else:
                    self.made[i] = None
                    self.base[i] = None
        self.key = None

    def held_only_here(self) -> Optional[int]:
        """How many cached DTensors view the current main gradient, when nobody but this cache
        holds any of them (the same test as :meth:`detach`'s); None when somebody does. The main
        gradient's owner may then empty its storage in place and refill it later
        (:meth:`MainGradient.release_main_grad
        <mfsdp2.groups.main_grad.MainGradient.release_main_grad>`): these DTensors stay valid
        over the refilled memory, and nobody can read them while it is empty."""
        n = 0
        for i in range(len(self.made)):  # no local name for a DTensor here: _refs must count as in get
            if self.made[i] is None or i in self.stale:
                continue
            if _refs(self.made, i) != self.base[i]:
                return None
            n += 1
        return n

    def cached(self, i: int) -> Optional[torch.Tensor]:
        return self.made[i]
