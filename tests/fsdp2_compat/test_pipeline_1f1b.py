"""A pipeline stage's 1F1B schedule drives FSDP2 by hand: ``unshard()`` once, forwards and
backwards of micro-batches interleaved (f0 f1 b0 f2 b1 f3 b2 b3), gradient sync and reshard only
on the last backward, ``reshard()`` at the end. mfsdp2 under the same calls gives FSDP2's
gradients and, over two optimizer steps, its weights (float64, same process, same data:
identical up to reduction-order rounding, REL_F64)."""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh

from . import sharded_pair
from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, loss_fn, make_opt

WS, MICRO, PER = 2, 4, 2
ORDER = [("f", 0), ("f", 1), ("b", 0), ("f", 2), ("b", 1), ("f", 3), ("b", 2), ("b", 3)]


def _stage_step(model, opt, step, rank):
    x, y = batch(step, WS * MICRO * PER, model.inp.in_features, dtype=F64)
    lo = rank * MICRO * PER
    mbs = [(x[lo + i * PER : lo + (i + 1) * PER], y[lo + i * PER : lo + (i + 1) * PER]) for i in range(MICRO)]
    model.unshard()
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    losses = {}
    for kind, i in ORDER:
        if kind == "f":
            losses[i] = loss_fn(model(mbs[i][0]), mbs[i][1]) / MICRO
        else:
            if i == MICRO - 1:
                model.set_requires_gradient_sync(True)
                model.set_reshard_after_backward(True)
            losses[i].backward()
    model.reshard()
    grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    return grads


def _run(rank, ws):
    out = {}
    for name, model in sharded_pair(init_device_mesh("cpu", (ws,))).items():
        opt = make_opt("adamw", model.parameters())
        grads = [_stage_step(model, opt, s, rank) for s in range(2)]
        out[name] = (grads, {k: p.full_tensor() for k, p in model.named_parameters()})
    return out


def test_1f1b_schedule_with_explicit_unshard_matches_fsdp2():
    for out in run_ranks(_run, WS):
        (g1, p1), (g2, p2) = out["fsdp2"], out["mfsdp2"]
        for step in range(2):
            for k, g in g1[step].items():
                assert_close_rel(g2[step][k], g, f"step {step} grad {k}", REL_F64)
        for k, p in p1.items():
            assert_close_rel(p2[k], p, f"param {k}", REL_F64)
