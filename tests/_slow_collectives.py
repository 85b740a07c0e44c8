"""Collectives that run late, for tests: buffer-reuse and ordering bugs become deterministic.

A runtime that reuses a buffer before the collective using it has finished, or reads a gathered
weight before the gather wrote it, is usually saved on a CPU by luck: gloo finishes a small
collective within microseconds. :class:`SlowCollectives` takes the luck away. While installed,
every ``torch.distributed`` collective called in this process is *issued* ``delay_s`` after the
call (on one worker thread, in call order, so every rank issues the same sequence), with the
real backend doing the work then: it reads its inputs and writes its outputs only after the
delay, as a collective queued behind other work on a GPU side stream does. The returned work
object reports completion only after that. The addresses are taken at the call, as a launch
takes them (re-pointing a storage afterwards does not move the collective). Anything the caller
does with those buffers before ``wait()`` -- reading the output, writing the input, handing their
memory to another buffer -- now meets the late collective.

On CUDA (part 2 of issue 17, when a GPU is lent) the same class queues ``torch.cuda._sleep`` on
the stream the collective is launched on (mfsdp2 launches on its side streams) before the real
asynchronous call: the delay is then the stream's, and the same tests check stream ordering.
The CUDA branch is the few lines in :meth:`SlowCollectives._call` marked so.

Counters: ``issued`` (collectives delayed), ``waited_early`` (``wait()`` called before the
collective was even issued: proof that the delay was long enough to matter).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# The functions mfsdp2 (and these tests) call; p2p ones are asynchronous by nature.
_ASYNC_KW = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
             "all_reduce", "broadcast", "all_gather", "barrier")
_P2P = ("isend", "irecv")


class _LateWork:
    """A ``torch.distributed`` Work stand-in for a collective the worker issues later."""

    def __init__(self, owner: "SlowCollectives", name: str) -> None:
        self._owner = owner
        self.name = name
        self.waited = False
        self._issued = threading.Event()
        self.work = None
        self.error: BaseException | None = None

    def _settle(self, work, error) -> None:
        self.work, self.error = work, error
        self._issued.set()

    def wait(self, timeout=None) -> bool:
        self.waited = True
        if not self._issued.is_set():
            self._owner.waited_early += 1
        self._issued.wait()
        if self.error is not None:
            raise self.error
        if self.work is None:
            return True
        return self.work.wait() if timeout is None else self.work.wait(timeout)

    def is_completed(self) -> bool:
        return self._issued.is_set() and (self.work is None or self.work.is_completed())


class SlowCollectives:
    """``with SlowCollectives(delay_s=0.02, device=...):`` -- see the module docstring."""

    def __init__(self, delay_s: float = 0.02, device: torch.device | str = "cpu") -> None:
        self.delay_s = delay_s
        self.device = torch.device(device)
        self.issued = 0
        self.waited_early = 0
        self._originals: dict[str, Callable] = {}
        self._wrappers: dict[str, Callable] = {}
        self._queue: "queue.Queue" = queue.Queue()
        self._worker: threading.Thread | None = None
        self._pending: list[_LateWork] = []

    # -- install / uninstall -------------------------------------------------------------------
    def __enter__(self) -> "SlowCollectives":
        for name in _ASYNC_KW + _P2P:
            orig = getattr(c10d, name, None) or getattr(dist, name, None)
            if orig is None:
                continue
            self._originals[name] = orig
            self._wrappers[name] = wrapped = functools.partial(self._call, name)
            for mod in (dist, c10d):
                if getattr(mod, name, None) is orig:
                    setattr(mod, name, wrapped)
        if self.device.type == "cpu":
            self._worker = threading.Thread(target=self._run, name="slow-collectives", daemon=True)
            self._worker.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            for w in self._pending:  # nothing may still write the caller's memory after this
                w._issued.wait()
                # Only works nobody waited for: a gloo send / receive waited twice blocks for a
                # second completion that never comes.
                if w.work is not None and w.error is None and not w.waited:
                    w.work.wait()
        finally:
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join(timeout=60)
            for name, orig in self._originals.items():
                for mod in (dist, c10d):
                    if getattr(mod, name, None) is self._wrappers[name]:
                        setattr(mod, name, orig)

    # -- the delayed call ----------------------------------------------------------------------
    def _call(self, name: str, *args, **kwargs) -> Any:
        orig = self._originals[name]
        if threading.current_thread() is self._worker:  # a deprecated alias calling the real one
            return orig(*args, **kwargs)
        self.issued += 1
        if self.device.type == "cuda":  # CUDA: the delay is a kernel on the launching stream
            torch.cuda._sleep(int(self.delay_s * 1e9))  # cycles: at 1-2 GHz, 0.5-1x delay_s
            return orig(*args, **kwargs)
        blocking = name in _ASYNC_KW and not kwargs.pop("async_op", False)
        late = _LateWork(self, name)
        self._pending.append(late)
        # A launched collective has its addresses: pin them now, so that re-pointing a storage
        # afterwards (mfsdp2's reshard) does not move where the late collective reads or writes.
        pinned = (_pin(args), {k: _pin(v) for k, v in kwargs.items()})
        self._queue.put((time.monotonic() + self.delay_s, name, orig, pinned, (args, kwargs), late))
        if blocking:
            late.wait()
            return None
        return late

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            due, name, orig, (args, kwargs), _originals, late = item  # the originals: kept referenced
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                work = orig(*args, **kwargs) if name in _P2P else orig(*args, async_op=True, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                late._settle(None, e)
            else:
                late._settle(work, None)


def _pin(x: Any) -> Any:
    """``x`` with every CPU tensor replaced by an alias of the memory it points at *now* (a
    non-owning storage at its current address; the original stays referenced by the caller)."""
    if isinstance(x, (list, tuple)):
        return type(x)(_pin(v) for v in x)
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.untyped_storage().nbytes() == 0:
        return x
    st = x.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(st.data_ptr(), x.device, st.nbytes())
    return torch.empty(0, dtype=x.dtype).set_(alias, x.storage_offset(), x.shape, x.stride())
