"""A collective in flight, and how waiting on it fails fast.

Why apart from :mod:`mfsdp2.comm.communicator`: the handle is what every layer above holds (the
buffers, the reductions, the allocator's cleanup after an error) while only the communicator issues
collectives; its failure rules -- a timeout naming the collective, a failed handle that stays
failed, :meth:`CommHandle.settle` telling cleanup code whether the buffers may be freed -- are a
concept of their own.
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["CommHandle", "CollectiveError", "set_collective_timeout", "unfinished"]

# Fail-fast: how long a CPU rank waits for one collective before giving up (None: as long as the
# process group allows, 30 min by default). A rank that died, hangs or issued a different sequence
# of collectives then surfaces as a CollectiveError naming the unit and step on the waiting ranks.
_timeout_s: Optional[float] = (
    float(os.environ["MFSDP2_COLLECTIVE_TIMEOUT_S"]) if os.environ.get("MFSDP2_COLLECTIVE_TIMEOUT_S") else None
)


def set_collective_timeout(seconds: Optional[float]) -> None:
    """Fail a wait on a collective after ``seconds`` with a :class:`CollectiveError` naming the
    collective, unit and step (``None``: no limit beyond the process group's own). Also settable
    with the environment variable ``MFSDP2_COLLECTIVE_TIMEOUT_S``. CPU (gloo) collectives; NCCL's
    own watchdog (``TORCH_NCCL_*`` timeouts) covers CUDA."""
    global _timeout_s
    if seconds is not None and seconds <= 0:
        raise ValueError(f"collective timeout must be > 0 seconds or None, got {seconds}")
    _timeout_s = seconds


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it (kind, unit, step)."""


class CommHandle:
    """A collective in flight. ``wait()`` is idempotent; ``then`` runs once after the wait
    (e.g. a copy-out that must not start before the collective is done). ``label`` names it in
    errors ("all-gather of unit 'layers.3' (step 12)").

    ``inner``: a handle this one completes (waited first; a copy-out wrapped around a collective).
    ``keep``: tensors the collective reads or writes that nobody else may hold (a staging buffer,
    the shards kept by a partial reshard); referencing them here keeps their memory from going
    back to torch's allocator -- and on CUDA to the current stream's pool, ahead of the side
    stream that still reads them -- until the wait has ordered the current stream after it.

    A wait that failed (timeout, dead peer) leaves the handle *failed*: the work stays referenced,
    later waits raise the same error, and :meth:`settle` tells cleanup code whether the
    collective has provably ended before it frees the buffers it uses."""

    __slots__ = ("_work", "_event", "_then", "_inner", "_keep", "_error", "label")

    def __init__(
        self, work=None, event=None, then=None, label: str = "", inner: "Optional[CommHandle]" = None, keep=None
    ):
        self._work = work  # a torch Work, or a list of them (point-to-point exchanges)
        self._event = event
        self._then = then
        self._inner = inner
        self._keep = keep
        self._error: Optional[CollectiveError] = None
        self.label = label

    @property
    def event(self):
        """The CUDA event after the collective on its stream (None: none, or already waited)."""
        return self._event

    def wait(self) -> None:
        if self._error is not None:
            raise CollectiveError(str(self._error)) from self._error
        try:
            if self._inner is not None:
                self._inner.wait()
                self._inner = None
            if self._work is not None:
                # Cleared only once every work finished: a failed wait must not make the next
                # wait (or a cleanup) believe the collective is over.
                for w in self._work if isinstance(self._work, list) else [self._work]:
                    _wait_work(w, self.label)
                self._work = None
        except CollectiveError as e:
            self._error = e
            raise
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            self._event = None
        self._keep = None
        if self._then is not None:
            then, self._then = self._then, None
            then()

    @property
    def pending(self) -> bool:
        return any(x is not None for x in (self._work, self._event, self._then, self._inner))

    def settle(self) -> bool:
        """For cleanup after an error: finish the collective if it can, never raise.

        True: it provably ended (waited, or its failed work reports completion), so the buffers
        it reads and writes may be freed. False: it may still be running on the backend's
        threads; the caller must not free its buffers (leak them, see
        :meth:`mfsdp2.memory.allocator.BucketAllocator.leak`), and this handle -- with the works and
        tensors it references -- is kept for the life of the process (:data:`unfinished`).
        A failed collective's ``then`` (a copy-out of garbage) never runs."""
        if self._error is None:
            try:
                self.wait()
                return True
            except CollectiveError:
                pass
        if self._ended():
            return True
        if self not in unfinished:
            unfinished.append(self)
        return False

    def _ended(self) -> bool:
        if self._inner is not None and not self._inner._ended():
            return False
        works = self._work if isinstance(self._work, list) else [self._work] if self._work is not None else []
        return all(_is_completed(w) for w in works)


# Handles whose collective failed and may still run (see CommHandle.settle): referenced forever so
# that neither their works nor the tensors they keep are released while a backend thread uses them.
unfinished: list[CommHandle] = []


def _is_completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # a backend that cannot tell: not provably ended
        return False


def _wait_work(work, label: str) -> None:
    t = _timeout_s
    try:
        done = work.wait() if t is None else work.wait(datetime.timedelta(seconds=t))
    except Exception as e:  # gloo: a peer closed the connection, or the timeout expired
        raise CollectiveError(_failure(label, t, e)) from e
    if done is False:  # backends that report a timeout instead of raising
        raise CollectiveError(_failure(label, t, None))


def _failure(label: str, t: Optional[float], cause) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    limit = f" within {t:g} s" if t is not None else ""
    return (
        f"mfsdp2 E29: {label or 'a collective'} failed or did not finish{limit} on rank {rank}: another rank "
        "died, hangs, or issued a different sequence of collectives (e.g. it skipped this unit's forward, "
        "or its inputs took another branch through the model). Make every rank run the same units in the "
        f"same order. Cause: {cause!r}"
    )
