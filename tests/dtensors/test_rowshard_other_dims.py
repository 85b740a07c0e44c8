"""Row splits along dims other than 0 in DTensor ops (mfsdp2.dtensors.row_propagation, mfsdp2.dtensors.dtensor_ops).

Our parameters' rows are slices along dim 0 -- or along ``d`` for a parameter
``shard_placement_fn`` shards there (``RowShard(d)``, mfsdp2.dtensors.shard_dim). Results and mixes must
keep the true rows whatever the dim:

* a transpose of a dim-0 parameter is split along its dim 1: labelled ``RowShard(1)`` with our
  rows (DTensor's fresh ``Shard(1)`` label claimed ``torch.chunk``'s: ``full_tensor()`` failed);
* our parameter combined with a ``torch.chunk`` DTensor split along *another* dim (``p + q`` with
  ``q`` ``Shard(1)``): DTensor's own change of shard dim (an all-to-all) splits the new dim by
  ``torch.chunk``, so the rows now go through ``Replicate`` into ours (before: a size error, or a
  silent broadcast where a piece held one row);
* a dim-1 parameter with a ``Shard(1)`` DTensor, a ``Replicate`` one, its own clone, and in-place
  updates and optimizer-style ``_foreach`` ops on it;
* ``redistribute`` between ``RowShard(1)``, ``Shard(1)``, ``Shard(0)`` and ``Replicate``.

Every result is compared with the op on full tensors (float64, exact), at world sizes 2 and 4."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks


def _rank(rank, ws):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import mfsdp2

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6, bias=False), nn.Linear(6, 10, bias=False),
                          nn.Linear(10, 8, bias=False)).double()
    ref = {k: v.detach().clone() for k, v in model.named_parameters()}
    mfsdp2.fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.shape[0] == 8 else None)
    p0, p2 = model[0].weight, model[2].weight  # dim 0 (6, 6); dim 1 (8, 10)
    a, c = ref["0.weight"], ref["2.weight"]
    q6 = torch.arange(36, dtype=torch.float64).reshape(6, 6) / 7
    q8 = torch.arange(80, dtype=torch.float64).reshape(8, 10) / 7
    out = {"placements": (repr(p0.placements), repr(p2.placements))}

    def check(name, got, want):
        out[name] = bool(torch.equal(got.full_tensor(), want))

    check("dim0_t", p0.t(), a.t())
    out["dim0_t_label"] = type(p0.t().placements[0]).__name__
    check("dim0_plus_shard1", p0 + distribute_tensor(q6, mesh, [Shard(1)]), a + q6)
    check("shard1_plus_dim0", distribute_tensor(q6, mesh, [Shard(1)]) + p0, a + q6)
    check("dim0_t_plus_shard1", p0.t() + distribute_tensor(q6, mesh, [Shard(1)]), a.t() + q6)
    check("dim1_plus_shard1", p2 + distribute_tensor(q8, mesh, [Shard(1)]), c + q8)
    check("dim1_plus_shard0", p2 * distribute_tensor(q8, mesh, [Shard(0)]), c * q8)
    check("dim1_plus_replicate", p2 - distribute_tensor(q8, mesh, [Replicate()]), c - q8)
    check("dim1_clone_lerp", torch.lerp(p2.detach().clone(), p2, 0.25), torch.lerp(c, c, 0.25))
    check("dim1_t", p2.t(), c.t())
    check("dim1_sum0", p2.sum(0), c.sum(0))
    check("dim1_sum1", p2.sum(1), c.sum(1))
    state = torch.zeros_like(p2)
    out["state_label"] = repr(state.placements)
    torch._foreach_add_([state], [p2], alpha=2.0)
    torch._foreach_mul_([state], 0.5)
    check("dim1_foreach_state", state, c)
    for name, target in (("to_shard1", [Shard(1)]), ("to_shard0", [Shard(0)]), ("to_replicate", [Replicate()])):
        r = p2.redistribute(mesh, target)
        check(name, r, c)
        back = r.redistribute(mesh, p2.placements)
        check(name + "_back", back, c)
        out[name + "_back_local"] = tuple(back.to_local().shape) == tuple(p2.to_local().shape)
    with torch.no_grad():
        p2.add_(distribute_tensor(q8, mesh, [Shard(1)]))
    check("dim1_add_", p2, c + q8)
    return out


@functools.lru_cache(maxsize=None)
def _results(ws: int):
    return run_ranks(_rank, ws)


@pytest.mark.parametrize("ws", [2, 4])
def test_row_splits_along_other_dims(ws):
    for r in _results(ws):
        assert r["placements"][1].startswith("(RowShard(dim=1"), r["placements"]
        assert r["dim0_t_label"] == "RowShard", r
        assert r["state_label"].startswith("(RowShard(dim=1"), r["state_label"]
        bad = {k: v for k, v in r.items() if v is False}
        assert not bad, (bad, r)
