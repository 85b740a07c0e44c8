"""HSDP on a (replicate=2, shard=2) mesh of 4 CPU ranks: parity with the unsharded reference for
ZeRO-3 and ZeRO-2, and gradient accumulation that all-reduces across replicas once (float64, to
REL_F64: see tests/models.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

from mfsdp2 import RowShard, fully_shard
from mfsdp2.base.profiling import event_log

from .._dist import run_ranks
from ..models import (
    F64, REL_F64, assert_close_rel, assert_losses_close, batch, build, loss_fn, make_opt, reference_run,
    sharded_train_step,
)

STEPS = 6
GLOBAL_BATCH = 8


def _wrap(model, mesh, strategy):
    for b in model.blocks:
        fully_shard(b, mesh=mesh, sharding_strategy=strategy)
    fully_shard(model, mesh=mesh, sharding_strategy=strategy)
    return model


def _hsdp(rank, ws, path):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    saved = None
    for strategy in ("optim_grads_params", "optim_grads"):
        model = _wrap(build("net", dtype=F64), mesh, strategy)
        p = model.blocks[0].fc1.weight
        assert isinstance(p.placements[0], Replicate) and isinstance(p.placements[1], RowShard), p.placements
        opt = make_opt("adamw", model.parameters())
        losses = [sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH) for step in range(STEPS)]
        out[strategy] = (losses, {k: q.full_tensor() for k, q in model.named_parameters()})
        if strategy == "optim_grads_params":
            # DCP round trip of the (Replicate, RowShard) state dict, into plain full tensors.
            sd = model.state_dict()
            dcp.save(sd, checkpoint_id=path)
            saved = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
            dcp.load(saved, checkpoint_id=path)

    # Accumulation over two micro-batches: the first skips the all-reduce across replicas.
    model = _wrap(build("net", dtype=F64), mesh, "optim_grads_params")
    replicate_group = mesh.get_group(0)
    calls = []
    orig = dist.all_reduce

    def spy(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is replicate_group and t.dtype == F64:  # not the small fp32 agreement collectives
            calls.append(t.numel())
        return orig(t, op=op, group=group, async_op=async_op)

    dist.all_reduce = spy
    n = GLOBAL_BATCH // ws
    event_log.enabled = True
    try:
        for micro in range(2):
            model.set_requires_all_reduce(micro == 1)
            x, y = batch(micro, GLOBAL_BATCH, 12, dtype=F64)
            event_log.clear()
            loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
            if micro == 0:
                assert not calls, "the all-reduce across replicas ran although it was switched off"
                assert all(q.grad is None for q in model.parameters()), "grads exposed before the all-reduce"
        # The all-reduce across replicas overlaps later units' backward: issued, then another
        # unit's backward begins, then it is waited.
        ev = [(k, u) for k, u in event_log.events if k in ("ar_issue", "ar_done", "backward_begin")]
        first = next(i for i, (k, _) in enumerate(ev) if k == "ar_issue")
        done = next(i for i, (k, u) in enumerate(ev) if k == "ar_done" and u == ev[first][1])
        assert any(k == "backward_begin" for k, _ in ev[first:done]), ev
    finally:
        dist.all_reduce = orig
        event_log.enabled = False
    n_groups = sum(len(m._mfsdp2_state.groups) for m in model.modules() if hasattr(m, "_mfsdp2_state"))
    grads = {}
    for k, q in model.named_parameters():  # this rank's rows (an empty grad where it holds none)
        start = q.placements[1].starts[mesh.get_local_rank(1)]
        assert q.grad is not None and q.grad.to_local().shape == q.to_local().shape, k
        grads[k] = (start, q.grad.to_local().clone())
    return out, grads, len(calls), n_groups, saved


def _reference_accumulated_grads():
    torch.set_num_threads(1)
    model = build("net", dtype=F64)
    for micro in range(2):
        x, y = batch(micro, GLOBAL_BATCH, 12, dtype=F64)
        loss_fn(model(x), y).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.slow
def test_hsdp_2x2_matches_reference_and_accumulates_with_one_all_reduce(tmp_path):
    ref_losses, ref_params = reference_run("net", "adamw", STEPS, GLOBAL_BATCH, dtype=F64)
    ref_grads = _reference_accumulated_grads()
    for rank, (per_strategy, grads, n_all_reduce, n_groups, saved) in enumerate(
            run_ranks(_hsdp, 4, str(tmp_path / "ckpt"))):
        for name, ref in ref_params.items():
            assert_close_rel(saved[name], ref, f"checkpoint {name} rank {rank}", REL_F64)
        for strategy, (losses, full) in per_strategy.items():
            assert_losses_close(losses, ref_losses, f"{strategy} rank {rank}", REL_F64)
            for name, ref in ref_params.items():
                assert_close_rel(full[name], ref, f"{strategy} rank {rank} {name}", REL_F64)
        assert n_all_reduce == n_groups, (n_all_reduce, n_groups)  # once per group, at the last micro-batch
        for name, ref in ref_grads.items():
            start, g = grads[name]
            if g.numel():
                assert_close_rel(g, ref[start : start + g.shape[0]], f"accumulated grad {name} rank {rank}", REL_F64)


def _chained(rank, ws):
    """HSDP with both collectives on a stream-ordered backend (NCCL's path, forced here on gloo's
    CPU communicators: without streams the host orders them instead): each unit's all-reduce
    across replicas is issued right behind its reduce-scatter, before any other unit's backward
    begins, as FSDP2 chains them; the gradients are the unchained path's, bit for bit."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for chained in (False, True):
        model = _wrap(build("net", dtype=F64), mesh, "optim_grads_params")
        comms = {id(c): c for m in model.modules() if hasattr(m, "_mfsdp2_state")
                 for c in m._mfsdp2_state.communicators()}
        saved = {k: c.stream_ordered for k, c in comms.items()}
        for c in comms.values():
            c.stream_ordered = chained
        n = GLOBAL_BATCH // ws
        x, y = batch(0, GLOBAL_BATCH, 12, dtype=F64)
        event_log.enabled = True
        event_log.clear()
        try:
            loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
            ev = [(k, u) for k, u in event_log.events if k in ("rs_issue", "ar_issue", "backward_begin")]
        finally:
            event_log.enabled = False
            for k, c in comms.items():
                c.stream_ordered = saved[k]
        out[chained] = (ev, {k: q.grad.to_local().clone() for k, q in model.named_parameters()})
    return out


@pytest.mark.slow
def test_hsdp_all_reduce_chained_behind_reduce_scatter_on_stream_ordered_backends():
    for res in run_ranks(_chained, 4):
        ev, grads = res[True]
        issued = [i for i, (k, _) in enumerate(ev) if k == "rs_issue"]
        assert issued
        for i in issued:  # the unit's all-reduce follows its reduce-scatter at once
            assert ev[i + 1] == ("ar_issue", ev[i][1]), ev
        plain_ev, plain = res[False]
        # unchained (gloo's own path): some unit's all-reduce waits for a later drain
        assert any(plain_ev[i + 1] != ("ar_issue", u)
                   for i, (k, u) in enumerate(plain_ev[:-1]) if k == "rs_issue"), plain_ev
        for k, g in plain.items():
            assert torch.equal(grads[k], g), k
