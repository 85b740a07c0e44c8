"""Random initialisation of row-sharded parameters: the offsets torch's RNG tracker needs.

On CUDA, DTensor runs a random op (``nn.init.normal_`` on a sharded parameter: torchtitan's
from-scratch path, meta device -> ``to_empty`` -> ``init_weights``) through its offset-based RNG
tracker: each rank generates its local piece from the one global Philox stream, starting at
``shard index * size of rank 0's piece``. For ``torch.chunk``'s split that is the piece's offset
in the full tensor, so FSDP2's sharded init equals the unsharded init at any world size. A
``RowShard`` piece starts at ``sum(rows[:r]) * row numel`` instead, which the tracker's formula
does not give when the ranks' row counts differ: every rank after the first would draw numbers
belonging to other rows.

:func:`rowshard_rng_offsets` computes the true start for a ``RowShard`` on dim 0 (with any
``Replicate`` mesh dims, as HSDP's), rounded up to the tracker's multiple of 4 as torch rounds
its own; :func:`install` makes torch's tracker use it for such specs and its own formula for
every other (tensor-parallel layouts, ``Shard(d != 0)``, torch's own placements). On the CPU the
tracker is off (torch generates each piece from the local generator): FSDP2's and mfsdp2's
pieces then differ by shard shape, as the unsharded init does from both.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from torch.distributed.tensor import Replicate

from .placement import RowShard

__all__ = ["rowshard_rng_offsets", "install"]

logger = logging.getLogger(__name__)


def _round4(n: int) -> int:
    return (n + 3) // 4 * 4


def rowshard_rng_offsets(spec) -> Optional[tuple[int, int]]:
    """``(start, end)`` offset increments of this rank's piece of a DTensor with ``spec``: start
    where its rows begin in the full tensor, end after the whole tensor; None when the spec is
    not a dim-0 ``RowShard`` over ``Replicate`` mesh dims (torch's own formula applies)."""
    rows = [(i, p) for i, p in enumerate(spec.placements) if isinstance(p, RowShard)]
    if len(rows) != 1 or rows[0][1].dim != 0:
        return None
    i, p = rows[0]
    if any(not isinstance(q, Replicate) for j, q in enumerate(spec.placements) if j != i):
        return None
    coord = spec.mesh.get_coordinate()
    if coord is None:
        return None
    inner = math.prod(spec.shape[1:])
    start = sum(p.rows[: coord[i]]) * inner
    return _round4(start), _round4(math.prod(spec.shape))


def install() -> None:
    """Make torch's offset-based RNG tracker use :func:`rowshard_rng_offsets` (idempotent)."""
    try:
        from torch.distributed.tensor._random import OffsetBasedRNGTracker
    except ImportError:  # pragma: no cover - a torch without the tracker
        return
    original = getattr(OffsetBasedRNGTracker, "_compute_rng_offsets", None)
    if original is None:  # torch before 2.13 computes its offsets inline
        logger.info("mfsdp2: this torch's RNG tracker has no _compute_rng_offsets: random init of "
                    "RowShard pieces on CUDA uses torch's formula (pieces of unequal rows draw other numbers "
                    "than FSDP2's)")
        return
    if getattr(original, "_mfsdp2_rowshard", False):
        return

    def _compute_rng_offsets(self, spec):
        ours = rowshard_rng_offsets(spec)
        return ours if ours is not None else original(self, spec)

    _compute_rng_offsets._mfsdp2_rowshard = True
    _compute_rng_offsets._torch = original
    OffsetBasedRNGTracker._compute_rng_offsets = _compute_rng_offsets
    logger.debug("mfsdp2: DTensor's RNG tracker offsets RowShard pieces by their rows")


install()
