"""The arithmetic of a flat AdamW step: the native kernel (``csrc/adamw.cpp``), and torch's own
functional AdamW over plain local tensors for everything else.

Why two: on the host one native call steps every segment of every flat shard (one pass over the
bytes, threads over work items), where torch's for-loop / foreach AdamW makes about ten passes
per parameter. The native kernel is used only where it computes torch's bits: at first use it
steps a probe problem (both ``lerp`` forms, amsgrad, maximize, float32 and float64, lengths with
vector tails) with each variant of its arithmetic -- one or two roundings for torch's ``lerp``
and ``addcmul`` (torch's AVX2 / AVX-512 kernels fuse them), MKL's or an IEEE square root
(torch's CPU ``sqrt`` is MKL's VML where torch has MKL; preferably MKL's for normal inputs only,
IEEE's for +0 and subnormals, which VML takes on a slow path) -- and keeps the variant that matches
``torch.optim.AdamW(foreach=False)`` bit for bit; none matching, it is not used (logged once).

Everything else -- no extension, ``MFSDP2_NATIVE=0``, ``native.reference_only()``, other
dtypes, ``fused=True``, accelerators -- is :func:`torch_step`: torch's functional AdamW on the
plain local tensors of the parameters' pieces and their state views (no DTensor dispatch). On
the CPU that is ``foreach`` (the same bits as the for-loop, and as the native kernel), with
``fused=True`` torch's fused CPU kernel, and on an accelerator ``torch._fused_adamw_``: one
multi-tensor launch per group and device, torch's own fused arithmetic.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
from torch.optim.adam import adam as _adam

from ..precision import native

__all__ = ["NativeStep", "native_arithmetic", "torch_step"]

logger = logging.getLogger(__name__)

_ARITH: Optional[tuple] = None  # (fma_lerp, fma_addcmul, sqrt_mode) matching torch, () if none does
_EMPTY: dict[torch.dtype, torch.Tensor] = {}


def _module():
    """The native module when it is loaded and enabled (not inside ``native.reference_only()``)."""
    return native._native_for()


def native_arithmetic() -> Optional[tuple]:
    """The native kernel's variant that computes torch's AdamW bits on this machine and torch
    build, or None (no extension, or no variant matches: then torch's arithmetic is used)."""
    global _ARITH
    mod = _module()
    if mod is None or not hasattr(mod, "adamw_step"):
        return None
    if _ARITH is None:
        _ARITH = _probe(mod)
        if _ARITH:
            logger.debug("mfsdp2.optim: native AdamW with fma_lerp=%s fma_addcmul=%s sqrt_mode=%s", *_ARITH)
        else:
            logger.warning("mfsdp2.optim: no variant of the native AdamW kernel reproduces torch's AdamW bits "
                           "on this machine; using torch's arithmetic on the flat shards instead")
    return _ARITH or None


def _subnormal_roots_are_ieee() -> bool:
    """Whether torch's CPU ``sqrt`` (MKL's VML where torch is built with it) gives the IEEE
    roots of +0 and subnormals, which sqrt mode 2 takes itself instead of asking VML.

    Why a direct check: VML's roots of subnormals are IEEE's on some CPUs (AMD EPYC) and off by
    an ulp in about one in a hundred on others (Intel Xeon with AVX-512 FP16); the variant probe
    below cannot see that, since any ``eps`` of its configurations swamps a root of 1e-20.
    ``math.sqrt`` is IEEE's in double, and a double root rounded to float32 is float32's IEEE
    root (53 >= 2 * 24 + 2)."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        x = (torch.rand(4099, generator=gen, dtype=torch.float64) * torch.finfo(dtype).tiny).to(dtype)
        x[::13] = 0.0
        ieee = torch.tensor([math.sqrt(v) for v in x.double().tolist()], dtype=torch.float64).to(dtype)
        if not torch.equal(torch.sqrt(x), ieee):
            return False
    return True


_PROBE_CONFIGS = (
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False),
    dict(lr=3e-1, betas=(0.3, 0.6), eps=1e-6, weight_decay=0.0, amsgrad=True, maximize=True),
)


def _probe(mod) -> tuple:
    """Try each variant on a few steps of random problems against torch's for-loop AdamW.

    MKL's VML initialises itself at its first call, and not safely across threads: in about one
    process in five (torch 2.13, two threads) the first CPU ``sqrt`` torch splits over its threads
    returns the second thread's chunk with errors up to 3e-4 relative, and every later call is
    right. The probe's reference would then be wrong (and the native kernel refused for the
    process), as would a first native step whose work items run in parallel; one small sqrt per
    dtype on this thread first settles the initialisation."""
    for dtype in (torch.float32, torch.float64):
        torch.ones(1, dtype=dtype).sqrt()
    # sqrt modes, fastest first: 2 (MKL's roots, IEEE's of +0 and subnormals), 1 (MKL's), 0 (IEEE's)
    modes = (2, 1, 0) if mod.has_vml_sqrt() else (0,)
    if 2 in modes and not _subnormal_roots_are_ieee():
        modes = (1, 0)
    variants = [(fl, fa, ms) for ms in modes for fl in (True, False) for fa in (True, False)]
    sizes = (4096 + 13, 37, 1, 16, 2048 + 5)
    for dtype in (torch.float32, torch.float64):
        # The last piece's gradients are so small that exp_avg_sq's inputs to the root are +0,
        # subnormals and the smallest normals (sqrt mode 2's two sides), some gradients exactly 0.
        tiny = (-22, -16) if dtype == torch.float32 else (-170, -150)
        for cfg in _PROBE_CONFIGS:
            gen = torch.Generator().manual_seed(1234)
            start = [torch.randn(n, generator=gen, dtype=dtype) for n in sizes]
            grads = [[torch.randn(n, generator=gen, dtype=dtype) * 10.0 ** (s - 3) for n in sizes[:-1]]
                     for s in range(3)]
            for gs in grads:
                n = sizes[-1]
                exp = torch.randint(tiny[0], tiny[1], (n,), generator=gen).to(dtype)
                g = torch.randn(n, generator=gen, dtype=dtype) * torch.pow(torch.tensor(10.0, dtype=dtype), exp)
                g[::7] = 0.0
                gs.append(g)
            ref = [torch.nn.Parameter(t.clone()) for t in start]
            opt = torch.optim.AdamW(ref, foreach=False, **cfg)
            for gs in grads:
                for p, g in zip(ref, gs):
                    p.grad = g
                opt.step()
            want = torch.cat([p.detach() for p in ref]
                             + [opt.state[p][k] for k in ("exp_avg", "exp_avg_sq") for p in ref])
            rows, pos = [], 0
            for i, n in enumerate(sizes):
                rows.append([0, pos, n, 0, i])
                pos += n
            hyper = torch.tensor([[cfg["lr"], *cfg["betas"], cfg["eps"], cfg["weight_decay"],
                                   float(cfg["amsgrad"]), float(cfg["maximize"])]], dtype=torch.float64)
            kept = []
            for var in variants:
                flat = torch.cat(start)
                m, v, vmax = (torch.zeros(pos, dtype=dtype) for _ in range(3))
                steps = torch.zeros(len(sizes))
                for gs in grads:
                    mod.adamw_step([flat], [torch.cat(gs)], [m], [v], [vmax], [steps], torch.tensor(rows), hyper, *var)
                got = torch.cat([flat, m, v])
                if _same_bits(got, want):
                    kept.append(var)
            variants = kept
    return variants[0] if variants else ()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, every NaN counting as one value (torch's own NaN bits differ by path)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]))


class NativeStep:
    """One native call for every flat segment of one dtype stepped in an optimizer step.

    ``add`` collects (flat state, parameter index, hyper-parameter row); ``run`` makes the
    call. Rows of the segment table are pieces in the flat states' coordinates; the kernel
    counts each piece's step and merges adjacent pieces with equal coefficients."""

    def __init__(self, mod, arithmetic: tuple, dtype: torch.dtype, bf16_seed: Optional[int] = None,
                 cache: Optional[dict] = None):
        """``bf16_seed``: the flat states' moments are bfloat16 (``adamw_step_bf16``, float32
        weights), their stochastic rounding salted with this seed. ``cache``: a dict kept by the
        caller across steps, where ``run`` keeps its segment table: a step over the same pieces
        as the last reuses the tensor (steady state: every step)."""
        self.mod = mod
        self.cache = cache
        self.arithmetic = arithmetic
        self.dtype = dtype
        self.bf16_seed = bf16_seed
        self.flats: dict[int, int] = {}
        self.states: list = []
        self.rows: list[tuple] = []
        self.hyper: list[list[float]] = []
        self._hyper_of: dict[int, int] = {}

    def hyper_row(self, index: int, group: dict) -> int:
        """The row of optimizer param group ``index`` (added once per step)."""
        row = self._hyper_of.get(index)
        if row is None:
            b1, b2 = group["betas"]
            row = self._hyper_of[index] = len(self.hyper)
            self.hyper.append([float(group["lr"]), float(b1), float(b2), float(group["eps"]),
                               float(group["weight_decay"]), float(bool(group["amsgrad"])),
                               float(bool(group["maximize"]))])
        return row

    def add(self, fs, i: int, row: int, param_id: int = 0) -> None:
        """Step parameter ``i`` of flat state ``fs`` with hyper-parameter row ``row``;
        ``param_id``: its id in the optimizer (keys the bfloat16 moments' random bits)."""
        k = self.flats.get(id(fs))
        if k is None:
            k = self.flats[id(fs)] = len(self.states)
            self.states.append(fs)
        self.rows.append((k, i, row, param_id))

    def run(self) -> None:
        """The call. Flat tensors and offsets are read now: a later parameter may have turned
        amsgrad's state on, or grown the span, of a flat state added before."""
        if not self.rows:
            return
        fss = self.states
        state_dtype = torch.bfloat16 if self.bf16_seed is not None else self.dtype
        empty = _EMPTY.get(state_dtype)
        if empty is None:
            empty = _EMPTY[state_dtype] = torch.empty(0, dtype=state_dtype)
        table = self._table()
        if self.bf16_seed is not None:
            self.mod.adamw_step_bf16(
                [fs.weight for fs in fss], [fs.grad_span() for fs in fss], [fs.exp_avg for fs in fss],
                [fs.exp_avg_sq for fs in fss],
                [fs.max_exp_avg_sq if fs.max_exp_avg_sq is not None else empty for fs in fss],
                [fs.steps for fs in fss], table, torch.tensor(self.hyper, dtype=torch.float64), self.bf16_seed,
                *self.arithmetic[:2])
            return
        self.mod.adamw_step([fs.weight for fs in fss], [fs.grad_span() for fs in fss], [fs.exp_avg for fs in fss],
                            [fs.exp_avg_sq for fs in fss],
                            [fs.max_exp_avg_sq if fs.max_exp_avg_sq is not None else empty for fs in fss],
                            [fs.steps for fs in fss], table, torch.tensor(self.hyper, dtype=torch.float64),
                            *self.arithmetic)

    def _table(self) -> torch.Tensor:
        """The segment table: (flat, offset, length, hyper row, step slot), and for bfloat16
        moments (parameter id, first element). The last one is reused when it was made from the
        same rows over flat states with equal pieces (offsets, lengths, first elements), whose values
        are all the table is made of; the kernel only reads it."""
        fss = self.states
        bf16 = self.bf16_seed is not None
        # what the table's values are made of (no flat state itself: the cache must not keep a
        # retired one's tensors alive)
        key = (tuple(self.rows), tuple(fs.pieces for fs in fss), tuple(fs.first_elem for fs in fss) if bf16 else None)
        kind = (bf16, self.dtype)
        hit = self.cache.get(kind) if self.cache is not None else None
        if hit is not None and hit[0] == key:
            return hit[1]
        if bf16:
            rows = [(k, *fss[k].pieces[i], row, i, pid, fss[k].first_elem[i]) for k, i, row, pid in self.rows]
        else:
            rows = [(k, *fss[k].pieces[i], row, i) for k, i, row, _ in self.rows]
        table = torch.tensor(rows, dtype=torch.int64)
        if self.cache is not None:
            self.cache[kind] = (key, table)
        return table


def torch_step(group: dict, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, fused: bool) -> None:
    """torch's functional AdamW on plain tensors: ``fused`` (torch's fused kernel: accelerators,
    and ``fused=True`` on the CPU) or ``foreach`` (the CPU's, same bits as the for-loop)."""
    b1, b2 = group["betas"]
    lr = group["lr"]
    if not fused:  # the for-loop reads tensor hyper-parameters as Python numbers; foreach refuses tensors
        lr, b1, b2 = (float(x) for x in (lr, b1, b2))
    _adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
        foreach=not fused, fused=fused, capturable=group["capturable"] if not fused else False,
        differentiable=False, grad_scale=None, found_inf=None, has_complex=False, decoupled_weight_decay=True,
        amsgrad=group["amsgrad"], beta1=b1, beta2=b2, lr=lr, weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=group["maximize"],
    )
