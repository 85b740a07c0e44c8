"""A parameter group's state transitions, driven directly (no forward or backward hooks): the
gathered buffer's life, a reduction's stages and the main gradient's life, each checked against
plain arithmetic on the full tensors.

* gather: resharded -> ``unshard`` -> (waited) unsharded, the unsharded parameters the full
  weights; ``reshard`` -> resharded, storage freed;
* reduction (ZeRO-3, two ranks): unsharded gradients -> ``reduce_grads`` -> pending at stage
  ``SHARD_GROUP`` -> ``advance_reduce`` -> landed: ``main_grad`` holds this rank's rows of the
  ranks' mean, exposed as the parameters' ``.grad``; a second reduction adds to it;
  ``zero_grad`` -> ``release_main_grad`` -> no main gradient;
* HSDP (two replicas of one rank): ``advance_reduce`` moves the reduction to stage ``REPLICAS``
  first, lands at the second call; with ``set_requires_all_reduce(False)`` the shard group's
  result goes into the partial sum and nothing lands until an all-reducing reduction adds it;
* sync off under a bfloat16 compute policy: ``accumulate_unsynced`` folds the gradients into
  the float32 accumulator and clears them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import MixedPrecisionPolicy, fully_shard
from mfsdp2.groups.grad_reduction import ReduceStage
from mfsdp2.memory.allocator import CachingAllocator

from .._dist import run_ranks


def _unit(mesh, **kw):
    torch.manual_seed(0)
    lin = nn.Linear(6, 8)
    full = {k: v.detach().clone() for k, v in lin.named_parameters()}
    fully_shard(lin, mesh=mesh, **kw)
    return lin, lin._mfsdp2_state.groups[0], full


def _grads(rank: int, g) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(up.shape, generator=gen, dtype=up.dtype) for up in g.unsharded_params]


def _zero3(rank: int, ws: int) -> dict:
    lin, g, full = _unit(init_device_mesh("cpu", (ws,)))
    alloc = CachingAllocator()
    out = {}
    assert not g.is_unsharded and not g.reduce_pending and g.main_grad is None
    h = g.unshard(alloc, ("weight", "u", 0), "gather")
    h.wait()
    g.register(unsharded=True)
    assert g.is_unsharded
    out["gathered"] = [up.detach().clone() for up in g.unsharded_params]
    g.reshard()
    assert not g.is_unsharded and g.weights._storage.nbytes() == 0
    # One reduction of known gradients, then a second that accumulates.
    mine = _grads(rank, g)
    everyone = [_grads(r, g) for r in range(ws)]
    for step in range(2):
        for up, t in zip(g.unsharded_params, mine):
            up.grad = t.clone()
        g.reduce_grads(alloc, ("u", 0), "reduce")
        assert g.reduce_pending and g._pending_reduce.stage is ReduceStage.SHARD_GROUP
        assert all(up.grad is None for up in g.unsharded_params)  # packed and dropped
        assert g.advance_reduce(alloc) and not g.reduce_pending
        out[f"grads{step}"] = [(dp.grad.to_local().clone(), g.layout.piece(i, g.rank).row_start)
                               for i, dp in enumerate(g.dist_params)]
    out["expected"] = [torch.stack([e[i] for e in everyone]).mean(0) for i in range(len(mine))]
    out["full"] = full
    for dp in g.dist_params:
        dp.grad = None
    g.release_main_grad()
    assert g.main_grad is None and alloc.stats.live_bytes == 0, alloc.stats
    return out


def _hsdp(rank: int, ws: int) -> dict:
    mesh = init_device_mesh("cpu", (ws, 1), mesh_dim_names=("replicate", "shard"))
    lin, g, _ = _unit(mesh)
    alloc = CachingAllocator()
    mine = _grads(rank, g)
    everyone = [_grads(r, g) for r in range(ws)]
    out = {"expected": [torch.stack([e[i] for e in everyone]).mean(0) for i in range(len(mine))]}
    # Without the all-reduce: the shard group's result waits in the partial sum.
    g.requires_all_reduce = False
    for up, t in zip(g.unsharded_params, mine):
        up.grad = t.clone()
    g.reduce_grads(alloc, ("u", 0), "reduce")
    assert g.advance_reduce(alloc) and g.partial is not None and g.main_grad is None
    # With it: stage REPLICAS first, then landed; the partial sum was added.
    g.requires_all_reduce = True
    for up, t in zip(g.unsharded_params, mine):
        up.grad = t.clone()
    g.reduce_grads(alloc, ("u", 0), "reduce")
    assert g._pending_reduce.stage is ReduceStage.SHARD_GROUP
    assert not g.advance_reduce(alloc) and g._pending_reduce.stage is ReduceStage.REPLICAS
    assert g.advance_reduce(alloc) and g.partial is None and not g.reduce_pending
    out["grads"] = [dp.grad.to_local().clone() for dp in g.dist_params]
    return out


def _unsynced(rank: int, ws: int) -> dict:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    lin, g, _ = _unit(init_device_mesh("cpu", (ws,)), mp_policy=mp)
    mine = _grads(rank, g)
    for _ in range(2):
        for up, t in zip(g.unsharded_params, mine):
            up.grad = t.clone()
        g.accumulate_unsynced()
        assert all(up.grad is None for up in g.unsharded_params)
    assert g.unsynced_grad.dtype == torch.float32 and all(g.unsynced_flags)
    slots = [g.layout.slots[i] for i in range(len(mine))]
    return {"acc": [g.unsynced_grad[s.offset: s.offset + s.numel].clone() for s in slots],
            "expected": [2 * t.float().reshape(-1) for t in mine]}


def test_gather_and_reduction_states():
    for rank, out in enumerate(run_ranks(_zero3, 2)):
        for got, (name, want) in zip(out["gathered"], out["full"].items()):
            assert torch.equal(got, want), name
        for (g0, start), (g1, _), exp in zip(out["grads0"], out["grads1"], out["expected"]):
            rows = exp[start: start + g0.shape[0]] if exp.dim() else exp
            torch.testing.assert_close(g0, rows, rtol=0, atol=1e-6)  # a two-term mean: exact up to the halving
            torch.testing.assert_close(g1, 2 * rows, rtol=0, atol=2e-6)
    assert not dist.is_initialized()


def test_hsdp_stages_and_partial_sum():
    for out in run_ranks(_hsdp, 2):
        for got, exp in zip(out["grads"], out["expected"]):
            torch.testing.assert_close(got, 2 * exp, rtol=0, atol=2e-6)  # the partial sum and this one


def test_unsynced_accumulation():
    for out in run_ranks(_unsynced, 2):
        for got, exp in zip(out["acc"], out["expected"]):
            assert torch.equal(got, exp)
