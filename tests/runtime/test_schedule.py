"""The scheduler: overlap proven by event order, memory bounds, activation checkpointing, gradient
accumulation, and recovery from passes that leave the recorded order.

Every parity check compares against a single-process, unsharded reference that runs the same
model class on the whole global batch (float64, losses, eval outputs and final parameters within
REL_F64 relative: see tests/models.py).

Spawning ranks costs several seconds, so each ``run_ranks`` call runs several configurations one
after the other on fresh models and returns what each step observed (event log, allocator peaks,
collective counts, schedule counters); module-scoped fixtures share one spawn between the test
functions that check different aspects of the same runs, and the checks run in the parent. A
configuration that raises inside a rank fails its spawn (a rank that stops mid-collective would
leave its peer hanging, so there is no carrying on), and every test of that fixture reports the
rank's traceback.

Unit names in the event log are module paths: ``"root"`` for the root, ``"blocks.<i>"`` for the
blocks. Steps are counted from 0: step 0 records the order, steps >= 1 predict from it.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from mfsdp2 import FSDPModule, MixedPrecisionPolicy, UnshardHandle, fully_shard
from mfsdp2.comm.communicator import comm_stats
from mfsdp2.base.profiling import event_log

from .._dist import run_ranks
from ..models import F64, REL_F64, Block, Net, assert_close_rel, assert_losses_close, batch, loss_fn, make_opt

WS = 2
N_BLOCKS = 4
N_UNITS = N_BLOCKS + 1  # blocks + root
D_IN = 12
BLOCKS = [f"blocks.{i}" for i in range(N_BLOCKS)]


# -- the model ------------------------------------------------------------------------------------
class CkptBlock(Block):
    """A block whose own forward is checkpointed *inside* the FSDP unit (the hooks wrap the checkpoint)."""

    reentrant = False

    def forward(self, x):
        return checkpoint(functools.partial(Block.forward, self), x, use_reentrant=self.reentrant)


class SchedNet(Net):
    """``Net`` with 4 blocks, optional activation checkpointing and a per-step set of skipped blocks."""

    def __init__(self, ckpt: str = "none"):
        super().__init__(d_in=D_IN, n_blocks=N_BLOCKS)
        self.ckpt = ckpt
        self.skip: tuple = ()
        if ckpt.startswith("inside"):
            for b in self.blocks:
                b.__class__ = CkptBlock
                b.reentrant = ckpt == "inside-reentrant"

    def forward(self, x):
        h = self.inp(x)  # requires grad: a reentrant checkpoint of a block gets an input that needs grad
        for i, b in enumerate(self.blocks):
            if i in self.skip:
                continue
            if self.ckpt.startswith("around"):
                # Checkpoint a whole FSDP module: its hooks run inside the checkpointed region and,
                # for the reentrant flavour, its forward runs under no_grad and is recomputed in backward.
                h = checkpoint(b, h, use_reentrant=self.ckpt == "around-reentrant")
            else:
                h = b(h)
        return self.head(h)


def _build(cfg) -> SchedNet:
    torch.manual_seed(0)
    return SchedNet(cfg.get("ckpt", "none")).to(F64)


# -- one training step, shared by the reference and the ranks -------------------------------------
def _rows(t: torch.Tensor, part):
    """Rows of ``t`` that rank ``part = (rank, ws)`` holds; ``(0, 1)`` is the whole tensor."""
    r, n = part
    k = t.shape[0] // n
    return t[r * k : (r + 1) * k]


def _micro_batches(step, cfg):
    x, y = batch(step, cfg["batch"], D_IN, dtype=F64)
    m = cfg.get("micro", 1)
    return list(zip(x.chunk(m), y.chunk(m)))


def _loss(model, x, y, cfg, part):
    """The (micro-)batch loss; with ``multi_forward`` two forwards feed one backward."""
    if cfg.get("multi_forward"):
        (x1, x2), (y1, y2) = x.chunk(2), y.chunk(2)
        return loss_fn(model(_rows(x1, part)), _rows(y1, part)) + loss_fn(model(_rows(x2, part)), _rows(y2, part))
    return loss_fn(model(_rows(x, part)), _rows(y, part))


def _eval_batch():
    return batch(10_000, 8, D_IN, dtype=F64)[0]


def reference(cfg):
    """Single process, unsharded, whole global batch: losses, eval outputs and final parameters."""
    torch.set_num_threads(1)
    model = _build(cfg)
    opt = make_opt(cfg["opt"], list(model.parameters()))
    losses, evals = [], {}
    micro = cfg.get("micro", 1)
    for step in range(cfg["steps"]):
        model.skip = cfg.get("skip", {}).get(step, ())
        total = 0.0
        for x, y in _micro_batches(step, cfg):
            loss = _loss(model, x, y, cfg, (0, 1)) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
        if step in cfg.get("eval_after", ()):
            with torch.no_grad():
                evals[step] = model(_eval_batch())
    return losses, evals, {k: v.detach().clone() for k, v in model.named_parameters()}


# -- the ranks ------------------------------------------------------------------------------------
def _run_one(rank, ws, cfg):
    mesh = init_device_mesh("cpu", (ws,))
    part = (rank, ws)
    model = _build(cfg)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=cfg.get("reshard_after_forward", True))
    fully_shard(model, mesh=mesh)
    # This file checks the per-unit reduce-scatter schedule; small units at two ranks on gloo would
    # share bucketed all-reduces instead (tests/groups/test_grad_buckets.py).
    model.set_all_reduce_bucket_cap_mb(0)
    if not cfg.get("reshard_after_backward", True):
        model.set_reshard_after_backward(False)
    params = dict(model.named_parameters())  # the DTensors the optimizer owns, by name
    opt = make_opt(cfg["opt"], list(params.values()))
    if cfg.get("unshard_async"):
        # The very first call on the model is unshard(): it runs before the root context (and its
        # allocator) exist, and its accounting must still balance once they do.
        first = model.unshard(async_op=True)
        first.wait()
    stats = model.allocator.stats
    sched = model._mfsdp2_state.ctx.schedule
    micro = cfg.get("micro", 1)
    out: dict = {"steps": [], "evals": {}}
    event_log.enabled = True
    try:
        for step in range(cfg["steps"]):
            if step == cfg.get("depth2_from"):
                model.set_prefetch_depth(2)
            model.skip = cfg.get("skip", {}).get(step, ())
            prof = None
            if step == cfg.get("profile_step"):
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
            rec: dict = {"micro": [], "mispredictions_before": sched.mispredictions}
            total = torch.zeros((), dtype=F64)
            for m, (x, y) in enumerate(_micro_batches(step, cfg)):
                if micro > 1:
                    model.set_requires_gradient_sync(m == micro - 1)
                mb: dict = {}
                comm_stats.reset()
                event_log.clear()
                stats.reset_peak()
                mb["live_weight_before"] = stats.live_by_role.get("weight", 0)
                if cfg.get("unshard_async") and step > 0:
                    handle = model.unshard(async_op=True)
                    mb["handle"] = type(handle).__name__
                    handle.wait()
                    mb["root_unsharded_after_wait"] = model._mfsdp2_state.shard_state.value
                loss = _loss(model, x, y, cfg, part) / micro
                mb["fwd_events"] = list(event_log.events)
                mb["fwd_peak_weight"] = stats.peak_by_role.get("weight", 0)
                mb["fwd_ag"] = comm_stats.all_gather_calls
                mb["live_weight_after_fwd"] = stats.live_by_role.get("weight", 0)
                event_log.clear()
                stats.reset_peak()
                loss.backward()
                mb["bwd_events"] = list(event_log.events)
                mb["bwd_peak_weight"] = stats.peak_by_role.get("weight", 0)
                mb["bwd_peak_grad"] = stats.peak_by_role.get("grad", 0)
                mb["live_weight_after_bwd"] = stats.live_by_role.get("weight", 0)
                mb["live_grad_after_bwd"] = stats.live_by_role.get("grad", 0)
                mb["ag"] = comm_stats.all_gather_calls
                mb["rs"] = comm_stats.reduce_scatter_calls
                rec["micro"].append(mb)
                total += loss.detach()
            if cfg.get("unshard_before_opt_step"):
                # Gathers the root's *current* shards; the optimizer then changes them, so the
                # next forward must notice the gather is stale and gather again.
                model.unshard(async_op=True)
            opt.step()
            opt.zero_grad()
            if prof is not None:
                prof.__exit__(None, None, None)
                rec["profile_names"] = sorted({e.name for e in prof.events() if e.name.startswith("mfsdp2")})
            dist.all_reduce(total)
            rec["loss"] = total.item() / ws
            rec["mispredictions_after"] = sched.mispredictions
            rec["recorded"] = [s.name for s in sched.recorded]
            if step in cfg.get("eval_after", ()):
                before = (sched.mispredictions, list(rec["recorded"]))
                comm_stats.reset()
                event_log.clear()
                with torch.no_grad():
                    y_eval = model(_rows(_eval_batch(), part))
                out["evals"][step] = {
                    "out": y_eval,
                    "ag": comm_stats.all_gather_calls,
                    "rs": comm_stats.reduce_scatter_calls,
                    "events": list(event_log.events),
                    "live_weight": stats.live_by_role.get("weight", 0),
                    "schedule_unchanged": before == (sched.mispredictions, [s.name for s in sched.recorded]),
                }
            out["steps"].append(rec)
    finally:
        event_log.enabled = False
    for mod in model.modules():  # put the DTensors back everywhere (reshard_after_backward=False leaves units gathered)
        if isinstance(mod, FSDPModule):
            mod.reshard()
    out["all_dtensor_after_reshard"] = all(isinstance(p, DTensor) for p in model.parameters())
    out["live_weight_end"] = stats.live_by_role.get("weight", 0)
    out["params"] = {k: p.full_tensor() for k, p in params.items()}
    return out


def _run_configs(rank, ws, cfgs):
    results = {}
    for name, cfg in cfgs.items():
        try:
            results[name] = cfg.get("fn", _run_one)(rank, ws, cfg)
        except Exception as e:
            raise RuntimeError(f"configuration {name!r} failed on rank {rank}") from e
        dist.barrier()
    return results


# -- checks ---------------------------------------------------------------------------------------
def assert_parity(results, cfg):
    ref_losses, ref_evals, ref_params = reference(cfg)
    assert ref_losses[-1] < ref_losses[0], "the reference did not train: parity would prove nothing"
    for rank, res in enumerate(results):
        losses = [s["loss"] for s in res["steps"]]
        assert_losses_close(losses, ref_losses, f"rank {rank}", REL_F64)
        assert set(res["params"]) == set(ref_params)
        for name, ref in ref_params.items():
            assert_close_rel(res["params"][name], ref, f"rank {rank} {name}", REL_F64)
        for step, ref_out in ref_evals.items():
            assert_close_rel(res["evals"][step]["out"], _rows(ref_out, (rank, len(results))),
                             f"rank {rank} eval {step}", REL_F64)
        assert res["all_dtensor_after_reshard"]
        assert res["live_weight_end"] == 0


def _pos(events, kind, unit):
    hits = [i for i, e in enumerate(events) if e == (kind, unit)]
    assert len(hits) == 1, f"expected exactly one {(kind, unit)} in the pass, found {len(hits)}: {events}"
    return hits[0]


def _spawn(cfgs, ws=WS):
    return run_ranks(_run_configs, ws, cfgs, timeout=150)


# =================================================================================================
# 1, 2, 6: the default schedule: overlap by order, allocator peaks, profiler ranges, parity
# =================================================================================================
BASE = dict(opt="adamw", batch=8, steps=6, depth2_from=4, profile_step=3)


@pytest.fixture(scope="module")
def base_run():
    return _spawn({"base": BASE})


def test_default_schedule_parity(base_run):
    assert_parity([r["base"] for r in base_run], BASE)


def test_forward_prefetch_issued_before_previous_block_computes(base_run):
    for rank, res in enumerate(r["base"] for r in base_run):
        steps = res["steps"]
        # Step 0 has no recorded order: every block is gathered on demand, after the previous one ran.
        ev = steps[0]["micro"][0]["fwd_events"]
        for i in range(N_BLOCKS - 1):
            assert _pos(ev, "ag_issue", BLOCKS[i + 1]) > _pos(ev, "forward_end", BLOCKS[i]), (rank, ev)
        # Steps 1..3 (depth 1): block i+1's all-gather is issued before block i starts computing,
        # and the root's pre-forward prefetches block 0.
        for step in (1, 2, 3):
            ev = steps[step]["micro"][0]["fwd_events"]
            assert _pos(ev, "ag_issue", "blocks.0") < _pos(ev, "forward_begin", "root"), (rank, step, ev)
            for i in range(N_BLOCKS - 1):
                assert _pos(ev, "ag_issue", BLOCKS[i + 1]) < _pos(ev, "forward_begin", BLOCKS[i]), (rank, step, ev)
                if i + 2 < N_BLOCKS:  # depth 1: not two ahead
                    assert _pos(ev, "ag_issue", BLOCKS[i + 2]) > _pos(ev, "forward_begin", BLOCKS[i]), (rank, step, ev)
        # Steps 4, 5 (set_prefetch_depth(2)): two blocks ahead.
        for step in (4, 5):
            ev = steps[step]["micro"][0]["fwd_events"]
            for i in range(N_BLOCKS - 2):
                assert _pos(ev, "ag_issue", BLOCKS[i + 2]) < _pos(ev, "forward_begin", BLOCKS[i]), (rank, step, ev)
        assert all(s["mispredictions_after"] == 0 for s in steps), [s["mispredictions_after"] for s in steps]


def test_backward_overlaps_reduce_scatter_and_prefetch(base_run):
    for rank, res in enumerate(r["base"] for r in base_run):
        for step in range(1, BASE["steps"]):
            ev = res["steps"][step]["micro"][0]["bwd_events"]
            for i in range(1, N_BLOCKS):
                # Block i's reduce-scatter is issued before block i-1's backward has finished ...
                assert _pos(ev, "rs_issue", BLOCKS[i]) < _pos(ev, "backward_end", BLOCKS[i - 1]), (rank, step, ev)
                # ... and is still in flight while block i-1 computes (finished only after it).
                assert _pos(ev, "rs_done", BLOCKS[i]) > _pos(ev, "backward_begin", BLOCKS[i - 1]), (rank, step, ev)
                # Backward prefetch: block i-1's all-gather is issued before block i's backward runs.
                assert _pos(ev, "ag_issue", BLOCKS[i - 1]) < _pos(ev, "backward_begin", BLOCKS[i]), (rank, step, ev)
            # The root (no hooked inputs) is reduced by the final callback, last.
            assert _pos(ev, "rs_issue", "root") > _pos(ev, "backward_end", "blocks.0")


def test_allocator_peaks(base_run):
    """What is asserted, per unit with one parameter group (one "weight" buffer per unit):

    * forward: the root stays gathered from its pre-forward to the end of backward, so the peak
      of live unsharded weights is root + the running block + ``depth`` prefetched blocks:
      exactly 3 at depth 1 and 4 at depth 2 once the order is recorded (2 in step 0: no prefetch);
    * backward: the same bound for weights (root + running + ``depth``), and exactly 1 unsharded
      gradient buffer: one reduction input alive at a time, as FSDP2's default
      (``set_reduce_scatter_max_input_buffers(1)``): the previous unit's reduction is finished
      before this unit's gradients are packed (its overlap with the next unit's backward is
      checked by test_backward_overlaps_reduce_scatter_and_prefetch);
    * between steps nothing is gathered and no gradient buffer is live.
    """
    for rank, res in enumerate(r["base"] for r in base_run):
        for step, s in enumerate(res["steps"]):
            mb = s["micro"][0]
            depth = 2 if step >= BASE["depth2_from"] else 1
            want_fwd = 2 if step == 0 else 1 + 1 + depth
            where = (rank, step, mb["fwd_peak_weight"], mb["bwd_peak_weight"], mb["bwd_peak_grad"])
            assert mb["live_weight_before"] == 0, where
            assert mb["fwd_peak_weight"] == want_fwd, where
            assert mb["live_weight_after_fwd"] == 1, where  # the root
            assert mb["bwd_peak_weight"] <= 1 + 1 + depth, where
            assert mb["bwd_peak_grad"] == 1, where
            assert mb["live_weight_after_bwd"] == 0 and mb["live_grad_after_bwd"] == 0, where


def test_collective_counts_default(base_run):
    for res in (r["base"] for r in base_run):
        for s in res["steps"]:
            mb = s["micro"][0]
            # one per unit in forward, one per block in backward (the root is not resharded after forward)
            assert mb["fwd_ag"] == N_UNITS
            assert mb["ag"] == 1 + 2 * N_BLOCKS
            assert mb["rs"] == N_UNITS


def test_profiler_trace_has_named_ranges(base_run):
    for res in (r["base"] for r in base_run):
        names = res["steps"][BASE["profile_step"]]["profile_names"]
        for prefix in ("mfsdp2.unshard", "mfsdp2.reshard", "mfsdp2.reduce_grad"):
            assert any(n.startswith(prefix) for n in names), (prefix, names)
        assert any(n == "mfsdp2.unshard blocks.2" for n in names), names


# =================================================================================================
# 3: activation checkpointing inside FSDP units and around whole FSDP modules
# =================================================================================================
CKPT_MODES = ["inside-reentrant", "inside-nonreentrant", "around-reentrant", "around-nonreentrant"]
CKPT = {m: dict(opt="adamw", batch=8, steps=4, ckpt=m) for m in CKPT_MODES}


def _mp_region(block, x):
    """A checkpointed region where an FSDP unit's (cast) output is saved by an op after it."""
    return torch.sin(block(x))


def _mp_region_inputs():
    torch.manual_seed(0)
    return Block(8, 16), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _run_mp_region(rank, ws, cfg):
    block, x = _mp_region_inputs()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    fully_shard(block, mesh=init_device_mesh("cpu", (ws,)), mp_policy=mp)
    x.requires_grad_()
    y = checkpoint(_mp_region, block, x, use_reentrant=False)
    y.sum().backward()
    return {"y": y.detach(), "x_grad": x.grad}


CKPT["mp_output_cast"] = dict(fn=_run_mp_region)


@pytest.fixture(scope="module")
def ckpt_run():
    return _spawn(CKPT)


@pytest.mark.parametrize("mode", CKPT_MODES)
def test_checkpoint_parity(ckpt_run, mode):
    assert_parity([r[mode] for r in ckpt_run], CKPT[mode])


def test_checkpoint_recompute_casts_outputs_like_forward(ckpt_run):
    """With ``output_dtype``, the recompute must produce what the forward produced (fp32 here, from
    bf16 compute), or the non-reentrant checkpoint rejects the recomputed saved tensors."""
    block, x = _mp_region_inputs()
    ref_block = block.to(torch.bfloat16)  # what the unit computes with: bf16 weights and inputs
    x.requires_grad_()
    y = torch.sin(ref_block(x.to(torch.bfloat16)).float())
    y.sum().backward()
    for rank, res in enumerate(r["mp_output_cast"] for r in ckpt_run):
        assert res["y"].dtype == torch.float32
        # The same casts on the same values: a bf16 rounding (2^-8 = 3.9e-3 relative) of any
        # intermediate differing would exceed 1e-3, so this asks for the same computation.
        assert_close_rel(res["y"], y.detach(), f"rank {rank} y", rel=1e-3)
        assert_close_rel(res["x_grad"], x.grad, f"rank {rank} x.grad", rel=1e-3)


@pytest.mark.parametrize("mode", CKPT_MODES)
def test_checkpoint_gathers_once_per_pass(ckpt_run, mode):
    """One all-gather per unit per forward, one per block per backward, none for the recompute."""
    for rank, res in enumerate(r[mode] for r in ckpt_run):
        for step, s in enumerate(res["steps"]):
            mb = s["micro"][0]
            where = (rank, step, mb["fwd_ag"], mb["ag"], mb["rs"])
            assert mb["fwd_ag"] == N_UNITS, where
            assert mb["ag"] == 1 + 2 * N_BLOCKS, where
            assert mb["rs"] == N_UNITS, where
            assert mb["bwd_peak_grad"] <= 2 and mb["live_weight_after_bwd"] == 0, where
            if mode.startswith("around"):
                # The recompute ran the FSDP module again inside backward (its hooks saw it) ...
                for b in BLOCKS:
                    assert ("forward_begin", b) in mb["bwd_events"], (where, mb["bwd_events"])
            if step >= 1:
                # ... and the backward still prefetches the next block in steady state.
                ev = mb["bwd_events"]
                for i in range(1, N_BLOCKS):
                    assert _pos(ev, "ag_issue", BLOCKS[i - 1]) < _pos(ev, "backward_begin", BLOCKS[i]), (where, ev)
        # Never a misprediction: the reentrant flavour around whole modules (whose forward runs
        # under no_grad, unhooked) is learned in step 0 and predicted from step 1 on.
        assert [s["mispredictions_after"] for s in res["steps"]] == [0] * len(res["steps"])


# =================================================================================================
# 4, 5: gradient accumulation and passes that change the schedule
# =================================================================================================
VARIANTS = {
    # 4 micro-batches of 4 rows, no sync on the first 3. SGD: its update scales with the gradient,
    # so a gradient reduced (or accumulated) twice cannot match.
    "accum": dict(opt="sgd", batch=16, steps=3, micro=4),
    "eval": dict(opt="adamw", batch=8, steps=4, eval_after=(0, 1, 2)),
    "skip": dict(opt="adamw", batch=8, steps=6, skip={2: (2,)}),
    "multi_forward": dict(opt="sgd", batch=8, steps=4, multi_forward=True),
    "no_reshard_after_backward": dict(opt="sgd", batch=8, steps=3, reshard_after_backward=False),
    "no_reshard_after_forward": dict(opt="adamw", batch=8, steps=3, reshard_after_forward=False),
    "unshard_async": dict(opt="adamw", batch=8, steps=3, unshard_async=True),
    "unshard_before_opt_step": dict(opt="adamw", batch=8, steps=3, unshard_before_opt_step=True),
}


@pytest.fixture(scope="module")
def variants_run():
    return _spawn(VARIANTS)


def _variant(run, name):
    return [r[name] for r in run]


def test_gradient_accumulation_without_sync(variants_run):
    res_all = _variant(variants_run, "accum")
    assert_parity(res_all, VARIANTS["accum"])
    for res in res_all:
        for s in res["steps"]:
            assert [mb["rs"] for mb in s["micro"]] == [0, 0, 0, N_UNITS]
            assert all(mb["ag"] == 1 + 2 * N_BLOCKS for mb in s["micro"])
            assert all(mb["live_weight_after_bwd"] == 0 for mb in s["micro"])
        assert res["steps"][-1]["mispredictions_after"] == 0


def test_eval_pass_between_steps(variants_run):
    res_all = _variant(variants_run, "eval")
    assert_parity(res_all, VARIANTS["eval"])  # includes the eval outputs
    for res in res_all:
        for step, ev in res["evals"].items():
            assert ev["ag"] == N_UNITS and ev["rs"] == 0, ev
            assert ev["live_weight"] == 0  # an eval pass leaves nothing gathered, the root included
            assert ev["schedule_unchanged"]  # not recorded, not a misprediction
            events = ev["events"]
            for i in range(N_BLOCKS - 1):  # and it uses the recorded order to prefetch
                assert _pos(events, "ag_issue", BLOCKS[i + 1]) < _pos(events, "forward_begin", BLOCKS[i]), events
        assert all(s["mispredictions_after"] == 0 for s in res["steps"])
        for s in res["steps"][1:]:  # the training steps after an eval still prefetch
            mb = s["micro"][0]
            assert mb["fwd_peak_weight"] == 3 and mb["ag"] == 1 + 2 * N_BLOCKS


def test_skipped_module_recovers(variants_run):
    res_all = _variant(variants_run, "skip")
    assert_parity(res_all, VARIANTS["skip"])
    full = ["root"] + BLOCKS
    for res in res_all:
        steps = res["steps"]
        inc = [s["mispredictions_after"] - s["mispredictions_before"] for s in steps]
        # step 2 skips blocks.2 (mispredicted), step 3 runs it again (mispredicted against the new
        # record), then the order is stable again.
        assert inc == [0, 0, 1, 1, 0, 0], inc
        assert [s["recorded"] for s in steps] == [full, full, full[:3] + full[4:], full, full, full]
        skip = steps[2]["micro"][0]
        # blocks.2 was prefetched by blocks.1 (the one wasted all-gather), dropped at the end of
        # forward, and neither computed nor reduced.
        assert skip["ag"] == 1 + 2 * N_BLOCKS - 1, skip["ag"]
        assert ("ag_issue", "blocks.2") in skip["fwd_events"] and ("reshard", "blocks.2") in skip["fwd_events"]
        assert ("forward_begin", "blocks.2") not in skip["fwd_events"]
        assert skip["rs"] == N_UNITS - 1 and skip["live_weight_after_fwd"] == 1
        # Backward is predicted from this step's forward: blocks.3 prefetches blocks.1.
        ev = skip["bwd_events"]
        assert _pos(ev, "ag_issue", "blocks.1") < _pos(ev, "backward_begin", "blocks.3"), ev
        # Prefetch resumed: the steps after the recovery overlap like before the skip.
        for s in steps[4:]:
            ev = s["micro"][0]["fwd_events"]
            for i in range(N_BLOCKS - 1):
                assert _pos(ev, "ag_issue", BLOCKS[i + 1]) < _pos(ev, "forward_begin", BLOCKS[i]), ev
            assert s["micro"][0]["ag"] == 1 + 2 * N_BLOCKS


def test_several_forwards_before_one_backward(variants_run):
    res_all = _variant(variants_run, "multi_forward")
    assert_parity(res_all, VARIANTS["multi_forward"])
    for res in res_all:
        for s in res["steps"]:
            mb = s["micro"][0]
            # root once; each block: 2 forwards + 2 backwards (a block reshards after each backward)
            assert mb["ag"] == 1 + 4 * N_BLOCKS, mb["ag"]
            assert mb["rs"] == N_UNITS, mb["rs"]  # both forwards' gradients reduced together, once
            assert mb["live_weight_after_bwd"] == 0
        # Both forwards follow the recorded order and the backward is predicted from both.
        assert all(s["mispredictions_after"] == 0 for s in res["steps"]), [
            s["mispredictions_after"] for s in res["steps"]]


def test_no_reshard_after_backward(variants_run):
    res_all = _variant(variants_run, "no_reshard_after_backward")
    assert_parity(res_all, VARIANTS["no_reshard_after_backward"])
    for res in res_all:
        for step, s in enumerate(res["steps"]):
            mb = s["micro"][0]
            assert mb["live_weight_after_bwd"] == N_UNITS  # everything stays gathered
            # the optimizer step makes the kept weights stale: the next forward re-gathers them
            assert mb["fwd_ag"] == N_UNITS and mb["ag"] == 1 + 2 * N_BLOCKS, (step, mb["fwd_ag"], mb["ag"])


def test_no_reshard_after_forward(variants_run):
    res_all = _variant(variants_run, "no_reshard_after_forward")
    assert_parity(res_all, VARIANTS["no_reshard_after_forward"])
    for res in res_all:
        for s in res["steps"]:
            mb = s["micro"][0]
            assert mb["ag"] == N_UNITS  # gathered once per step: backward reuses the forward's weights
            assert mb["live_weight_after_fwd"] == N_UNITS and mb["live_weight_after_bwd"] == 0
            assert mb["rs"] == N_UNITS


def test_explicit_async_unshard(variants_run):
    res_all = _variant(variants_run, "unshard_async")
    assert_parity(res_all, VARIANTS["unshard_async"])
    for res in res_all:
        for s in res["steps"][1:]:
            mb = s["micro"][0]
            assert mb["handle"] == UnshardHandle.__name__
            assert mb["root_unsharded_after_wait"] == "unsharded"
            assert mb["fwd_events"][0] == ("ag_issue", "root")
            assert mb["ag"] == 1 + 2 * N_BLOCKS  # the forward does not gather the root again
        # the unshard issued before the root context existed is accounted for and released
        assert res["live_weight_end"] == 0


def test_async_unshard_before_optimizer_step_is_regathered(variants_run):
    res_all = _variant(variants_run, "unshard_before_opt_step")
    assert_parity(res_all, VARIANTS["unshard_before_opt_step"])  # no stale root weights
    for res in res_all:
        for s in res["steps"][1:]:
            mb = s["micro"][0]
            # the stale in-flight gather is dropped and the root gathered again
            assert mb["fwd_events"][:2] == [("reshard", "root"), ("ag_issue", "root")], mb["fwd_events"][:3]
            assert mb["ag"] == 1 + 2 * N_BLOCKS


# =================================================================================================
# world size 4
# =================================================================================================
WS4 = {
    "base": dict(opt="adamw", batch=8, steps=3),
    "around-reentrant": dict(opt="adamw", batch=8, steps=3, ckpt="around-reentrant"),
    "accum": dict(opt="sgd", batch=16, steps=2, micro=4),
}


@pytest.mark.slow
def test_world_size_4():
    results = _spawn(WS4, ws=4)
    for name, cfg in WS4.items():
        res_all = [r[name] for r in results]
        assert_parity(res_all, cfg)
        for res in res_all:
            last = res["steps"][-1]["micro"][-1]
            ev = last["fwd_events"]
            for i in range(N_BLOCKS - 1):
                assert _pos(ev, "ag_issue", BLOCKS[i + 1]) < _pos(ev, "forward_begin", BLOCKS[i]), (name, ev)
            assert last["rs"] == N_UNITS and last["bwd_peak_grad"] <= 2
