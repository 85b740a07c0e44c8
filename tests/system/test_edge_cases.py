"""Edge cases and small FSDP2-compatibility defects:

* a parameter with a zero-size trailing dimension, shape (5, 0), at world size 2: its row counts
  sum to 5, ``full_tensor()`` and the state dicts give (5, 0), and training matches an unsharded
  reference;
* ``set_is_last_backward`` does what FSDP2's does, compared with torch's ``fully_shard``;
* ``tensor_parallel._root`` lets unexpected errors surface;
* the TransformerEngine extra is pinned to TE >= 2.
"""

from __future__ import annotations

import ast
import os

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard
from mfsdp2.dtensors.tensor_parallel import _root

from .._dist import run_ranks
from ..models import REL_F64, assert_close_rel, batch, build, loss_fn


# -- zero-size trailing dimension -------------------------------------------------------------------
class _WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.empty = nn.Parameter(torch.empty(5, 0))  # 5 rows of 0 elements
        self.tail = nn.Parameter(torch.randn(3))
        self.double()  # float64: parity to rounding (REL_F64), whatever the machine's kernels

    def forward(self, x):
        # The empty parameter takes part (its sum is 0), so it gets a (5, 0) gradient.
        return self.lin(x) * self.tail + self.empty.sum()


def _train_steps(model, rank, ws, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = batch(step, 4, 4, dtype=torch.float64)
        n = x.shape[0] // ws
        loss = loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _zero_size(rank, ws):
    from mfsdp2.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    mesh = init_device_mesh("cpu", (ws,))
    model = fully_shard(_WithEmpty(), mesh=mesh)
    p = model.empty
    rows = p.placements[0].rows
    full = p.full_tensor()
    _train_steps(model, rank, ws)
    sd = model.state_dict()
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    model.load_state_dict(sd)  # round trip through our own sharded state dict
    return {
        "rows": rows,
        "full": tuple(full.shape),
        "sd": tuple(sd["empty"].shape),
        "full_sd": tuple(full_sd["empty"].shape),
        "params": {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()},
    }


def test_zero_size_trailing_dim_at_world_size_2():
    res = run_ranks(_zero_size, 2, timeout=180)
    ref = _WithEmpty()
    _train_steps(ref, 0, 1)  # unsharded, the whole batch: the independent reference
    for r in res:
        assert sum(r["rows"]) == 5, r["rows"]
        assert r["full"] == r["sd"] == r["full_sd"] == (5, 0)
        for name, v in ref.named_parameters():
            assert_close_rel(r["params"][name], v.detach(), name, REL_F64)


# -- set_is_last_backward against FSDP2 ---------------------------------------------------------------
def _micro_batches(rank, ws, which, sync_each):
    """Three micro-batches, ``set_is_last_backward(False)`` on the first two (and, with
    ``sync_each=False``, no gradient sync either: FSDP2's documented accumulation pattern)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=torch.float64)
    shard = (lambda m: torch_fully_shard(m, mesh=mesh)) if which == "fsdp2" else (lambda m: fully_shard(m, mesh=mesh))
    for b in model.blocks:
        shard(b)
    shard(model)
    in_flight = []
    for mb in range(3):
        last = mb == 2
        model.set_is_last_backward(last)
        if not sync_each:
            model.set_requires_gradient_sync(last)
        x, y = batch(mb, 4, 12, dtype=torch.float64)
        loss_fn(model(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]).backward()
        if which == "mfsdp2":
            ctx = model._mfsdp2_state.ctx
            in_flight.append(sum(g.reduce_pending for s in ctx.states for g in s.groups))
    grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v)).full_tensor().clone()
             for k, v in model.named_parameters()}
    return grads, in_flight


@pytest.mark.parametrize("sync_each", [True, False])
def test_set_is_last_backward_matches_fsdp2(sync_each):
    ours = run_ranks(_micro_batches, 2, "mfsdp2", sync_each, timeout=180)
    ref = run_ranks(_micro_batches, 2, "fsdp2", sync_each, timeout=180)
    for (grads, in_flight), (ref_grads, _) in zip(ours, ref):
        for k, v in ref_grads.items():
            assert_close_rel(grads[k], v, k, REL_F64)
        # Not the last backward: its final reductions were left in flight (only with gradient
        # sync; without it there is nothing to reduce). The last backward finished everything.
        assert in_flight[2] == 0, in_flight
        if sync_each:
            assert in_flight[0] > 0 and in_flight[1] > 0, in_flight


# -- tensor_parallel._root ------------------------------------------------------------------------------
class _BrokenMesh:
    def _get_root_mesh(self):
        raise RuntimeError("mesh bookkeeping is corrupt")


def test_root_mesh_lookup_lets_unexpected_errors_surface():
    with pytest.raises(RuntimeError, match="bookkeeping is corrupt"):
        _root(_BrokenMesh())
    assert _root(object()) is None  # a torch whose DeviceMesh cannot tell: the caller refuses with advice


# -- packaging ------------------------------------------------------------------------------------------
def test_te_extra_requires_transformer_engine_2():
    """te.py's main_grad protocol (lazy main_grad lookup) needs TransformerEngine >= 2."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "setup.py")
    tree = ast.parse(open(path).read())
    extras = next(
        kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
        for kw in node.keywords if kw.arg == "extras_require"
    )
    te = ast.literal_eval(extras)["te"]
    assert any(req.startswith("transformer-engine") and ">=2" in req for req in te), te
