"""Simulated copy streams for CPU offload's copy path (``mfsdp2.memory.offload.StreamOps``).

On a CPU the offload copies are plain host copies; on CUDA with page-locked memory they run on a
copy stream of their own and whoever reads the result waits on the event after the copy. These
stream operations run that path on a CPU: each copy stream is a ``tests/_late_streams.SimStream``
(a thread running its operations in order) and every copy first sleeps ``delay`` seconds, so it
reads its source and writes its destination *late*. A reader that skipped its wait then sees
stale data every time.

Two ways to stand for the compute stream:

* ``SimCopyOps(sim)``: ``sim.compute`` of a ``SimStreams`` (for operations queued with
  ``sim.run``: unit tests of the ordering between streams);
* ``SimCopyOps(None)``: the host. In a model run on the CPU every operation other than the copies
  runs on the host when it is called, so the host is the compute stream and every side stream:
  waiting on an event there is a host wait, and a copy stream waiting on it waits for nothing.

``skip_waits``: ``wait_event`` does nothing -- the control run whose readers do not wait.
``log`` records ``("copy", stream name)`` and ``("wait", stream name)`` in order.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import torch

from mfsdp2.memory.offload import CopyDirection, StreamOps

from ._late_streams import SimEvent, SimStream, SimStreams

__all__ = ["SimCopyOps", "HOST"]

HOST = "host"


class _Event(SimEvent):
    """A simulated event with CUDA's host wait name."""

    def synchronize(self) -> None:
        self.wait()


class SimCopyOps(StreamOps):
    def __init__(self, sim: Optional[SimStreams], delay: float = 0.005, skip_waits: bool = False) -> None:
        self.sim = sim
        self.delay = delay
        self.skip_waits = skip_waits
        self.log: list[tuple[str, str]] = []
        self._own: list[SimStream] = []
        self._lock = threading.Lock()

    def asynchronous(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        return True  # every offload copy stands for a CUDA <-> pinned-host copy

    def new_stream(self, device: torch.device, direction: CopyDirection) -> SimStream:
        s = self.sim.new_stream(direction.value) if self.sim is not None else SimStream(direction.value)
        self._own.append(s)
        return s

    def current_stream(self, device: torch.device):
        return self.sim.current_stream() if self.sim is not None else HOST

    def wait_stream(self, waiter, other) -> None:
        if other is HOST:
            return  # the host's operations are done when issued
        self.sim.wait_stream(waiter, other)

    def copy(self, stream: SimStream, dst: torch.Tensor, src: torch.Tensor) -> _Event:
        delay = self.delay

        def late_copy() -> None:
            time.sleep(delay)
            dst.copy_(src)

        stream.enqueue(late_copy)
        ev = _Event()
        ev.recorded = True
        stream.enqueue(ev._set.set)
        with self._lock:
            self.log.append(("copy", stream.name))
        return ev

    def wait_event(self, stream, event) -> None:
        with self._lock:
            self.log.append(("wait", getattr(stream, "name", HOST) if stream is not None else HOST))
        if self.skip_waits:
            return
        if stream is None or stream is HOST:
            event.synchronize()
        else:
            stream.enqueue(event.synchronize)

    def close(self) -> None:
        for s in self._own:
            s.synchronize()
            if self.sim is None:
                s.close()
