"""CPU offload (FSDP2's ``CPUOffloadPolicy``): main weights, gradients and optimizer states in
host memory, the optimizer step on the CPU (mfsdp2/memory/offload.py).

On a CPU mesh mfsdp2 runs the offload code path anyway -- main and model storage distinct, no
reduce-scatter into the main gradient, copy-out after each reduction, norms summed over the host
twin group -- so these tests exercise what a CUDA run does except the tensors' device (the CUDA
case itself is in tests/system/test_cuda_parity.py). Each run checks that the path was really taken (copy-out
counts, no main gradient from the compute allocator, main weights not sharing the model buffer)
against a control without offload that takes the other path.

References, float64 (``REL_F64``, see tests/models.py): torch FSDP2 with the same policy run in the
same process (losses, full parameters and gradients each step, DSD state dicts), and the unsharded
model (strategies, HSDP, FSDP x TP, ``clip_grad_norm_``, conversions). ``pin_memory=False`` for
FSDP2: its default ``True`` raises on a CPU-only torch ("Cannot access accelerator device");
mfsdp2 accepts it and pins nothing.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.checkpoint.state_dict as dsd
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

from . import mean_loss, sharded_pair, snapshot, assert_same_snapshots
from .test_dsd import GET_OPTIONS, _assert_same, _describe, _fqn_optim
from .._dist import run_ranks
from ..integrations.test_tp import _build as tp_build
from ..models import F64, REL_F64, assert_close_rel, assert_losses_close, batch, build, loss_fn, make_opt, shard_blocks

STEPS, GB = 3, 8
OFF = CPUOffloadPolicy(pin_memory=False)


def _groups(model):
    return [g for m in model.modules() if hasattr(m, "_mfsdp2_state") for g in m._mfsdp2_state.groups]


def _step(model, opt, step, rank, ws, dp=None, before_step=None):
    """One step on this rank's slice of the global batch; ``before_step(model)`` sees the reduced
    gradients. Returns the mean loss over the ranks."""
    dp_rank, dp_size = dp if dp is not None else (rank, ws)
    n = GB // dp_size
    x, y = batch(step, GB, model.inp.in_features, dtype=F64)
    loss = loss_fn(model(x[dp_rank * n : (dp_rank + 1) * n]), y[dp_rank * n : (dp_rank + 1) * n])
    loss.backward()
    out = before_step(model) if before_step is not None else None
    opt.step()
    opt.zero_grad()
    return mean_loss(loss), out  # ranks of one TP group hold the same loss: the mean is unchanged


def _offload_facts(model, opt) -> dict:
    """Where things live and which path the run took (compared with a run without offload)."""
    groups = _groups(model)
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    return dict(
        offloaded=[g.main.offloaded for g in groups],
        copy_outs=[g.copy_outs for g in groups],
        # the main grad never came from the compute device's allocator (it is host memory)
        main_grad_blocks=model.allocator.stats.peak_by_role.get("main_grad", 0),
        # persistent strategies: main weights are not the model buffer's local slice
        shares_model_buffer=[g.main_weight.data_ptr() == g.weights.local_slice(g.weights.unsharded).data_ptr()
                             for g in groups if g.persistent],
        devices={p.device.type for p in model.parameters()} | {p.to_local().device.type for p in model.parameters()},
        grad_devices={p.grad.to_local().device.type for p in model.parameters() if p.grad is not None},
        state_devices={t.to_local().device.type for t in states},
        pinned=any(p.to_local().is_pinned() for p in model.parameters()),
        # no_shard / ZeRO-1: all-reduce buckets issued, against the groups that reduce
        buckets=(model._mfsdp2_state.ctx.buckets.issued_count, sum(g.requires_grad for g in groups)),
        # host memory memory_stats() reports, against what the groups hold there
        host_bytes=(model.memory_stats()["host_bytes"],
                    sum(g.main_weight.element_size() * (g.layout.shard_numel + g.requires_grad * (
                        g.layout.total_numel if g.full_grads else g.layout.shard_numel)) for g in groups)),
    )


def _assert_offload_path(facts: dict, reductions: int, where: str, pin: bool = False) -> None:
    assert all(facts["offloaded"]), where
    assert facts["copy_outs"] == [reductions] * len(facts["copy_outs"]), (where, facts["copy_outs"])
    assert facts["main_grad_blocks"] == 0, where
    assert not any(facts["shares_model_buffer"]), where
    assert facts["devices"] == facts["state_devices"] == {"cpu"}, (where, facts)
    assert facts["grad_devices"] in (set(), {"cpu"}), where
    assert facts["host_bytes"][0] == facts["host_bytes"][1] > 0, (where, facts["host_bytes"])
    # page-locked only when asked and CUDA exists (torch cannot pin without it)
    assert facts["pinned"] == (pin and torch.cuda.is_available()), where


# -- world size 2 -------------------------------------------------------------------------------
def _vs_fsdp2(rank, ws, mesh, kind):
    """mfsdp2 and FSDP2, both with CPUOffloadPolicy, trained side by side; then DSD state dicts
    from both (every get option) and a full state dict of FSDP2's loaded into a fresh mfsdp2
    model, one more step each."""
    models = sharded_pair(mesh, kind, offload_policy=OFF)
    opts = {k: make_opt("adamw", m.parameters()) for k, m in models.items()}
    out = {"losses": {k: [] for k in models}, "snaps": {k: [] for k in models}}
    for s in range(STEPS):
        for k, m in models.items():
            loss, snap = _step(m, opts[k], s, rank, ws, before_step=snapshot)
            out["losses"][k].append(loss)
            out["snaps"][k].append(snap)
    out["facts"] = _offload_facts(models["mfsdp2"], opts["mfsdp2"])
    out["final"] = {k: snapshot(m) for k, m in models.items()}
    for i, o in enumerate(GET_OPTIONS):
        options = StateDictOptions(**o)
        for k, m in models.items():
            out["get", k, i] = (_describe(dsd.get_model_state_dict(m, options=options)),
                                _describe(dsd.get_optimizer_state_dict(m, opts[k], options=options)))
    full = StateDictOptions(full_state_dict=True)
    msd = dsd.get_model_state_dict(models["fsdp2"], options=full)
    osd = dsd.get_optimizer_state_dict(models["fsdp2"], opts["fsdp2"], options=full)
    fresh = shard_blocks(build(kind, seed=5, dtype=F64), mesh, offload_policy=OFF)
    fresh_opt = make_opt("adamw", fresh.parameters())
    fmsd, fosd = _fqn_optim(fresh, fresh_opt, msd, osd["state"])
    dsd.set_model_state_dict(fresh, fmsd, options=full)
    dsd.set_optimizer_state_dict(fresh, fresh_opt, fosd, options=full)
    out["resumed"] = {}
    for k, m in (("fsdp2", models["fsdp2"]), ("mfsdp2", fresh)):
        opt = opts["fsdp2"] if k == "fsdp2" else fresh_opt
        loss, snap = _step(m, opt, STEPS, rank, ws, before_step=snapshot)
        out["resumed"][k] = (loss, snap, snapshot(m))
    return out


def _accumulate(models: dict, rank, ws) -> dict:
    """Two synced micro-batches per step (no zero_grad between them): the second reduction is
    added to the host main gradient through a host copy. Returns each model's snapshots, taken
    before each optimizer step."""
    opts = {k: make_opt("adamw", m.parameters()) for k, m in models.items()}
    snaps = {k: [] for k in models}
    n = GB // ws // 2
    for s in range(STEPS):
        x, y = batch(s, GB, 12, dtype=F64)
        x, y = x[rank * 2 * n : (rank + 1) * 2 * n], y[rank * 2 * n : (rank + 1) * 2 * n]
        for k, m in models.items():
            for mb in range(2):
                (loss_fn(m(x[mb * n : (mb + 1) * n]), y[mb * n : (mb + 1) * n]) / 2).backward()
            snaps[k].append(snapshot(m))
            opts[k].step()
            opts[k].zero_grad()
    return snaps, opts


def _accumulate_vs_fsdp2(rank, ws, mesh):
    """:func:`_accumulate` with FSDP2's offload alongside (it adds into its CPU grad)."""
    models = sharded_pair(mesh, "net", offload_policy=OFF)
    snaps, opts = _accumulate(models, rank, ws)
    return snaps, _offload_facts(models["mfsdp2"], opts["mfsdp2"])


def _bucketed_accumulation(rank, ws, mesh):
    """no_shard / ZeRO-1 with offload, two synced backwards per step: both reductions go
    through the shared all-reduce buckets (mfsdp2/groups/grad_buckets.py), the first copied out of its
    bucket slice into the host main grad, the second added to it."""
    out = {}
    for strategy in ("optim", "no_shard"):
        model = shard_blocks(build("net", dtype=F64), mesh, offload_policy=OFF, sharding_strategy=strategy)
        snaps, opts = _accumulate({"mfsdp2": model}, rank, ws)
        out[strategy] = (snaps["mfsdp2"], _offload_facts(model, opts["mfsdp2"]))
    return out


def _strategies(rank, ws, mesh):
    """ZeRO-2 / ZeRO-1 / no_shard with offload (FSDP2 has no such strategies): the unsharded
    model is the reference. FSDP2's default CPUOffloadPolicy() (pin_memory=True) is accepted."""
    out = {}
    for strategy in ("optim_grads", "optim", "no_shard"):
        model = shard_blocks(build("net", dtype=F64), mesh, offload_policy=CPUOffloadPolicy(),
                             sharding_strategy=strategy)
        opt = make_opt("adamw", model.parameters())
        losses = [_step(model, opt, s, rank, ws)[0] for s in range(STEPS)]
        out[strategy] = (losses, snapshot(model), _offload_facts(model, opt))
    return out


def _bf16_pairs(rank, ws, mesh):
    """bf16 compute, fp32 main: with and without offload the arithmetic is the same, so the runs
    must agree bit for bit; the run without offload is the control for the path checks."""
    from mfsdp2 import MixedPrecisionPolicy

    out = {}
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for strategy in ("optim_grads_params", "optim_grads"):
        runs = {}
        for name, policy in (("offload", OFF), ("device", None)):
            kw = {"offload_policy": policy} if policy is not None else {}
            model = shard_blocks(build("net"), mesh, mp_policy=mp, sharding_strategy=strategy, **kw)
            opt = make_opt("adamw", model.parameters())
            losses = []
            for s in range(STEPS):
                n = GB // ws
                x, y = batch(s, GB, 12)
                loss = loss_fn(model(x[rank * n : (rank + 1) * n]).float(), y[rank * n : (rank + 1) * n])
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            runs[name] = (losses, {k: p.to_local().clone() for k, p in model.named_parameters()},
                          _offload_facts(model, opt))
        out[strategy] = runs
    return out


def _clip(rank, ws, mesh):
    """``mfsdp2.clip_grad_norm_`` and torch's on the offloaded model (host main grads), for the
    2-norm and the inf-norm, against the unsharded model's clip."""
    import mfsdp2

    out = {}
    for fn_name, norm_type in (("mfsdp2", 2.0), ("mfsdp2", float("inf")), ("torch", 2.0)):
        model = shard_blocks(build("net", dtype=F64), mesh, offload_policy=OFF)
        n = GB // ws
        x, y = batch(0, GB, 12, dtype=F64)
        loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        fn = mfsdp2.clip_grad_norm_ if fn_name == "mfsdp2" else torch.nn.utils.clip_grad_norm_
        total = fn(model.parameters(), max_norm=0.05, norm_type=norm_type)
        total = total.full_tensor() if hasattr(total, "full_tensor") else total
        out[fn_name, norm_type] = (total.item(), total.device.type, {k: g for k, (_, g) in snapshot(model).items()})
    return out


def _conversions(rank, ws, mesh):
    """``model.to(float64)`` of an offloaded float32 model (groups rebuilt: they must keep their
    host main state), and FSDP2's meta recipe with offload: meta build, ``to_empty(device="cpu")``,
    ``copy_`` init from full values."""
    out = {}
    model = shard_blocks(build("net"), mesh, offload_policy=OFF)
    model.to(F64)
    opt = make_opt("adamw", model.parameters())
    out["to_float64"] = ([_step(model, opt, s, rank, ws)[0] for s in range(STEPS)], snapshot(model),
                         _offload_facts(model, opt))
    with torch.device("meta"):
        meta = build("net").to(F64)
    shard_blocks(meta, mesh, offload_policy=OFF)
    meta.to_empty(device="cpu")
    _copy_init(meta, mesh)
    opt = make_opt("adamw", meta.parameters())
    out["meta"] = ([_step(meta, opt, s, rank, ws)[0] for s in range(STEPS)], snapshot(meta), _offload_facts(meta, opt))
    return out


def _meta_offload(rank, ws, mesh):
    """A model built on the meta device and sharded with offload keeps everything on meta (no
    host or device bytes; tests/frontend/test_meta_init.py counts them without offload)
    until its init, then gets host main state: ``mfsdp2.materialize``
    (the normal build's draw, see tests/frontend/test_meta_init.py) then ``.to(float64)`` (groups rebuilt
    on the host), or FSDP2's ``to_empty(device="cpu")`` and a ``copy_`` init. ZeRO-3, and the
    persistent strategies, whose main weights never share the model buffer under offload."""
    import mfsdp2

    out = {}
    for strategy, init in (("optim_grads_params", "materialize"), ("optim_grads", "materialize"),
                           ("optim", "materialize"), ("no_shard", "materialize"),
                           ("optim_grads", "to_empty"), ("no_shard", "to_empty")):
        with torch.device("meta"):
            model = build("net")
        shard_blocks(model, mesh, offload_policy=CPUOffloadPolicy(), sharding_strategy=strategy)
        groups = _groups(model)
        # main weights, model-weight buffers and parameters: all on meta
        before = {t.device.type for g in groups for t in (g.main_weight, g.weights.shard)} | {
            p.device.type for p in model.parameters()}
        if init == "materialize":
            torch.manual_seed(0)  # the stream build("net", seed=0) draws from
            mfsdp2.materialize(model)
            model.to(F64)
        else:
            model.to(F64).to_empty(device="cpu")
            _copy_init(model, mesh)
        opt = make_opt("adamw", model.parameters())
        losses = [_step(model, opt, s, rank, ws)[0] for s in range(STEPS)]
        out[strategy, init] = (before, losses, snapshot(model), _offload_facts(model, opt))
    return out


def _copy_init(model, mesh) -> None:
    """Every parameter ``copy_``-ed from the normal build's full values (FSDP2's meta recipe)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    full = {k: v.detach().to(F64) for k, v in build("net").named_parameters()}
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(distribute_tensor(full[k], mesh, [Replicate()]))


def _rank2(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    return dict(
        fsdp2=_vs_fsdp2(rank, ws, mesh, "net"),
        accumulate=_accumulate_vs_fsdp2(rank, ws, mesh),
        bucketed_accumulation=_bucketed_accumulation(rank, ws, mesh),
        strategies=_strategies(rank, ws, mesh),
        bf16=_bf16_pairs(rank, ws, mesh),
        clip=_clip(rank, ws, mesh),
        conversions=_conversions(rank, ws, mesh),
        meta=_meta_offload(rank, ws, mesh),
    )


@functools.lru_cache(maxsize=None)
def _results2():
    return run_ranks(_rank2, 2, timeout=400)


# -- the unsharded reference ----------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _reference(kind: str = "net", steps: int = STEPS, seed: int = 0):
    """Per step: the loss, and every parameter and gradient before the optimizer step; then the
    final parameters (unsharded, float64, the whole global batch)."""
    torch.set_num_threads(1)
    model = build(kind, seed=seed, dtype=F64)
    opt = make_opt("adamw", model.parameters())
    losses, snaps = [], []
    for s in range(steps):
        x, y = batch(s, GB, model.inp.in_features, dtype=F64)
        loss = loss_fn(model(x), y)
        loss.backward()
        snaps.append({k: (p.detach().clone(), p.grad.detach().clone()) for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, snaps, {k: p.detach().clone() for k, p in model.named_parameters()}


def _assert_final(params: dict, ref: dict, where: str) -> None:
    for k, v in ref.items():
        assert_close_rel(params[k][0], v, f"{where} {k}", REL_F64)


def _assert_trains_like_fsdp2(r: dict, kind: str, where: str) -> None:
    """Per step: losses against the unsharded model; full parameters and gradients against
    FSDP2's (and the unsharded model's) before each optimizer step; the final parameters."""
    ref_losses, ref_snaps, ref_final = _reference(kind)
    _assert_offload_path(r["facts"], STEPS, where)
    for k in ("mfsdp2", "fsdp2"):
        assert_losses_close(r["losses"][k], ref_losses, f"{where} {k}", REL_F64)
    for s in range(STEPS):
        assert_same_snapshots(r["snaps"]["mfsdp2"][s], r["snaps"]["fsdp2"][s], f"{where} step {s}", REL_F64)
        for k, (p, g) in ref_snaps[s].items():
            assert_close_rel(r["snaps"]["mfsdp2"][s][k][0], p, f"{where} step {s} param {k}", REL_F64)
            assert_close_rel(r["snaps"]["mfsdp2"][s][k][1], g, f"{where} step {s} grad {k}", REL_F64)
    assert_same_snapshots(r["final"]["mfsdp2"], r["final"]["fsdp2"], f"{where} final", REL_F64)
    _assert_final(r["final"]["mfsdp2"], ref_final, where)


def _assert_state_dicts_like_fsdp2(r: dict, where: str) -> None:
    """Every DSD get option gives what FSDP2's offloaded model gives; FSDP2's full state dict
    loaded into a fresh offloaded mfsdp2 model continues exactly as FSDP2 does."""
    for i, o in enumerate(GET_OPTIONS):
        for part in (0, 1):
            _assert_same(r["get", "mfsdp2", i][part], r["get", "fsdp2", i][part],
                         f"{where} {o} {('model', 'optim')[part]}")
    (lt, st, ft), (lo, so, fo) = r["resumed"]["fsdp2"], r["resumed"]["mfsdp2"]
    assert abs(lo - lt) <= REL_F64 * abs(lt), (where, lo, lt)
    assert_same_snapshots(so, st, f"{where} resumed step", REL_F64)
    assert_same_snapshots(fo, ft, f"{where} after the resumed step", REL_F64)


def test_zero3_offload_matches_fsdp2_offload_and_unsharded_each_step():
    for rank, res in enumerate(_results2()):
        _assert_trains_like_fsdp2(res["fsdp2"], "net", f"rank {rank}")


def test_accumulation_across_synced_backwards_matches_fsdp2_offload():
    _, ref_snaps, _ = _reference()
    for rank, res in enumerate(_results2()):
        snaps, facts = res["accumulate"]
        where = f"accumulation rank {rank}"
        _assert_offload_path(facts, 2 * STEPS, where)
        for s in range(STEPS):
            assert_same_snapshots(snaps["mfsdp2"][s], snaps["fsdp2"][s], f"{where} step {s}", REL_F64)
            for k, (_, g) in ref_snaps[s].items():  # the mean of the two halves' means: the full-batch gradient
                assert_close_rel(snaps["mfsdp2"][s][k][1], g, f"{where} step {s} grad {k}", REL_F64)


def test_dsd_state_dicts_under_offload_match_fsdp2():
    for rank, res in enumerate(_results2()):
        _assert_state_dicts_like_fsdp2(res["fsdp2"], f"rank {rank}")


def _assert_bucketed(facts: dict, backwards: int, where: str) -> None:
    """The first backward has no plan (a bucket per group); every later one follows the plan,
    which puts all the groups of this small model into one bucket (25 MiB cap)."""
    issued, groups = facts["buckets"]
    assert groups > 1 and issued == groups + backwards - 1, (where, facts["buckets"])


@pytest.mark.parametrize("strategy", ["optim_grads", "optim", "no_shard"])
def test_other_strategies_with_offload_match_unsharded(strategy):
    """ZeRO-1 and no_shard all-reduce in shared buckets: under offload each group's slice is
    copied out to its host main grad (never made the main grad itself, as it is without
    offload: copy_outs counts them)."""
    ref_losses, _, ref_final = _reference()
    for rank, res in enumerate(_results2()):
        losses, params, facts = res["strategies"][strategy]
        where = f"{strategy} rank {rank}"
        _assert_offload_path(facts, STEPS, where, pin=True)  # CPUOffloadPolicy(): pin_memory=True
        assert facts["shares_model_buffer"], f"{where}: persistent groups expected"
        if strategy != "optim_grads":
            _assert_bucketed(facts, STEPS, where)
        assert_losses_close(losses, ref_losses, where, REL_F64)
        _assert_final(params, ref_final, where)


@pytest.mark.parametrize("strategy", ["optim", "no_shard"])
def test_bucketed_accumulation_with_offload_matches_unsharded(strategy):
    _, ref_snaps, ref_final = _reference()
    for rank, res in enumerate(_results2()):
        snaps, facts = res["bucketed_accumulation"][strategy]
        where = f"{strategy} accumulation rank {rank}"
        _assert_offload_path(facts, 2 * STEPS, where)
        _assert_bucketed(facts, 2 * STEPS, where)
        for s in range(STEPS):
            for k, (p, g) in ref_snaps[s].items():  # the mean of the two halves' means: the full-batch gradient
                assert_close_rel(snaps[s][k][0], p, f"{where} step {s} param {k}", REL_F64)
                assert_close_rel(snaps[s][k][1], g, f"{where} step {s} grad {k}", REL_F64)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_bf16_compute_offload_equals_device_run_bitwise(strategy):
    for rank, res in enumerate(_results2()):
        off, dev = res["bf16"][strategy]["offload"], res["bf16"][strategy]["device"]
        where = f"{strategy} rank {rank}"
        _assert_offload_path(off[2], STEPS, where)
        # the control takes the other path: no copy-out, the main grad from the allocator
        assert (not any(dev[2]["offloaded"]) and set(dev[2]["copy_outs"]) == {0}
                and dev[2]["main_grad_blocks"] > 0), where
        assert off[0] == dev[0], (where, off[0], dev[0])
        for k, v in dev[1].items():
            assert torch.equal(off[1][k], v), f"{where} {k}"


def test_clip_grad_norm_on_offloaded_grads_matches_unsharded():
    import math

    for fn_name, norm_type in (("mfsdp2", 2.0), ("mfsdp2", math.inf), ("torch", 2.0)):
        torch.set_num_threads(1)
        ref = build("net", dtype=F64)
        x, y = batch(0, GB, 12, dtype=F64)
        loss_fn(ref(x), y).backward()
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.05, norm_type=norm_type).item()
        for rank, res in enumerate(_results2()):
            total, device, grads = res["clip"][fn_name, norm_type]
            where = f"{fn_name} norm {norm_type} rank {rank}"
            assert device == "cpu", where
            assert abs(total - ref_total) <= REL_F64 * ref_total, (where, total, ref_total)
            for k, p in ref.named_parameters():
                assert_close_rel(grads[k], p.grad, f"{where} {k}", REL_F64)


@pytest.mark.parametrize("case", ["to_float64", "meta"])
def test_conversions_keep_offloaded_main_state(case):
    ref_losses, _, ref_final = _reference()
    for rank, res in enumerate(_results2()):
        losses, params, facts = res["conversions"][case]
        where = f"{case} rank {rank}"
        _assert_offload_path(facts, STEPS, where)
        assert_losses_close(losses, ref_losses, where, REL_F64)
        _assert_final(params, ref_final, where)


@pytest.mark.parametrize("strategy,init", [("optim_grads_params", "materialize"), ("optim_grads", "materialize"),
                                           ("optim", "materialize"), ("no_shard", "materialize"),
                                           ("optim_grads", "to_empty"), ("no_shard", "to_empty")])
def test_meta_built_offloaded_model_gets_host_main_state_at_init(strategy, init):
    ref_losses, _, ref_final = _reference()
    for rank, res in enumerate(_results2()):
        before, losses, params, facts = res["meta"][strategy, init]
        where = f"{strategy} {init} rank {rank}"
        assert before == {"meta"}, (where, before)
        _assert_offload_path(facts, STEPS, where, pin=True)  # CPUOffloadPolicy(): pin_memory=True
        if strategy != "optim_grads_params":
            assert facts["shares_model_buffer"], f"{where}: persistent groups expected"
        assert_losses_close(losses, ref_losses, where, REL_F64)
        _assert_final(params, ref_final, where)


# -- world size 4 ---------------------------------------------------------------------------------
def _rank4(rank, ws):
    out = {}
    # empty local pieces ("tiny" at world size 4), against FSDP2 in the same process
    out["tiny"] = _vs_fsdp2(rank, ws, init_device_mesh("cpu", (ws,)), "tiny")
    # HSDP: (replicate=2, shard=2)
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard_blocks(build("net", dtype=F64), hsdp, offload_policy=OFF)
    opt = make_opt("adamw", model.parameters())
    out["hsdp"] = ([_step(model, opt, s, rank, ws)[0] for s in range(STEPS)], snapshot(model),
                   _offload_facts(model, opt))
    # FSDP x TP: (dp=2, tp=2), blocks tensor-parallel, then sharded over dp with offload
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tp_build(tp, "optim_grads_params", offload_policy=OFF)
    opt = make_opt("adamw", model.parameters())
    dp = (tp.get_local_rank(0), 2)
    out["tp"] = ([_step(model, opt, s, rank, ws, dp=dp)[0] for s in range(STEPS)], snapshot(model),
                 _offload_facts(model, opt))
    return out


@functools.lru_cache(maxsize=None)
def _results4():
    return run_ranks(_rank4, 4, timeout=500)


@pytest.mark.slow
def test_ws4_empty_pieces_offload_matches_fsdp2_offload():
    for rank, res in enumerate(_results4()):
        _assert_trains_like_fsdp2(res["tiny"], "tiny", f"tiny rank {rank}")
        _assert_state_dicts_like_fsdp2(res["tiny"], f"tiny rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hsdp", "tp"])
def test_ws4_hsdp_and_tp_with_offload_match_unsharded(case):
    ref_losses, _, ref_final = _reference()
    for rank, res in enumerate(_results4()):
        losses, params, facts = res[case]
        where = f"{case} rank {rank}"
        _assert_offload_path(facts, STEPS, where)
        assert_losses_close(losses, ref_losses, where, REL_F64)
        _assert_final(params, ref_final, where)


def test_policy_puts_main_state_in_host_memory_whatever_the_compute_device():
    """What fully_shard derives from the policy (no ranks needed): host main memory for a CUDA
    compute device too (the mesh need not exist to check this), pinned only when asked and
    CUDA exists; no offload for ``OffloadPolicy()``; a wrong type named with the unit."""
    from torch.distributed.fsdp import OffloadPolicy

    from mfsdp2.memory.offload import main_memory_for

    cpu = torch.device("cpu")
    for compute in (cpu, torch.device("cuda", 0)):
        assert main_memory_for(None, compute, "Block") is None
        assert main_memory_for(OffloadPolicy(), compute, "Block") is None
        for pin in (True, False):
            m = main_memory_for(CPUOffloadPolicy(pin_memory=pin), compute, "Block")
            assert m.device == cpu and m.offloaded and m.pin == (pin and torch.cuda.is_available()), (compute, pin, m)
    with pytest.raises(TypeError, match="offload_policy for Block must be an OffloadPolicy"):
        main_memory_for("cpu", cpu, "Block")
