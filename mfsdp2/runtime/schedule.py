"""Recorded execution order and the prefetch decisions made from it.

Forward: the root records the order in which units *start* forward in a training
(grad-enabled) forward. In the next pass, when unit ``k`` of that order starts, the all-gathers of
the next ``prefetch_depth`` units are issued so they overlap unit ``k``'s compute. Eval
(``no_grad``) passes use the recorded order but do not replace it.

Backward: the prediction is the reversed order in which units *finished* forward since the last
backward, counting only units that will run a backward (their outputs were hooked, or they are
known to be recomputed by a reentrant activation checkpoint). Finishing order, not starting
order, because a unit nested in another finishes first and runs its backward last; every
forward since the last backward, because ``loss = f(x1) + f(x2)`` runs the second forward's
backward first and then the first's. The root is not part of the backward prediction: it stays
unsharded from forward to backward and its output hook fires first, so it just starts the chain.

The prediction is checked at every step: the moment a unit runs out of the predicted order (a
branch, a skipped unit, a different model path) the schedule stops prefetching for the rest of
that pass and falls back to on-demand unshards. A pass that ends before its prediction (a
skipped last unit) or leaves it counts as one misprediction (:attr:`Schedule.mispredictions`); a
pass with nothing to predict from (the very first one) does not. A wrong prediction therefore
costs at most one wasted all-gather, never a wrong module's weights (each unit waits for *its
own* gather) and never a hang (every rank follows the same recorded order, and a mismatch is
detected locally before anything is issued).

``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` (FSDP2's API) replace
the prediction for the units they are set on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .state import FSDPState

__all__ = ["Schedule"]

# Forwards whose backward never came (a graph dropped without backward, e.g. validation without
# no_grad) keep their units in the backward record until the next backward; bound how many.
_MAX_FORWARDS_PER_BACKWARD = 8


class _Pass:
    """Position tracking of one pass (forward or backward) against a predicted order."""

    __slots__ = ("order", "seen", "diverged", "replayed")

    def __init__(self, order: "list[FSDPState]"):
        self.order = order
        self.seen: list = []
        self.diverged = False
        self.replayed = False

    def advance(self, state: "FSDPState") -> int:
        """Note that ``state`` runs now; returns its index in the prediction or -1 if off-script."""
        k = len(self.seen)
        self.seen.append(state)
        if self.diverged or k >= len(self.order) or self.order[k] is not state:
            self.diverged = True
            return -1
        return k

    @property
    def mispredicted(self) -> bool:
        """There was a prediction and the pass did not follow it to the end."""
        return bool(self.order) and (self.diverged or len(self.seen) != len(self.order))


class Schedule:
    def __init__(self, states: "list[FSDPState]", prefetch_depth: int = 1):
        self.states = states
        self.prefetch_depth = prefetch_depth
        self.recorded: list = []  # forward (start) order of the last complete training forward
        self._fwd: Optional[_Pass] = None
        self._fwd_grad = False
        self._bwd_record: list = []  # finishing order of units expecting a backward, since the last backward
        self._bwd: Optional[_Pass] = None
        self.mispredictions = 0

    # -- forward ------------------------------------------------------------------------------
    def begin_forward(self, grad: bool = True) -> None:
        self._fwd = _Pass(self.recorded)
        self._fwd_grad = grad

    @property
    def in_forward(self) -> bool:
        """A root forward is running."""
        return self._fwd is not None

    @property
    def in_training_forward(self) -> bool:
        """A grad-enabled root forward is running (units inside it may run under no_grad)."""
        return self._fwd is not None and self._fwd_grad

    def replay(self) -> None:
        """The running forward is a quiet pass (:mod:`mfsdp2.runtime.quiet_units`), whose units'
        forwards the schedule does not see: it neither replaces the recorded order nor counts as
        a misprediction."""
        if self._fwd is not None:
            self._fwd.replayed = True

    def end_forward(self, record: bool) -> None:
        if self._fwd is not None and not self._fwd.replayed:
            if self._fwd.mispredicted:
                self.mispredictions += 1
            if record:
                self.recorded = list(self._fwd.seen)
        self._fwd = None
        self._fwd_grad = False

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

    def expect_backward(self, state: "FSDPState") -> None:
        """Called as a non-root ``state`` finishes a forward whose backward will run."""
        self._bwd_record.append(state)
        limit = _MAX_FORWARDS_PER_BACKWARD * max(len(self.states), 1)
        if len(self._bwd_record) > limit:
            del self._bwd_record[: len(self._bwd_record) - limit]

    # -- backward -----------------------------------------------------------------------------
    def on_backward(self, state: "FSDPState") -> "list[FSDPState]":
        """Called as ``state``'s backward is about to run (its pre-backward hook)."""
        if self._bwd is None:
            self._bwd = _Pass([s for s in reversed(self._bwd_record) if not s.is_root])
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

    def end_backward(self, keep: "list[FSDPState]" = ()) -> None:
        """``keep``: units whose backward is still to come in a later ``backward()`` call of the
        same step (chunked loss, two losses): they stay in the prediction for it."""
        if self._bwd is not None and self._bwd.mispredicted and not keep:
            self.mispredictions += 1
        self._bwd = None
        self._bwd_record = [s for s in self._bwd_record if s in keep]

    def abandon_pass(self) -> None:
        """Forget the pass in progress (after an exception); the recorded order is kept."""
        self._fwd = None
        self._fwd_grad = False
        self._bwd = None
        self._bwd_record = []
