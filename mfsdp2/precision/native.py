"""Native kernels over a flat buffer and its segment table (``csrc/``), each beside the
pure-PyTorch reference that runs when the extension is absent, cannot load, is disabled, or
is handed tensors it does not take (another device or dtype).

Why: a flat shard is one tensor whose segments are parameters, and the FP8 all-gather's work on
it was a few torch ops per parameter: the quantise a multiply, a clamp and a float8 cast (three
passes and a temporary), the dequantise a float8 -> float32 cast that torch's CPU build converts
one element at a time (~25 ms for 8M elements on one core; bf16 -> float32: ~2 ms), a divide
and a copy. Each kernel does its job in one vectorised pass over the buffer, one call for all
segments (``benchmarks/native_kernels.py``: 3-5x faster than the best PyTorch way on the
benchmark models). Kernels that did not beat PyTorch by 1.5x were not kept (docs/design.md).

The extension is optional. ``make demo`` / ``make test`` build it in place after installing the
package (``setup.py build_ext --inplace``); ``MFSDP2_NATIVE=0`` in the environment makes every
call take the reference path (and ``setup.py`` skip the build). Its module name carries the
torch version it was built against and only the name of the running torch's version is looked
for, so a build for one torch is never loaded by another; a module that fails to load
(missing, undefined symbol, ...) is logged once and the references are used.

Results are **bit-identical** to the references (tests/precision/test_native.py): float8 rounding is
torch's (round to nearest, ties to even, of the clamped value), and dequantising is a lookup in
256-entry per-segment tables that torch computes with the reference's own operations.

The same module holds the flat AdamW step (``csrc/adamw.cpp``); :mod:`mfsdp2.optim.kernel` binds
it, and torch's own AdamW arithmetic is its reference.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
from typing import Iterator, Optional, Sequence

import torch

__all__ = ["Segments", "available", "has_vbmi", "reference_only", "quantise_fp8", "dequantise_fp8", "dequantise_tables",
           "ENV"]

logger = logging.getLogger(__name__)

ENV = "MFSDP2_NATIVE"  # "0": never load the extension
API_VERSION = 6  # csrc/module.cpp's kApiVersion: a build from other sources is not used


def module_name(version: str = torch.__version__) -> str:
    """The extension's module name for a torch version (setup.py builds the same name)."""
    return "mfsdp2._native_torch_" + re.sub(r"[^0-9A-Za-z]", "_", version)


_module = None
_loaded = False
_enabled = True
_allow_vbmi = True  # tests switch the dequantise's AVX-512 VBMI path off to check the other one


def _load():
    global _module, _loaded
    if _loaded:
        return _module
    _loaded = True
    if os.environ.get(ENV, "1") == "0":
        logger.info("mfsdp2: native kernels disabled (%s=0); using the PyTorch reference paths", ENV)
        return None
    name = module_name()
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            logger.warning("mfsdp2: native kernels failed to load (%s); using the PyTorch reference paths", e)
        else:
            logger.info("mfsdp2: native kernels not built for torch %s (make test / make demo build them); "
                        "using the PyTorch reference paths", torch.__version__)
        return None
    except (ImportError, OSError) as e:  # undefined symbols, a foreign binary, ...
        logger.warning("mfsdp2: native kernels failed to load (%s); using the PyTorch reference paths", e)
        return None
    api = getattr(mod, "api_version", lambda: None)()
    if api != API_VERSION:
        logger.warning("mfsdp2: the native kernels' build is stale (API %s, expected %s); using the PyTorch "
                       "reference paths (rebuild: python setup.py build_ext --inplace)", api, API_VERSION)
        return None
    built = mod.torch_version()
    if built != torch.__version__:
        logger.warning("mfsdp2: native kernels were built for torch %s, this is %s; using the PyTorch "
                       "reference paths (rebuild: python setup.py build_ext --inplace)", built, torch.__version__)
        return None
    _module = mod
    return mod


def available() -> bool:
    """Whether the native kernels are loaded and enabled."""
    return _enabled and _load() is not None


def has_vbmi() -> bool:
    """Whether the dequantise runs its AVX-512 VBMI path on this CPU (benchmarks record it)."""
    return available() and _module.has_vbmi()


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """Run the references inside the block even where the native kernels are loaded (tests,
    benchmarks)."""
    global _enabled
    was, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = was


class Segments:
    """A segment table: ``(offset, length)`` pairs into a flat buffer, sorted and disjoint (an
    empty segment may sit anywhere). The int64 tensors the kernels read are made once."""

    __slots__ = ("offsets", "lengths", "_t")

    def __init__(self, offsets: Sequence[int], lengths: Sequence[int]):
        self.offsets = tuple(int(o) for o in offsets)
        self.lengths = tuple(int(n) for n in lengths)
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"Segments: {len(self.offsets)} offsets but {len(self.lengths)} lengths")
        end = 0
        for i, (o, n) in enumerate(zip(self.offsets, self.lengths)):
            if n < 0 or (n and o < end):
                raise ValueError(f"Segments: segment {i} (offset {o}, length {n}) has a negative length or "
                                 f"overlaps / precedes the previous one (ending at {end}); segments must be "
                                 "sorted and disjoint")
            end = o + n if n else end
        self._t: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def __len__(self) -> int:
        return len(self.offsets)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._t is None:
            self._t = (torch.tensor(self.offsets, dtype=torch.int64), torch.tensor(self.lengths, dtype=torch.int64))
        return self._t

    def __repr__(self) -> str:
        return f"Segments(offsets={self.offsets}, lengths={self.lengths})"


def _native_for(*tensors: torch.Tensor):
    """The module when it is loaded, enabled, and every tensor is a contiguous 1-D CPU one."""
    if not _enabled:
        return None
    mod = _load()
    if mod is None:
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous():
            return None
    return mod


# -- FP8 all-gather ---------------------------------------------------------------------------


def quantise_fp8(src: torch.Tensor, dst: torch.Tensor, segs: Segments, scales: torch.Tensor,
                 dtype: torch.dtype) -> None:
    """``dst`` (uint8, ``src``'s length) := the float8 (``dtype``) bytes of
    ``clamp(src * scales[s], -max, max)`` on each segment ``s``, 0 elsewhere (padding).

    The reference: per segment, a float32 multiply by the scale, a clamp, and torch's cast."""
    fmax = torch.finfo(dtype).max
    mod = _native_for(src, dst) if src.dtype == torch.float32 and dst.dtype == torch.uint8 else None
    if mod is not None and scales.device.type == "cpu":
        off, ln = segs.tensors()
        mod.quantise_fp8(src, dst, off, ln, scales, fmax, dtype == torch.float8_e5m2)
        return
    q = dst.view(dtype)
    q.zero_()
    for i, (o, n) in enumerate(zip(segs.offsets, segs.lengths)):
        if n:
            q[o:o + n].copy_((src[o:o + n].float() * scales[i]).clamp_(-fmax, fmax))


_LUT: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _float8_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The float32 value of each of the 256 float8 bytes, converted by torch."""
    key = (dtype, device)
    if key not in _LUT:
        _LUT[key] = torch.arange(256, dtype=torch.uint8, device=device).view(dtype).to(torch.float32)
    return _LUT[key]


def dequantise_fp8(src: torch.Tensor, dst: torch.Tensor, segs: Segments, scales: torch.Tensor,
                   dtype: torch.dtype, tables: Optional[torch.Tensor] = None) -> None:
    """On each segment ``s``: ``dst := (float8 bytes of src as float32) / scales[s]`` in
    ``dst``'s dtype; ``dst`` outside the segments is left alone.

    Native: the float8 byte has 256 values, so the reference's result is one of 256 per
    segment; torch computes those tables (float32 values / scale, cast to ``dst``'s dtype: the
    reference's operations) and the kernel looks each byte up (with AVX-512 VBMI byte permutes
    where the CPU has them, vector gathers otherwise). ``tables``: :func:`dequantise_tables`'
    result for these scales, made once by a caller that dequantises several parts (one per
    rank of a gathered block) with the same scales."""
    mod = _native_for(src, dst) if src.dtype == torch.uint8 and dst.element_size() in (2, 4) else None
    if mod is not None and scales.device.type == "cpu" and len(segs):
        if tables is None:
            tables = dequantise_tables(scales, dtype, dst.dtype)
        off, ln = segs.tensors()
        mod.lookup_bytes(src, dst, off, ln, tables, _allow_vbmi)
        return
    q = src.view(dtype)
    for i, (o, n) in enumerate(zip(segs.offsets, segs.lengths)):
        if n:
            dst[o:o + n].copy_(q[o:o + n].to(torch.float32).div_(scales[i]))


def dequantise_tables(scales: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """The native dequantise's ``[segments, 256]`` lookup tables: each float8 byte's float32
    value divided by the segment's scale, cast to ``out_dtype`` (the reference's operations)."""
    return ((_float8_values(dtype, scales.device)[None, :] / scales.to(torch.float32)[:, None])
            .to(out_dtype).contiguous())
