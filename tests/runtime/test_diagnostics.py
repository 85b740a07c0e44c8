"""Diagnostics: describe(), the buffer check, global per-parameter norms against an unsharded
reference, and the NaN/Inf check that makes every rank raise together."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import mfsdp2.runtime.diagnostics as diag
from mfsdp2 import fully_shard

from .._dist import run_ranks
from ..models import F64, REL_F64, batch, build, loss_fn

GB = 8


def _sharded(ws):
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=F64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _backward(model, rank, ws):
    x, y = batch(0, GB, 12, dtype=F64)
    n = GB // ws
    loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()


def _norms_and_describe(rank, ws):
    model = _sharded(ws)
    model(torch.zeros(1, 12, dtype=F64))  # names units by path (lazy init)
    text = diag.describe(model)
    diag.check_buffers(model)
    _backward(model, rank, ws)
    diag.check_finite_grads(model)  # finite: no error
    return text, diag.grad_norms(model), diag.weight_norms(model)


def test_describe_and_norms_match_the_unsharded_reference():
    torch.set_num_threads(1)
    ref = build("net", dtype=F64)
    x, y = batch(0, GB, 12, dtype=F64)
    loss_fn(ref(x), y).backward()
    for text, gn, wn in run_ranks(_norms_and_describe, 2):
        for unit in ("root", "blocks.0", "blocks.1", "blocks.2", "total"):
            assert unit in text, text
        assert "float64" in text
        assert set(gn) == {n for n, _ in ref.named_parameters()}
        for n, p in ref.named_parameters():  # float64: REL_F64, see tests/models.py
            assert math.isclose(gn[n], p.grad.norm().item(), rel_tol=REL_F64), (n, gn[n], p.grad.norm().item())
            assert math.isclose(wn[n], p.detach().norm().item(), rel_tol=REL_F64), (n, wn[n], p.detach().norm().item())


def _nan_on_one_rank(rank, ws):
    model = _sharded(ws)
    _backward(model, rank, ws)
    if rank == 1:  # corrupt only this rank's rows: rank 0 holds finite values
        g = model.blocks[1].fc2.weight.grad
        g._local_tensor.view(-1)[0] = float("nan")
    try:
        diag.check_finite_grads(model)
    except FloatingPointError as e:
        return str(e)
    return None


def test_non_finite_gradient_on_one_rank_raises_on_every_rank_naming_the_parameter():
    msgs = run_ranks(_nan_on_one_rank, 2)
    for m in msgs:
        assert m is not None and "blocks.1.fc2.weight" in m and "NaN/Inf" in m, msgs


def _replaced(rank, ws, what):
    model = _sharded(ws)
    if what == "param":
        model.blocks[0].fc1.weight = torch.nn.Parameter(torch.zeros(40, 16, dtype=F64))
    else:  # a broken plan: the second slot starts inside the first
        from dataclasses import replace

        g = model.blocks[0]._mfsdp2_state.groups[0]
        slots = list(g.layout.slots)
        slots[1] = replace(slots[1], offset=slots[0].offset + 1)
        object.__setattr__(g.layout, "slots", tuple(slots))
    try:
        diag.check_buffers(model)
    except AssertionError as e:
        return str(e)
    return None


@pytest.mark.parametrize("what,needle", [("param", "was replaced after fully_shard"), ("layout", "overlap")])
def test_check_buffers_names_the_broken_parameter(what, needle):
    (m,) = run_ranks(_replaced, 1, what)
    assert m is not None and needle in m, m
    assert "fc1.weight" in m or "norm" in m, m
