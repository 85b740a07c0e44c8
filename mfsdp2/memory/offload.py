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
* quantities computed from main state (``clip_grad_norm_``'s norms, the persistent weights'
  content fingerprint) are agreed over the group's gloo twin (``Communicator.host``), never over
  the device group.

Why the offload path also runs on a CPU mesh, where both devices are the CPU: so the CPU tests
exercise every branch a CUDA run takes (no aliasing, copy-in, copy-out, host collectives); only the
tensors' device differs there. ``MainMemory.offloaded`` is that switch; ``device`` is where.

Synchronisation on CUDA, as FSDP2's: with page-locked main memory both copies are
*non-blocking* and an event marks their end, so the host does not stall once per group in
forward and backward.

* **copy-out** (:func:`copy_to_main`): the group keeps the event and waits for it before the host
  reads or writes the main gradient -- the next accumulation into it, and at the latest the end of
  backward, where every group's copy is waited (``backward._final_callback``), so ``.grad`` is
  complete when ``backward()`` returns. Where the host must read the result at once -- adding into
  an existing gradient, post-accumulate-grad hooks (optimizer-in-backward) -- the copy stays
  blocking, as in FSDP2.
* **copy-in** (:func:`copy_from_main`): ordered on the device anyway (the gather's side stream
  waits on the current stream, see :mod:`mfsdp2.comm.communicator`), but the copy reads the main shard after
  the host went on, and the host may write it next. The event of the latest such copy is waited
  (:func:`settle_host_reads`) at the end of backward and before any optimizer step (a step pre-hook
  installed with the first non-blocking copy-in), and by every mfsdp2 path that writes the main
  weights: ``load_state_dict``, ``state_dict()`` (whose entries DCP's load writes into in place),
  the safetensors load, ``materialize`` and ``set_optimizer_state_dict``
  (``tests/checkpoint/test_offload_reads.py``). A write by other code between a forward and the
  end of its GPU work (``p.copy_(...)`` right after an eval forward whose output was not read yet)
  must ``torch.cuda.synchronize()`` first -- as with FSDP2.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

__all__ = ["MainMemory", "main_memory_for", "copy_from_main", "copy_to_main", "settle_host_reads", "nonblocking"]

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
    if dst.device.type == "cuda" and src.device.type == "cpu":
        return src.is_pinned()
    if src.device.type == "cuda" and dst.device.type == "cpu":
        return dst.is_pinned()
    return False


# The event after the latest non-blocking copy *from* main memory, per device (copy-in).
_host_reads: dict = {}
_step_hook = None


def copy_from_main(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` from main memory into compute memory; non-blocking where
    :func:`nonblocking` allows, with its end noted for :func:`settle_host_reads`."""
    if not nonblocking(dst, src):
        dst.copy_(src)
        return
    dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _host_reads[dst.device] = event  # a later event on the stream covers the earlier copies
    _install_step_hook()


def settle_host_reads() -> None:
    """Wait until every non-blocking copy-in has read host memory (before the host writes it)."""
    while _host_reads:
        _, event = _host_reads.popitem()
        event.synchronize()


def copy_to_main(dst: torch.Tensor, src: torch.Tensor, blocking: bool = False):
    """``dst.copy_(src)`` from compute memory into main memory. Returns an event the host must
    synchronize before it touches ``dst`` when the copy runs non-blocking, else None."""
    if blocking or not nonblocking(dst, src):
        dst.copy_(src)
        return None
    dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return event


def _install_step_hook() -> None:
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_hook = register_optimizer_step_pre_hook(lambda *_: settle_host_reads())

