"""Meta-device init: build under torch.device("meta"), fully_shard, materialize -- equal to the
model built normally from the same seed, bit for bit, at world sizes 1, 2 and 4; and it trains."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import mfsdp2
from mfsdp2 import fully_shard

from ._dist import run_ranks
from .models import build, make_opt, sharded_train_step, shard_blocks


def _meta_vs_normal(rank, ws, kind):
    mesh = init_device_mesh("cpu", (ws,))
    normal = shard_blocks(build(kind, seed=0), mesh)
    with torch.device("meta"):
        meta = build(kind, seed=0)  # build() seeds the RNG first; meta tensors draw nothing
    torch.manual_seed(0)  # the stream the normal build started from
    shard_blocks(meta, mesh)
    groups = [g for m in meta.modules() if hasattr(m, "_mfsdp2_state") for g in m._mfsdp2_state.groups]
    assert all(g.needs_init for g in groups)
    mfsdp2.materialize(meta)
    equal = {k: torch.equal(p.full_tensor(), dict(normal.named_parameters())[k].full_tensor())
             for k, p in meta.named_parameters()}
    # And both train identically.
    opts = [make_opt("adamw", m.parameters()) for m in (normal, meta)]
    losses = [[sharded_train_step(m, o, s, rank, ws, 8) for s in range(2)] for m, o in zip((normal, meta), opts)]
    return equal, losses


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_meta_init_equals_normal_init_bit_for_bit(ws):
    for equal, (l_normal, l_meta) in run_ranks(_meta_vs_normal, ws, "frozen" if ws == 2 else "net"):
        assert equal and all(equal.values()), equal
        assert l_normal == l_meta


def _meta_errors(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    with torch.device("meta"):
        m = build("net")
    shard_blocks(m, mesh)
    out = {}
    try:
        m(torch.zeros(1, 12))
    except RuntimeError as e:
        out["forward"] = str(e)
    with torch.device("meta"):
        mixed = build("net")
    mixed.head = torch.nn.Linear(16, 5)  # a real module inside a meta model
    try:
        fully_shard(mixed, mesh=mesh)
    except ValueError as e:
        out["mixed"] = str(e)
    return out


def test_meta_model_used_before_materialize_or_mixed_is_refused():
    (out,) = run_ranks(_meta_errors, 1)
    assert "call mfsdp2.materialize(model)" in out.get("forward", ""), out
    assert "mixes parameters on the meta device" in out.get("mixed", ""), out
