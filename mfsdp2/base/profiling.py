"""Named ranges and an optional event log, so traces and tests can see what the runtime did.

Every range shows up twice: as an NVTX range (nsys on GPU) and as a ``torch.profiler``
``record_function`` range (CPU and GPU profiler traces), under the same name, e.g.
``mfsdp2.unshard layers.3``. Both cost nothing when nothing listens: ``record_function`` is
only entered while a torch profiler is recording, and NVTX ranges are only pushed while an NVTX
tool is attached (:func:`nvtx_tool_attached`). Why that test: libnvtx reaches a tool only
through the injection library named in ``NVTX_INJECTION64_PATH``, which nsys and ncu set in the
process they profile; without one every push is a no-op in libnvtx, but the ``nvtx`` package's
Python wrapper still costs about a microsecond per range -- a few hundred ranges per step on a
model of many small units. ``MFSDP2_NVTX=1`` forces the ranges on (a tool attached another way).

Where the NVTX ranges come from (:func:`select_nvtx`, once at import): the ``nvtx`` package when
it is installed; otherwise torch's own binding, ``torch.cuda.nvtx``, which every CUDA build of
torch has -- many clusters (and our lent GPU machine) have no ``nvtx`` package, and the ranges
would silently vanish from nsys there. A CPU-only torch has neither (its ``torch.cuda.nvtx``
raises): then only the profiler ranges are emitted. :data:`nvtx_source` says which was chosen.

The event log is for tests and debugging: when enabled it appends ``(kind, unit)`` tuples in
issue order (``"ag_issue"``, ``"forward_begin"``, ``"rs_issue"``, ...), which lets a test assert
overlap by order rather than by wall time.

Recipes
-------
* GPU, nsys: ``nsys profile -t cuda,nvtx,osrt --capture-range=cudaProfilerApi -o mfsdp2 \
  torchrun --nproc-per-node 8 train.py`` and open the report; the ``mfsdp2.*`` NVTX ranges
  sit on the CPU thread row, the collectives on the NCCL streams.
* CPU, torch.profiler: wrap a few steps in ``torch.profiler.profile(activities=[ProfilerActivity.CPU])``
  and ``prof.export_chrome_trace("trace.json")``; the ``mfsdp2.*`` ranges and the
  ``gloo:all_gather`` / ``gloo:all_reduce`` events are there (open in Perfetto).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Callable, Optional

import torch

__all__ = ["trace_range", "EventLog", "event_log", "select_nvtx", "nvtx_source", "nvtx_tool_attached"]

logger = logging.getLogger(__name__)
_profiler_enabled = torch._C._autograd._profiler_enabled


def nvtx_tool_attached(env=None) -> bool:
    """Whether NVTX ranges reach a tool: an injection library is named (``NVTX_INJECTION64_PATH``
    / ``NVTX_INJECTION32_PATH``, set by nsys and ncu in the profiled process), or ``MFSDP2_NVTX=1``."""
    env = os.environ if env is None else env
    if env.get("MFSDP2_NVTX") == "1":
        return True
    return bool(env.get("NVTX_INJECTION64_PATH") or env.get("NVTX_INJECTION32_PATH"))


def select_nvtx(attached: Optional[bool] = None
                ) -> tuple[Optional[str], Optional[Callable[[str], object]], Optional[Callable[[], object]]]:
    """``(source, push, pop)`` of the NVTX binding to use: none without a tool attached
    (``attached``, default :func:`nvtx_tool_attached`); else the ``nvtx`` package, else
    ``torch.cuda.nvtx`` where it works (a CUDA build; probed with one empty range), else
    ``(None, None, None)``."""
    if not (nvtx_tool_attached() if attached is None else attached):
        return None, None, None
    try:
        pkg = importlib.import_module("nvtx")
        return "nvtx", pkg.push_range, pkg.pop_range
    except ImportError:
        pass
    cuda_nvtx = torch.cuda.nvtx
    try:
        cuda_nvtx.range_push("mfsdp2")
        cuda_nvtx.range_pop()
    except (RuntimeError, AttributeError):  # a CPU-only torch: "NVTX functions not installed"
        return None, None, None
    return "torch.cuda.nvtx", cuda_nvtx.range_push, cuda_nvtx.range_pop


#: Which NVTX binding mfsdp2's ranges go to: ``"nvtx"``, ``"torch.cuda.nvtx"`` or ``None`` (no
#: tool attached, or no binding).
nvtx_source, _nvtx_push, _nvtx_pop = select_nvtx()


class _TraceRange:
    """An NVTX range plus a profiler range named ``name`` (see :func:`trace_range`)."""

    __slots__ = ("name", "_rf")

    def __init__(self, name: str):
        self.name = name
        self._rf: Optional[torch.autograd.profiler.record_function] = None

    def __enter__(self) -> "_TraceRange":
        if _nvtx_push is not None:
            _nvtx_push(self.name)
        if _profiler_enabled():
            self._rf = torch.autograd.profiler.record_function(self.name)
            self._rf.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._rf is not None:
            self._rf.__exit__(*exc)
            self._rf = None
        if _nvtx_pop is not None:
            _nvtx_pop()


class _NoRange:
    """What :func:`trace_range` returns while nothing listens: one shared object, no work."""

    __slots__ = ()

    def __enter__(self) -> "_NoRange":
        return self

    def __exit__(self, *exc) -> None:
        return None


_NO_RANGE = _NoRange()


def trace_range(name: str):
    """Context manager: an NVTX range plus a profiler range named ``name``; a shared no-op while
    neither an NVTX tool is attached nor a torch profiler records (a runtime step opens a few
    ranges per unit, so building and entering one object each would cost the host for nothing).
    A profiler started inside such a range sees the ranges opened after it."""
    if _nvtx_push is None and not _profiler_enabled():
        return _NO_RANGE
    return _TraceRange(name)


class EventLog:
    """An append-only list of ``(kind, unit_name)`` recorded only while ``enabled``."""

    def __init__(self) -> None:
        self.enabled = False
        self.events: list[tuple[str, str]] = []

    def record(self, kind: str, unit: str) -> None:
        if self.enabled:
            self.events.append((kind, unit))

    def clear(self) -> None:
        self.events.clear()


event_log = EventLog()
