"""Bucketed gradient all-reduce of the full-gradient strategies (no_shard, ZeRO-1) and of the
sharded-gradient ones (ZeRO-2, ZeRO-3) whose small units' reduce-scatter is a gloo all-reduce
anyway (see mfsdp2/groups/grad_buckets.py).

* Parity in float64 against the unsharded model (REL_F64, see tests/models.py), with buckets that
  span every unit (DDP's 25 MiB), two units, and one group each (a 1-byte cap): training steps,
  then single backwards checked gradient by gradient against the unsharded model on the same
  weights -- the mean, a sum (divide factor 1), force-sum, an all-reduce hook, accumulation
  without sync, and a unit skipped in one backward (the plan breaks: what the open bucket holds is
  issued, the rest goes one group per bucket; the skipped unit keeps ``grad=None`` everywhere).
* Collective counts (torch.profiler's ``gloo:all_reduce`` events) of one training step: the
  number of all-reduces falls by exactly the number of groups that share a bucket.
* The mechanism without processes: a wait on a member of a bucket that is not issued yet issues
  it first, with the members packed so far.
* A bucket whose all-reduce fails (a work that never completes) is leaked by ``reset()``, never
  freed, and its members drop the main gradients that were its slices.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard
from mfsdp2.groups.grad_buckets import BucketMemberHandle, GradientBuckets, _plan
from mfsdp2.memory.allocator import CachingAllocator

from .._dist import run_ranks
from ..models import (
    F64, REL_F64, Net, assert_close_rel, assert_losses_close, batch, loss_fn, make_opt, reference_run,
    sharded_train_step,
)

GLOBAL_BATCH = 8
STEPS = 5
BLOCK = 32 + (16 * 40 + 40) + (40 * 16 + 16)  # elements of one block's group (norm, fc1, fc2): 1368
# Caps (MiB): every unit in one bucket; two blocks per bucket (the rest: block 0 + the root); one
# group per bucket.
CAPS = {"ddp": 25.0, "two_units": 2.5 * BLOCK * 8 / 2**20, "one_unit": 1 / 2**20}
BUCKETS_PER_STEP = {"ddp": 1, "two_units": 2, "one_unit": 4}  # 3 blocks + the root
# Full-gradient strategies, and the sharded ones (every group here is below comm's
# SMALL_REDUCE_SCATTER_BYTES at world size 2, so its reduce-scatter is an all-reduce on gloo;
# sharded groups share buckets at two ranks only, where the result is bit-identical).
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class SkipNet(Net):
    """Net whose block ``skip`` (None: none) is left out of the forward."""

    skip = None

    def forward(self, x):
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            if i != self.skip:
                h = b(h)
        return self.head(h)


def _build() -> SkipNet:
    torch.manual_seed(0)  # the same values as tests.models.build("net")
    return SkipNet().to(F64)


def _shard(model, mesh, strategy):
    for b in model.blocks:
        fully_shard(b, mesh=mesh, sharding_strategy=strategy)
    fully_shard(model, mesh=mesh, sharding_strategy=strategy)
    return model


def _reference_grads(full: dict, micro: list, skip=None) -> dict:
    """The unsharded model with weights ``full``: gradients of the summed losses of ``micro``
    (steps of the global batch), each the mean over the global batch."""
    ref = _build()
    ref.skip = skip
    with torch.no_grad():
        for k, p in ref.named_parameters():
            p.copy_(full[k])
    for step in micro:
        x, y = batch(step, GLOBAL_BATCH, 12, dtype=F64)
        loss_fn(ref(x), y).backward()
    return {k: p.grad for k, p in ref.named_parameters()}


def _backward(model, rank, ws, step):
    n = GLOBAL_BATCH // ws
    x, y = batch(step, GLOBAL_BATCH, 12, dtype=F64)
    loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()


def _check_grads(model, ref: dict, scale: float, where: str) -> None:
    for k, p in model.named_parameters():
        if ref[k] is None:
            assert p.grad is None, f"{where} {k}: unused everywhere, must keep grad=None"
            continue
        assert p.grad is not None, f"{where} {k}: no gradient"
        assert_close_rel(p.grad.full_tensor(), ref[k] * scale, f"{where} {k}", REL_F64)


def _twice(model, rank, ws, step, ref: dict, scale: float, where: str) -> None:
    """Two backwards of the same batch: the first (re)records the order, the second follows the
    plan made from it; both must give the reference's gradients."""
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        _backward(model, rank, ws, step)
        _check_grads(model, ref, scale, where)


def _bucket_run(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for strategy in STRATEGIES:
        for cap_name, cap in CAPS.items():
            where = f"{strategy}/{cap_name} rank {rank}"
            model = _shard(_build(), mesh, strategy)
            model.set_all_reduce_bucket_cap_mb(cap)
            opt = make_opt("adamw", model.parameters())
            losses = [sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH) for step in range(STEPS)]
            trained = {k: p.full_tensor().clone() for k, p in model.named_parameters()}  # no_shard: a view
            buckets = model._mfsdp2_state.ctx.buckets
            issued = buckets.issued_count
            sharded_train_step(model, opt, STEPS, rank, ws, GLOBAL_BATCH)
            per_step = buckets.issued_count - issued
            assert per_step == BUCKETS_PER_STEP[cap_name], (where, per_step)
            full = {k: p.full_tensor().clone() for k, p in model.named_parameters()}
            ref = _reference_grads(full, [7])
            _twice(model, rank, ws, 7, ref, 1.0, f"{where} mean")
            model.set_gradient_divide_factor(1.0, recurse=True)  # a sum over the ranks
            _twice(model, rank, ws, 7, ref, float(ws), f"{where} sum")
            model.set_gradient_divide_factor(None, recurse=True)
            units = [m for m in model.modules() if hasattr(m, "_mfsdp2_state")]
            for m in units:  # not recursive, as in FSDP2
                m.set_force_sum_reduction_for_comms(True)
            _twice(model, rank, ws, 7, ref, 1.0, f"{where} force-sum")
            for m in units:
                m.set_force_sum_reduction_for_comms(False)
                m.set_all_reduce_hook(lambda t: t.mul_(3.0))
            _twice(model, rank, ws, 7, ref, 3.0, f"{where} all-reduce hook")
            for m in units:
                m.set_all_reduce_hook(None)
            # Accumulation: two micro-batches, only the second synchronises.
            acc = _reference_grads(full, [7, 8])
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                for micro, step in enumerate((7, 8)):
                    model.set_requires_gradient_sync(micro == 1)
                    _backward(model, rank, ws, step)
                _check_grads(model, acc, 1.0, f"{where} accumulation")
            # A unit skipped in one backward (the plan breaks mid-bucket), then back.
            model.zero_grad(set_to_none=True)
            _backward(model, rank, ws, 7)
            for skip in (1, None):
                model.skip = skip
                model.zero_grad(set_to_none=True)
                _backward(model, rank, ws, 7)
                _check_grads(model, _reference_grads(full, [7], skip), 1.0, f"{where} skip {skip}")
            out[(strategy, cap_name)] = (losses, trained)
            del model, opt
    return out


def test_bucketed_all_reduce_matches_unsharded_model():
    ref_losses, ref_params = reference_run("net", "adamw", STEPS, GLOBAL_BATCH, dtype=F64)
    for results in run_ranks(_bucket_run, 2, timeout=600):
        for (strategy, cap), (losses, trained) in results.items():
            where = f"{strategy}/{cap}"
            assert_losses_close(losses, ref_losses, where, REL_F64)
            for k, ref in ref_params.items():
                assert_close_rel(trained[k], ref, f"{where} {k}", REL_F64)


def _count_run(rank, ws):
    from torch.profiler import ProfilerActivity, profile

    mesh = init_device_mesh("cpu", (ws,))
    counts = {}
    for strategy in STRATEGIES:
        for cap_name, cap in CAPS.items():
            model = _shard(_build(), mesh, strategy)
            model.set_all_reduce_bucket_cap_mb(cap)
            opt = make_opt("adamw", model.parameters())
            for step in range(3):  # the first records the order; the plan holds from the second
                sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                sharded_train_step(model, opt, 3, rank, ws, GLOBAL_BATCH)
            counts[(strategy, cap_name)] = sum(e.count for e in prof.key_averages() if e.key == "gloo:all_reduce")
    return counts


def test_bucketing_cuts_all_reduces_by_the_groups_sharing_a_bucket():
    for counts in run_ranks(_count_run, 2):
        for strategy in STRATEGIES:
            base = counts[(strategy, "one_unit")]  # one all-reduce per group, plus the step's others
            for cap_name in CAPS:
                saved = BUCKETS_PER_STEP["one_unit"] - BUCKETS_PER_STEP[cap_name]
                assert counts[(strategy, cap_name)] == base - saved, (strategy, cap_name, counts)
        assert counts[("no_shard", "ddp")] < counts[("no_shard", "one_unit")]


# -- the mechanism, without processes ----------------------------------------------------------
class _FakeComm:
    world_size = 2

    def __init__(self):
        self.calls = []

    def all_reduce(self, t, op, label=""):
        from mfsdp2.comm.communicator import CommHandle

        self.calls.append(t.numel())
        return CommHandle(label=label)


class _FakeGroup:
    def __init__(self):
        self.reduce_bucket = None
        self.finished = 0

    def finish_reduce(self, allocator):
        self.finished += 1
        self.reduce_bucket = None


def test_wait_on_a_member_of_an_unissued_bucket_issues_it_first():
    comm = _FakeComm()
    b = GradientBuckets(CachingAllocator(), "root", cap_mb=1.0)
    groups = [_FakeGroup() for _ in range(3)]
    lane = ("lane",) + (torch.float32,)
    # First backward: no plan yet, one bucket per group.
    for g in groups:
        bucket, view = b.reserve(g, lane, comm, None, 100, torch.float32, torch.device("cpu"), "x")
        g.reduce_bucket = bucket
        b.packed(bucket)
    assert comm.calls == [100, 100, 100]
    b.complete_all()
    b.end_backward()
    # Second backward follows the plan: one bucket of 300; two members packed, then a wait.
    comm.calls.clear()
    handles = []
    for g in groups[:2]:
        bucket, view = b.reserve(g, lane, comm, None, 100, torch.float32, torch.device("cpu"), "x")
        g.reduce_bucket = bucket
        b.packed(bucket)
        handles.append(BucketMemberHandle(b, bucket))
    assert comm.calls == [], "the planned bucket waits for its third member"
    handles[0].wait()
    assert comm.calls == [200], "the wait issued the bucket with what it held"
    # The third group is now off the plan: a bucket of its own.
    bucket, _ = b.reserve(groups[2], lane, comm, None, 100, torch.float32, torch.device("cpu"), "x")
    b.packed(bucket)
    assert comm.calls == [200, 100]


@pytest.mark.parametrize(
    "sizes,cap,expect",
    [([5, 5, 5], 10, [[5, 5], [5]]), ([20, 5], 10, [[20], [5]]), ([3, 3, 3], 1, [[3], [3], [3]])],
)
def test_plan_cuts_the_record_by_the_cap(sizes, cap, expect):
    groups = [object() for _ in sizes]
    plan = _plan(list(zip(groups, sizes)), cap)
    assert [[n for _, n in bucket] for bucket in plan] == expect
    # A group packed twice in one backward starts a new bucket.
    g = object()
    assert [len(b) for b in _plan([(g, 1), (object(), 1), (g, 1)], 100)] == [2, 1]


# -- a bucket whose all-reduce fails is leaked, never freed (docs/design.md, buffer lifetime) ----
def _failed_bucket(rank, ws):
    from mfsdp2.comm.communicator import CollectiveError, CommHandle

    from ..memory.test_buffer_lifetime import HungWork

    mesh = init_device_mesh("cpu", (ws,))
    model = _shard(_build(), mesh, "no_shard")
    opt = make_opt("adamw", model.parameters())
    for step in range(2):  # the second backward follows the plan: one bucket for every unit
        sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH)
    ctx = model._mfsdp2_state.ctx
    groups = [g for m in model.modules() if hasattr(m, "_mfsdp2_state") for g in m._mfsdp2_state.groups]
    works = []

    def hung_all_reduce(t, op=None, group=None, label=""):
        works.append(HungWork())
        return CommHandle(work=works[-1], label=label)

    for g in groups:
        g.replicate_comm.all_reduce = hung_all_reduce
    n = GLOBAL_BATCH // ws
    x, y = batch(2, GLOBAL_BATCH, 12, dtype=F64)
    loss = loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])  # releases last step's bucket
    freed = []
    orig_free = ctx.allocator.free
    ctx.allocator.free = lambda key: (freed.append(key), orig_free(key))[1]
    try:
        loss.backward()
        raise AssertionError("the hung bucket did not fail")
    except CollectiveError:
        pass
    model.reset()
    return {
        "issued": len(works),
        "freed_buckets": [k for k in freed if k[0] == "grad_bucket"],
        "leaked": ctx.allocator.stats.leaked_buffers,
        "main_grads": [g.main_grad is not None for g in groups],
        "pending": [g.reduce_pending for g in groups],
    }


def test_failed_bucket_is_leaked_not_freed():
    for r in run_ranks(_failed_bucket, 2):
        assert r["issued"] == 1, r  # one bucket for the whole model
        assert r["freed_buckets"] == [], r
        assert r["leaked"] >= 1, r
        assert not any(r["main_grads"]) and not any(r["pending"]), r


def _bits_run(rank, ws):
    """ZeRO-3 with buckets (default) and without: the trained weights, and how many unit
    reductions went into buckets."""
    from mfsdp2.comm.communicator import comm_stats

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for cap in (25.0, 0.0):
        model = _shard(_build(), mesh, "optim_grads_params")
        model.set_all_reduce_bucket_cap_mb(cap)
        opt = make_opt("adamw", model.parameters())
        comm_stats.reset()
        for step in range(STEPS):
            sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH)
        out[cap] = ({k: p.full_tensor() for k, p in model.named_parameters()}, comm_stats.reduce_scatters_in_buckets)
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_sharded_groups_share_buckets_at_two_ranks_with_identical_bits(ws):
    """Two ranks: the small ZeRO-3 units reduce in buckets and train bit for bit as with one
    reduction each. Four ranks: gloo's summation order would depend on the bucket layout, so they
    keep their own reductions (a resumed run repeats the uninterrupted one exactly)."""
    for out in run_ranks(_bits_run, ws):
        (bucketed, n_bucketed), (alone, n_alone) = out[25.0], out[0.0]
        assert n_alone == 0 and (n_bucketed > 0) == (ws == 2), (ws, n_bucketed, n_alone)
        for k in alone:
            assert torch.equal(bucketed[k], alone[k]), f"ws {ws} {k}"
