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

Synchronisation on CUDA: both copies are *blocking* (``copy_`` without ``non_blocking``: the host
waits until the copy is done). Copy-out must be: the host reads the main gradient next (optimizer
step, ``clip_grad_norm_``, post-accumulate-grad hooks). Copy-in is ordered on the device anyway
(the gather's side stream waits on the current stream, see :mod:`mfsdp2.comm`), but a
non-blocking copy from page-locked memory would still be reading the main shard while the host
goes on -- and the host may write it next (an optimizer step after an eval forward, a load, a user
write through ``.data``), with nothing to make it wait. Blocking copies cost overlap, not
correctness.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

__all__ = ["MainMemory", "main_memory_for"]

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
        raise TypeError(f"mfsdp2: offload_policy for {where} must be an OffloadPolicy, got {type(offload_policy).__name__}")
    pin = bool(offload_policy.pin_memory) and torch.cuda.is_available()
    if offload_policy.pin_memory and not pin and "pin" not in _logged:
        _logged.add("pin")
        logger.info("mfsdp2: CPUOffloadPolicy(pin_memory=True) without CUDA: host memory is not pinned")
    return MainMemory(torch.device("cpu"), offloaded=True, pin=pin)
