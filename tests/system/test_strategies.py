"""Sharding strategies (ZeRO-1/2/3, no_shard): parity with the unsharded reference, bytes owned
per rank against the ZeRO formulas, bf16 compute with fp32 main weights against a reference that
makes the same casts, and gradient divide factors against exact multiples of the reference.
Parity runs in float64 (to REL_F64, see tests/models.py); the bf16 test's tolerance comes from the
spread between two legitimate orderings of its own reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import MixedPrecisionPolicy, fully_shard
from mfsdp2.base import compat

from .._dist import run_ranks
from ..models import (
    F64, REL_F64, assert_close_rel, assert_losses_close, batch, build, local_grad_rows, loss_fn, make_opt,
    reference_run, rel_dist, same_cast_tolerances, sharded_train_step,
)

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
STEPS = 6
GLOBAL_BATCH = 8


def _wrap(model, mesh, strategy, **kw):
    for b in model.blocks:
        fully_shard(b, mesh=mesh, sharding_strategy=strategy, **kw)
    fully_shard(model, mesh=mesh, sharding_strategy=strategy, **kw)
    return model


def _groups(model):
    return [g for m in model.modules() if hasattr(m, "_mfsdp2_state") for g in m._mfsdp2_state.groups]


def _formula(strategy: str, n_params: int, ws: int, b: int = 8) -> dict[str, float]:
    """The ZeRO paper's per-rank bytes (single-precision training, here float64, ``b`` bytes per
    element: no separate master copy), Adam's two states. Psi = ``n_params``; N = ``ws``."""
    psi = n_params * b
    shard = psi / ws
    return {
        "no_shard": {"params": psi, "grads": psi, "optim": 2 * psi},
        "optim": {"params": psi, "grads": psi, "optim": 2 * shard},
        "optim_grads": {"params": psi, "grads": shard, "optim": 2 * shard},
        "optim_grads_params": {"params": shard, "grads": shard, "optim": 2 * shard},
    }[strategy]


def _optim_bytes(opt) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return total


def _strategies_run(rank, ws, kind):
    mesh = init_device_mesh("cpu", (ws,))
    results = {}
    for strategy in STRATEGIES:
        model = _wrap(build(kind, dtype=F64), mesh, strategy)
        opt = make_opt("adamw", model.parameters())
        losses = []
        for step in range(STEPS):
            if step == STEPS - 1:
                # Bytes owned after backward (grads alive), before the optimizer step.
                n = GLOBAL_BATCH // ws
                x, y = batch(step, GLOBAL_BATCH, model.inp.in_features, dtype=F64)
                loss = loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
                loss.backward()
                opt.step()  # creates / updates the states; grads still alive
                stats = model.memory_stats()
                groups = _groups(model)
                layout = {
                    "P": sum(g.layout.total_numel for g in groups),
                    "S": sum(g.layout.shard_numel for g in groups),
                    "numel": sum(p.numel() for p in model.parameters()),
                }
                opt.zero_grad()
                t = loss.detach().clone()
                dist.all_reduce(t)
                losses.append(t.item() / ws)
                optim_bytes = _optim_bytes(opt)
            else:
                losses.append(sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH))
        full = {k: p.full_tensor() for k, p in model.named_parameters()}
        results[strategy] = (losses, full, stats, layout, optim_bytes)
        del model, opt
    return results


@pytest.mark.parametrize(
    "ws,kind",
    [(2, "net"), pytest.param(4, "net", marks=pytest.mark.slow), pytest.param(4, "tiny", marks=pytest.mark.slow)],
)
def test_strategies_match_reference_and_zero_memory_formulas(ws, kind):
    ref_losses, ref_params = reference_run(kind, "adamw", STEPS, GLOBAL_BATCH, dtype=F64)
    assert ref_losses[-1] < ref_losses[0]
    results = run_ranks(_strategies_run, ws, kind)
    for rank, per_strategy in enumerate(results):
        for strategy, (losses, full, stats, layout, optim_bytes) in per_strategy.items():
            where = f"{strategy} rank {rank}"
            assert_losses_close(losses, ref_losses, where, REL_F64)
            for name, ref in ref_params.items():
                assert_close_rel(full[name], ref, f"{where} {name}", REL_F64)
            # Bytes owned per rank: the ZeRO formula on the padded element counts, exactly ...
            P, S = layout["P"], layout["S"]
            params = stats["model_weight_bytes"] + stats["main_weight_bytes"]
            grads = stats["main_grad_bytes"]
            n_shard = 1 if strategy == "no_shard" else ws
            assert P == n_shard * S, (where, P, S)
            exact = _formula(strategy, P, n_shard)
            assert params == exact["params"], (where, params, exact)
            assert grads == exact["grads"], (where, grads, exact)
            # ... and on the unpadded parameter count, within the layout's padding.
            paper = _formula(strategy, layout["numel"], ws)
            pad = 8 * (P - layout["numel"])
            assert abs(params - paper["params"]) <= pad, (where, params, paper)
            assert abs(grads - paper["grads"]) <= pad, (where, grads, paper)
            if kind == "net":  # (tiny's empty pieces hold no Adam states: fewer bytes)
                assert abs(optim_bytes - paper["optim"]) <= 2 * pad, (where, optim_bytes, paper)
            # The transient allocator holds nothing but the main grads between steps.
            assert stats["transient_live_bytes"] <= grads, (where, stats)


def _gathers_once_per_step(rank, ws, cap_mb):
    """optim_grads keeps the full weights: gathered once per optimizer step, not per forward and
    backward; eval passes and gradient accumulation gather nothing. One all-gather per unit with
    bucketing off (``cap_mb=0``); with it, one per unit in the first forward (no recorded order
    yet), then one bucket for the whole model (mfsdp2/groups/gather_buckets.py)."""
    mesh = init_device_mesh("cpu", (ws,))
    model = _wrap(build("net"), mesh, "optim_grads")
    if cap_mb is not None:
        model.set_all_reduce_bucket_cap_mb(cap_mb)
    opt = make_opt("adamw", model.parameters())
    calls = []
    name = compat.all_gather_name()  # all_gather_single, or all_gather_into_tensor before torch 2.13
    orig = getattr(dist, name)

    def spy(out, inp, group=None, async_op=False):
        if out.numel() > 2 * ws:  # not the small agreement / presence collectives
            calls.append(out.numel())
        return orig(out, inp, group=group, async_op=async_op)

    setattr(dist, name, spy)
    per_step = []
    try:
        for step in range(3):
            calls.clear()
            sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH)
            per_step.append(len(calls))
        calls.clear()
        with torch.no_grad():  # eval after a step: gathers the stepped weights once
            model(batch(9, 4, 12)[0])
        per_step.append(len(calls))
        calls.clear()
        with torch.no_grad():  # nothing stepped since: no gather
            model(batch(9, 4, 12)[0])
        model(batch(10, 4, 12)[0]).sum().backward()  # accumulation, no optimizer step
        per_step.append(len(calls))
    finally:
        setattr(dist, name, orig)
    return per_step


@pytest.mark.parametrize("cap_mb", [None, 0])
def test_optim_grads_gathers_once_per_optimizer_step(cap_mb):
    units = 4  # 3 blocks + root
    per_unit = cap_mb == 0
    expected = [units, units, units, units, 0] if per_unit else [units, 1, 1, 1, 0]
    for per_step in run_ranks(_gathers_once_per_step, 2, cap_mb):
        assert per_step == expected, per_step


# -- bf16 compute, fp32 main weights -----------------------------------------------------------
def _bf16_run(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {}
    for strategy in STRATEGIES:
        model = _wrap(build("net"), mesh, strategy, mp_policy=mp)
        assert all(g.main_weight.dtype == torch.float32 and g.weights.dtype == torch.bfloat16 for g in _groups(model))
        opt = make_opt("adamw", model.parameters())
        losses = [sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH) for step in range(STEPS)]
        out[strategy] = (losses, {k: p.full_tensor() for k, p in model.named_parameters()})
    return out


def test_bf16_compute_fp32_main_weights_match_same_cast_reference():
    ws = 2
    # Tolerances from the reference itself (see same_cast_tolerances): 2x the spread between ws
    # micro-batches and one, per parameter and for the losses.
    ref_losses, ref_params, loss_tol, tol = same_cast_tolerances(STEPS, ws, GLOBAL_BATCH)
    for per_strategy in run_ranks(_bf16_run, ws):
        for strategy, (losses, full) in per_strategy.items():
            assert_losses_close(losses, ref_losses, strategy, loss_tol)
            for name, ref in ref_params.items():
                assert_close_rel(full[name], ref, f"{strategy} {name}", rel=tol[name])
    # The comparison is sharp enough to see bf16: fp32 compute falls outside the tolerance, for
    # the losses and for most parameters.
    fp32_losses, fp32_params = reference_run("net", "adamw", STEPS, GLOBAL_BATCH)
    assert max(abs(a - b) / abs(b) for a, b in zip(fp32_losses, ref_losses)) > loss_tol
    outside = [k for k, r in ref_params.items() if rel_dist(fp32_params[k], r) > tol[k]]
    assert len(outside) > len(ref_params) // 2, (outside, tol)


# -- gradient divide factor ------------------------------------------------------------------
def _reference_grads():
    torch.set_num_threads(1)
    model = build("net", dtype=F64)
    x, y = batch(0, GLOBAL_BATCH, 12, dtype=F64)
    loss_fn(model(x), y).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def _divide_run(rank, ws, mesh_shape, strategy):
    mesh = init_device_mesh("cpu", mesh_shape)
    out = {}
    n = GLOBAL_BATCH // ws
    x, y = batch(0, GLOBAL_BATCH, 12, dtype=F64)
    for factor in (None, 1.0, 3.0):
        model = _wrap(build("net", dtype=F64), mesh, strategy)
        model.set_gradient_divide_factor(factor, recurse=True)
        loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        out[factor] = {k: local_grad_rows(p) for k, p in model.named_parameters()}
    return out


@pytest.mark.parametrize(
    "mesh_shape,strategy",
    [((2,), "optim_grads_params"), ((2,), "no_shard"),
     pytest.param((2, 2), "optim_grads_params", marks=pytest.mark.slow)],
)
def test_gradient_divide_factor_sum_and_custom(mesh_shape, strategy):
    ws = 1
    for d in mesh_shape:
        ws *= d
    ref = _reference_grads()  # the mean over the global batch = mean over ranks of local means
    for per_factor in run_ranks(_divide_run, ws, mesh_shape, strategy):
        for factor, grads in per_factor.items():
            scale = 1.0 if factor is None else ws / factor
            for name, (start, g) in grads.items():
                expect = ref[name][start : start + g.shape[0]] * scale
                assert_close_rel(g, expect, f"factor {factor} {name}", REL_F64)


# -- checkpoints -------------------------------------------------------------------------------
def _checkpoint_run(rank, ws, path):
    import torch.distributed.checkpoint as dcp

    from mfsdp2.checkpoint import state_dict as msd

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for strategy in STRATEGIES:
        model = _wrap(build("net", dtype=F64), mesh, strategy)
        opt = make_opt("adamw", model.parameters())
        for step in range(2):
            sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH)
        saved = {k: p.full_tensor() for k, p in model.named_parameters()}
        where = f"{path}/{strategy}"
        if strategy == "no_shard":  # Replicate placements: model.state_dict() + DCP
            dcp.save(model.state_dict(), checkpoint_id=where)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            sd = model.state_dict()
            dcp.load(sd, checkpoint_id=where)
            model.load_state_dict(sd)
        else:  # the mfsdp2.checkpoint.state_dict helpers, optimizer included
            m, o = msd.get_state_dict(model, opt)
            msd.save({"model": m, "optim": o}, checkpoint_id=where)
            exp_avg = {k: v["exp_avg"].to_local().clone() for k, v in o["state"].items() if "exp_avg" in v}
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
                for st in opt.state.values():
                    st["exp_avg"].zero_()
            m, o = msd.get_state_dict(model, opt)
            sd = {"model": m, "optim": o}
            msd.load(sd, checkpoint_id=where)
            msd.set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            _, o2 = msd.get_state_dict(model, opt)
            for k, v in exp_avg.items():
                assert torch.equal(o2["state"][k]["exp_avg"].to_local(), v), (strategy, k)
        # The next forward regathers the loaded weights (persistent buffers notice the load).
        sharded_train_step(model, opt, 2, rank, ws, GLOBAL_BATCH)
        out[strategy] = (saved, {k: p.full_tensor() for k, p in model.named_parameters()})
    return out


def test_checkpoint_round_trip_for_every_strategy(tmp_path):
    _, ref_after = reference_run("net", "adamw", 3, GLOBAL_BATCH, dtype=F64)
    for per_strategy in run_ranks(_checkpoint_run, 2, str(tmp_path)):
        for strategy, (saved, after) in per_strategy.items():
            assert saved.keys() == after.keys() == ref_after.keys()
            for k in saved:
                # Zeroed after the save, loaded back, one more step: exactly the uninterrupted run.
                assert_close_rel(after[k], ref_after[k], f"{strategy} {k} after save / zero / load / step", REL_F64)


# -- gradient accumulation without sync --------------------------------------------------------
def _no_sync_run(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    n = GLOBAL_BATCH // ws
    for strategy in STRATEGIES:
        model = _wrap(build("net", dtype=F64), mesh, strategy)
        for micro in range(3):
            model.set_requires_gradient_sync(micro == 2)
            x, y = batch(micro, GLOBAL_BATCH, 12, dtype=F64)
            loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
            if micro < 2:
                assert all(p.grad is None for p in model.parameters()), "grads exposed before the sync"
        out[strategy] = {k: local_grad_rows(p) for k, p in model.named_parameters()}
    return out


def test_accumulation_without_sync_for_every_strategy():
    torch.set_num_threads(1)
    ref_model = build("net", dtype=F64)
    for micro in range(3):
        x, y = batch(micro, GLOBAL_BATCH, 12, dtype=F64)
        loss_fn(ref_model(x), y).backward()
    ref = {k: p.grad for k, p in ref_model.named_parameters()}
    for per_strategy in run_ranks(_no_sync_run, 2):
        for strategy, grads in per_strategy.items():
            for name, (start, g) in grads.items():
                assert_close_rel(g, ref[name][start : start + g.shape[0]], f"{strategy} {name}", REL_F64)


class _WideNet(torch.nn.Module):
    """One unit whose float64 gradient (66,048 elements, 516 KiB) is above gloo's small-reduction
    threshold (point-to-point reduce-scatter) between two small units (bucketed all-reduce at
    world size 2 on gloo), and a root that owns the head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(12, 256)
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(256, 8), torch.nn.Tanh(), torch.nn.Linear(8, 256)),
             torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh()),
             torch.nn.Sequential(torch.nn.Linear(256, 8), torch.nn.Tanh(), torch.nn.Linear(8, 256))]
        )
        self.head = torch.nn.Linear(256, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _zero1_steps(model, opt, rank, ws):
    """4 steps of 2 micro-batches (the first without gradient sync); step 0 keeps zeroed grads
    (``zero_grad(set_to_none=False)``) for step 1 to accumulate onto."""
    n = GLOBAL_BATCH // ws if ws else GLOBAL_BATCH  # ws 0: the unsharded reference, whole batches
    for step in range(4):
        for micro in range(2):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(micro == 1)
            x, y = batch(10 * step + micro, GLOBAL_BATCH, 12, dtype=F64)
            if ws:
                x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
            loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 1)


def _zero1_run(rank, ws, cap):
    from mfsdp2.comm.communicator import comm_stats

    mesh = init_device_mesh("cpu", (ws,))
    model = _wrap(_WideNet().to(F64), mesh, "optim")
    model.set_all_reduce_bucket_cap_mb(cap)
    opt = make_opt("adamw", model.parameters())
    comm_stats.reset()
    _zero1_steps(model, opt, rank, ws)
    counts = (comm_stats.reduce_scatter_calls, comm_stats.reduce_scatters_in_buckets, comm_stats.all_reduce_buckets)
    return {k: p.full_tensor() for k, p in model.named_parameters()}, counts


@pytest.mark.parametrize("ws,cap", [(2, 25.0), (2, 0.0), pytest.param(4, 25.0, marks=pytest.mark.slow)])
def test_zero1_reduce_scatters_into_its_rows_and_matches_reference(ws, cap):
    """ZeRO-1 reduces with a reduce-scatter into this rank's rows of its full-size main gradient
    (half an all-reduce's bytes; the optimizer steps only those rows), or shares a bucketed
    all-reduce where its reduce-scatter would be one anyway (small units, gloo): the trained
    weights equal the unsharded model's under accumulation without sync and across steps."""
    ref = _WideNet().to(F64)
    ref_opt = make_opt("adamw", ref.parameters())
    _zero1_steps(ref, ref_opt, 0, 0)
    for rank, (full, (rs, in_buckets, buckets)) in enumerate(run_ranks(_zero1_run, ws, cap)):
        for name, p in ref.named_parameters():
            assert_close_rel(full[name], p.detach(), f"ws {ws} cap {cap} rank {rank} {name}", REL_F64)
        # 4 synced backwards, 4 groups each (3 blocks + root). The wide unit always reduce-scatters;
        # the 3 small ones share one bucket per backward when bucketing is on (the first backward
        # has no plan yet: a bucket each).
        if cap:
            assert (rs, in_buckets, buckets) == (4, 0, 3 + 3), (ws, rs, in_buckets, buckets)
        else:
            assert (rs, in_buckets, buckets) == (16, 0, 0), (ws, rs, in_buckets, buckets)
