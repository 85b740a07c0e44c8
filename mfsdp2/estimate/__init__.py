"""Per-rank memory of a training step under mfsdp2, predicted before launch (no processes, no
parameter memory): :func:`estimate_memory` returns a :class:`MemoryEstimate`;
``python -m mfsdp2.estimate --help`` is the command-line form. See docs/design.md, "Memory
estimate"."""

from .api import estimate_memory
from .plan import OPTIMIZERS
from .report import MemoryEstimate

# Nothing in the runtime imports this folder: the estimate replays the runtime's planning code.
MAY_IMPORT: tuple[str, ...] = ("base", "comm", "dtensors", "memory", "precision", "groups", "runtime", "checkpoint",
                               "frontend", "integrations", "optim", "models")

__all__ = ["estimate_memory", "MemoryEstimate", "OPTIMIZERS"]
