"""Stream operations for collectives that run late on an accelerator (``tests/_slow_collectives.py``).

A collective launched on a CUDA stream (NCCL) is a kernel on that stream: it starts when the
stream reaches it -- after everything enqueued before it there -- reads its inputs while it runs,
and writes its outputs some time later, while the host has long moved on. Until it ends the
stream goes no further. To reproduce that with a backend that cannot (gloo stages through host
memory, and two ranks cannot share one GPU under NCCL), the harness enqueues, *on the launching
stream at the call*:

1. an event ``reached`` (the stream got to the collective: the work before it has run);
2. a **gate**: the stream stops until the host opens it (the collective "kernel" runs);
3. the copy of the staged outputs back into the output tensors;
4. an event ``done`` (what ``work.wait()`` makes the current stream wait on).

A worker thread waits for ``reached``, sleeps the injected delay, and only *then* reads the inputs
into host staging memory (:meth:`read`, from the worker, not from the launching stream, which is
held at the gate: nothing enqueued after the collective there can run first), runs the real
collective on the staged host tensors and opens the gate. Nothing blocks the host at the call.
So the inputs are read, and the outputs change, tens of milliseconds after the call: a consumer
that skipped the wait, a block freed or reused before it, or an input that something else
overwrites (another stream, the host) before the collective's turn, meets the late collective
every time. Where the input is read from is the address taken at the call (:meth:`source`), as a
kernel's pointer is: on CUDA a non-owning alias, so a block that the runtime frees and torch's
caching allocator hands to a new owner (on a stream not ordered after the collective) is read
with the new owner's data -- the missing ``record_stream`` / missing event class of bug.

A collective with nothing to write back (a send, a barrier) gets no gate, so that a send and a
receive queued on one stream do not deadlock here (NCCL would need them in one group); its input
is copied into staging at the stream's position (the earliest a kernel there could read it).

Two implementations of the same operations:

* :class:`CudaStreams` -- real CUDA streams; the gate is ``cuStreamWaitValue32`` on a flag in
  page-locked memory (the stream polls it on the device), or, where the driver refuses stream
  memory operations, ``cuLaunchHostFunc`` with a host function that blocks until opened (the
  stream cannot pass it before it returns). Both are CUDA driver calls through ``ctypes``. The
  worker reads inputs on a stream of its own (non-blocking: it never waits for the held stream).
* :class:`SimStreams` -- simulated streams for CPU tests of the same logic: each stream is a
  thread running its queued operations in order, events are set when the stream reaches them,
  and a gate is a ``threading.Event`` the stream waits on. Tensors are CPU tensors standing for
  device memory; the worker reads them directly. Ordering, delay and the failure of a missing
  wait are then deterministic on a machine without a GPU. Their memory is referenced, not
  aliased (a CPU block freed to malloc may be unmapped, and reading it would crash the rank): a
  premature free shows through the runtime's allocator instead, whose released blocks the
  harness poisons (``SlowCollectives(poison_frees=True)``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import threading
from typing import Callable, Iterator, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["CudaStreams", "SimStreams", "GATE_ENV", "alias"]

GATE_ENV = "MFSDP2_SLOW_GATE"  # "memop" | "hostfunc": force one CUDA gate (default: memop, else hostfunc)


def alias(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed through a non-owning storage at the address its memory has *now*: it neither
    keeps the memory alive nor follows a storage that is re-pointed afterwards (mfsdp2's reshard).
    The caller keeps the memory mapped (see the users)."""
    st = t.untyped_storage()
    if st.nbytes() == 0:
        return t
    view = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device, st.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(view, t.storage_offset(), t.shape, t.stride())


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------


class _MemOpGate:
    """``cuStreamWaitValue32(stream, flag, 1, GEQ)``: the stream waits on the device until the host
    writes 1 into ``flag`` (a page-locked int32, mapped into the device's address space)."""

    name = "memop"
    _GEQ = 0x0

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._wait = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._wait.restype = ctypes.c_int
        self._devptr = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or lib.cuMemHostGetDevicePointer
        self._devptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        self._devptr.restype = ctypes.c_int

    def arm(self, stream) -> torch.Tensor:
        flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        ptr = ctypes.c_uint64(0)
        if self._devptr(ctypes.byref(ptr), ctypes.c_void_p(flag.data_ptr()), 0) != 0:
            ptr = ctypes.c_uint64(flag.data_ptr())  # unified addressing: the host pointer is the device's
        rc = self._wait(ctypes.c_void_p(stream.cuda_stream), ptr.value, 1, self._GEQ)
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {rc}")
        return flag

    @staticmethod
    def open(flag: torch.Tensor) -> None:
        flag.fill_(1)


class _HostFuncGate:
    """``cuLaunchHostFunc(stream, f)`` where ``f`` blocks until opened: the stream cannot run past
    a host function that has not returned."""

    name = "hostfunc"
    _CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._launch = lib.cuLaunchHostFunc
        self._launch.argtypes = [ctypes.c_void_p, self._CB, ctypes.c_void_p]
        self._launch.restype = ctypes.c_int
        self._gates: dict[int, threading.Event] = {}
        self._next = 1  # 0 would be passed as NULL
        self._lock = threading.Lock()
        self._cb = self._CB(self._run)  # referenced for as long as the driver may call it

    def _run(self, key) -> None:
        with self._lock:
            gate = self._gates.pop(int(key))
        gate.wait()

    def arm(self, stream) -> threading.Event:
        gate = threading.Event()
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._gates[key] = gate
        rc = self._launch(ctypes.c_void_p(stream.cuda_stream), self._cb, ctypes.c_void_p(key))
        if rc != 0:
            with self._lock:
                self._gates.pop(key, None)
            raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {rc}")
        return gate

    @staticmethod
    def open(gate: threading.Event) -> None:
        gate.set()


class CudaStreams:
    """The harness's stream operations on real CUDA streams (see the module docstring)."""

    def __init__(self) -> None:
        self._gate = None
        self.gate_name = ""
        self._readers: dict = {}  # device index -> the worker's stream for reading inputs

    @staticmethod
    def owns(tensors: list[torch.Tensor]) -> bool:
        return any(t.is_cuda for t in tensors)

    @staticmethod
    def stage(t: torch.Tensor) -> torch.Tensor:
        """Page-locked host memory for ``t``'s data (filled later: :meth:`read`, :meth:`stage_now`)."""
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)

    @staticmethod
    def stage_now(host: torch.Tensor, t: torch.Tensor) -> None:
        host.copy_(t, non_blocking=True)  # on the current (launching) stream, at its position

    @staticmethod
    def source(t: torch.Tensor) -> torch.Tensor:
        """What the worker reads at the collective's turn: ``t``'s memory at the call's address,
        not owned (a kernel holds a pointer, not a reference): freeing ``t`` meanwhile lets
        torch's caching allocator hand the block on, and the late read then sees the new owner's
        data. The block stays mapped (the caching allocator keeps segments until
        ``empty_cache``), so the read itself is safe."""
        return alias(t)

    def read(self, host: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``host`` now, on the worker's own stream, and wait for it."""
        with torch.cuda.device(src.device):
            reader = self._readers.get(src.device.index)
            if reader is None:
                reader = self._readers[src.device.index] = torch.cuda.Stream(src.device)
            with torch.cuda.stream(reader):
                host.copy_(src, non_blocking=True)
            reader.synchronize()

    @staticmethod
    def record():
        ev = torch.cuda.Event()
        ev.record()
        return ev

    @staticmethod
    def host_wait(ev) -> None:
        ev.synchronize()

    def gate(self):
        stream = torch.cuda.current_stream()
        if self._gate is None:
            self._gate, token = self._pick(stream)
            return token
        return self._gate.arm(stream)

    def _pick(self, stream):
        """The first gate that arms on this driver (``MFSDP2_SLOW_GATE`` forces one), and the
        token of that first arming."""
        forced = os.environ.get(GATE_ENV, "")
        kinds = [k for k in (_MemOpGate, _HostFuncGate) if not forced or k.name == forced]
        errors = []
        for kind in kinds:
            try:
                gate = kind()
                token = gate.arm(stream)
            except Exception as e:  # noqa: BLE001 - a driver without stream memory operations
                errors.append(f"{kind.name}: {e!r}")
                continue
            self.gate_name = kind.name
            if errors:
                logger.warning("slow collectives: gate %s (%s)", kind.name, "; ".join(errors))
            return gate, token
        raise RuntimeError(f"no CUDA gate could be armed: {errors}")

    def open(self, token) -> None:
        self._gate.open(token)

    @staticmethod
    def write_back(dst: torch.Tensor, host: torch.Tensor) -> None:
        dst.copy_(host, non_blocking=True)

    @staticmethod
    def stream_wait(ev) -> None:
        torch.cuda.current_stream().wait_event(ev)

    @staticmethod
    def done(ev) -> bool:
        return ev.query()


# --------------------------------------------------------------------------------------------
# simulated streams (CPU tests)
# --------------------------------------------------------------------------------------------


class SimEvent:
    """Set when its stream reaches it; like a CUDA event, waiting on one never recorded is a no-op."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self.recorded = False

    def query(self) -> bool:
        return self._set.is_set() or not self.recorded

    def wait(self, timeout: Optional[float] = 60.0) -> None:
        if self.recorded and not self._set.wait(timeout):
            raise TimeoutError("simulated event never reached")


class SimStream:
    """A thread that runs its queued operations in order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._q: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._loop, name=f"sim-stream-{name}", daemon=True)
        self._thread.start()

    def enqueue(self, op: Callable[[], None]) -> None:
        self._q.put(op)

    def _loop(self) -> None:
        while True:
            op = self._q.get()
            if op is None:
                return
            try:
                op()
            except BaseException as e:  # noqa: BLE001 - reported by synchronize
                self.errors.append(e)

    def synchronize(self, timeout: float = 60.0) -> None:
        done = threading.Event()
        self.enqueue(done.set)
        if not done.wait(timeout):
            raise TimeoutError(f"simulated stream {self.name} did not drain")
        if self.errors:
            raise self.errors[0]

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(10)


class SimStreams:
    """The harness's stream operations on simulated streams (see the module docstring).

    ``compute`` is the default current stream; :meth:`stream` switches the calling thread's
    current stream (like ``torch.cuda.stream``); :meth:`run` queues an arbitrary operation (a
    "kernel") on the current stream."""

    def __init__(self) -> None:
        self.compute = SimStream("compute")
        self.streams = [self.compute]
        self._local = threading.local()

    def new_stream(self, name: str) -> SimStream:
        s = SimStream(name)
        self.streams.append(s)
        return s

    def current_stream(self) -> SimStream:
        return getattr(self._local, "stream", self.compute)

    @contextlib.contextmanager
    def stream(self, s: SimStream) -> Iterator[SimStream]:
        prev = self.current_stream()
        self._local.stream = s
        try:
            yield s
        finally:
            self._local.stream = prev

    def run(self, op: Callable[[], None]) -> None:
        self.current_stream().enqueue(op)

    @staticmethod
    def owns(tensors: list[torch.Tensor]) -> bool:
        return True

    @staticmethod
    def stage(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype)

    def stage_now(self, host: torch.Tensor, t: torch.Tensor) -> None:
        self.run(lambda: host.copy_(t))

    @staticmethod
    def source(t: torch.Tensor) -> torch.Tensor:
        return t  # referenced: see the module docstring

    @staticmethod
    def read(host: torch.Tensor, src: torch.Tensor) -> None:
        host.copy_(src)

    def record(self) -> SimEvent:
        ev = SimEvent()
        ev.recorded = True
        self.run(ev._set.set)
        return ev

    @staticmethod
    def host_wait(ev: SimEvent) -> None:
        ev.wait()

    def gate(self) -> threading.Event:
        gate = threading.Event()
        self.run(lambda: gate.wait(120))
        return gate

    @staticmethod
    def open(gate: threading.Event) -> None:
        gate.set()

    def write_back(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        self.run(lambda: dst.copy_(host))

    def stream_wait(self, ev: SimEvent) -> None:
        self.run(ev.wait)

    def wait_stream(self, waiter: SimStream, other: SimStream) -> None:
        with self.stream(other):
            ev = self.record()
        waiter.enqueue(ev.wait)

    @staticmethod
    def done(ev: SimEvent) -> bool:
        return ev.query()

    def synchronize(self) -> None:
        for s in self.streams:
            s.synchronize()

    def close(self) -> None:
        for s in self.streams:
            s.close()


# --------------------------------------------------------------------------------------------
# preflight: does a CUDA gate hold a stream until opened, and release it then?
# --------------------------------------------------------------------------------------------


def gate_selftest(name: str, hold_s: float = 0.05, release_s: float = 5.0) -> dict:
    """Arm gate ``name`` on a side stream, queue a copy behind it, and check that the copy has
    not run ``hold_s`` later, that the current stream (not waiting) reads the old data, and that
    the copy runs within ``release_s`` of opening. ``{"armed", "held", "stale_without_wait",
    "released", "error"}``. Run it in a subprocess with a timeout: a gate the device never sees
    opening leaves its stream stuck for good."""
    import time

    out = {"gate": name, "armed": False, "held": False, "stale_without_wait": False, "released": False, "error": ""}
    kind = {"memop": _MemOpGate, "hostfunc": _HostFuncGate}[name]
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(dev)
    x = torch.zeros(1 << 20, device=dev)
    src = torch.full((1 << 20,), 7.0, pin_memory=True)
    torch.cuda.synchronize()
    try:
        gate = kind()
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            token = gate.arm(side)
            x.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
    except Exception as e:  # noqa: BLE001
        out["error"] = repr(e)
        return out
    out["armed"] = True
    time.sleep(hold_s)
    out["held"] = not ev.query()
    out["stale_without_wait"] = bool((x == 0).all())  # the current stream, no wait: old data
    gate.open(token)
    t0 = time.monotonic()
    while not ev.query() and time.monotonic() - t0 < release_s:
        time.sleep(0.001)
    out["released"] = ev.query()
    if out["released"]:
        torch.cuda.current_stream(dev).wait_event(ev)
        out["released"] = bool((x == 7).all())
    return out


if __name__ == "__main__":  # python -m tests._late_streams memop|hostfunc  (prints one JSON line)
    import json
    import sys

    print(json.dumps(gate_selftest(sys.argv[1] if len(sys.argv) > 1 else "memop")))
