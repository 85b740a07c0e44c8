"""Meta-device init: build under torch.device("meta"), fully_shard, materialize -- equal to the
model built normally from the same seed, bit for bit, at world sizes 1, 2 and 4; and it trains."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import mfsdp2
from mfsdp2 import fully_shard

from .._dist import run_ranks
from ..models import build, make_opt, sharded_train_step, shard_blocks


def _meta_vs_normal(rank, ws, kind, optimizer_first=False):
    mesh = init_device_mesh("cpu", (ws,))
    normal = shard_blocks(build(kind, seed=0), mesh)
    with torch.device("meta"):
        meta = build(kind, seed=0)  # build() seeds the RNG first; meta tensors draw nothing
    torch.manual_seed(0)  # the stream the normal build started from
    shard_blocks(meta, mesh)
    groups = [g for m in meta.modules() if hasattr(m, "_mfsdp2_state") for g in m._mfsdp2_state.groups]
    assert all(g.needs_init for g in groups)
    # An optimizer built on the meta parameters (as FSDP2 allows) must step what materialize fills.
    meta_opt = make_opt("adamw", meta.parameters()) if optimizer_first else None
    mfsdp2.materialize(meta)
    equal = {k: torch.equal(p.full_tensor(), dict(normal.named_parameters())[k].full_tensor())
             for k, p in meta.named_parameters()}
    # And both train identically.
    opts = [make_opt("adamw", normal.parameters()), meta_opt or make_opt("adamw", meta.parameters())]
    losses = [[sharded_train_step(m, o, s, rank, ws, 8) for s in range(2)] for m, o in zip((normal, meta), opts)]
    return equal, losses


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_meta_init_equals_normal_init_bit_for_bit(ws):
    for equal, (l_normal, l_meta) in run_ranks(_meta_vs_normal, ws, "frozen" if ws == 2 else "net"):
        assert equal and all(equal.values()), equal
        assert l_normal == l_meta


def test_optimizer_built_before_materialize_trains_the_materialized_shards():
    (equal, (l_normal, l_meta)), _ = run_ranks(_meta_vs_normal, 2, "net", True)
    assert equal and all(equal.values()), equal
    assert l_normal == l_meta


def _meta_allocations(rank, ws):
    """Bytes the CPU allocator hands out during fully_shard of a meta model, as torch's profiler
    records them (every allocation, including ones freed before the end), for units of every
    buffer kind: ZeRO-3 with an FP8 gather (main shard, uint8 shard, scales), ZeRO-2 in bf16
    (persistent model weights + fp32 main shard), no_shard, and the root."""
    from torch.profiler import ProfilerActivity, profile

    mesh = init_device_mesh("cpu", (ws,))
    with torch.device("meta"):
        model = build("net")
    bf16 = mfsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fp8 = mfsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather_dtype=torch.float8_e4m3fn)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fully_shard(model.blocks[0], mesh=mesh, mp_policy=fp8)
        fully_shard(model.blocks[1], mesh=mesh, mp_policy=bf16, sharding_strategy="optim_grads")
        fully_shard(model.blocks[2], mesh=mesh, mp_policy=bf16, sharding_strategy="no_shard")
        fully_shard(model, mesh=mesh, mp_policy=bf16)
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    params = {k: (type(p).__name__, p.device.type) for k, p in model.named_parameters()}
    mfsdp2.materialize(model)
    after = {k: p.device.type for k, p in model.named_parameters()}
    stats = model.memory_stats()
    out = model(torch.zeros(2, 12))
    return allocated, params, after, stats, tuple(out.shape)


def test_fully_shard_of_a_meta_model_allocates_nothing_until_materialize():
    """Before: every group allocated its fp32 main-weight shard (and the unsharded buffer, FP8's
    bytes) at fully_shard even for a meta model, so 405B at 8 ranks could not be sharded here."""
    for allocated, params, after, stats, shape in run_ranks(_meta_allocations, 2):
        assert allocated == 0, allocated
        assert set(params.values()) == {("DTensor", "meta")}, params  # as torch FSDP2's
        assert set(after.values()) == {"cpu"}, after
        assert stats["main_weight_bytes"] > 0 and stats["fp8_bytes"] == 0, stats  # FP8 bytes: per gather
        assert shape == (2, 5)


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
