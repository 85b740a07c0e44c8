"""``mfsdp2.optim.AdamW(step_in_backward=True)`` under ``CPUOffloadPolicy``: a group's host step
starts when its gradient lands, while backward still runs (mfsdp2/optim/overlap.py).

* Parity, per strategy (ZeRO-3, ZeRO-2, ZeRO-1, no_shard), world sizes 1 and 2, with gradient
  accumulation (``set_requires_gradient_sync(False)`` and ``set_is_last_backward(False)``
  micro-batches), clipping (``max_grad_norm``, against ``mfsdp2.clip_grad_norm_`` then ``step()``),
  param groups cutting through units with an LR scheduler, gradients touched between backward and
  step under clipping: bit for bit the same run without overlap (weights and optimizer states),
  and within ``REL_F64`` (float64) of the unsharded model with torch's AdamW and of torch FSDP2
  with ``CPUOffloadPolicy`` and torch's AdamW. Each case also checks that steps really ran in
  backward (or, with clipping, that none did).
* The step starts before backward ends: a hook on the input's gradient (the last thing backward
  computes) waits until a step job has finished; without step_in_backward none ever runs.
* Every refused misuse raises ``StepInBackwardError`` at the documented point.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

import mfsdp2
from mfsdp2 import fully_shard
from mfsdp2.optim import AdamW
from mfsdp2.optim.overlap import StepInBackwardError

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, build, loss_fn

pytestmark = pytest.mark.slow

STEPS, GB, MICRO = 3, 8, 2
OFF = CPUOffloadPolicy(pin_memory=False)
STRATEGIES = {"zero3": {}, "zero2": {"sharding_strategy": "optim_grads"}, "zero1": {"sharding_strategy": "optim"},
              "no_shard": {"sharding_strategy": "no_shard"}}
MODES = ("plain", "nosync", "lastbwd", "clip", "groups", "clip_touch")
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _shard(model, mesh, runtime, strategy):
    kw = dict(STRATEGIES[strategy]) if runtime is fully_shard else {}
    for b in model.blocks:
        runtime(b, mesh=mesh, offload_policy=OFF, **kw)
    runtime(model, mesh=mesh, offload_policy=OFF, **kw)
    return model


def _param_groups(model, mode):
    named = list(model.named_parameters())
    if mode != "groups":
        return [dict(params=[p for _, p in named], **HYPER)]
    return [dict(params=[p for _, p in named if p.dim() >= 2], **HYPER),
            dict(params=[p for _, p in named if p.dim() < 2], lr=5e-3, betas=(0.5, 0.9), eps=1e-6,
                 weight_decay=0.0, amsgrad=True)]


def _train(kind: str, mode: str, strategy: str, rank: int, ws: int, mesh=None):
    """Three steps (of two micro-batches each with accumulation). ``kind``: "off" (mfsdp2 AdamW, no overlap), "sib"
    (step_in_backward), "fsdp2" (torch FSDP2 + torch AdamW), "ref" (unsharded, torch AdamW, the
    whole global batch per micro-batch pair). Returns the full parameters, the full optimizer
    states, and how many steps ran in backward."""
    torch.manual_seed(0)
    model = build("net", dtype=F64)
    clip = mode in ("clip", "clip_touch")
    if kind == "ref":
        opt = torch.optim.AdamW(_param_groups(model, mode))
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_shard

        _shard(model, mesh, torch_shard, strategy)
        opt = torch.optim.AdamW(_param_groups(model, mode))
    else:
        _shard(model, mesh, fully_shard, strategy)
        opt = AdamW(_param_groups(model, mode), step_in_backward=kind == "sib",
                    max_grad_norm=0.05 if clip and kind == "sib" else None)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if mode == "groups" else None
    in_backward = 0
    dp_rank, dp_size = (0, 1) if kind == "ref" else (rank, ws)
    micro = MICRO if mode in ("nosync", "lastbwd") else 1
    n = GB // dp_size // micro
    for step in range(STEPS):
        x, y = batch(step, GB, model.inp.in_features, dtype=F64)
        x, y = x[dp_rank * n * micro:(dp_rank + 1) * n * micro], y[dp_rank * n * micro:(dp_rank + 1) * n * micro]
        for k in range(micro):
            last = k == micro - 1
            if kind != "ref" and mode == "nosync":
                model.set_requires_gradient_sync(last)
            if kind != "ref" and mode == "lastbwd":
                model.set_is_last_backward(last)
            (loss_fn(model(x[k * n:(k + 1) * n]), y[k * n:(k + 1) * n]) / micro).backward()
        if kind == "sib":
            in_backward += len(opt._overlap.pending)
        if mode == "clip_touch":  # gradients changed between backward and step: exact under max_grad_norm
            model.blocks[0].fc1.weight.grad.mul_(0.5)
            mfsdp2.clip_grad_norm_(list(model.parameters()), 0.02)  # a user's own clip (beside max_grad_norm)
            if kind == "off":
                mfsdp2.clip_grad_norm_(list(model.parameters()), 0.05)
        elif clip and kind != "sib":
            (mfsdp2.clip_grad_norm_ if kind == "off" else torch.nn.utils.clip_grad_norm_)(
                list(model.parameters()), 0.05)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    params = {k: _full(p) for k, p in model.named_parameters()}
    names = {id(p): k for k, p in model.named_parameters()}
    states = {f"{names[id(p)]}.{k}": _full(v) for p, st in opt.state.items() for k, v in st.items()
              if isinstance(v, torch.Tensor) and v.dim()}
    return params, states, in_backward


def _same(a: dict, b: dict) -> list:
    return sorted(k for k in a if not torch.equal(a[k], b[k])) + sorted(set(a) ^ set(b))


def _parity(rank, ws, strategies, modes):
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for strategy in strategies:
        for mode in modes:
            if mode == "clip_touch" and strategy != "zero3":
                continue
            off = _train("off", mode, strategy, rank, ws, mesh)
            sib = _train("sib", mode, strategy, rank, ws, mesh)
            fsdp2 = (_train("fsdp2", mode, strategy, rank, ws, mesh)
                     if strategy in ("zero3", "zero2") and mode != "clip_touch" else None)
            ref = _train("ref", mode, strategy, rank, ws) if mode != "clip_touch" else None
            out[(strategy, mode)] = dict(params=_same(off[0], sib[0]), states=_same(off[1], sib[1]), in_backward=sib[2],
                                         sib=sib[0], fsdp2=fsdp2[0] if fsdp2 else None, ref=ref[0] if ref else None)
    return out


def _check_parity(results, ws, strategies, modes):
    failures = []
    for (strategy, mode), r in results[0].items():
        where = f"ws={ws} {strategy} {mode}"
        if r["params"] or r["states"]:
            failures.append(f"{where}: not bitwise equal to the run without overlap: "
                            f"params {r['params']} states {r['states']}")
        clip = mode in ("clip", "clip_touch")
        # 4 offloaded groups per step (3 blocks and the root), times 3 steps; none under clipping
        if (r["in_backward"] == 0) != clip or (not clip and r["in_backward"] != 4 * STEPS):
            failures.append(f"{where}: {r['in_backward']} group steps ran in backward")
        for other in ("ref", "fsdp2"):
            if r[other] is not None:
                for k, v in r[other].items():
                    try:
                        assert_close_rel(r["sib"][k], v, f"{where} vs {other}: {k}", REL_F64)
                    except AssertionError as e:
                        failures.append(str(e))
    assert not failures, "\n".join(failures)
    assert {k for k in results[0]} == {(s, m) for s in strategies for m in modes if m != "clip_touch" or s == "zero3"}


def test_parity_world_size_2():
    strategies = tuple(STRATEGIES)
    _check_parity(run_ranks(_parity, 2, strategies, MODES, timeout=600), 2, strategies, MODES)


def test_parity_world_size_1():
    strategies, modes = ("zero3", "zero2"), ("plain", "nosync", "clip")
    _check_parity(run_ranks(_parity, 1, strategies, modes, timeout=300), 1, strategies, modes)


# -- the step runs while backward does ----------------------------------------------------------
def _started_in_backward(rank, ws):
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for sib in (True, False):
        torch.manual_seed(0)
        model = _shard(build("net", dtype=F64), mesh, fully_shard, "zero3")
        opt = AdamW(model.parameters(), step_in_backward=sib, **HYPER)
        x, y = batch(0, GB, model.inp.in_features, dtype=F64)
        x = x[rank * GB // ws:(rank + 1) * GB // ws].requires_grad_(True)
        seen = {}

        def hook(grad, opt=opt, seen=seen, sib=sib):
            # The last gradient backward computes (the input's): block the backward until a step
            # job has finished, so its end is provably before backward's.
            deadline = time.monotonic() + (30.0 if sib else 0.5)
            while time.monotonic() < deadline and not (opt._overlap is not None and opt._overlap.jobs_done):
                time.sleep(0.01)
            seen["done"] = opt._overlap.jobs_done if opt._overlap is not None else 0
            seen["pending"] = list(opt._overlap.pending) if opt._overlap is not None else []
            return grad

        x.register_hook(hook)
        loss_fn(model(x), y[rank * GB // ws:(rank + 1) * GB // ws]).backward()
        opt.step()
        out[sib] = seen
    return out


def test_step_starts_before_backward_ends():
    for r in run_ranks(_started_in_backward, 2):
        assert r[True]["done"] >= 1 and r[True]["pending"], r
        assert r[False]["done"] == 0, r


# -- refusals -----------------------------------------------------------------------------------
def _scaler_step(opt):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(torch.ones(()))  # the scale exists (as after scaler.scale(loss).backward())
    scaler.step(opt)  # unscale_ divides the gradients the step in backward used


def _misuse(rank, ws):
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (ws,))
    x, y = batch(0, GB, 12, dtype=torch.float32)
    x, y = x[rank * GB // ws:(rank + 1) * GB // ws], y[rank * GB // ws:(rank + 1) * GB // ws]

    def fresh(strategy="zero3"):
        torch.manual_seed(0)
        model = _shard(build("net"), mesh, fully_shard, strategy)
        opt = AdamW(model.parameters(), step_in_backward=True, **HYPER)
        return model, opt

    def backward(model):
        loss_fn(model(x), y).backward()

    cases = {
        "second synced backward": (lambda m, o: backward(m), "another gradient reduction|forward / all-gather"),
        "mfsdp2.clip_grad_norm_": (lambda m, o: mfsdp2.clip_grad_norm_(m.parameters(), 1.0), "clip_grad_norm_"),
        "torch clip_grad_norm_": (lambda m, o: (torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1e-3), o.step()),
                                  "modified in place"),
        # every parameter: a rank holding no rows of a parameter sees no write to it
        "grad.mul_": (lambda m, o: ([p.grad.mul_(0.5) for p in m.parameters()], o.step()), "modified in place"),
        "grad assigned": (lambda m, o: (setattr(m.blocks[2].fc2.bias, "grad", m.blocks[2].fc2.bias.grad * 2), o.step()),
                          "replaced or cleared"),
        "lr changed": (lambda m, o: (o.param_groups[0].__setitem__("lr", 1e-3), o.step()), "hyper-parameters"),
        "GradScaler": (lambda m, o: _scaler_step(o), "modified in place"),
        "zero_grad without step": (lambda m, o: o.zero_grad(), r"zero_grad\(\) without"),
        "forward before step": (lambda m, o: m(x), "forward / all-gather"),
        "load_state_dict before step": (lambda m, o: o.load_state_dict(o.state_dict()), "load_state_dict"),
    }
    out = {}
    for strategy in ("zero3", "zero2"):
        for name, (act, expect) in cases.items():
            model, opt = fresh(strategy)
            backward(model)
            # The steps in backward have read their gradients (as they will have on a busy step):
            # a write before a step reads the gradient is what that step uses -- exact.
            opt._overlap.settle()
            try:
                act(model, opt)
                out[(strategy, name)] = "no error"
            except StepInBackwardError as e:
                import re

                out[(strategy, name)] = "ok" if re.search(expect, str(e)) else f"wrong message: {e}"
            except Exception as e:  # noqa: BLE001 - reported
                out[(strategy, name)] = f"{type(e).__name__}: {e}"
    # Accepted uses, for contrast: step() then the same actions
    model, opt = fresh()
    backward(model)
    opt.step()
    opt.zero_grad()
    backward(model)
    opt.step()
    out["accepted"] = "ok"
    # a closure that runs the backward
    model, opt = fresh()
    opt.step(lambda: loss_fn(model(x), y).backward())
    out["closure"] = "ok"
    return out


def test_misuse_is_refused():
    for r in run_ranks(_misuse, 2):
        bad = {k: v for k, v in r.items() if v != "ok"}
        assert not bad, bad


def test_options_checked():
    with pytest.raises(ValueError, match="max_grad_norm"):
        AdamW([torch.nn.Parameter(torch.zeros(2))], max_grad_norm=0.0)
    opt = AdamW([torch.nn.Parameter(torch.zeros(2))], step_in_backward=True)
    assert opt.step_in_backward and not AdamW([torch.nn.Parameter(torch.zeros(2))]).step_in_backward
