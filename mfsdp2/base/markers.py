"""Attribute names mfsdp2 sets on objects it does not own (parameters, hook functions), named once.

Why constants: these attributes carry facts between folders that never import each other's
private names -- the parameter a DTensor parameter was made from (ties, adoption, and which
DTensor parameters are mfsdp2's at all) and which optimizer hooks read nothing of the optimizer.
A misspelt string literal would make such a test silently false.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["ORIGINAL_PARAM", "READS_NO_PARAMS", "reads_no_params", "marked_reads_no_params"]

#: On each of mfsdp2's DTensor parameters: a weak reference to the module parameter it replaced
#: (None once that one is gone). Its presence in ``p.__dict__`` marks the parameter as mfsdp2's.
ORIGINAL_PARAM = "_mfsdp2_original"

#: On an optimizer step hook of mfsdp2's: it reads nothing of the optimizer's parameters or state,
#: so the local step (:mod:`mfsdp2.runtime.local_step`) may swap them around it.
READS_NO_PARAMS = "mfsdp2_reads_no_params"


def reads_no_params(fn: Callable) -> Callable:
    """Mark ``fn`` (an optimizer step hook) as reading nothing of the optimizer; returns it."""
    setattr(fn, READS_NO_PARAMS, True)
    return fn


def marked_reads_no_params(fn: Callable) -> bool:
    return bool(getattr(fn, READS_NO_PARAMS, False))
