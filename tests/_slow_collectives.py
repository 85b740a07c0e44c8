"""Collectives that run late, for tests: buffer-lifetime and ordering bugs become deterministic.

A runtime that reuses a buffer before the collective using it has finished, frees or overwrites
a collective's input before the collective read it, or reads a gathered weight before the gather
wrote it, is usually saved by luck: gloo finishes a small collective within microseconds, and a
collective on a GPU stream usually ends before anyone looks. While :class:`SlowCollectives` is
installed, every ``torch.distributed`` collective called in this process reads its inputs and
writes its outputs ``delay_s`` after the call, and the host never waits for that:

* **CPU tensors**: the call is *issued* ``delay_s`` later by one worker thread (in call order, so
  every rank issues the same sequence) with the real backend doing the work then -- reading the
  inputs then too; the returned work object reports completion only after that (an
  ``async_op=False`` call waits for it, as it must). The addresses are taken at the call, as a
  launch takes them (re-pointing a storage afterwards does not move the collective); the
  caller's tensors stay referenced (gloo reads and writes through them).
* **Accelerator tensors** (``device="cuda"``; or simulated streams in CPU tests): the call enqueues
  on the *current stream* an event ``reached``, a device-side **gate** and the copy of the results
  back into the outputs, then returns at once (``async_op=False`` too: as an NCCL call does). A
  worker waits until the stream reached the gate (the work before the collective on its stream
  has run), sleeps the delay, *then* reads the inputs into host staging memory, runs the real
  collective (gloo) there and opens the gate. The returned work's ``wait()`` makes the current
  stream wait for the copy back -- NCCL's semantics, never the host's. See
  ``tests/_late_streams.py`` for the stream operations, the gates and where inputs are read from.

So anything the caller does with those buffers before the wait -- reading the output, writing the
input, freeing either, handing their memory to another buffer, or reusing it on another stream --
meets the late collective every time.

A premature *free* is made visible by poisoning (``poison_frees=True``, the default): every block
the runtime's allocator (``mfsdp2.memory.allocator.BucketAllocator.free``) takes back is filled
with NaN where it is freed and kept out of reuse until the harness exits (:meth:`SlowCollectives._poison`).
All of the runtime's collective buffers -- gradients to reduce, reduce-scatter outputs and
scratch, gathered weights, float8 gather inputs -- come from that allocator, so a free before the
wait turns the late collective's input (or the block its output lands in) into NaN, whatever
malloc or torch's allocator would have done with it. Counter: ``poisoned``.

With ``stream_ordered=True`` (the default on CUDA) the harness also presents the process group to
mfsdp2 as a stream-ordered backend (NCCL): ``mfsdp2.comm.communicator`` then takes its NCCL path -- collectives
called with ``async_op=False`` inside its side streams and an event recorded after them -- which
is what runs on GPUs in production and cannot otherwise run with two ranks on one GPU. False
keeps gloo's own path (``async_op=True``, the work waited). gloo lacks nothing mfsdp2's NCCL path
uses except a native AVG on older torch: the harness runs AVG as SUM and divides the staged result.
With ``premul_sum=True`` it also presents the group as having NCCL's ``PREMUL_SUM`` (so the
runtime's reduce plan picks it: a gradient divide factor other than the shard group's size, float32)
and runs a ``PREMUL_SUM(f)`` as gloo can: the inputs, read at the collective's turn, times ``f``, then
``SUM`` -- the arithmetic NCCL performs inside the collective.

Counters: ``issued`` (collectives delayed); ``waited_early`` (``wait()`` called before the data
moved: the delay mattered to a waiter); ``overtaken`` (a later collective was issued before this
one's data moved: the host did not block on it); ``poisoned`` (blocks poisoned at their free);
``premul_issued`` (``PREMUL_SUM`` collectives run as a scaled ``SUM``).
"""

from __future__ import annotations

import functools
import inspect
import queue
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ._late_streams import CudaStreams, alias

# The functions mfsdp2 (and these tests) call; p2p ones are asynchronous by nature.
_ASYNC_KW = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
             "all_to_all_single", "all_reduce", "broadcast", "all_gather", "barrier")
_P2P = ("isend", "irecv")
# (outputs, inputs): positions, in the function's signature, of the tensor (or list) arguments.
_IO = {
    "all_gather_single": ((0,), (1,)), "all_gather_into_tensor": ((0,), (1,)),
    "reduce_scatter_single": ((0,), (1,)), "reduce_scatter_tensor": ((0,), (1,)),
    "all_reduce": ((0,), (0,)), "broadcast": ((0,), (0,)),
    "all_gather": ((0,), (1,)), "reduce_scatter": ((0,), (1,)), "all_to_all_single": ((0,), (1,)),
    "isend": ((), (0,)), "irecv": ((0,), ()), "barrier": ((), ()),
}


class _LateWork:
    """A ``torch.distributed`` Work stand-in for a CPU collective the worker issues later."""

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


class _StreamWork:
    """The work of a collective enqueued on a stream: ``wait()`` orders the current stream after
    the copy back (the host goes on); complete once that copy ran."""

    def __init__(self, owner: "SlowCollectives", name: str, index: int, done, token) -> None:
        self._owner = owner
        self.name = name
        self.index = index
        self.done = done
        self.token = token  # the gate (a flag the device reads): kept alive until the copy back ran
        self.moved = threading.Event()  # the worker opened the gate
        self.waited = False
        self.error: BaseException | None = None

    def wait(self, timeout=None) -> bool:
        self.waited = True
        if not self.moved.is_set():
            self._owner.waited_early += 1
        if self.error is not None:
            raise self.error
        self._owner.streams.stream_wait(self.done)
        return True

    def is_completed(self) -> bool:
        return self.moved.is_set() and self._owner.streams.done(self.done)


@functools.lru_cache(maxsize=None)
def _signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(fn)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


class SlowCollectives:
    """``with SlowCollectives(delay_s=0.02, device=...):`` -- see the module docstring.

    ``streams``: the stream operations for accelerator tensors (default: real CUDA streams when
    ``device`` is CUDA; tests pass ``_late_streams.SimStreams()``). ``stream_ordered``: present
    the group to mfsdp2 as NCCL-like (default: on CUDA)."""

    def __init__(self, delay_s: float = 0.02, device: torch.device | str = "cpu", streams=None,
                 stream_ordered: Optional[bool] = None, poison_frees: bool = True,
                 premul_sum: bool = False) -> None:
        self.delay_s = delay_s
        self.poison_frees = poison_frees
        self.premul_sum = premul_sum
        self.poisoned = 0
        self.premul_issued = 0  # PREMUL_SUM collectives run as a scaled SUM
        self._quarantine: list[torch.Tensor] = []
        self._saved_free = None
        self._saved_op_support = None
        self.device = torch.device(device)
        self.streams = streams if streams is not None else (CudaStreams() if self.device.type == "cuda" else None)
        self.stream_ordered = self.device.type == "cuda" if stream_ordered is None else stream_ordered
        self.issued = 0
        self.waited_early = 0
        self.overtaken = 0
        self.errors: list[BaseException] = []
        self._originals: dict[str, Callable] = {}
        self._wrappers: dict[str, Callable] = {}
        self._queue: "queue.Queue" = queue.Queue()
        self._completions: "queue.Queue" = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._pending: list = []
        self._saved_policy = None

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
        from mfsdp2.comm.registry import clear_communicators

        # A communicator decides its path (stream-ordered, PREMUL_SUM) when it is made, and
        # mfsdp2 keeps one per group: one made outside this harness, or under another persona,
        # would keep its path here. So the cache is dropped at the entry and at the exit.
        clear_communicators()
        if self.stream_ordered:
            import mfsdp2.comm.communicator as comm

            self._saved_policy = comm.stream_ordered_backend
            comm.stream_ordered_backend = lambda name, device_type: device_type == "cuda"
        if self.premul_sum:
            import mfsdp2.comm.communicator as comm

            self._saved_op_support = real_support = comm.reduce_op_support
            comm.reduce_op_support = lambda backend: (True, real_support(backend)[1])
        if self.poison_frees:
            from mfsdp2.memory.allocator import BucketAllocator

            self._saved_free = real_free = BucketAllocator.free

            def free(alloc, key) -> None:
                block = alloc._live.get(key)
                if block is not None:
                    self._poison(block)
                real_free(alloc, key)

            BucketAllocator.free = free
        for target, label in ((self._run, "slow-collectives"), (self._complete, "slow-collectives-done")):
            t = threading.Thread(target=target, name=label, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc) -> None:
        try:
            for w in self._pending:  # nothing may still write the caller's memory after this
                if isinstance(w, _StreamWork):
                    w.moved.wait()
                    self.streams.host_wait(w.done)
                    continue
                w._issued.wait()
                # Only works nobody waited for: a gloo send / receive waited twice blocks for a
                # second completion that never comes.
                if w.work is not None and w.error is None and not w.waited:
                    w.work.wait()
        finally:
            self._queue.put(None)
            for t in self._threads:
                t.join(timeout=60)
            for name, orig in self._originals.items():
                for mod in (dist, c10d):
                    if getattr(mod, name, None) is self._wrappers[name]:
                        setattr(mod, name, orig)
            import mfsdp2.comm.communicator as comm
            from mfsdp2.comm.registry import clear_communicators
            from mfsdp2.memory.allocator import BucketAllocator

            clear_communicators()
            if self._saved_policy is not None:
                comm.stream_ordered_backend = self._saved_policy
            if self._saved_op_support is not None:
                comm.reduce_op_support = self._saved_op_support
            if self._saved_free is not None:
                BucketAllocator.free = self._saved_free
            self._quarantine.clear()  # every late collective has ended
        if self.errors and exc[0] is None:
            raise AssertionError(f"slow collectives: the late collectives failed: {self.errors[:3]!r}")

    # -- poisoned frees ------------------------------------------------------------------------
    def _poison(self, block: torch.Tensor) -> None:
        """A block the runtime's allocator takes back: fill it with NaN (0xFF bytes for one-byte
        types, float8's NaN; -1 for integers) where the free happens -- on the current stream,
        where a new owner's first write would land -- and keep it referenced until the harness
        exits, so neither malloc nor torch's caching allocator hands it on or unmaps it. A
        collective that still reads it reads the poison every time (the new owner's data is
        luck: a block freed to malloc is reused, or not, by whoever asks next); one that still
        writes it writes memory nobody else holds. A runtime that frees after the wait never
        sees it: the wait ordered the free, and so the fill, after the collective."""
        if block.numel() == 0 or block.dtype == torch.bool:
            return
        if block.element_size() == 1:
            fill = functools.partial(block.view(torch.uint8).fill_, 0xFF)
        elif block.dtype.is_floating_point or block.dtype.is_complex:
            fill = functools.partial(block.fill_, float("nan"))
        else:
            fill = functools.partial(block.fill_, -1)
        if block.device.type == "cpu" and self.streams is not None and hasattr(self.streams, "run"):
            self.streams.run(fill)  # simulated device memory: on the current simulated stream
        else:
            fill()  # the CPU now; CUDA: enqueued on the current stream
        self.poisoned += 1
        self._quarantine.append(block)

    # -- the delayed call ----------------------------------------------------------------------
    def _call(self, name: str, *args, **kwargs) -> Any:
        orig = self._originals[name]
        if threading.current_thread() in self._threads:  # a deprecated alias calling the real one
            return orig(*args, **kwargs)
        tensors = _tensors(args) + _tensors(kwargs)
        if self.streams is not None and tensors and self.streams.owns(tensors):
            return self._call_on_stream(name, orig, args, kwargs)
        self.issued += 1
        blocking = name in _ASYNC_KW and not kwargs.pop("async_op", False)
        late = _LateWork(self, name)
        self._pending.append(late)
        # A launched collective has its addresses: pin them now, so that re-pointing a storage
        # afterwards (mfsdp2's reshard) does not move where the late collective reads or writes.
        pinned = (_pin(args), {k: _pin(v) for k, v in kwargs.items()})
        self._queue.put(("cpu", time.monotonic() + self.delay_s, name, orig, pinned, (args, kwargs), late))
        if blocking:
            late.wait()
            return None
        return late

    def _call_on_stream(self, name: str, orig: Callable, args, kwargs) -> Any:
        """Enqueue ``reached``, the gate and the copy back on the current stream; return without
        waiting. The worker reads the inputs at the collective's turn (``_run``)."""
        async_op = bool(kwargs.pop("async_op", False))
        sig = _signature(orig)
        bound = sig.bind(*args, **kwargs)
        params = list(sig.parameters)
        outs, ins = _IO[name]
        st = self.streams
        writes: list[tuple[torch.Tensor, torch.Tensor]] = []
        reads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (staging, where the worker reads it)
        now: list[tuple[torch.Tensor, torch.Tensor]] = []  # staged at the stream's position
        staged: dict[str, Any] = {}
        gated = any(_tensors(bound.arguments.get(params[i])) for i in outs)  # something to write back
        for i in sorted(set(outs) | set(ins)):
            pname = params[i]
            value = bound.arguments[pname]

            def stage(t: torch.Tensor, i=i) -> torch.Tensor:
                host = st.stage(t)
                if i in ins:
                    (reads if gated else now).append((host, st.source(t) if gated else t))
                if i in outs:
                    writes.append((t, host))
                return host

            staged[pname] = type(value)(stage(t) for t in value) if isinstance(value, (list, tuple)) else stage(value)
        for host, t in now:
            st.stage_now(host, t)
        reached = st.record()
        token = st.gate() if gated else None
        for dst, host in writes:
            st.write_back(dst, host)
        done = st.record()
        bound.arguments.update(staged)
        divide, scale = 0, None
        op = bound.arguments.get("op")
        if op is not None and op == dist.ReduceOp.AVG:
            bound.arguments["op"] = dist.ReduceOp.SUM
            divide = dist.get_world_size(bound.arguments.get("group"))
        elif op is not None and op == dist.ReduceOp.PREMUL_SUM:
            bound.arguments["op"], scale = dist.ReduceOp.SUM, _premul_factor(op)
            self.premul_issued += 1
        work = _StreamWork(self, name, self.issued, done, token)
        self.issued += 1
        self._pending = [w for w in self._pending if not (isinstance(w, _StreamWork) and w.is_completed())]
        self._pending.append(work)
        hosts = [h for _, h in writes]
        self._queue.put(("stream", time.monotonic() + self.delay_s, name, orig, bound, reached, reads, scale, work,
                         hosts, divide))
        return work if (async_op or name in _P2P) else None

    def _run(self) -> None:
        """Issue the collectives in call order, each ``delay_s`` after its call."""
        while True:
            item = self._queue.get()
            if item is None:
                self._completions.put(None)
                return
            if item[0] == "cpu":
                _, due, name, orig, (args, kwargs), _originals, late = item  # the originals: kept referenced
                time.sleep(max(0.0, due - time.monotonic()))
                try:
                    args, kwargs, premul = _emulate_premul_sum(name, orig, args, kwargs)
                    self.premul_issued += premul
                    work = orig(*args, **kwargs) if name in _P2P else orig(*args, async_op=True, **kwargs)
                except BaseException as e:  # noqa: BLE001 - handed to the waiter
                    late._settle(None, e)
                else:
                    late._settle(work, None)
                continue
            _, due, name, orig, bound, reached, reads, scale, work, hosts, divide = item
            try:
                self.streams.host_wait(reached)  # the stream got to the collective: held at its gate
                time.sleep(max(0.0, due - time.monotonic()))
                for host, src in reads:  # the collective's turn: it reads its inputs now
                    self.streams.read(host, src)
                    if scale is not None:
                        host.mul_(scale)
                reads.clear()  # drop the aliases and references at once
                real = (orig(*bound.args, **bound.kwargs) if name in _P2P
                        else orig(*bound.args, async_op=True, **bound.kwargs))
            except BaseException as e:  # noqa: BLE001 - the gate must open anyway
                real, work.error = None, e
                self.errors.append(e)
            # Completed by the other thread: waiting here would keep a later receive from being
            # posted while an earlier send waits for it (point-to-point exchanges).
            self._completions.put((real, work, hosts, divide))

    def _complete(self) -> None:
        """Wait for each issued collective, in order; then open its gate."""
        while True:
            item = self._completions.get()
            if item is None:
                return
            real, work, hosts, divide = item
            try:
                if real is not None:
                    real.wait()
                    if divide:
                        for h in hosts:
                            h.div_(divide)
            except BaseException as e:  # noqa: BLE001
                work.error = e
                self.errors.append(e)
            finally:
                if self.issued > work.index + 1:
                    self.overtaken += 1
                work.moved.set()
                if work.token is not None:
                    self.streams.open(work.token)


def _pin(x: Any) -> Any:
    """``x`` with every CPU tensor replaced by an alias of the memory it points at *now* (a
    non-owning storage at its current address; the original stays referenced by the harness)."""
    if isinstance(x, (list, tuple)):
        return type(x)(_pin(v) for v in x)
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
        return x
    return alias(x)


def _premul_factor(op) -> float:
    return float(op.factor)


def _emulate_premul_sum(name: str, orig: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """A ``PREMUL_SUM(f)`` call (NCCL's; gloo has none) as gloo can run it: the inputs multiplied
    by ``f``, read now (the collective's turn), then ``SUM`` -- the arithmetic NCCL performs
    inside the collective. An input that is also the output (an in-place all-reduce) is scaled
    in place (the collective overwrites it anyway); any other is replaced by a scaled copy."""
    sig = _signature(orig)
    bound = sig.bind(*args, **kwargs)
    op = bound.arguments.get("op")
    if op is None or op != dist.ReduceOp.PREMUL_SUM:
        return args, kwargs, False
    factor = _premul_factor(op)
    params = list(sig.parameters)
    outs, ins = _IO[name]
    for i in ins:
        value = bound.arguments[params[i]]
        if i in outs:
            for t in _tensors(value):
                t.mul_(factor)
        elif isinstance(value, (list, tuple)):
            bound.arguments[params[i]] = type(value)(t * factor for t in value)
        else:
            bound.arguments[params[i]] = value * factor
    bound.arguments["op"] = dist.ReduceOp.SUM
    return bound.args, bound.kwargs, True
