"""Paths of the native AdamW step that the random tests of test_optim_kernel.py rarely take, each
against torch's for-loop AdamW bit for bit (NaNs compared as NaN), float32 and float64.

Underflowing ``exp_avg_sq``: square-root inputs that are +0, positive subnormals and normals side
by side. MKL's VML square root (torch's CPU ``sqrt``) takes +0 and subnormals on a slow path, so
the kernel's square-root mode 2 hands VML a 1 in their place and takes their IEEE roots itself --
where MKL's roots of them are IEEE's, which holds on some CPUs and not on others: the probe
checks, drops mode 2 where they are not, and these cases check the mode it kept on this machine.
Small gradients -- vanishing ones in deep stacks, rows that get none and decay -- make such inputs
common; the random tests draw gradients whose squares stay normal. Lengths straddle the vector
tails and the kernel's 2048-element blocks, and each block holds both kinds, so the update's two
sources of roots are both taken in one block.

The segment table NativeStep reuses across steps.

The division by ``sqrt(1 - beta2 ** step)``: through its reciprocal and an exact FMA correction
where that divisor lies in [2^-20, 1], a true division outside (beta2 within 1e-12 of 1).

The segment table NativeStep reuses across steps: the same tensor only for equal pieces.
"""

from __future__ import annotations

import pytest
import torch

from mfsdp2.optim import kernel

from .test_optim_kernel import _torch_ops_ieee_sqrt

ARITH = kernel.native_arithmetic()
needs_native = pytest.mark.skipif(ARITH is None, reason="native kernels not built (make native)")

SIZES = (1, 15, 17, 2047, 2049, 4099)
CONFIGS = (
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False),
    dict(lr=1e-2, betas=(0.9, 0.999), eps=0.0, weight_decay=0.0, amsgrad=True, maximize=False),
    dict(lr=3e-1, betas=(0.3, 0.6), eps=1e-6, weight_decay=0.5, amsgrad=True, maximize=True),
)
# Gradient exponents whose squares (times 1 - beta2) land on +0, subnormals and normals.
TINY = {torch.float32: (-24, -15), torch.float64: (-170, -148)}


def _grads(gen, dtype, step: int) -> list[torch.Tensor]:
    out = []
    lo, hi = TINY[dtype]
    ten = torch.tensor(10.0, dtype=dtype)
    for n in SIZES:
        exp = torch.randint(lo, hi, (n,), generator=gen).to(dtype)
        g = torch.randn(n, generator=gen, dtype=dtype) * torch.pow(ten, exp)
        g[step % 5::5] = 0.0  # exact zeros: v stays +0 where it was
        if n > 100:
            g[::97] = torch.randn(len(g[::97]), generator=gen, dtype=dtype)  # a few normal ones per block
        out.append(g)
    return out


def _flat_step(flat, grads, m, v, vmax, steps, cfg, mode) -> None:
    rows, pos = [], 0
    for i, n in enumerate(SIZES):
        rows.append([0, pos, n, 0, i])
        pos += n
    hyper = torch.tensor([[cfg["lr"], *cfg["betas"], cfg["eps"], cfg["weight_decay"], float(cfg["amsgrad"]),
                           float(cfg["maximize"])]], dtype=torch.float64)
    kernel._module().adamw_step([flat], [torch.cat(grads)], [m], [v], [vmax], [steps], torch.tensor(rows), hyper,
                                ARITH[0], ARITH[1], mode)


def _kinds(x: torch.Tensor) -> tuple[bool, bool, bool]:
    tiny = torch.finfo(x.dtype).tiny
    return bool((x == 0).any()), bool(((x > 0) & (x < tiny)).any()), bool((x >= tiny).any())


@needs_native
@pytest.mark.parametrize("cfg", CONFIGS, ids=["wd", "amsgrad", "amsgrad-maximize-small-beta"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_mkl_sqrt_modes_match_torch_on_underflowing_moments(dtype, cfg):
    """Mode 1 (VML's root everywhere) gives torch's bits, and so does mode 2 (IEEE's for +0 and
    subnormals) where the probe kept it."""
    if not kernel._module().has_vml_sqrt() or not ARITH[2]:
        pytest.skip("torch's sqrt is not MKL's here: only the IEEE mode applies (tested below)")
    gen = torch.Generator().manual_seed(7)
    start = [torch.randn(n, generator=gen, dtype=dtype) for n in SIZES]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = torch.optim.AdamW(ref, foreach=False, **cfg)
    total = sum(SIZES)
    ours = {mode: [torch.cat(start)] + [torch.zeros(total, dtype=dtype) for _ in range(3)] + [torch.zeros(len(SIZES))]
            for mode in ((1, 2) if ARITH[2] == 2 else (1,))}
    seen = [False, False, False]
    for s in range(4):
        grads = _grads(gen, dtype, s)
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        src = torch.cat([opt.state[p]["max_exp_avg_sq" if cfg["amsgrad"] else "exp_avg_sq"] for p in ref])
        seen = [a or b for a, b in zip(seen, _kinds(src))]
        for mode, (flat, m, v, vmax, steps) in ours.items():
            _flat_step(flat, grads, m, v, vmax, steps, cfg, mode)
    assert seen == [True, True, True], "the roots' inputs must include +0, subnormals and normals"
    want = {"param": torch.cat([p.detach() for p in ref]),
            "exp_avg": torch.cat([opt.state[p]["exp_avg"] for p in ref]),
            "exp_avg_sq": torch.cat([opt.state[p]["exp_avg_sq"] for p in ref])}
    if cfg["amsgrad"]:
        want["max_exp_avg_sq"] = torch.cat([opt.state[p]["max_exp_avg_sq"] for p in ref])
    for mode, (flat, m, v, vmax, _) in ours.items():
        got = {"param": flat, "exp_avg": m, "exp_avg_sq": v, "max_exp_avg_sq": vmax}
        for k, w in want.items():
            assert kernel._same_bits(got[k], w), (mode, k)


@needs_native
@pytest.mark.parametrize("cfg", CONFIGS, ids=["wd", "amsgrad", "amsgrad-maximize-small-beta"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_ieee_sqrt_mode_on_underflowing_moments(dtype, cfg):
    """Mode 0 (one loop, IEEE root: torch builds without MKL) against torch's ops with numpy's root."""
    gen = torch.Generator().manual_seed(11)
    h = [cfg["lr"], *cfg["betas"], cfg["eps"], cfg["weight_decay"], cfg["amsgrad"], cfg["maximize"]]
    start = [torch.randn(n, generator=gen, dtype=dtype) for n in SIZES]
    ref = [[t.clone()] + [torch.zeros(t.numel(), dtype=dtype) for _ in range(3)] for t in start]
    flat, m, v, vmax = torch.cat(start), *(torch.zeros(sum(SIZES), dtype=dtype) for _ in range(3))
    steps = torch.zeros(len(SIZES))
    for s in range(1, 4):
        grads = _grads(gen, dtype, s)
        for (p, rm, rv, rvmax), g in zip(ref, grads):
            _torch_ops_ieee_sqrt(p, g, rm, rv, rvmax, s, h, *ARITH[:2])
        _flat_step(flat, grads, m, v, vmax, steps, cfg, 0)
    src = torch.cat([r[3] if cfg["amsgrad"] else r[2] for r in ref])
    assert _kinds(src) == (True, True, True)
    for k, got in enumerate((flat, m, v, vmax) if cfg["amsgrad"] else (flat, m, v)):
        assert kernel._same_bits(got, torch.cat([r[k] for r in ref])), k


@needs_native
def test_probe_keeps_mode_2_only_where_vml_roots_of_subnormals_are_ieee(monkeypatch):
    """The roots compared here with IEEE's (numpy's, a correctly rounded instruction) decide
    whether mode 2 may be chosen on this machine; and a probe told they are not never chooses it."""
    import numpy as np

    if not kernel._module().has_vml_sqrt():
        pytest.skip("torch's sqrt is not MKL's here: the IEEE mode only")
    gen = torch.Generator().manual_seed(5)
    ieee = True
    for dtype in (torch.float32, torch.float64):
        x = (torch.rand(8191, generator=gen, dtype=torch.float64) * torch.finfo(dtype).tiny).to(dtype)
        ieee = ieee and torch.equal(torch.sqrt(x), torch.from_numpy(np.sqrt(x.numpy())))
    if not ieee:
        assert ARITH[2] != 2, ARITH
    monkeypatch.setattr(kernel, "_subnormal_roots_are_ieee", lambda: False)
    assert kernel._probe(kernel._module())[2] != 2


@needs_native
def test_sqrt_mode_is_checked():
    x = torch.zeros(4)
    hyper = torch.tensor([[1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0, 0.0]], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="sqrt_mode must be 0, 1 or 2"):
        kernel._module().adamw_step([x], [x.clone()], [x.clone()], [x.clone()], [torch.empty(0)], [torch.zeros(1)],
                                    torch.tensor([[0, 0, 4, 0, 0]]), hyper, True, True, 3)


@needs_native
@pytest.mark.parametrize("beta2", [1 - 1e-13, 0.0, 0.999], ids=["true-division", "unit-divisor", "reciprocal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_bias_correction_division_paths(dtype, beta2):
    """The root's division by sqrt(1 - beta2 ** step) gives torch's bits on both of its paths, the
    bfloat16-moment kernel's too (against the float32 step from the same moments)."""
    cfg = dict(lr=1e-2, betas=(0.9, beta2), eps=1e-8, weight_decay=1e-2, amsgrad=True, maximize=False)
    gen = torch.Generator().manual_seed(5)
    start = [torch.randn(n, generator=gen, dtype=dtype) for n in SIZES]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = torch.optim.AdamW(ref, foreach=False, **cfg)
    flat, m, v, vmax = torch.cat(start), *(torch.zeros(sum(SIZES), dtype=dtype) for _ in range(3))
    steps = torch.zeros(len(SIZES))
    for s in range(3):
        grads = [torch.randn(n, generator=gen, dtype=dtype) * 10.0 ** (s - 2) for n in SIZES]
        grads[0][0] = float("inf") if s == 1 else grads[0][0]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        _flat_step(flat, grads, m, v, vmax, steps, cfg, ARITH[2])
    for got, key in ((m, "exp_avg"), (v, "exp_avg_sq"), (vmax, "max_exp_avg_sq")):
        assert kernel._same_bits(got, torch.cat([opt.state[p][key] for p in ref])), key
    assert kernel._same_bits(flat, torch.cat([p.detach() for p in ref]))
    if dtype != torch.float32:
        return
    # bfloat16 moments: one step from bfloat16-exact moments equals the float32 kernel's IEEE step
    n = sum(SIZES)
    p0 = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-2
    m0 = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    v0 = (torch.rand(n, generator=gen) * 1e-4).bfloat16()
    hyper = torch.tensor([[cfg["lr"], *cfg["betas"], cfg["eps"], cfg["weight_decay"], 0.0, 0.0]], dtype=torch.float64)
    want = p0.clone()
    kernel._module().adamw_step([want], [g], [m0.float()], [v0.float()], [torch.empty(0)], [torch.full((1,), 4.0)],
                                torch.tensor([[0, 0, n, 0, 0]]), hyper, ARITH[0], ARITH[1], 0)
    got = p0.clone()
    kernel._module().adamw_step_bf16([got], [g], [m0.clone()], [v0.clone()], [torch.empty(0, dtype=torch.bfloat16)],
                                     [torch.full((1,), 4.0)], torch.tensor([[0, 0, n, 0, 0, 0, 0]]), hyper, 3,
                                     ARITH[0], ARITH[1])
    assert kernel._same_bits(got, want)


@needs_native
def test_segment_table_reused_only_for_equal_pieces():
    """NativeStep keeps its segment table across steps in the caller's cache: the same tensor for
    the same rows over equal pieces; a re-made flat state (new offsets) gets a new table."""
    from types import SimpleNamespace

    cache: dict = {}
    fs = SimpleNamespace(pieces={0: (0, 5), 1: (8, 3)}, first_elem={0: 0, 1: 0})

    def table(bf16_seed=None):
        b = kernel.NativeStep(kernel._module(), ARITH, torch.float32, bf16_seed=bf16_seed, cache=cache)
        row = b.hyper_row(0, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                              "amsgrad": False, "maximize": False})
        for i in (0, 1):
            b.add(fs, i, row, param_id=i)
        return b._table()

    first = table()
    assert first.tolist() == [[0, 0, 5, 0, 0], [0, 8, 3, 0, 1]]
    assert table() is first
    fs.pieces = {0: (2, 5), 1: (10, 3)}  # a re-made flat state: new offsets
    moved = table()
    assert moved is not first and moved.tolist() == [[0, 2, 5, 0, 0], [0, 10, 3, 0, 1]]
    bf16 = table(bf16_seed=0)  # the bfloat16 table (parameter ids, first elements) is its own
    assert bf16.tolist() == [[0, 2, 5, 0, 0, 0, 0], [0, 10, 3, 0, 1, 1, 0]]
    fs.first_elem = {0: 0, 1: 96}
    assert table(bf16_seed=0).tolist()[1][6] == 96
    assert table() is moved
