"""The native kernels (csrc/, mfsdp2/precision/native.py) against their pure-PyTorch references, bit for bit.

The references are the FP8 all-gather's own torch ops (multiply, clamp, torch's float8 cast;
float8 -> float32 cast, divide, copy into the compute dtype). Compared on random segment tables
(empty segments, gaps, empty segments whose offset lies past the end, lengths around the
16384-element work items), random float32 bit patterns (NaN, +-inf, subnormals, huge values),
any scale (0, inf, NaN included), both float8 formats, three output dtypes, one and two threads;
and on every float32 rounding case of the cast (all 2^16 high halves x the low halves that decide
ties). Also: the loader's fallbacks, and FP8 training that is bit-identical with and without the
kernels. Cases needing the built extension skip when it is absent (``make native``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from mfsdp2.precision import native

from .._dist import run_ranks
from .._optional import given, settings, st

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
ITEM = 16384  # csrc/segments.h kItem

needs_native = pytest.mark.skipif(not native.available(), reason="native kernels not built (make native)")

_lengths = st.one_of(st.integers(0, 40), st.sampled_from([0, 1, 15, 16, 17, ITEM - 1, ITEM, ITEM + 1, 2 * ITEM + 5]))


@st.composite
def _tables(draw, max_segments: int = 6):
    """(Segments, buffer length): sorted disjoint segments with gaps, some empty (one of them
    possibly reporting an offset past the end, as an empty shard piece does)."""
    offsets, lengths, pos = [], [], 0
    for _ in range(draw(st.integers(0, max_segments))):
        pos += draw(st.integers(0, 9))
        n = draw(_lengths)
        offsets.append(pos)
        lengths.append(n)
        pos += n
    numel = pos + draw(st.integers(0, 9))
    if draw(st.booleans()):
        offsets.append(numel + draw(st.integers(0, 50)))
        lengths.append(0)
    return native.Segments(offsets, lengths), numel


def _values(seed: int, numel: int) -> torch.Tensor:
    """float32 values: a third arbitrary bit patterns (NaN, inf, subnormals, 1e38), the rest
    normal values around the float8 range and some that scale to exact rounding ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 10.0 ** torch.randint(-12, 4, (numel,), generator=g)
    bits = torch.randint(-2**31, 2**31, (numel,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    pick = torch.randint(0, 3, (numel,), generator=g)
    x = torch.where(pick == 0, bits, x)
    ties = torch.randint(0, 2**12, (numel,), generator=g).float() / 2.0**torch.randint(0, 24, (numel,), generator=g)
    return torch.where(pick == 1, ties, x)


_scales = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _quantise(x, segs, scales, dtype, reference: bool) -> torch.Tensor:
    q = torch.full((x.numel(),), 0xAB, dtype=torch.uint8)  # padding must come out 0
    if reference:
        with native.reference_only():
            native.quantise_fp8(x, q, segs, scales, dtype)
    else:
        native.quantise_fp8(x, q, segs, scales, dtype)
    return q


@needs_native
@settings(max_examples=150, deadline=None)
@given(table=_tables(), seed=st.integers(0, 2**31), dtype=st.sampled_from(FP8), data=st.data())
def test_quantise_matches_reference(table, seed, dtype, data):
    segs, numel = table
    x = _values(seed, numel)
    scales = torch.tensor(data.draw(st.lists(_scales, min_size=len(segs), max_size=len(segs))), dtype=torch.float32)
    got, want = _quantise(x, segs, scales, dtype, False), _quantise(x, segs, scales, dtype, True)
    _same_nan_sign_where_scale_is_nan(got, want, x, segs, scales)
    assert torch.equal(got, want), (got != want).nonzero()[:10].flatten().tolist()


def _same_nan_sign_where_scale_is_nan(got, want, x, segs, scales) -> None:
    """Where a NaN value meets a NaN scale, the product's NaN is either operand's: x86 returns the
    first operand's, and torch's own multiply puts the scale first in its vector body and the
    value first in its scalar tail (``x * s`` of 40 elements: the last three differ). The float8
    NaN's sign bit is then arbitrary; both are NaN. Clear that bit there, in both."""
    for off, n, s in zip(segs.offsets, segs.lengths, scales.tolist()):
        if n and s != s:
            both = x[off:off + n].isnan()
            for q in (got, want):
                q[off:off + n] = torch.where(both, q[off:off + n] & 0x7F, q[off:off + n])


@needs_native
@pytest.mark.parametrize("dtype", FP8)
def test_quantise_rounds_every_case_like_torch(dtype):
    """Scale 1, every float32 whose low 16 bits are one of the patterns that decide rounding (0,
    1, just below / at / above half, all ones) with all 2^16 high halves: every exponent, both
    signs, NaN / inf, every kept-mantissa and round bit of both float8 formats (the bits that
    decide them lie in the high half; the low half only breaks ties)."""
    hi = torch.arange(2**16, dtype=torch.int64) << 16
    lo = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    x = (hi[:, None] | lo[None, :]).flatten()
    x = torch.where(x >= 2**31, x - 2**32, x).to(torch.int32).view(torch.float32)
    segs = native.Segments([0], [x.numel()])
    one = torch.ones(1)
    got, want = _quantise(x, segs, one, dtype, False), _quantise(x, segs, one, dtype, True)
    assert torch.equal(got, want), x[(got != want)][:10].tolist()


@needs_native
@settings(max_examples=100, deadline=None)
@given(table=_tables(), seed=st.integers(0, 2**31), dtype=st.sampled_from(FP8),
       out=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), vbmi=st.booleans(), data=st.data())
def test_dequantise_matches_reference(table, seed, dtype, out, vbmi, data):
    """Both native paths (AVX-512 VBMI byte permutes where this CPU has them, gathers) against
    the reference."""
    segs, numel = table
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8)
    q[: min(256, numel)] = torch.arange(min(256, numel), dtype=torch.uint8)  # every byte, NaN bytes included
    scales = torch.tensor(data.draw(st.lists(_scales, min_size=len(segs), max_size=len(segs))), dtype=torch.float32)
    ints = torch.int16 if torch.finfo(out).bits == 16 else torch.int32

    def run(reference: bool) -> torch.Tensor:
        dst = torch.full((numel,), 1234.5, dtype=out)  # left alone outside the segments
        if reference:
            with native.reference_only():
                native.dequantise_fp8(q, dst, segs, scales, dtype)
        else:
            was, native._allow_vbmi = native._allow_vbmi, vbmi
            try:
                native.dequantise_fp8(q, dst, segs, scales, dtype)
            finally:
                native._allow_vbmi = was
        return dst.view(ints)

    got, want = run(False), run(True)
    assert torch.equal(got, want), (got != want).nonzero()[:10].flatten().tolist()


@needs_native
def test_thread_count_does_not_change_the_bytes():
    n = 5 * ITEM + 123
    segs = native.Segments([0, 3 * ITEM + 7], [3 * ITEM + 7, 2 * ITEM + 100])
    x = _values(3, n)
    scales = torch.tensor([448 / 7.0, 0.25])
    was = torch.get_num_threads()
    try:
        out = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            q = _quantise(x, segs, scales, torch.float8_e4m3fn, False)
            d = torch.zeros(n, dtype=torch.bfloat16)  # the last 16 elements lie outside the segments
            native.dequantise_fp8(q, d, segs, scales, torch.float8_e4m3fn)
            out.append((q, d.view(torch.int16)))
    finally:
        torch.set_num_threads(was)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_segments_refuse_overlaps():
    with pytest.raises(ValueError, match="sorted and disjoint"):
        native.Segments([0, 5], [10, 3])
    with pytest.raises(ValueError, match="negative length"):
        native.Segments([0], [-1])
    native.Segments([0, 99, 5], [5, 0, 3])  # an empty segment may report any offset


@needs_native
def test_kernels_refuse_bad_tables_by_name():
    mod = native._load()
    x, q = torch.zeros(10), torch.zeros(10, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="quantise_fp8: segment 0 .* lies outside the buffer of 10"):
        mod.quantise_fp8(x, q, torch.tensor([5]), torch.tensor([6]), torch.ones(1), 448.0, False)
    with pytest.raises(RuntimeError, match="lookup_bytes: segment 1 .* sorted and disjoint"):
        mod.lookup_bytes(q, torch.zeros(10, dtype=torch.bfloat16), torch.tensor([0, 2]), torch.tensor([4, 2]),
                         torch.zeros(2, 256, dtype=torch.bfloat16), True)
    with pytest.raises(RuntimeError, match="one scale per segment"):
        mod.quantise_fp8(x, q, torch.tensor([0]), torch.tensor([4]), torch.ones(2), 448.0, False)


# -- loading ----------------------------------------------------------------------------------


@pytest.fixture
def fresh_loader(monkeypatch):
    """native's loader state reset for the test, restored after it."""
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_loaded", False)
    return monkeypatch


class _Stub:
    def __init__(self, api, version):
        self.api_version = lambda: api
        self.torch_version = lambda: version


@pytest.mark.parametrize("why, load", [
    ("failed to load", lambda name: (_ for _ in ()).throw(ImportError(f"{name}.so: undefined symbol: _ZN3c10"))),
    ("failed to load", lambda name: (_ for _ in ()).throw(OSError("invalid ELF header"))),
    ("stale", lambda name: _Stub(native.API_VERSION - 1, torch.__version__)),
    ("built for torch 2.11.0", lambda name: _Stub(native.API_VERSION, "2.11.0")),
])
def test_a_module_that_cannot_be_used_falls_back_with_a_warning(fresh_loader, caplog, why, load):
    fresh_loader.setattr(native.importlib, "import_module", load)
    fresh_loader.delenv(native.ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="mfsdp2.precision.native"):
        assert not native.available()
        assert not native.available()  # decided once, logged once
    assert len(caplog.records) == 1 and why in caplog.records[0].getMessage()
    x, q = torch.tensor([1.0, -3.0, 500.0]), torch.empty(3, dtype=torch.uint8)
    native.quantise_fp8(x, q, native.Segments([0], [3]), torch.ones(1), torch.float8_e4m3fn)  # the reference
    assert q.view(torch.float8_e4m3fn).float().tolist() == [1.0, -3.0, 448.0]


def test_only_the_running_torchs_module_is_looked_for(fresh_loader):
    asked = []
    fresh_loader.setattr(native.importlib, "import_module", lambda name: asked.append(name) or _Stub(0, ""))
    fresh_loader.delenv(native.ENV, raising=False)
    native.available()
    assert asked == [native.module_name(torch.__version__)]
    assert native.module_name("2.11.0+cu128") != native.module_name("2.13.0+cpu")


def test_environment_variable_forces_the_references():
    code = ("import torch; from mfsdp2.precision import native; assert not native.available(); "
            "q = torch.empty(2, dtype=torch.uint8); "
            "native.quantise_fp8(torch.tensor([2.0, -0.5]), q, native.Segments([0], [2]), torch.ones(1), "
            "torch.float8_e5m2); "
            "assert q.view(torch.float8_e5m2).float().tolist() == [2.0, -0.5]")
    env = dict(os.environ, **{native.ENV: "0"})
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# -- FP8 training, with and without the kernels -------------------------------------------------


def _fp8_training_both_ways(rank, ws):
    from .test_fp8 import _llama

    with native.reference_only():
        ref = _llama(rank, ws, True)
    got = _llama(rank, ws, True)
    return native.available(), ref[0], got[0], ref[4], got[4]


@needs_native
@pytest.mark.slow
def test_fp8_training_is_bit_identical_with_the_kernels():
    """Llama-tiny, 2 ranks, FP8 all-gather, 20 AdamW steps: losses and every final weight equal
    bit for bit whether the all-gathers quantise / dequantise natively or with torch."""
    for used, ref_losses, losses, ref_params, params in run_ranks(_fp8_training_both_ways, 2):
        assert used
        assert losses == ref_losses
        for name, p in params.items():
            assert torch.equal(p, ref_params[name]), name


@pytest.mark.skipif(os.environ.get("MFSDP2_EXPECT_NATIVE") != "1",
                    reason="only where the build must have succeeded (CI)")
def test_the_extension_was_built_where_the_build_is_required():
    """``.ci/run`` sets MFSDP2_EXPECT_NATIVE=1: ``make native`` only prints a message when the
    build fails (users without a compiler still get the reference paths), so without this a broken
    build would leave CI green while every native test skipped."""
    assert native.available(), "MFSDP2_EXPECT_NATIVE=1 but the native extension did not load (see make native's output)"
