"""``mfsdp2.optim.AdamW(state_dtype=torch.bfloat16)``: bfloat16 moments, stochastically rounded.

* The native kernel computes the PyTorch reference's bits (hypothesis: lengths, segment
  offsets, element indices crossing 2**32, every hyper-parameter flag, non-finite gradients).
* Against float32 AdamW (torch's for-loop ops with an IEEE root, an implementation apart from
  the one tested): every step's parameters are its bits from the stored moments, and every
  stored moment one of the two bfloat16 neighbours of its float32 moment.
* Stochastic rounding: exact on representable values, unbiased (the mean of many roundings
  within six standard deviations of the value), NaN stored as 0x7FC0; over 2000 steps of
  ``beta2 = 0.999`` the stored ``exp_avg_sq`` tracks float32's where rounding to nearest freezes.
* Sharded: every strategy (ZeRO-3/2/1, no_shard, HSDP, CPU offload), with and without the
  native kernel, gives the same bits as the reference applied to the unsharded parameters (the
  random bits are keyed by parameter and element, not by rank); state dicts load into torch's
  AdamW and back, and through DCP into bfloat16 and float32 moments; float64 weights are
  refused, naming the parameter. Under CPU offload,
  ``step_in_backward=True`` gives the same bits as the step after backward.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from mfsdp2.checkpoint import state_dict as msd
from mfsdp2.optim import AdamW, kernel
from mfsdp2.optim.bf16_states import random_bits, salt, step_piece, stochastic_round

from .._dist import run_ranks
from .._optional import given, HealthCheck, settings, st
from ..models import batch, build, loss_fn
from .test_optim_kernel import _ieee_reference
from .test_optim_adamw import (
    LAYOUTS, _groups_of, _inject, _meshes, _shard, _step_grads, _step_nan_padded, full, same_bits,
)

BF16 = torch.bfloat16


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values just below and just above each finite float32 ``x`` in magnitude
    (equal where ``x`` is representable)."""
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = u & 0xFFFF0000
    hi = torch.where(u == lo, lo, lo + 0x10000)
    as_bf = lambda b: torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32).to(BF16)
    return as_bf(lo), as_bf(hi)


# -- the kernel against the reference -----------------------------------------------------------
@pytest.mark.skipif(kernel.native_arithmetic() is None, reason="the native AdamW kernel is not built / not usable here")
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    n=st.integers(1, 3000),
    offset=st.integers(0, 40),
    first=st.sampled_from([0, 17, 2**32 - 1000, 2**33 + 5]),
    lr=st.sampled_from([1e-3, 0.3]),
    betas=st.sampled_from([(0.9, 0.999), (0.3, 0.6), (0.99, 0.5)]),
    eps=st.sampled_from([1e-8, 1e-3]),
    wd=st.sampled_from([0.0, 0.1]),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    nonfinite=st.booleans(),
    seed=st.integers(0, 2**40),
    pid=st.integers(0, 2**33),
)
def test_native_kernel_equals_pytorch_reference(n, offset, first, lr, betas, eps, wd, amsgrad, maximize, nonfinite,
                                               seed, pid):
    gen = torch.Generator().manual_seed(n * 7 + offset)
    size = offset + n + 3
    p0 = torch.randn(size, generator=gen)
    m0 = (torch.randn(size, generator=gen) * 0.1).to(BF16)
    v0 = (torch.rand(size, generator=gen) * 0.01).to(BF16)
    grads = [torch.randn(size, generator=gen) * 10.0 ** -k for k in range(3)]
    if nonfinite:
        grads[1][offset] = float("nan")
        grads[1][offset + n - 1] = float("inf")
    group = dict(lr=lr, betas=betas, eps=eps, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    hyper = torch.tensor([[lr, *betas, eps, wd, float(amsgrad), float(maximize)]], dtype=torch.float64)
    ref = [p0.clone(), m0.clone(), v0.clone(), v0.clone()]
    nat = [p0.clone(), m0.clone(), v0.clone(), v0.clone()]
    ref_step, nat_steps = torch.zeros(()), torch.zeros(2)
    sl = slice(offset, offset + n)
    mod = kernel._module()
    for g in grads:
        step_piece(ref[0][sl], g[sl], ref[1][sl], ref[2][sl], ref[3][sl] if amsgrad else None, ref_step, group,
                   seed=seed, param_id=pid, first_elem=first)
        seg = torch.tensor([[0, offset, n, 0, 1, pid, first]], dtype=torch.int64)
        mod.adamw_step_bf16([nat[0]], [g], [nat[1]], [nat[2]], [nat[3]], [nat_steps], seg, hyper, seed,
                            *kernel.native_arithmetic()[:2])
    assert nat_steps[1].item() == ref_step.item() == 3.0 and nat_steps[0].item() == 0.0
    assert same_bits(nat[0], ref[0])
    for a, b in zip(nat[1:], ref[1:]):
        assert torch.equal(_bits16(a), _bits16(b))
    assert torch.equal(nat[0][:offset], p0[:offset]) and torch.equal(nat[0][offset + n:], p0[offset + n:])
    assert mod.bf16_salt(seed, pid, 3.0) == salt(seed, pid, 3.0)


# -- against float32 AdamW ------------------------------------------------------------------------
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_each_step_is_float32_adamw_from_the_stored_moments(amsgrad, maximize):
    """Every step, from the parameter and the widened stored moments, float32 AdamW's step (torch's
    for-loop ops with an IEEE root: ``_ieee_reference``, written apart from ``step_piece``) gives
    the parameter bit for bit and moments of which the stored ones are bfloat16 neighbours. The
    first step starts from zero moments, as float32 AdamW's does."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(37, 5), (300,), ()]
    grads = [[torch.randn(s, generator=gen) * 10.0 ** -k for s in shapes] for k in range(3)]
    cfg = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize)
    ours = [torch.randn(s, generator=gen) for s in shapes]
    states = [[torch.zeros(s, dtype=BF16) for _ in range(3)] for s in shapes]
    steps = [torch.zeros(()) for _ in shapes]
    for k in range(3):
        for i in range(len(shapes)):
            m, v, vmax = states[i]
            want = [ours[i].clone().reshape(-1), m.float().reshape(-1), v.float().reshape(-1), vmax.float().reshape(-1)]
            _ieee_reference(want[0], grads[k][i].reshape(-1), want[1], want[2], want[3], float(k + 1), cfg)
            step_piece(ours[i], grads[k][i], m, v, vmax if amsgrad else None, steps[i], cfg, seed=1, param_id=i,
                       first_elem=0)
            assert same_bits(ours[i].reshape(-1), want[0]), (i, k, "parameter")
            for name, got, exact in zip(("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), (m, v, vmax), want[1:]):
                if name == "max_exp_avg_sq" and not amsgrad:
                    continue
                lo, hi = _neighbours(exact)
                got = got.reshape(-1)
                ok = (_bits16(got) == _bits16(lo)) | (_bits16(got) == _bits16(hi))
                assert bool(ok.all()), (i, k, name)


# -- stochastic rounding ----------------------------------------------------------------------------
def test_stochastic_rounding_is_exact_unbiased_and_keeps_specials():
    r = random_bits(salt(0, 0, 1.0), 0, 1 << 16, torch.device("cpu"))
    for bits in (r >> 16, r & 0xFFFF):
        # representable values (and infinities) round to themselves
        x = torch.tensor([1.0, -2.5, 0.0, -0.0, 2.0**127, float("inf"), -float("inf")]).repeat(8)
        got = stochastic_round(x, bits[: x.numel()])
        assert torch.equal(_bits16(got), _bits16(x.to(BF16)))
        assert _bits16(stochastic_round(torch.tensor([float("nan"), -float("nan")]), bits[:2])).tolist() == [0x7FC0] * 2
        # x = lo + f ulp: each rounding is lo + Bernoulli(f) ulp; the mean of N has standard
        # deviation ulp sqrt(f (1 - f) / N)
        for f in (0.5, 0.1, 0.93):
            lo, ulp = 1.0, 2.0 ** -7
            x = torch.full((bits.numel(),), lo + f * ulp)
            got = stochastic_round(x, bits).double()
            assert bool(((got == lo) | (got == lo + ulp)).all())
            sd = ulp * math.sqrt(f * (1 - f) / bits.numel())
            assert abs(got.mean().item() - (lo + f * ulp)) < 6 * sd, f
            neg = stochastic_round(-x, bits).double()
            assert abs(neg.mean().item() + (lo + f * ulp)) < 6 * sd, f


def test_exp_avg_sq_tracks_float32_where_rounding_to_nearest_freezes():
    """A constant gradient g at beta2 = 0.999: float32's exp_avg_sq is (1 - 0.999^t) g^2. Its
    relative change per step falls below half a bfloat16 step after a few hundred steps, where
    rounding to nearest stops moving; stochastic rounding keeps the mean over elements on
    float32's curve (per element it is a random walk of a few percent, its mean over 4096
    elements well inside 1 %)."""
    n, steps = 4096, 2000
    g = torch.full((n,), 0.3)
    cfg = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
    p, m, v, step_t = torch.zeros(n), torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16), torch.zeros(())
    v32 = torch.zeros(n)
    v_rn = torch.zeros(n, dtype=BF16)
    for _ in range(steps):
        step_piece(p, g, m, v, None, step_t, cfg, seed=0, param_id=0, first_elem=0)
        v32.mul_(0.999).addcmul_(g, g, value=0.001)
        v_rn = (v_rn.float().mul_(0.999).addcmul_(g, g, value=0.001)).to(BF16)
    want = v32.double().mean().item()
    assert abs(v.double().mean().item() / want - 1) < 0.01
    assert abs(v_rn.double().mean().item() / want - 1) > 0.1  # the failure stochastic rounding avoids


def test_refusals():
    w = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="state_dtype must be None"):
        AdamW(w, state_dtype=torch.float16)
    with pytest.raises(ValueError, match="fused=True and capturable=True"):
        AdamW(w, state_dtype=BF16, fused=True)
    copied = copy.deepcopy(AdamW(w, state_dtype=BF16, seed=3))  # pickling keeps the option
    assert copied.state_dtype == BF16 and copied.seed == 3


# -- sharded, every strategy ------------------------------------------------------------------------
def _unsharded_reference(groups_cfg, grads_per_step, seed):
    """The reference step on the unsharded parameters: parameter ids are positions in the
    optimizer, elements count from each parameter's start."""
    model = build("net")
    named = list(model.named_parameters())
    by_name = dict(named)
    state = {}
    pid = 0
    order = []
    for cfg in groups_cfg:
        for name in cfg["names"]:
            order.append((name, pid, cfg))
            pid += 1
    for grads in grads_per_step:
        for name, k, cfg in order:
            g = grads[name]
            if g is None:
                continue
            p = by_name[name].detach()
            s = state.setdefault(name, [torch.zeros(p.shape, dtype=BF16) for _ in range(3)] + [torch.zeros(())])
            step_piece(p, g, s[0], s[1], s[2] if cfg["amsgrad"] else None, s[3], cfg, seed=seed, param_id=k,
                       first_elem=0)
    return {n: p.detach() for n, p in named}, state


def _bf16_ranks(rank, ws, path):
    meshes = _meshes()
    seed = 11
    case = dict(seed=4, nonfinite=True, skip=True)
    names = [n for n, _ in build("net").named_parameters()]
    decay = [n for n in names if n.endswith("weight") and "norm" not in n]
    groups_cfg = [dict(names=decay, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=False,
                       maximize=False),
                  dict(names=[n for n in names if n not in decay], lr=5e-3, betas=(0.5, 0.9), eps=1e-6,
                       weight_decay=0.0, amsgrad=True, maximize=True)]
    grads = [_step_grads(case, s, list(build("net").named_parameters())) for s in range(3)]
    want_p, want_s = _unsharded_reference(groups_cfg, grads, seed)
    keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    checked = 0
    for layout in LAYOUTS:
        for variant in ("native", "reference"):
            model = _shard(build("net"), layout, meshes)
            x, y = batch(0, 4, 12)
            loss_fn(model(x), y).backward()
            by_name = dict(model.named_parameters())
            opt = AdamW([dict(params=[by_name[n] for n in c["names"]], **{k: v for k, v in c.items() if k != "names"})
                         for c in groups_cfg], state_dtype=BF16, seed=seed)
            views = {n: p.grad for n, p in model.named_parameters()}
            for s in range(3):
                _inject(model, views, grads[s])
                _step_nan_padded(opt, _groups_of(model), variant)
            what = f"{layout} {variant}"
            for n, p in model.named_parameters():
                assert same_bits(full(p), want_p[n]), f"{what}: weight {n}"
                st = opt.state[p]
                amsgrad = n not in decay
                assert sorted(st) == sorted(["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else []))
                assert st["step"].item() == want_s[n][3].item() and st["step"].device.type == "cpu", what
                for k, ref in zip(keys, want_s[n]):
                    if k in st:
                        t = st[k]
                        assert isinstance(t, DTensor) and t.dtype == BF16 and t.placements == p.placements, (what, n, k)
                        assert same_bits(full(t.float()), ref.float()), f"{what}: {k} of {n}"
            checked += 1
            if layout == "optim_grads_params" and variant == "native":
                # DCP (mfsdp2.checkpoint.state_dict): into a fresh model with bfloat16 moments
                # (the same bits) and with torch's float32 AdamW (the values widened)
                ck = os.path.join(path, "dcp_bf16")
                model_sd, optim_sd = msd.get_state_dict(model, opt)
                msd.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ck)
                for kind in ("ours", "torch"):
                    other = _shard(build("net", seed=4), layout, meshes)
                    o_by = dict(other.named_parameters())
                    og = [dict(params=[o_by[n] for n in c["names"]], **{k: v for k, v in c.items() if k != "names"})
                          for c in groups_cfg]
                    oo = AdamW(og, state_dtype=BF16, seed=seed) if kind == "ours" else torch.optim.AdamW(og)
                    m_sd, o_sd = msd.get_state_dict(other, oo)
                    sd = {"model": m_sd, "optim": o_sd}
                    msd.load(sd, checkpoint_id=ck)
                    msd.set_state_dict(other, oo, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
                    for n, p in model.named_parameters():
                        q = o_by[n]
                        assert same_bits(full(q), full(p)), (kind, n)
                        for k in keys:
                            if k in opt.state[p]:
                                got = oo.state[q][k]
                                assert got.dtype == (BF16 if kind == "ours" else torch.float32), (kind, n, k)
                                assert same_bits(full(got.float()), full(opt.state[p][k].float())), (kind, n, k)
                        assert oo.state[q]["step"].item() == opt.state[p]["step"].item(), (kind, n)
                # our state dict into torch's AdamW (float32 moments: the bfloat16 values widened)
                sd = opt.state_dict()
                ropt = torch.optim.AdamW([dict(params=[by_name[n] for n in c["names"]],
                                               **{k: v for k, v in c.items() if k != "names"}) for c in groups_cfg])
                ropt.load_state_dict(sd)
                for n, p in model.named_parameters():
                    for k in keys:
                        if k in opt.state[p]:
                            rt = ropt.state[p][k]
                            assert (rt.dtype == torch.float32
                                    and same_bits(full(rt), full(opt.state[p][k].float()))), (n, k)
                # torch's float32 state (one real step on other values) into ours: rounded to nearest
                ropt.step()
                fresh = AdamW([dict(params=[by_name[n] for n in c["names"]],
                                    **{k: v for k, v in c.items() if k != "names"}) for c in groups_cfg],
                              state_dtype=BF16, seed=seed)
                fresh.load_state_dict(ropt.state_dict())
                for n, p in model.named_parameters():
                    for k in keys:
                        if k in ropt.state[p]:
                            got, want = fresh.state[p][k], ropt.state[p][k]
                            assert got.dtype == BF16
                            assert same_bits(full(got.float()), full(want).to(BF16).float()), (n, k)
                    assert fresh.state[p]["step"].item() == ropt.state[p]["step"].item()
                fresh.step()  # steps from the loaded moments
    # float64 main weights are refused, naming the parameter
    model = _shard(build("net", dtype=torch.float64), "optim_grads_params", meshes)
    x, y = batch(0, 4, 12, dtype=torch.float64)
    loss_fn(model(x), y).backward()
    opt = AdamW(model.parameters(), state_dtype=BF16)
    with pytest.raises(ValueError, match=r"parameter '.*weight' has torch.float64 main weights"):
        opt.step()
    return checked


@pytest.mark.slow
def test_every_strategy_equals_the_unsharded_reference(tmp_path):
    assert run_ranks(_bf16_ranks, 2, str(tmp_path)) == [2 * len(LAYOUTS)] * 2


def _offload_overlap(rank, ws):
    """CPU offload with bfloat16 moments, with and without ``step_in_backward``: three real
    training steps, the same bits, and the steps really ran in backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    from mfsdp2 import fully_shard

    from ..models import sharded_train_step

    mesh = init_device_mesh("cpu", (ws,))
    runs = {}
    for sib in (False, True):
        model = build("net")
        for b in model.blocks:
            fully_shard(b, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        opt = AdamW(model.parameters(), lr=1e-2, state_dtype=BF16, step_in_backward=sib)
        for s in range(3):
            sharded_train_step(model, opt, s, rank, ws, 8)
        runs[sib] = ({n: full(p) for n, p in model.named_parameters()},
                     {(n, k): full(v.float()) for n, p in model.named_parameters() for k, v in opt.state[p].items()
                      if k != "step"}, opt._overlap.jobs_done if sib else 0)
    (p0, s0, _), (p1, s1, done) = runs[False], runs[True]
    assert all(same_bits(p0[k], p1[k]) for k in p0) and all(same_bits(s0[k], s1[k]) for k in s0)
    return done


@pytest.mark.slow
def test_offload_step_in_backward_gives_the_same_bits():
    done = run_ranks(_offload_overlap, 2)
    assert done[0] == done[1] == 4 * 3, done  # 4 offloaded groups (3 blocks, the root) per step
