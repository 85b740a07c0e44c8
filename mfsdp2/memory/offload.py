"""Where a parameter group's *main* state lives: FSDP2's ``CPUOffloadPolicy``.

A group computes on its mesh's device -- the **compute device**: gathered weights, flat
gradients, reduction outputs, every allocator block. Its **main** state -- the main weights, the
main gradients, and therefore the optimizer's states and its step -- lives on the **main
device**. Without offload the two are the same device and the runtime shares memory between them
where it can (a persistent buffer's local slice *is* the main weights; a reduce-scatter writes
straight into the main gradient). With ``CPUOffloadPolicy`` the main device is the CPU (page-locked
memory when ``pin_memory=True`` and CUDA is present) and nothing is shared:

* **copy-in**: each gather copies (and casts) the main shard into its input on the compute device
  (ZeRO-3), or a persistent buffer's local slice is refreshed from it (ZeRO-1/2, no_shard);
* **copy-out**: each finished reduction is copied from the compute device into the main gradient
  (or added to it, through a host copy);
* quantities computed from main state (``clip_grad_norm_``'s norms) are agreed over the group's
  gloo twin (``Communicator.host``), never over the device group.

Why the offload path also runs on a CPU mesh, where both devices are the CPU: so the CPU tests
exercise every branch a CUDA run takes (no aliasing, copy-in, copy-out, host collectives); only the
tensors' device differs there. ``MainMemory.offloaded`` is that switch; ``device`` is where.

**Copy streams** (CUDA, page-locked main memory; FSDP2's copy-in and post-reduce streams). Both
copies are non-blocking and run on a side stream of their own per device and direction (created
at high priority, like the communicator's collective streams), not on the compute stream: a copy
issued there would queue behind the compute kernels already issued and hold back the ones after
it, so a prefetched gather's copy-in could not overlap the current unit's compute, nor a
gradient's copy-out the next unit's backward. The copy stream first waits on the current stream
(the destination block's previous readers, the reduction's post-divide: work issued there
before), then copies and records an event. Whoever reads the result waits on that event:

* **copy-in** (:func:`copy_from_main`): the all-gather's side stream waits on it before the
  collective reads the input (``DataParallelBuffer.all_gather``), so neither the host nor the
  compute stream waits; a persistent buffer's refreshed slice is waited by whichever stream
  reads it next (its own gather's, or the current stream packing a gather bucket or computing
  with a one-rank buffer: :func:`wait_copy`). The copy reads host memory after the host went on,
  and the host may write it next: the event of the latest copy-in per device is waited
  (:func:`settle_host_reads`) at the end of backward and before any optimizer step (a step
  pre-hook installed with the first non-blocking copy-in), and by every mfsdp2 path that writes
  the main weights: ``load_state_dict``, ``state_dict()`` (whose entries DCP's load writes into
  in place), the safetensors load, ``materialize`` and ``set_optimizer_state_dict``
  (``tests/checkpoint/test_offload_reads.py``). A write by other code between a forward and the
  end of its GPU work (``p.copy_(...)`` right after an eval forward whose output was not read
  yet) must ``torch.cuda.synchronize()`` first -- as with FSDP2.
* **copy-out** (:func:`copy_to_main`): the host is the reader. The group keeps the event and
  waits for it before the host reads or writes the main gradient -- the next accumulation into
  it, and at the latest the end of backward, where every group's copy is waited
  (``backward._final_callback``), so ``.grad`` is complete when ``backward()`` returns. Where the host
  must read the result at once -- adding into an existing gradient, post-accumulate-grad hooks
  (optimizer-in-backward) -- the copy stays blocking, as in FSDP2.

**Lifetime of what a copy stream reads.** A reduction's output block is read by the copy-out
after the host moved on. mfsdp2's allocators hand a freed block to the next request at once (the
runtime's rule is that a block is freed in program order on the current stream after the wait
that proves its last use ended), so ``record_stream`` -- which only tells torch's caching
allocator -- would not protect it. The block is *held* instead (:func:`hold`): its free runs once
the current stream waited on the copy's event, at the latest when a later copy-out takes its
place (at most :data:`MAX_HELD` blocks held), when its group reduces again, or when the host
waited for the copy. So one extra reduction output lives a little longer; the compute stream
waits only on a copy issued one reduction earlier, normally long done. Page-locked host memory
needs nothing: torch's host allocator records the copy's stream itself.

**Stream operations** go through one object (:class:`StreamOps`, ``torch.cuda`` by default) so that
the ordering can be checked on a CPU: ``tests/memory/test_offload_streams.py`` installs simulated
streams (:func:`set_stream_ops`) whose copies run late on threads, and shows that every reader
waits on the event of the copy it reads, and that one that does not reads stale data.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from ..base.markers import reads_no_params

__all__ = [
    "MainMemory", "main_memory_for", "copy_from_main", "copy_to_main", "settle_host_reads", "nonblocking",
    "wait_copy", "hold", "release_held", "StreamOps", "set_stream_ops", "CopyDirection", "MAX_HELD",
]

logger = logging.getLogger(__name__)

_logged: set = set()


@dataclass(frozen=True)
class MainMemory:
    """Where a group's main weights and gradients live (see the module docstring)."""

    device: torch.device
    offloaded: bool = False  # main storage distinct from compute storage (CPUOffloadPolicy)
    pin: bool = False  # page-locked host memory (faster, overlappable host <-> device copies)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device, pin_memory=self.pin)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pin)

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a compute-device tensor) on the main device: a blocking copy when the devices
        differ, so the host may read the result at once; ``t`` itself otherwise."""
        return t if t.device == self.device else t.to(self.device)


def main_memory_for(offload_policy, compute: torch.device, where: str) -> Optional[MainMemory]:
    """The main memory ``offload_policy`` asks for (``None``: the compute device's, no offload).

    ``CPUOffloadPolicy(pin_memory=True)`` (FSDP2's default) pins only where an accelerator
    exists: page-locked memory is a CUDA notion (torch raises "Cannot access accelerator device"
    for it on a CPU-only build, and so does FSDP2 with its default policy there)."""
    if offload_policy is None or type(offload_policy) is OffloadPolicy:
        return None
    if not isinstance(offload_policy, CPUOffloadPolicy):
        raise TypeError(f"mfsdp2 E91: offload_policy for {where} must be an OffloadPolicy "
                        "(CPUOffloadPolicy() or OffloadPolicy()), "
                        f"got {type(offload_policy).__name__}")
    pin = bool(offload_policy.pin_memory) and torch.cuda.is_available()
    if offload_policy.pin_memory and not pin and "pin" not in _logged:
        _logged.add("pin")
        logger.info("mfsdp2: CPUOffloadPolicy(pin_memory=True) without CUDA: host memory is not pinned")
    return MainMemory(torch.device("cpu"), offloaded=True, pin=pin)


def nonblocking(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether a copy between ``src`` and ``dst`` may run without blocking the host: one side on
    CUDA, the other in page-locked host memory (from pageable memory CUDA copies synchronously)."""
    if dst.is_cuda == src.is_cuda:  # both on CUDA or neither (every gather's copy-in asks this)
        return False
    if dst.device.type == "cuda" and src.device.type == "cpu":
        return src.is_pinned()
    if src.device.type == "cuda" and dst.device.type == "cpu":
        return dst.is_pinned()
    return False


class CopyDirection(str, enum.Enum):
    """The copy stream a copy runs on: host -> device and device -> host copies use different
    streams, so the two directions (separate copy engines on a GPU) overlap each other too."""

    TO_DEVICE = "copy-in"
    TO_HOST = "copy-out"


class StreamOps:
    """The stream operations offload copies need, on CUDA. An *event* is anything with
    ``synchronize()`` (the host waits until its stream reached it); a *stream* is this object's
    own (None: the device has no streams, work issued there is done when the call returns)."""

    def asynchronous(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Whether the copy runs on a copy stream (else: a plain blocking ``copy_``)."""
        return nonblocking(dst, src)

    def new_stream(self, device: torch.device, direction: CopyDirection) -> Any:
        return torch.cuda.Stream(device, priority=-1)  # high priority, as the collectives' streams

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device) if device.type == "cuda" else None

    def wait_stream(self, waiter: Any, other: Any) -> None:
        if other is not None:
            waiter.wait_stream(other)

    def copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """``dst.copy_(src)`` issued on ``stream``; the event recorded after it."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (None: the host waits)."""
        if stream is None:
            event.synchronize()
        else:
            stream.wait_event(event)


_ops = StreamOps()
_streams: dict = {}  # (device, CopyDirection) -> the copy stream


def set_stream_ops(ops: Optional[StreamOps]) -> StreamOps:
    """Install ``ops`` (None: CUDA's) for every later copy; returns the previous ones. Tests run
    the copy path on simulated streams with it; the copy streams are made anew."""
    global _ops
    prev, _ops = _ops, ops if ops is not None else StreamOps()
    _streams.clear()
    return prev


def _copy_stream(device: torch.device, direction: CopyDirection) -> Any:
    key = (device, direction)
    if key not in _streams:
        _streams[key] = _ops.new_stream(device, direction)
    return _streams[key]


# The event after the latest non-blocking copy *from* main memory, per device (copy-in).
_host_reads: dict = {}
_step_hook = None


def _issue(dst: torch.Tensor, src: torch.Tensor, device: torch.device, direction: CopyDirection) -> Any:
    stream = _copy_stream(device, direction)
    # The copy stream starts after what the current stream issued before: the block ``dst`` may
    # still be read there (a persistent slice by the last forward), ``src`` is written there
    # (a reduction's post-divide).
    _ops.wait_stream(stream, _ops.current_stream(device))
    return _ops.copy(stream, dst, src)


def copy_from_main(dst: torch.Tensor, src: torch.Tensor) -> Optional[Any]:
    """``dst.copy_(src)`` from main memory into compute memory. Where the copy may run
    asynchronously (:meth:`StreamOps.asynchronous`) it runs on the device's copy-in stream and
    the event after it is returned: whoever reads ``dst`` next must wait on it
    (:func:`wait_copy`); it is also noted for :func:`settle_host_reads`. None: the copy is done."""
    if not _ops.asynchronous(dst, src):
        dst.copy_(src)
        return None
    event = _issue(dst, src, dst.device, CopyDirection.TO_DEVICE)
    _host_reads[dst.device] = event  # a later event on the copy-in stream covers the earlier copies
    _install_step_hook()
    return event


def wait_copy(event: Optional[Any], device: torch.device, stream: Any = None) -> None:
    """Order the reader of a copy after it: ``stream`` (a collective's side stream) waits on
    ``event``; without one, the current stream of ``device`` (or the host, where the device has
    no streams: CPU collectives read their input when issued). A no-op for ``None``."""
    if event is None:
        return
    _ops.wait_event(stream if stream is not None else _ops.current_stream(device), event)


def settle_host_reads() -> None:
    """Wait until every non-blocking copy-in has read host memory (before the host writes it)."""
    while _host_reads:
        _, event = _host_reads.popitem()
        event.synchronize()


def copy_to_main(dst: torch.Tensor, src: torch.Tensor, blocking: bool = False) -> Optional[Any]:
    """``dst.copy_(src)`` from compute memory into main memory. Where it may run asynchronously
    (and ``blocking`` is off) it runs on the device's copy-out stream and the event after it is
    returned: the host must ``synchronize()`` it before it touches ``dst``, and ``src`` must stay
    unused until then (:func:`hold`). None: the copy is done."""
    if blocking or not _ops.asynchronous(dst, src):
        dst.copy_(src)
        return None
    return _issue(dst, src, src.device, CopyDirection.TO_HOST)


# Frees of blocks a copy stream still reads: (owner, event, device, release), oldest first.
MAX_HELD = 1
_held: "deque[tuple[Any, Any, torch.device, Callable[[], None]]]" = deque()


def hold(owner: Any, event: Any, device: torch.device, release: Callable[[], None]) -> None:
    """Run ``release`` (the free of a block the copy behind ``event`` reads) only once the
    current stream waited on ``event``: when more than :data:`MAX_HELD` are held (the oldest),
    or at :func:`release_held`. See the module docstring."""
    _held.append((owner, event, device, release))
    while len(_held) > MAX_HELD:
        _release(_held.popleft(), host_waited=False)


def release_held(owner: Any = None, host_waited: bool = False) -> None:
    """Release what ``owner`` holds (None: everything). ``host_waited``: the host synchronized
    the copies already (the end of backward), no stream needs to wait."""
    if not _held:  # the common case (nothing offloaded): every reduction asks
        return
    keep = [h for h in _held if owner is not None and h[0] is not owner]
    done = [h for h in _held if owner is None or h[0] is owner]
    _held.clear()
    _held.extend(keep)
    for h in done:
        _release(h, host_waited)


def _release(h: tuple, host_waited: bool) -> None:
    _, event, device, release = h
    if not host_waited:
        current = _ops.current_stream(device)
        if current is not None:
            _ops.wait_event(current, event)  # the free is ordered after the copy on the device
        else:
            event.synchronize()
    release()


def _install_step_hook() -> None:
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_hook = register_optimizer_step_pre_hook(_settle_before_step)


def _settle_before_step(*_) -> None:
    settle_host_reads()


# Reads nothing of the optimizer (see mfsdp2.runtime.local_step).
reads_no_params(_settle_before_step)
