"""The flat AdamW's native step (csrc/adamw.cpp through mfsdp2.optim.kernel.NativeStep) against
``torch.optim.AdamW(foreach=False)`` on separate tensors, bit for bit (NaNs compared as NaN: torch's
own NaN bits differ between its vector and scalar code).

Random flat layouts (gaps between the pieces, which must stay untouched: NaN gradients there),
lengths around the vector width, the kernel's 1024-element blocks and 16384-element work items,
two param groups with their own hyper-parameters (both lerp forms, beta2 = 0, eps = 0, lr = 0,
amsgrad and maximize per group), pieces skipped in some steps (their step counts differ, as
torch's), non-finite gradients, float32 and float64, float32 and float64 step counters, one and
two threads. Cases need the built extension and skip without it (``make native``); the pure-torch
path is checked against torch in tests/optim/test_optim_adamw.py. The single-loop variant, which
torch builds without MKL take, is checked against torch's ops with an IEEE square root.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mfsdp2.optim import kernel

from .._dist import process_context
from .._optional import given, settings, st

ARITH = kernel.native_arithmetic()
needs_native = pytest.mark.skipif(ARITH is None, reason="native kernels not built (make native)")

_sizes = st.one_of(st.integers(0, 40), st.sampled_from([1, 15, 16, 17, 1023, 1024, 1025, 16383, 16384, 16385, 40000]))
_hyper = st.fixed_dictionaries({
    "lr": st.sampled_from([0.0, 1e-3, 1e-2, 0.3]),
    "betas": st.sampled_from([(0.9, 0.999), (0.3, 0.6), (0.0, 0.5), (0.95, 0.0), (0.5, 0.5)]),
    "eps": st.sampled_from([1e-8, 1e-3, 0.0]),
    "weight_decay": st.sampled_from([0.0, 1e-2, 0.5]),
    "amsgrad": st.booleans(),
    "maximize": st.booleans(),
})


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return kernel._same_bits(a.flatten(), b.flatten())


def _grad(gen, n: int, dtype, step: int, nonfinite: bool) -> torch.Tensor:
    g = torch.randn(n, generator=gen, dtype=dtype) * 10.0 ** torch.randint(-6, 2, (n,), generator=gen).to(dtype)
    if nonfinite and n:
        k = torch.randint(0, n, (max(1, n // 50),), generator=gen)
        g[k] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)[torch.arange(k.numel()) % 3]
    return g


@needs_native
@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(_sizes, min_size=1, max_size=5), data=st.data(),
       dtype=st.sampled_from([torch.float32, torch.float64]),
       step_dtype=st.sampled_from([torch.float32, torch.float64]), hypers=st.lists(_hyper, min_size=2, max_size=2),
       steps=st.integers(1, 4), nonfinite=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**31))
def test_native_step_matches_torch_adamw(sizes, data, dtype, step_dtype, hypers, steps, nonfinite, threads, seed):
    gen = torch.Generator().manual_seed(seed)
    gaps = data.draw(st.lists(st.integers(0, 9), min_size=len(sizes) + 1, max_size=len(sizes) + 1))
    which = data.draw(st.lists(st.integers(0, 1), min_size=len(sizes), max_size=len(sizes)))
    offsets, pos = [], gaps[0]
    for n, gap in zip(sizes, gaps[1:]):
        offsets.append(pos)
        pos += n + gap
    start = [torch.randn(n, generator=gen, dtype=dtype) for n in sizes]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    groups = [{"params": [p for p, w in zip(ref, which) if w == k], **hypers[k]} for k in (0, 1)]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], foreach=False)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    index_of = {id(g): k for k, g in enumerate(opt.param_groups)}

    sentinel = 7.25
    weight = torch.full((pos,), sentinel, dtype=dtype)
    for o, t in zip(offsets, start):
        weight[o:o + t.numel()] = t
    fs = SimpleNamespace(weight=weight, grad=torch.full((pos,), float("nan"), dtype=dtype),
                         exp_avg=torch.zeros(pos, dtype=dtype), exp_avg_sq=torch.zeros(pos, dtype=dtype),
                         max_exp_avg_sq=torch.zeros(pos, dtype=dtype) if any(h["amsgrad"] for h in hypers) else None,
                         steps=torch.zeros(len(sizes), dtype=step_dtype),
                         pieces={i: (o, n) for i, (o, n) in enumerate(zip(offsets, sizes))})
    fs.grad_span = lambda: fs.grad
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for s in range(steps):
            skip = (data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes))) if s
                    else [False] * len(sizes))
            batch = kernel.NativeStep(kernel._module(), ARITH, dtype)
            for i, (p, o, n) in enumerate(zip(ref, offsets, sizes)):
                g = _grad(gen, n, dtype, s, nonfinite)
                p.grad = None if skip[i] else g.clone()
                fs.grad[o:o + n] = g
                if not skip[i]:
                    grp = group_of[id(p)]
                    batch.add(fs, i, batch.hyper_row(index_of[id(grp)], grp))
            opt.step()
            batch.run()
    finally:
        torch.set_num_threads(was)

    covered = torch.zeros(pos, dtype=torch.bool)
    for i, (p, o, n) in enumerate(zip(ref, offsets, sizes)):
        covered[o:o + n] = True
        assert same_bits(weight[o:o + n], p.detach()), ("param", i, n)
        st_ = opt.state.get(p)
        if not st_:
            assert fs.steps[i].item() == 0 and same_bits(weight[o:o + n], start[i])
            continue
        assert fs.steps[i].item() == st_["step"].item(), ("step", i)
        assert same_bits(fs.exp_avg[o:o + n], st_["exp_avg"]), ("exp_avg", i, n)
        assert same_bits(fs.exp_avg_sq[o:o + n], st_["exp_avg_sq"]), ("exp_avg_sq", i, n)
        if "max_exp_avg_sq" in st_:
            assert same_bits(fs.max_exp_avg_sq[o:o + n], st_["max_exp_avg_sq"]), ("max_exp_avg_sq", i, n)
    # gaps (padding) never stepped: NaN gradients there changed nothing
    assert bool((weight[~covered] == sentinel).all()) and bool((fs.exp_avg[~covered] == 0).all())


built = pytest.mark.skipif(kernel._module() is None, reason="native kernels not built (make native)")


@built
def test_probe_found_torchs_arithmetic():
    """On an AVX2 / AVX-512 build with MKL (this machine's) torch fuses lerp and addcmul and takes
    MKL's sqrt; the probe must have picked a variant (else the native kernel is never used)."""
    assert ARITH is not None, "the probe found no variant computing torch's bits: the native kernel is off"
    fma_lerp, fma_addcmul, mkl_sqrt = ARITH
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        assert fma_lerp and fma_addcmul
    if torch.backends.mkl.is_available() and kernel._module().has_vml_sqrt():
        assert mkl_sqrt


@needs_native
def test_kernel_refuses_bad_tables():
    mod = kernel._module()
    x = torch.zeros(8)
    steps = torch.zeros(2)
    hyper = torch.tensor([[1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0, 0.0]], dtype=torch.float64)
    call = lambda segs: mod.adamw_step([x], [x.clone()], [x.clone()], [x.clone()], [torch.empty(0)], [steps],
                                       torch.tensor(segs, dtype=torch.int64), hyper, *ARITH)
    with pytest.raises(RuntimeError, match="overlap"):
        call([[0, 0, 4, 0, 0], [0, 3, 4, 0, 1]])
    with pytest.raises(RuntimeError, match="outside"):
        call([[0, 6, 4, 0, 0]])
    with pytest.raises(RuntimeError, match="step slot"):
        call([[0, 0, 4, 0, 5]])
    with pytest.raises(RuntimeError, match="max_exp_avg_sqs"):
        amsgrad = hyper.clone()
        amsgrad[0, 5] = 1
        mod.adamw_step([x], [x.clone()], [x.clone()], [x.clone()], [torch.empty(0)], [steps],
                       torch.tensor([[0, 0, 4, 0, 0]]), amsgrad, *ARITH)
    # the bfloat16-moment kernel reads its (7-column) table through the same checks
    b = torch.zeros(8, dtype=torch.bfloat16)
    bf16 = lambda segs: mod.adamw_step_bf16([x], [x.clone()], [b], [b.clone()], [torch.empty(0)], [steps],
                                            torch.tensor(segs, dtype=torch.int64), hyper, 0, *ARITH[:2])
    with pytest.raises(RuntimeError, match="adamw_step_bf16: segments overlap"):
        bf16([[0, 0, 4, 0, 0, 0, 0], [0, 3, 4, 0, 1, 1, 0]])
    with pytest.raises(RuntimeError, match="negative entry in column 6"):
        bf16([[0, 0, 4, 0, 0, 0, -1]])
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] must be BFloat16"):
        mod.adamw_step_bf16([x], [x.clone()], [x.clone()], [b], [torch.empty(0)], [steps],
                            torch.tensor([[0, 0, 4, 0, 0, 0, 0]]), hyper, 0, *ARITH[:2])


def _torch_ops_ieee_sqrt(p, g, m, v, vmax, step, h, fma_lerp, fma_addcmul):
    """One AdamW step with torch's ops in torch's order, but an IEEE square root (numpy's):
    what the kernel's single-loop variant must give (torch builds without MKL)."""
    import numpy as np

    lr, b1, b2, eps, wd, ams, mx = h
    g = -g if mx else g
    if wd:
        p.mul_(1 - lr * wd)
    if fma_lerp:
        m.lerp_(g, 1 - b1)
    else:
        w = torch.tensor(1 - b1, dtype=m.dtype)
        m.copy_(torch.where(w.abs() < 0.5, w * (g - m) + m, (w - 1) * (g - m) + g))
    v.mul_(b2)
    if fma_addcmul:
        v.addcmul_(g, g, value=1 - b2)
    else:
        v.copy_(v + torch.tensor(1 - b2, dtype=v.dtype) * g * g)
    if ams:
        torch.maximum(vmax, v, out=vmax)
    src = vmax if ams else v
    root = torch.from_numpy(np.sqrt(src.numpy()))
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    den = (root / bc2 ** 0.5).add_(eps)
    p.addcdiv_(m, den, value=-(lr / bc1))


@needs_native
@settings(max_examples=30, deadline=None)
@given(n=_sizes, dtype=st.sampled_from([torch.float32, torch.float64]), hyper=_hyper, seed=st.integers(0, 2**31))
def test_ieee_sqrt_variant(n, dtype, hyper, seed):
    """The single-loop variant (IEEE root) against torch's ops with numpy's IEEE root, with this
    machine's rounding of lerp / addcmul (ARITH): the path of torch builds without MKL."""
    gen = torch.Generator().manual_seed(seed)
    h = [hyper["lr"], *hyper["betas"], hyper["eps"], hyper["weight_decay"], hyper["amsgrad"], hyper["maximize"]]
    p = torch.randn(n, generator=gen, dtype=dtype)
    m, v, vmax = (torch.zeros(n, dtype=dtype) for _ in range(3))
    ours = [t.clone() for t in (p, m, v, vmax)]
    steps = torch.zeros(1)
    for s in range(1, 4):
        g = _grad(gen, n, dtype, s, nonfinite=s == 2)
        _torch_ops_ieee_sqrt(p, g, m, v, vmax, s, h, *ARITH[:2])
        kernel._module().adamw_step([ours[0]], [g], [ours[1]], [ours[2]], [ours[3]], [steps],
                                    torch.tensor([[0, 0, n, 0, 0]]), torch.tensor([h], dtype=torch.float64),
                                    ARITH[0], ARITH[1], False)
    for a, b, k in zip(ours, (p, m, v, vmax), ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")):
        assert same_bits(a, b), k


def _ieee_reference(p, g, m, v, vmax, step: float, cfg: dict) -> None:
    """torch's for-loop AdamW step on float32 tensors, in place, with an IEEE square root (numpy's
    float32 sqrt) in place of torch's: what the kernel's single-loop variant (torch builds
    without MKL) must compute."""
    import numpy as np

    lr, (b1, b2), eps, wd = cfg["lr"], cfg["betas"], cfg["eps"], cfg["weight_decay"]
    if wd:
        p.mul_(1 - lr * wd)
    g = -g if cfg["maximize"] else g
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    s = v
    if cfg["amsgrad"]:
        torch.maximum(vmax, v, out=vmax)
        s = vmax
    with np.errstate(invalid="ignore"):
        root = torch.from_numpy(np.sqrt(s.numpy()))
    denom = (root / (1 - b2 ** step) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / (1 - b1 ** step)))


@needs_native
@settings(max_examples=25, deadline=None)
@given(n=_sizes.filter(lambda n: n > 0), cfg=_hyper, nonfinite=st.booleans())
def test_single_loop_variant_equals_ieee_reference(n, cfg, nonfinite):
    """The variant for torch builds without MKL (one vectorised loop, IEEE square root), float32
    and bfloat16 moments, against the reference above; torch's lerp / addcmul roundings as found
    on this machine. bfloat16: the parameter from the widened moments, the moments the
    stochastic rounding of the float32 ones."""
    from mfsdp2.optim.bf16_states import h32, random_bits, salt, stochastic_round

    mod = kernel._module()
    fma = ARITH[:2]
    gen = torch.Generator().manual_seed(n)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    if nonfinite:
        g[0] = float("nan")
        g[-1] = float("inf")
    m0 = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16).float()
    v0 = (torch.rand(n, generator=gen) * 0.01).to(torch.bfloat16).float()
    hyper = torch.tensor([[cfg["lr"], *cfg["betas"], cfg["eps"], cfg["weight_decay"], float(cfg["amsgrad"]),
                           float(cfg["maximize"])]], dtype=torch.float64)
    ref = [p0.clone(), m0.clone(), v0.clone(), v0.clone()]
    _ieee_reference(ref[0], g, ref[1], ref[2], ref[3], 1.0, cfg)
    nat = [p0.clone(), m0.clone(), v0.clone(), v0.clone()]
    mod.adamw_step([nat[0]], [g], [nat[1]], [nat[2]], [nat[3]], [torch.zeros(1)],
                   torch.tensor([[0, 0, n, 0, 0]]), hyper, *fma, False)
    for a, b in zip(nat, ref if cfg["amsgrad"] else ref[:3]):
        assert same_bits(a, b)
    bf = [p0.clone(), m0.to(torch.bfloat16), v0.to(torch.bfloat16), v0.to(torch.bfloat16)]
    mod.adamw_step_bf16([bf[0]], [g], [bf[1]], [bf[2]], [bf[3]], [torch.zeros(1)],
                        torch.tensor([[0, 0, n, 0, 0, 5, 0]]), hyper, 9, *fma)
    assert same_bits(bf[0], ref[0])
    r = random_bits(salt(9, 5, 1.0), 0, n, torch.device("cpu"))
    want = [stochastic_round(ref[1], r >> 16), stochastic_round(ref[2], r & 0xFFFF)]
    if cfg["amsgrad"]:
        want.append(stochastic_round(ref[3], h32(r ^ 0x9E3779B9) >> 16))
    for a, b in zip(bf[1:], want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@built
@pytest.mark.slow
def _probe_in_child(queue) -> None:
    from mfsdp2.optim import kernel
    queue.put(str(kernel.native_arithmetic()))


def test_probe_succeeds_in_fresh_processes():
    """The probe is the first MKL VML use of a fresh process: without settling VML's
    initialisation on one thread first, torch's reference sqrt was wrong in about one process in
    five (its second thread's chunk, up to 3e-4 relative) and the native kernel refused there.

    The processes come from the suite's forkserver (tests/_dist.py): torch and mfsdp2 are
    imported there, nothing has run, so each child's probe is its first VML call, with torch's
    default thread count."""
    ctx = process_context()
    found = []
    for _ in range(8):
        queue = ctx.Queue()
        proc = ctx.Process(target=_probe_in_child, args=(queue,))
        proc.start()
        found.append(queue.get(timeout=120))
        proc.join(timeout=30)
        assert proc.exitcode == 0, proc.exitcode
    assert found == [str(ARITH)] * 8, found
