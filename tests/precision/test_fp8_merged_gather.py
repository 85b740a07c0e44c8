"""FP8 all-gather of a unit in one collective: its float8 group carries the unit's bf16 group
(norms, biases) in the same all-gather (``mfsdp2.precision.fp8.gather_riders``).

Checked against the separate per-group gathers (``MFSDP2_FP8_MERGED_GATHER=0``'s path, run in
the same processes on the same model and data): every gathered weight, every loss and every
trained weight bit for bit; and the collective count: one all-gather per unit per gather instead
of two for units holding both kinds of parameters. Units with float8 parameters only, with none,
the root (gathered once), explicit ``unshard()`` before any root forward (scales agreed inside
the group), prefetch, the trace-pool allocator and HSDP all go through the merged path."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from mfsdp2 import MixedPrecisionPolicy, comm_stats, fully_shard
from mfsdp2.precision import fp8 as fp8_mod

from .._dist import run_ranks
from ..models import Block

STEPS = 4
E4M3 = torch.float8_e4m3fn


class _Mixed(nn.Module):
    """Units of every kind: blocks (float8 weights + bf16 norm and biases), ``proj`` (float8
    only), ``out_norm`` (bf16 only), and the root (``inp``: weight + bias)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.blocks = nn.ModuleList(Block(16, 40) for _ in range(3))
        self.proj = nn.Linear(16, 16, bias=False)
        self.out_norm = nn.LayerNorm(16)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out_norm(self.proj(h))


def _units(model):
    return [*model.blocks, model.proj, model.out_norm, model]


def _train(rank, ws, merged: bool, allocator: str, hsdp: bool, raf=True):
    fp8_mod.MERGE_GATHERS = merged
    torch.manual_seed(0)
    model = _Mixed()
    mesh = (init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("rep", "shard")) if hsdp
            else init_device_mesh("cpu", (ws,)))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, all_gather_dtype=E4M3)
    for m in _units(model)[:-1]:
        fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, mp_policy=mp, allocator=allocator)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def gathered():
        out = {}
        for u, m in enumerate(_units(model)):
            m.unshard()
            # the unit's own gathered parameters (nested units' are sharded DTensors)
            out.update({f"{u}.{k}": p.detach().clone() for k, p in m.named_parameters() if not isinstance(p, DTensor)})
            m.reshard()
        return out

    first = gathered()  # explicit unshard before any root forward: scales agreed per group
    losses, calls, views = [], [], []
    g = torch.Generator().manual_seed(1 + rank)
    for step in range(STEPS):
        x, y = torch.randn(6, 12, generator=g), torch.randn(6, 16, generator=g)
        comm_stats.reset()
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        calls.append(comm_stats.all_gather_calls)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    with torch.no_grad():
        model(torch.zeros(1, 12))  # the root forward agrees on the new scales
        views.append(gathered())
    stats = model.allocator.stats
    full = {k: p.full_tensor() for k, p in model.named_parameters()}
    return first, views, losses, calls, full, (stats.leaked_buffers, stats.live_by_role.get("fp8", 0))


def _compare(ws: int, allocator: str, hsdp: bool, raf=True, calls=(3 * 2 + 2 + 2 + 1, 3 * 2 * 2 + 2 + 2 + 2)):
    merged = run_ranks(_train, ws, True, allocator, hsdp, raf)
    separate = run_ranks(_train, ws, False, allocator, hsdp, raf)
    for rank, (a, b) in enumerate(zip(merged, separate)):
        first_a, views_a, losses_a, calls_a, full_a, mem_a = a
        first_b, views_b, losses_b, calls_b, full_b, _ = b
        for k in first_b:
            assert first_a[k].dtype == torch.bfloat16 and torch.equal(first_a[k], first_b[k]), (rank, k)
        for va, vb in zip(views_a, views_b):
            for k in vb:
                assert torch.equal(va[k], vb[k]), (rank, k)
        assert all(torch.equal(x, y) for x, y in zip(losses_a, losses_b)), (rank, losses_a, losses_b)
        for k in full_b:
            assert torch.equal(full_a[k], full_b[k]), (rank, k)
        assert mem_a == (0, 0), mem_a  # no block leaked, the float8 bytes freed after each gather
        # Per step (default): 3 blocks x (forward + backward) + proj x 2 + out_norm x 2 + the
        # root once. Separately the blocks and the root gather two groups each time.
        assert calls_a[1:] == [calls[0]] * (STEPS - 1), calls_a
        assert calls_b[1:] == [calls[1]] * (STEPS - 1), calls_b


@pytest.mark.parametrize("allocator", ["caching", "trace_pool"])
def test_merged_fp8_gather_is_bitwise_the_separate_gathers(allocator):
    _compare(2, allocator, hsdp=False)


@pytest.mark.slow
def test_merged_fp8_gather_hsdp():
    _compare(4, "caching", hsdp=True)


@pytest.mark.slow
def test_merged_fp8_gather_with_partial_reshard():
    """reshard_after_forward=2 of 4 ranks: the forward gather is merged; the backward's in-block
    gathers of the kept bf16 shards stay one per group (blocks: 1 + 2; separately 2 + 2)."""
    _compare(4, "caching", hsdp=False, raf=2, calls=(3 * 3 + 2 + 2 + 1, 3 * 4 + 2 + 2 + 2))
