"""Allocators: the pool planner against exact lower bounds, the trace pool's replay and divergence
handling (no shared bytes, no corrupted contents), and training parity per allocator with eval
passes and gradient accumulation between training steps."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import TracePoolAllocator, fully_shard
from mfsdp2.base import compat
from mfsdp2.memory.allocator import EXACT_ROLES, role_of
from mfsdp2.memory.pool_plan import Interval, PoolPlan, check_plan, max_live, plan_pool

from .._dist import run_ranks
from .._optional import given, settings, st
from ..models import (
    F64, REL_F64, assert_close_rel, assert_losses_close, batch, build, loss_fn, make_opt, reference_run, reference_step,
)

ALIGN = 16


# -- planner ------------------------------------------------------------------------------------
def random_trace(seed: int, n_events: int = 80, max_live_blocks: int = 8) -> list[Interval]:
    """Random alloc/free sequences: a few recurring sizes (as in a model) plus odd ones."""
    r = random.Random(seed)
    sizes = [r.choice([1, 2, 4, 8, 16, 32, 64]) * 1024 for _ in range(6)]
    t, live, ivs = 0, [], []
    for _ in range(n_events):
        t += 1
        if live and (len(live) >= max_live_blocks or r.random() < 0.5):
            start, size = live.pop(r.randrange(len(live)))
            ivs.append(Interval(start, t, size))
        else:
            live.append((t, r.choice(sizes) if r.random() < 0.8 else r.randint(1, 1 << 16)))
    for start, size in live:
        t += 1
        ivs.append(Interval(start, t, size))
    return ivs


intervals_st = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 20), st.integers(0, 5000)).map(
        lambda t: Interval(t[0], t[0] + t[1], t[2])
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(intervals_st)
def test_plan_never_shares_bytes_between_overlapping_lifetimes(ivs):
    plan = plan_pool(ivs, ALIGN)
    check_plan(ivs, plan, ALIGN)  # raises on shared bytes / misalignment
    assert plan.pool_size >= max_live(ivs, ALIGN)
    assert plan_pool(ivs, ALIGN) == plan  # deterministic


# derandomize: the bound is empirical (the optimum itself can exceed 1.15x on adversarial traces),
# so CI checks the same 200 traces every run instead of new ones (no flaky failures).
@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(0, 2**32 - 1))
def test_plan_within_15_percent_of_lower_bound_on_random_traces(seed):
    ivs = random_trace(seed)
    plan = plan_pool(ivs, ALIGN)
    check_plan(ivs, plan, ALIGN)
    lb = max_live(ivs, ALIGN)
    assert lb <= plan.pool_size <= 1.15 * lb, (seed, plan.pool_size / lb)


def test_max_live_and_plan_exact_small_cases():
    # Two disjoint lifetimes share the bytes; a third overlapping both sits beside them.
    ivs = [Interval(0, 2, 100), Interval(2, 4, 100), Interval(1, 3, 50)]
    assert max_live(ivs) == 150
    plan = plan_pool(ivs)
    check_plan(ivs, plan)
    assert plan.pool_size == 150
    # A bad plan is caught.
    with pytest.raises(AssertionError, match="share bytes"):
        check_plan(ivs, PoolPlan((0, 0, 0), 100, "wrong"))


# -- trace pool, single process -------------------------------------------------------------------
class Checked:
    """Drives an allocator and proves no two live buffers share bytes and none was overwritten:
    each buffer is filled with its own id at allocation and checked at free."""

    def __init__(self, alloc):
        self.alloc = alloc
        self.live: dict = {}
        self.next_id = 1

    def a(self, key, numel, dtype=torch.float32):
        t = self.alloc.allocate(key, numel, dtype, "cpu")
        assert t.numel() == numel and t.dtype == dtype
        lo, hi = t.data_ptr(), t.data_ptr() + numel * t.element_size()
        for k, (u, l2, h2, _) in self.live.items():
            assert not (numel and u.numel() and lo < h2 and l2 < hi), f"{key} shares bytes with live {k}"
        t.fill_(self.next_id)
        self.live[key] = (t, lo, hi, self.next_id)
        self.next_id += 1

    def f(self, key):
        t, _, _, ident = self.live.pop(key)
        assert bool((t == ident).all()), f"{key} was overwritten while live"
        self.alloc.free(key)


def _step(c: Checked, units: int, size: int = 1000, tag=("train", True), prefetch: bool = True):
    """One FSDP-like step: weights gathered with one prefetch in forward and backward, a grad
    buffer and a reduce-scatter output per unit in backward."""
    c.alloc.mark_step(tag)
    c.a(("weight", 0), size)
    for u in range(units):
        if prefetch and u + 1 < units:
            c.a(("weight", u + 1), size)
        c.f(("weight", u))
        if not prefetch and u + 1 < units:
            c.a(("weight", u + 1), size)
    if tag[0] == "eval":
        return
    c.a(("weight", units - 1), size)
    for u in reversed(range(units)):
        if u > 0:
            c.a(("weight", u - 1), size)
        c.a(("grad", u), size)
        c.f(("weight", u))
        c.a(("rs_out", u), size // 2)
        c.f(("grad", u))
        c.f(("rs_out", u))


def test_trace_pool_replays_with_zero_allocations_and_matches_caching_live_bytes():
    tp = TracePoolAllocator(debug=True)
    c = Checked(tp)
    for _ in range(2):
        _step(c, 6)
    before = tp.stats.underlying_allocations
    hits = tp.trace_stats.pool_hits
    for _ in range(5):
        _step(c, 6)
    assert tp.stats.underlying_allocations == before  # steady state: nothing new
    assert tp.trace_stats.pool_hits - hits == 5 * (6 + 6 * 3)  # every request from the pool
    assert tp.trace_stats.divergences == 0 and tp.trace_stats.plans == 1
    # The pool is the step's peak live bytes (3 buffers of 1000 + one of 500 alive at most).
    assert tp.trace_stats.pool_bytes <= 1.05 * tp.stats.peak_bytes


class _Observer:
    """Records what an allocator tells its observers, and which keys' blocks were made while it
    said a key was being obtained (what ``mfsdp2.FSDPMemTracker`` files by role)."""

    def __init__(self):
        self.events, self.obtaining = [], None

    def allocating(self, key):
        assert self.obtaining is None, (self.obtaining, key)
        self.obtaining = key
        self.events.append(("allocating", key))

    def allocated(self, key, block):
        assert self.obtaining == key, (self.obtaining, key)
        self.obtaining = None
        self.events.append(("allocated", key, None if block is None else block.data_ptr()))


@pytest.mark.parametrize("alloc_name", ["dynamic", "caching", "trace_pool"])
def test_observers_hear_every_allocation_around_obtaining_its_block(alloc_name):
    from mfsdp2.memory.trace_pool import make_allocator

    alloc = make_allocator(alloc_name)
    obs = _Observer()
    alloc.observers.append(obs)
    c = Checked(alloc)
    for _ in range(3):  # traced, planned, replayed from the pool
        _step(c, 3)
    # Every allocate, fresh or served from a pool: told before it is obtained, then the block served.
    requests = [e for e in obs.events if e[0] == "allocated"]
    assert len(requests) == 3 * (3 + 3 * 3) and len(obs.events) == 2 * len(requests)
    assert all(a[0] == "allocating" and b[0] == "allocated" and a[1] == b[1]
               for a, b in zip(obs.events[::2], obs.events[1::2]))
    assert obs.obtaining is None
    # A failed request is told too, with no block, and leaves the allocator usable.
    alloc._obtain = lambda *a: (_ for _ in ()).throw(MemoryError("planted"))
    with pytest.raises(MemoryError):
        alloc.allocate(("weight", 9), 10, torch.float32, "cpu")
    assert obs.events[-2:] == [("allocating", ("weight", 9)), ("allocated", ("weight", 9), None)]
    assert not alloc.is_live(("weight", 9))


def test_trace_pool_divergence_falls_back_then_replans_when_the_pattern_repeats():
    tp = TracePoolAllocator(debug=True)
    c = Checked(tp)
    _step(c, 4)  # traced and planned
    _step(c, 4)  # replayed
    assert tp.trace_stats.divergences == 0
    _step(c, 4, prefetch=False)  # a different order: the rest of the step from the fallback
    assert tp.trace_stats.divergences == 1
    plans = tp.trace_stats.plans
    _step(c, 5)  # another new pattern (a unit more): diverges, becomes the candidate
    _step(c, 5)  # ... repeats: re-planned when the next step begins
    _step(c, 5)
    assert tp.trace_stats.plans == plans + 1
    n, d = tp.stats.underlying_allocations, tp.trace_stats.divergences
    _step(c, 5)
    _step(c, 5)
    assert tp.stats.underlying_allocations == n
    # Eval passes have their own plan and do not disturb the training plan.
    for _ in range(3):
        _step(c, 5, tag=("eval", True))
        _step(c, 5)
    assert tp.trace_stats.divergences == d


def test_trace_pool_never_hands_out_bytes_of_a_block_that_outlived_its_step():
    tp = TracePoolAllocator(debug=True)
    c = Checked(tp)
    for _ in range(2):  # two kinds of step, each planned with its buffer at offset 0
        tp.mark_step("A")
        c.a("x", 1000)
        c.f("x")
        tp.mark_step("B")
        c.a("y", 1000)
        c.f("y")
    assert tp.trace_stats.pool_hits == 2
    tp.mark_step("A")
    c.a("x", 1000)  # from the pool, and still live when the step ends (an interrupted step)
    tp.mark_step("B")
    c.a("y", 1000)  # planned at the same offset: must come from elsewhere (Checked proves it)
    # Two divergences: step A ended before its free; B's slot was taken.
    assert tp.trace_stats.pool_hits == 3 and tp.trace_stats.divergences == 2
    c.f("x")
    c.f("y")
    assert tp.stats.live_bytes == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["train", "eval", "short", "odd"]), st.integers(2, 5)), max_size=12))
def test_trace_pool_random_step_sequences_keep_every_buffer_intact(steps):
    tp = TracePoolAllocator(debug=True)
    c = Checked(tp)
    left = []
    for i, (kind, units) in enumerate(steps):
        if kind == "train":
            _step(c, units)
        elif kind == "eval":
            _step(c, units, tag=("eval", True))
        elif kind == "odd":
            _step(c, units, size=777, prefetch=False)
        else:  # ends early: a buffer stays live through the next step
            tp.mark_step(("train", True))
            c.a(("weight", 0), 1000)
            c.a(("left", i), 1000)
            c.f(("weight", 0))
            left.append(("left", i))
            continue
        while left:
            c.f(left.pop())
    for key in list(c.live):
        c.f(key)
    assert tp.stats.live_bytes == 0


# -- distributed: parity per allocator, steady state, traces of a real step -----------------------
GLOBAL_BATCH = 8
SCHEDULE = ["train", "eval", "train", "accum", "eval", "train", "accum", "train"]


EVAL_X = torch.ones(2, 12, dtype=F64)


def _mixed_reference():
    """The unsharded model through SCHEDULE on the global batch: an accumulation step's mean of
    two half-batch means is the full batch's mean; eval outputs at the same points."""
    torch.set_num_threads(1)
    model = build("net", dtype=F64)
    opt = make_opt("adamw", model.parameters())
    losses, evals, step = [], [], 0
    for kind in SCHEDULE:
        if kind == "eval":
            with torch.no_grad():
                evals.append(model(EVAL_X).sum().item())
            continue
        losses.append(reference_step(model, opt, step, GLOBAL_BATCH, F64))
        step += 1
    return losses, evals, {k: v.detach().clone() for k, v in model.named_parameters()}


def _train_mixed(rank, ws, alloc_name):
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=F64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh, allocator=alloc_name)
    opt = make_opt("adamw", model.parameters())
    n = GLOBAL_BATCH // ws
    losses, evals = [], []
    step = 0
    for kind in SCHEDULE:
        if kind == "eval":  # forward-only pass between training steps
            model.eval()
            with torch.no_grad():
                evals.append(model(EVAL_X).sum().item())
            model.train()
            continue
        x, y = batch(step, GLOBAL_BATCH, 12, dtype=F64)
        x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        micro = 2 if kind == "accum" else 1
        total = 0.0
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            h = n // micro
            loss = loss_fn(model(x[m * h : (m + 1) * h]), y[m * h : (m + 1) * h]) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        t = torch.tensor(total, dtype=F64)
        dist.all_reduce(t)
        losses.append(t.item() / ws)
        step += 1
    a = model.allocator
    # After the last step only the main grads are live (until the next forward releases them).
    assert {r: n for r, n in a.stats.live_by_role.items() if n} == {"main_grad": 4}, a.stats
    params = {k: p.full_tensor() for k, p in model.named_parameters()}
    return losses, evals, params, type(a).__name__


@pytest.mark.parametrize("alloc_name", ["dynamic", "caching", "trace_pool"])
def test_parity_per_allocator_with_eval_and_accumulation_between_steps(alloc_name):
    ref_losses, ref_evals, ref_params = _mixed_reference()
    for rank, (losses, evals, params, cls) in enumerate(run_ranks(_train_mixed, 2, alloc_name)):
        assert cls == {"dynamic": "DynamicAllocator", "caching": "CachingAllocator",
                       "trace_pool": "TracePoolAllocator"}[alloc_name]
        # Eval outputs, losses and weights against the unsharded model (float64, REL_F64: see
        # tests/models.py); an eval that saw stale or half-gathered weights is off by >= 1e-3.
        assert_losses_close(evals, ref_evals, f"rank {rank} eval", REL_F64)
        assert_losses_close(losses, ref_losses, f"rank {rank}", REL_F64)
        for k, ref in ref_params.items():
            assert_close_rel(params[k], ref, f"rank {rank} {k}", REL_F64)


def _steady(rank, ws, alloc_name, model_kind, fresh_bytes=None):
    if fresh_bytes is not None:  # which CPU blocks the caching allocator keeps (see its keeps())
        import mfsdp2.memory.allocator

        mfsdp2.memory.allocator.MAP_FRESH_BYTES = fresh_bytes
    mesh = init_device_mesh("cpu", (ws,))
    if model_kind == "llama":
        import torch.nn.functional as F

        from mfsdp2.models.llama import LlamaConfig, SyntheticTokens, Transformer, rank_slice

        cfg = dataclasses.replace(LlamaConfig.tiny(), n_layers=6)
        torch.manual_seed(0)
        model = Transformer(cfg)
        units = model.layers
        data = SyntheticTokens(cfg.vocab_size, seed=7)

        def step_loss(step):
            x, y = data.batch(step, 4, cfg.max_seq_len)
            return F.cross_entropy(model(rank_slice(x, rank, ws)).flatten(0, 1), rank_slice(y, rank, ws).flatten())
    else:
        model = build("net")
        units = model.blocks

        def step_loss(step):
            x, y = batch(step, GLOBAL_BATCH, 12)
            n = GLOBAL_BATCH // ws
            return loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])

    for u in units:
        fully_shard(u, mesh=mesh)
    fully_shard(model, mesh=mesh,
                allocator=TracePoolAllocator(debug=True) if alloc_name == "trace_pool" else alloc_name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counts = []
    for step in range(7):
        step_loss(step).backward()
        opt.step()
        opt.zero_grad()
        counts.append(model.allocator.stats.underlying_allocations)
    out = {"counts": counts, "per_step": [b - a for a, b in zip(counts, counts[1:])]}
    a = model.allocator
    if isinstance(a, TracePoolAllocator):
        # The recorded training step, as intervals: how close is the plan to the lower bound?
        plan = a._plans[("train", True)]
        freed, opened = {}, {}
        for i, ev in enumerate(plan.events):
            if ev[0] == "a":
                opened[ev[1]] = (i, ev[2] * ev[3].itemsize)
            elif ev[1] in opened:
                s, nbytes = opened.pop(ev[1])
                freed[s] = Interval(s, i, nbytes)
        ivs = list(freed.values())
        p = plan_pool(ivs, 64)
        out["ratio"] = p.pool_size / max_live(ivs, 64)
        out["n_intervals"] = len(ivs)
        out["hits"] = (a.trace_stats.pool_hits, a.trace_stats.fallback_hits)
        hits = a.trace_stats.pool_hits
        step_loss(99).backward()
        opt.step()
        out["hits_last_step"] = a.trace_stats.pool_hits - hits
        out["fallback_last_step"] = a.trace_stats.fallback_hits - out["hits"][1]
        out["planned"] = len(plan.slots)
        out["unplanned"] = sum(ev[0] == "a" for ev in plan.events) - len(plan.slots)
        out["unplanned_roles"] = sorted({role_of(ev[1]) for i, ev in enumerate(plan.events)
                                         if ev[0] == "a" and i not in plan.slots})
    return out


@pytest.mark.parametrize("alloc_name", ["caching", "trace_pool"])
def test_steady_state_steps_obtain_the_same_memory_every_step(alloc_name):
    """After the plans settle every step obtains the same blocks from torch (no divergence, no
    growth): what a phase gave back at its end, and the main gradients, released at each forward.
    With this model's small blocks the caching allocator obtains every buffer from torch (which
    caches small blocks itself: malloc's heap); where glibc would map blocks afresh (here: all,
    ``MAP_FRESH_BYTES=0``) it reuses them within each phase and obtains far fewer.

    Without storage swapping (``compat.HAS_STORAGE_SWAP`` false) the gathered weights are torch's
    memory (``storage.resize_``, buffer.py), and this model's flat gradients all reduce through
    an all-reduce bucket (below 256 KiB on gloo): what the allocator serves is then main
    gradients and buckets, the roles given back to torch when released whatever their size
    (``EXACT_ROLES``). So the plan has nothing to pool, and ``MAP_FRESH_BYTES=0`` changes
    nothing."""
    small = run_ranks(_steady, 2, alloc_name, "net")
    for r in small:
        assert len(set(r["per_step"][3:])) == 1 and r["per_step"][-1] > 0, r
        if alloc_name == "trace_pool":
            # every planned request from its pool; the rest from the fallback: main gradients,
            # buckets and (with storage swapping) the root's weights, alive through both phases
            assert r["hits_last_step"] == r["planned"] and r["fallback_last_step"] == r["unplanned"] > 0, r
            assert r["unplanned_roles"] == sorted(EXACT_ROLES | ({"weight"} if compat.HAS_STORAGE_SWAP else set())), r
            assert (r["planned"] > 0) == compat.HAS_STORAGE_SWAP, r
    if alloc_name == "caching":
        for a, b in zip(small, run_ranks(_steady, 2, "caching", "net", 0)):
            assert len(set(b["per_step"][3:])) == 1, (a, b)
            if compat.HAS_STORAGE_SWAP:
                assert b["per_step"][-1] < a["per_step"][-1], (a, b)
            else:
                assert b["per_step"] == a["per_step"], (a, b)


def test_transformer_step_trace_plans_within_5_percent_of_lower_bound():
    out = run_ranks(_steady, 2, "trace_pool", "llama")
    for r in out:
        # 6 layers + root: weights (twice for layers; not served by the allocator without storage
        # swapping, see buffer.py) and one flat gradient per unit, at least (no receive scratch at
        # world size 2: the received chunk lands in the output)
        assert r["n_intervals"] >= (6 * 2 + 1 if compat.HAS_STORAGE_SWAP else 0) + 7, r
        assert 1.0 <= r["ratio"] <= 1.05, r
        assert len(set(r["per_step"][3:])) == 1, r


# -- main grads: allocator blocks from the first reduction to the next forward ----------------------
def _main_grad_lifecycle(rank, ws, set_to_none):
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=F64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_opt("sgd", model.parameters())
    groups = [g for m in model.modules() if hasattr(m, "_mfsdp2_state") for g in m._mfsdp2_state.groups]
    n = GLOBAL_BATCH // ws
    losses, live_in_forward = [], []
    seen = {}

    def spy(mod, args, out):  # inside forward, after the root's pre-forward released them
        seen["main_grad_live"] = model.allocator.stats.live_by_role.get("main_grad", 0)

    model.blocks[0].register_forward_hook(spy)
    for step in range(4):
        x, y = batch(step, GLOBAL_BATCH, 12, dtype=F64)
        x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        total = 0.0
        for half in range(2):  # two synced backward passes accumulate into the main grads
            h = n // 2
            loss = loss_fn(model(x[half * h : (half + 1) * h]), y[half * h : (half + 1) * h]) / 2
            loss.backward()
            total += loss.item()
            if half == 0:
                live_in_forward.append(seen["main_grad_live"])
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        t = torch.tensor(total, dtype=F64)
        dist.all_reduce(t)
        losses.append(t.item() / ws)
    return (losses, live_in_forward, {k: p.full_tensor() for k, p in model.named_parameters()},
            [g.main_grad is None for g in groups])


@pytest.mark.parametrize("set_to_none", [True, False])
def test_main_grads_released_after_zero_grad_and_accumulate_across_backward_passes(set_to_none):
    ref_losses, ref_params = reference_run("net", "sgd", 4, GLOBAL_BATCH, dtype=F64)
    for rank, (losses, live_in_forward, params, _) in enumerate(run_ranks(_main_grad_lifecycle, 2, set_to_none)):
        assert_losses_close(losses, ref_losses, f"rank {rank}", REL_F64)
        for k, ref in ref_params.items():
            assert_close_rel(params[k], ref, f"rank {rank} {k}", REL_F64)
        # set_to_none: no main grad is held through the next forward (FSDP2 frees its sharded
        # grads too); zeroed grads (set_to_none=False) keep theirs.
        assert live_in_forward == ([0, 0, 0, 0] if set_to_none else [0, 4, 4, 4]), live_in_forward
