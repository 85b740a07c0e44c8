"""bfloat16 AdamW moments with stochastic rounding: the pure-PyTorch step, and the hash that
keys its random bits (the native kernel, ``csrc/adamw_bf16.cpp``, computes the same bits).

Why bfloat16 moments: AdamW keeps two float32 moments per parameter, 8 of the 16 bytes per
parameter a float32 AdamW run holds; in bfloat16 they take 4, and the step, a memory-bound pass,
moves 20 bytes per element instead of 28. Why stochastic rounding: a moment stored back to
nearest loses every update below half a bfloat16 step (eight bits of mantissa): at
``beta2 = 0.999``, ``exp_avg_sq`` moves by 0.1 % of itself per step, under that step, so it
freezes at its first values. Rounding up with probability equal to the fraction cut off keeps
each stored moment exact in expectation, and the error of a run of steps a random walk instead
of a bias. (Kahan compensation would be exact without randomness, but stores a second bfloat16
per moment: the bytes saved are gone.)

What is exact: the arithmetic in float32 is torch AdamW's for-loop ops on the widened moments,
with one difference: the square root is IEEE's (correctly rounded) where torch's CPU sqrt is
MKL's, which rounds about 0.7 % of results the other way (these moments are not torch's format,
so there are no torch bits to keep, and the native kernel's single loop is faster than the
blocks an MKL root needs). On the CPU the native kernel computes this function's bits. The
parameter is updated from the float32 moments before they are rounded, so a step is float32
AdamW's step (IEEE root) from the stored moments, and the first step's parameters are float32
AdamW's up to the root's rounding. NaN moments are stored as the quiet NaN 0x7FC0.

The random bits of element ``e`` of a parameter (``e`` counted in the parameter's storage
order, from its first element, whatever the rank holds) at a step are
``h32(lo(e) ^ salt)``, ``salt = h32(h32(h32(step) ^ param_id) ^ seed)`` (and ``h32(salt ^ hi(e))``
instead of ``salt`` when ``e >= 2**32``): ``exp_avg`` takes the high 16 bits, ``exp_avg_sq``
the low 16, ``max_exp_avg_sq`` the high 16 of ``h32(r ^ 0x9E3779B9)``. Keyed so, a run gives
the same bits at any world size, strategy or thread count, and HSDP replicas stay identical.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["h32", "ieee_sqrt", "salt", "stochastic_round", "random_bits", "step_piece", "step_pieces"]

_M = 0xFFFFFFFF
_CACHED_SETS = 8  # piece sets whose gather indices a flat state keeps (step_pieces)


def h32(x):
    """lowbias32 on an int or an int64 tensor of values in [0, 2**32): multipliers below 2**31,
    so an int64 product never overflows."""
    if isinstance(x, int):
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & _M
        x ^= x >> 15
        x = (x * 0x735A2D97) & _M
        return x ^ (x >> 15)
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M
    return x ^ (x >> 15)


def salt(seed: int, param_id: int, step: float) -> int:
    """The hash salt of one parameter's step (``bf16_salt`` in the native module)."""
    a = h32(int(step) & _M)
    b = h32(a ^ (param_id & _M))
    return h32(b ^ (seed & _M))


def random_bits(s: int, first_elem: int, n: int, device: torch.device) -> torch.Tensor:
    """The 32 random bits (int64) of elements ``first_elem .. first_elem + n`` under salt ``s``."""
    e = torch.arange(first_elem, first_elem + n, dtype=torch.int64, device=device)
    return _keyed_bits(e, torch.full_like(e, s), first_elem + n > (1 << 32))


def _keyed_bits(elem: torch.Tensor, s_e: torch.Tensor, wide: bool) -> torch.Tensor:
    """The random bits of elements ``elem`` (indices in their parameters) under per-element
    salts ``s_e``; ``wide``: some index is 2**32 or more (its high half salts the salt)."""
    if wide:
        top = elem >> 32
        s_e = torch.where(top == 0, s_e, h32(s_e ^ (top & _M)))
    return h32((elem & _M) ^ s_e)


def _rounded(m: torch.Tensor, v: torch.Tensor, vmax: Optional[torch.Tensor], r: torch.Tensor) -> list:
    """The float32 moments stochastically rounded with their share of the random bits ``r``:
    ``exp_avg`` the high 16, ``exp_avg_sq`` the low 16, ``max_exp_avg_sq`` (when given) the high
    16 of ``h32(r ^ 0x9E3779B9)``."""
    out = [stochastic_round(m, r >> 16), stochastic_round(v, r & 0xFFFF)]
    if vmax is not None:
        out.append(stochastic_round(vmax, h32(r ^ 0x9E3779B9) >> 16))
    return out


def stochastic_round(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` to bfloat16: its bits plus the 16 random bits ``r16`` (int64 in [0, 2**16)),
    truncated; NaN to 0x7FC0."""
    u = x.view(torch.int32).to(torch.int64) & _M
    t = (u + r16) >> 16
    t = torch.where(torch.isnan(x), torch.full_like(t, 0x7FC0), t)
    return torch.where(t >= 0x8000, t - 0x10000, t).to(torch.int16).view(torch.bfloat16)


def ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    """A correctly rounded square root: numpy's on the CPU (torch's CPU sqrt is MKL's, not
    correctly rounded), torch's on accelerators (CUDA's sqrtf is)."""
    if x.device.type != "cpu":
        return x.sqrt()
    import numpy as np

    with np.errstate(invalid="ignore"):
        return torch.from_numpy(np.sqrt(x.contiguous().numpy()))


def _arith(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, vmax: Optional[torch.Tensor],
           group: dict, step: float) -> None:
    """torch's for-loop AdamW ops, in place on 1-D float32 tensors (``m``, ``v``, ``vmax``: the
    widened moments), with an IEEE square root; elementwise, so an element's bits do not depend
    on which other elements share the call."""
    lr, (beta1, beta2) = float(group["lr"]), (float(b) for b in group["betas"])
    eps, wd = float(group["eps"]), float(group["weight_decay"])
    if wd != 0:
        p.mul_(1 - lr * wd)
    if group["maximize"]:
        g = -g
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc2_sqrt = (1 - beta2 ** step) ** 0.5
    step_size = lr / (1 - beta1 ** step)
    if vmax is not None:
        torch.maximum(vmax, v, out=vmax)
    denom = (ieee_sqrt(vmax if vmax is not None else v) / bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)


def step_piece(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               max_exp_avg_sq: Optional[torch.Tensor], step_t: torch.Tensor, group: dict, *, seed: int,
               param_id: int, first_elem: int) -> None:
    """One AdamW step of one piece, in place: ``param`` / ``grad`` float32, the moments bfloat16
    (any shape, all of one numel and contiguous), ``step_t`` torch's step counter. The for-loop
    AdamW's ops in order, on the widened moments, with an IEEE square root."""
    step_t += 1
    if param.numel() == 0:
        return
    p = param.view(-1)
    m, v = exp_avg.view(-1).float(), exp_avg_sq.view(-1).float()
    vmax = max_exp_avg_sq.view(-1).float() if group["amsgrad"] else None
    step = float(step_t.item())
    _arith(p, grad.reshape(-1), m, v, vmax, group, step)
    r = random_bits(salt(seed, param_id, step), first_elem, p.numel(), p.device)
    for dst, src in zip((exp_avg, exp_avg_sq, max_exp_avg_sq), _rounded(m, v, vmax, r)):
        dst.view(-1).copy_(src)


def step_pieces(weight: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                max_exp_avg_sq: Optional[torch.Tensor], pieces: list, group: dict, *, seed: int,
                cache: dict) -> None:
    """:func:`step_piece` for many pieces of the same flat tensors (1-D ``weight``, ``grad``,
    moments) in one set of ops per step count: on an accelerator a piece's step is some twenty
    kernels, so a flat state of many parameters takes this path. ``pieces``: ``(offset, length,
    param_id, first_elem, step_t)``, all stepped with ``group``; every ``step_t`` is counted, and
    the pieces whose new counts agree are stepped together, gathered (``index_select``) where
    padding lies between them. The same bits as :func:`step_piece` per piece (elementwise ops).
    ``cache``: where the gather indices and element keys of each set of pieces are kept."""
    by_step: dict[float, list] = {}
    for off, n, pid, first, step_t in pieces:
        step_t += 1
        if n:
            by_step.setdefault(float(step_t.item()), []).append((off, n, pid, first))
    for step, run in by_step.items():
        key = tuple(run)
        keys = cache.get(key)
        if keys is None:
            if len(cache) >= _CACHED_SETS:  # sets that change step by step (skipped parameters): keep a few
                cache.clear()
            keys = cache[key] = _piece_keys(run, weight.device)
        idx, lo, hi, elem, owner = keys
        salts = torch.tensor([salt(seed, pid, step) for _, _, pid, _ in run], dtype=torch.int64)
        r = _keyed_bits(elem, salts.to(weight.device, non_blocking=True)[owner],
                        any(first + n > (1 << 32) for _, n, _, first in run))
        if idx is None:  # back to back: views
            p, g = weight[lo:hi], grad[lo:hi]
            m, v = exp_avg[lo:hi].float(), exp_avg_sq[lo:hi].float()
            vmax = max_exp_avg_sq[lo:hi].float() if group["amsgrad"] else None
        else:
            p, g = weight.index_select(0, idx), grad.index_select(0, idx)
            m, v = exp_avg.index_select(0, idx).float(), exp_avg_sq.index_select(0, idx).float()
            vmax = max_exp_avg_sq.index_select(0, idx).float() if group["amsgrad"] else None
        _arith(p, g, m, v, vmax, group, step)
        outs = list(zip((exp_avg, exp_avg_sq, max_exp_avg_sq), _rounded(m, v, vmax, r)))
        if idx is None:
            for dst, src in outs:
                dst[lo:hi].copy_(src)
        else:
            weight.index_copy_(0, idx, p)
            for dst, src in outs:
                dst.index_copy_(0, idx, src)


def _piece_keys(run: list, device: torch.device) -> tuple:
    """For pieces ``(offset, length, param_id, first_elem)``: the gather index (None when they
    are back to back, with the span ``[lo, hi)``), each element's index in its parameter, and
    which piece (position in ``run``) each element belongs to."""
    order = sorted(range(len(run)), key=lambda k: run[k][0])
    contiguous = all(run[order[k]][0] + run[order[k]][1] == run[order[k + 1]][0] for k in range(len(order) - 1))
    lengths = torch.tensor([run[k][1] for k in order], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.tensor(order, dtype=torch.int64), lengths)
    starts = torch.tensor([run[k][0] for k in order], dtype=torch.int64)
    firsts = torch.tensor([run[k][3] for k in order], dtype=torch.int64)
    within = torch.arange(int(lengths.sum()), dtype=torch.int64) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths)
    elem = torch.repeat_interleave(firsts, lengths) + within
    lo = run[order[0]][0]
    hi = run[order[-1]][0] + run[order[-1]][1]
    idx = None if contiguous else (torch.repeat_interleave(starts, lengths) + within).to(device)
    return idx, lo, hi, elem.to(device), owner.to(device)
