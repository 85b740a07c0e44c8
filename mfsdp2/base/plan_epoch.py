"""The version every unit's step plan is checked against, and why it last changed.

A unit's plan (:mod:`mfsdp2.runtime.step_plan`) holds decisions made once -- which gathers to
issue, which groups to reduce, whether to reshard after forward -- that the general path
re-derives at every call. A plan is reused only while nothing it assumed has changed, and the
test for that must cost O(1) per call: every event that could change an assumption bumps one
integer here, and a plan compares the integer it was built at with the current one.

Why in the bottom layer: the events come from every layer -- a ``requires_grad`` flip is seen
where the parameters are registered (``groups``), a rebuilt group where the unit's state is kept
(``runtime``, ``frontend``) -- and each may only import downwards. Per-unit settings
(``set_reshard_after_forward``, ``no_sync``) do not come here: they bump their unit's own
version (:class:`mfsdp2.runtime.state.FSDPState`), so toggling gradient sync every few
micro-batches rebuilds one unit's plan, not every unit's.
"""

from __future__ import annotations

import enum
import logging
from typing import Optional

__all__ = ["PlanChange", "bump", "current", "last_change"]

logger = logging.getLogger(__name__)


class PlanChange(enum.Enum):
    """What made the plans stale (the last cause is kept for tests and debugging)."""

    PARAMETERS = "parameters"  # a unit's groups were rebuilt: adoption, conversion, sharing
    REQUIRES_GRAD = "requires_grad"  # a parameter was frozen or unfrozen


_epoch = 0
_last: Optional[PlanChange] = None


def bump(change: PlanChange) -> None:
    """Make every plan built before this call stale."""
    global _epoch, _last
    _epoch += 1
    _last = change
    logger.debug("mfsdp2: step plans invalidated (%s)", change.value)


def current() -> int:
    return _epoch


def last_change() -> Optional[PlanChange]:
    return _last
