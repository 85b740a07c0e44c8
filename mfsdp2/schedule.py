"""Recorded execution order and the prefetch decisions made from it.

The root records the order in which units run forward in a training (grad-enabled) forward.
In the next pass, when unit ``k`` of that order starts, the all-gathers of the next
``prefetch_depth`` units are issued so they overlap unit ``k``'s compute. Backward uses the
reversed order. The prediction is checked at every step: the moment a unit runs out of the
recorded order (a branch, a skipped unit, a different model path) the schedule stops prefetching
for the rest of that pass and falls back to on-demand unshards, and the new order is recorded.
A wrong prediction therefore costs at most one wasted all-gather, never a wrong module's weights
(each unit waits for *its own* gather) and never a hang (every rank follows the same recorded
order, and a mismatch is detected locally before anything is issued).

``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` (FSDP2's API) replace
the prediction for the units they are set on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .state import FSDPState

__all__ = ["Schedule"]


class _Pass:
    """Position tracking of one pass (forward or backward) against a predicted order."""

    __slots__ = ("order", "seen", "diverged")

    def __init__(self, order: "list[FSDPState]"):
        self.order = order
        self.seen: list = []
        self.diverged = False

    def advance(self, state: "FSDPState") -> int:
        """Note that ``state`` runs now; returns its index in the prediction or -1 if off-script."""
        k = len(self.seen)
        self.seen.append(state)
        if self.diverged or k >= len(self.order) or self.order[k] is not state:
            self.diverged = True
            return -1
        return k


class Schedule:
    def __init__(self, states: "list[FSDPState]", prefetch_depth: int = 1):
        self.states = states
        self.prefetch_depth = prefetch_depth
        self.recorded: list = []  # forward order of the last complete training forward
        self._fwd: Optional[_Pass] = None
        self._bwd: Optional[_Pass] = None
        self.mispredictions = 0

    # -- forward ------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self._fwd = _Pass(self.recorded)

    def end_forward(self, record: bool) -> None:
        if self._fwd is not None:
            if self._fwd.diverged:
                self.mispredictions += 1
            if record:
                self.recorded = list(self._fwd.seen)
        self._fwd = None

    def on_forward(self, state: "FSDPState") -> "list[FSDPState]":
        """Called as ``state`` starts forward: the units whose all-gather to issue now."""
        if self._fwd is None:
            return []
        k = self._fwd.advance(state)
        if state.forward_prefetch is not None:
            return list(state.forward_prefetch)
        if k < 0:
            return []
        return self.recorded[k + 1 : k + 1 + self.prefetch_depth]

    # -- backward -----------------------------------------------------------------------------
    def on_backward(self, state: "FSDPState") -> "list[FSDPState]":
        """Called as ``state``'s backward is about to run (its pre-backward hook)."""
        if self._bwd is None:
            # The root stays unsharded from forward to backward and its output hook fires first,
            # so it is not part of the predicted order: it just starts the chain.
            self._bwd = _Pass([s for s in reversed(self.recorded) if not s.is_root])
        if state.is_root:
            if state.backward_prefetch is not None:
                return list(state.backward_prefetch)
            return self._bwd.order[: self.prefetch_depth] if not self._bwd.seen else []
        k = self._bwd.advance(state)
        if state.backward_prefetch is not None:
            return list(state.backward_prefetch)
        if k < 0:
            return []
        return self._bwd.order[k + 1 : k + 1 + self.prefetch_depth]

    def end_backward(self) -> None:
        if self._bwd is not None and self._bwd.diverged:
            self.mispredictions += 1
        self._bwd = None
