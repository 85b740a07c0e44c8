"""The scheduler: overlap proven by event order, memory bounds, profiler ranges, gradient
accumulation, and recovery from passes that leave the recorded order.

The default schedule is checked on one run of 6 steps: the forward prefetches the next block's
all-gather before the current block computes (two ahead after ``set_prefetch_depth(2)``), the
backward overlaps each block's reduce-scatter with the next block's backward and prefetch, and
the allocator's peaks of gathered weights and gradient buffers stay at the bounds that ordering
allows. The variants then change what a step does (micro-batches without sync, eval passes, a
skipped block, two forwards per backward, reshard settings, explicit ``unshard``): each must
still train like the unsharded reference and the schedule must recover its prefetching.

Every parity check compares against a single-process, unsharded reference that runs the same
model class on the whole global batch (float64, losses, eval outputs and final parameters within
REL_F64 relative: see tests/models.py). The model, the reference and the rank-side runner are in
``_schedule_runs.py``; each module-scoped fixture here is one spawn of ranks whose recorded steps
several tests check.

Unit names in the event log are module paths: ``"root"`` for the root, ``"blocks.<i>"`` for the
blocks. Steps are counted from 0: step 0 records the order, steps >= 1 predict from it.
"""

from __future__ import annotations

import pytest

from mfsdp2 import UnshardHandle

from ._schedule_runs import BLOCKS, N_BLOCKS, N_UNITS, _pos, _spawn, assert_parity


# =================================================================================================
# the default schedule: overlap by order, allocator peaks, profiler ranges, parity
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
# gradient accumulation and passes that change the schedule
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
