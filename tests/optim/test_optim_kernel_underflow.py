"""The native AdamW step where ``exp_avg_sq`` underflows: square-root inputs that are +0, positive
subnormals and normals side by side, in float32 and float64, against torch's for-loop AdamW bit for
bit (NaNs compared as NaN).

Why a file of its own: MKL's VML square root (torch's CPU ``sqrt``) takes +0 and subnormals on a
slow path, so the kernel's square-root mode 2 hands VML a 1 in their place and takes their IEEE
roots itself (MKL's roots of them being IEEE's: the probe checks, and these cases check again on
this machine). Small gradients -- vanishing ones in deep stacks, rows that get none and decay --
make such inputs common; the random tests in test_optim_kernel.py draw gradients whose squares
stay normal. Lengths straddle the vector tails and the kernel's 2048-element blocks, and each block
holds both kinds, so the update's two sources of roots are both taken in one block.
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
    """Modes 1 (VML's root everywhere) and 2 (IEEE's for +0 and subnormals) both give torch's bits."""
    if not kernel._module().has_vml_sqrt() or not ARITH[2]:
        pytest.skip("torch's sqrt is not MKL's here: only the IEEE mode applies (tested below)")
    gen = torch.Generator().manual_seed(7)
    start = [torch.randn(n, generator=gen, dtype=dtype) for n in SIZES]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = torch.optim.AdamW(ref, foreach=False, **cfg)
    total = sum(SIZES)
    ours = {mode: [torch.cat(start)] + [torch.zeros(total, dtype=dtype) for _ in range(3)] + [torch.zeros(len(SIZES))]
            for mode in (1, 2)}
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
def test_sqrt_mode_is_checked():
    x = torch.zeros(4)
    hyper = torch.tensor([[1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0, 0.0]], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="sqrt_mode must be 0, 1 or 2"):
        kernel._module().adamw_step([x], [x.clone()], [x.clone()], [x.clone()], [torch.empty(0)], [torch.zeros(1)],
                                    torch.tensor([[0, 0, 4, 0, 0]]), hyper, True, True, 3)
