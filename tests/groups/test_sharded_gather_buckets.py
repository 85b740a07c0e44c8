"""ZeRO-3 all-gathers bucketed across units (``set_all_gather_bucket_cap_mb``;
mfsdp2/groups/gather_buckets.py, mfsdp2/runtime/unshard.plan_bucketed_gathers).

* Parity in float64 against the unsharded single-process model (REL_F64, see tests/models.py) on
  the persistent-bucket tests' model of many small units and one above the cap, through their
  scripted steps: a write through ``.data``, eval passes, a unit skipped in the forward, the
  forward order changed (members waited before their bucket was issued), an explicit
  ``unshard()`` before the forward. No bucket block outlives a forward or a step. The same with
  every collective issued 20 ms late (rows copied out before the wait, or a block reused early,
  would train to other numbers).
* Bitwise against per-unit gathers (cap 0) in the same process: the same bytes are moved, so
  losses, eval outputs and weights must be identical -- float32, bf16 compute (the cast into the
  bucket), the trace-pool allocator, activation checkpointing around units (reentrant: the
  gathers happen in the recompute) and a step back-propagated in two ``backward()`` calls; and
  with buckets, fewer all-gathers per step.
* Against torch FSDP2 in the same process (float64, the scripted order changes and skipped
  unit): losses, parameters and gradients at every step.
* A write between a bucket's issue and its unit's use (an in-place update of a later unit's
  weights from an earlier unit's forward hook) is gathered afresh: bitwise equal to the per-unit
  gathers, which read the weights after the write. Without the version check the bucket's rows
  would be the old weights.
* The tiny benchmark's shape: ceil(units / units per bucket) all-gathers in the forward and as
  many in the backward, at most ``max_in_flight`` bucket blocks at once.
* The setter refuses a negative size (E100).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from mfsdp2 import MixedPrecisionPolicy, fully_shard
from mfsdp2.comm.communicator import comm_stats

from .._dist import run_ranks
from .._slow_collectives import SlowCollectives
from ..models import F64, batch, loss_fn, make_opt
from .test_persistent_gather_buckets import (
    D, GLOBAL_BATCH, STEPS, _build, _cap_mb, _reference, _train, check_against_reference, compare_with_fsdp2,
    sharded_tiny, tiny_gather_counts,
)

ZERO3 = "optim_grads_params"


def _sharded(mesh, dtype=F64, cap: bool = True, allocator=None, **kw):
    model = _build(dtype)
    for m in [model.inp, *model.layers, model.head]:
        fully_shard(m, mesh=mesh, sharding_strategy=ZERO3, **kw)
    fully_shard(model, mesh=mesh, sharding_strategy=ZERO3, **kw, **({"allocator": allocator} if allocator else {}))
    if cap:
        model.set_all_gather_bucket_cap_mb(_cap_mb(model))
    return model


def _check_parity(model, rank, ws, where, ref, slow=False):
    opt = make_opt("adamw", model.parameters())
    counts = []
    if slow:
        with SlowCollectives(0.02) as s:
            losses, evals = _train(model, opt, rank, ws, STEPS, counts=counts)
        assert s.issued > 0 and s.waited_early > 0
    else:
        losses, evals = _train(model, opt, rank, ws, STEPS, counts=counts)
    check_against_reference(model, losses, evals, ref, where)
    return counts


def _parity_run(rank, ws):
    ref = _reference()
    mesh = init_device_mesh("cpu", (ws,))
    per_unit = _check_parity(_sharded(mesh, cap=False), rank, ws, f"per unit rank {rank}", ref)
    bucketed = _check_parity(_sharded(mesh), rank, ws, f"buckets rank {rank}", ref)
    # Step 0's forward records the order (nothing is planned before it), its backward is planned
    # from that record: every step gathers less.
    assert all(b < p for b, p in zip(bucketed, per_unit)), (bucketed, per_unit)
    _check_parity(_sharded(mesh, allocator="trace_pool"), rank, ws, f"slow rank {rank}", ref, slow=True)
    return True


def test_parity_with_unsharded_model():
    assert all(run_ranks(_parity_run, 2))


# -- bitwise: buckets against per-unit gathers -------------------------------------------------
class _CkptNet(nn.Module):
    """Units of small layers, each called through a reentrant checkpoint (its forward runs under
    ``no_grad``; backward recomputes it, gathering it then), and a loss back-propagated in two
    ``backward()`` calls (two halves of the batch: a chunked loss)."""

    def __init__(self, n: int = 6):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(n))
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(checkpoint(layer, h, use_reentrant=True))
        return self.head(h)


def _ckpt_train(rank, ws, mesh, cap: bool) -> tuple:
    torch.manual_seed(0)
    model = _CkptNet()
    for m in [model.inp, *model.layers, model.head]:
        fully_shard(m, mesh=mesh, sharding_strategy=ZERO3)
    fully_shard(model, mesh=mesh, sharding_strategy=ZERO3)
    if cap:
        model.set_all_gather_bucket_cap_mb(3.5 * model.layers[0]._mfsdp2_state.groups[0].weights.nbytes / 2**20)
    opt = make_opt("adamw", model.parameters())
    losses, counts = [], []
    for step in range(4):
        before = comm_stats.all_gather_calls
        x, y = batch(step, GLOBAL_BATCH, D)
        n = GLOBAL_BATCH // ws
        x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        for half in (slice(0, n // 2), slice(n // 2, n)):  # two backward() calls per step
            loss = loss_fn(model(x[half]), y[half]) / 2
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        counts.append(comm_stats.all_gather_calls - before)
        assert model._mfsdp2_state.ctx.allocator.stats.live_by_role.get("gather_bucket", 0) == 0
    return losses, {k: p.full_tensor().clone() for k, p in model.named_parameters()}, counts


CASES = {
    "fp32": dict(),
    "bf16 compute": dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
    "trace_pool": dict(allocator="trace_pool"),
}


def _bitwise_run(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    for name, kw in CASES.items():
        runs = {}
        for cap in (True, False):
            model = _sharded(mesh, torch.float32, cap=cap, **kw)
            opt = make_opt("adamw", model.parameters())
            counts = []
            losses, evals = _train(model, opt, rank, ws, STEPS, counts=counts)
            runs[cap] = (losses, evals, {k: p.full_tensor().clone() for k, p in model.named_parameters()}, counts)
        (la, ea, pa, ca), (lb, eb, pb, cb) = runs[True], runs[False]
        assert la == lb, (name, la, lb)
        assert all(torch.equal(a, b) for a, b in zip(ea, eb)), name
        assert all(torch.equal(pa[k], pb[k]) for k in pa), name
        assert all(a < b for a, b in zip(ca, cb)), (name, ca, cb)
    (la, pa, ca), (lb, pb, cb) = _ckpt_train(rank, ws, mesh, True), _ckpt_train(rank, ws, mesh, False)
    assert la == lb and all(torch.equal(pa[k], pb[k]) for k in pa), "checkpointed, two backward calls"
    assert all(a < b for a, b in zip(ca[1:], cb[1:])), (ca, cb)
    return True


def test_bitwise_against_per_unit_gathers():
    assert all(run_ranks(_bitwise_run, 2))


# -- against torch FSDP2 -------------------------------------------------------------------------
def _fsdp2_run(rank, ws):
    """Bucketed ZeRO-3 against torch FSDP2's defaults (every unit gathers alone)."""
    return compare_with_fsdp2(rank, ws, {}, {}, lambda m: m.set_all_gather_bucket_cap_mb(_cap_mb(m)))


def test_matches_fsdp2():
    assert all(run_ranks(_fsdp2_run, 2))


# -- a write after the bucket was issued -----------------------------------------------------------
def _late_write_run(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for cap in (True, False):
        model = _sharded(mesh, torch.float32, cap=False)
        if cap:  # one bucket for every unit: issued at the root's forward, before the write
            model.set_all_gather_bucket_cap_mb(1)
        # No prefetch: layer 6's own unshard takes its bucket's handle (a prefetched unit's
        # stale gather is caught again at its pre-forward).
        model.set_prefetch_depth(0)
        target = model.layers[6].weight

        def halve_layer_6(module, args):
            # Runs inside the root's forward, after the bucket holding layer 6 was issued (with
            # buckets) and before layer 6 is prefetched or gathers on its own (without): the
            # write must be used.
            with torch.no_grad():
                target.mul_(0.5)

        model.layers[0].register_forward_pre_hook(halve_layer_6)
        opt = make_opt("adamw", model.parameters())
        losses = []
        for step in range(4):
            x, y = batch(step, GLOBAL_BATCH, D)
            n = GLOBAL_BATCH // ws
            loss = loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[cap] = (losses, {k: p.full_tensor().clone() for k, p in model.named_parameters()})
    assert out[True][0] == out[False][0], (out[True][0], out[False][0])
    assert all(torch.equal(out[True][1][k], out[False][1][k]) for k in out[True][1])
    return True


def test_write_after_the_bucket_was_issued_is_gathered_afresh():
    assert all(run_ranks(_late_write_run, 2))


# -- the tiny benchmark's shape: collective counts ---------------------------------------------
def _tiny_counts(rank, ws, n, per_bucket):
    model, unit = sharded_tiny(ws, n, ZERO3)
    model.set_all_gather_bucket_cap_mb((per_bucket + 0.5) * unit / 2**20)
    counts = tiny_gather_counts(model)
    stats = model._mfsdp2_state.ctx.allocator.stats
    return counts, stats.peak_by_role.get("gather_bucket", 0), stats.live_by_role.get("gather_bucket", 0)


@pytest.mark.parametrize("per_bucket", [5, 64])
def test_tiny_model_gathers_in_buckets(per_bucket):
    n = 32
    buckets = math.ceil(n / per_bucket)
    for counts, peak, live in run_ranks(_tiny_counts, 2, n, per_bucket):
        # First step: no recorded order, one all-gather per unit in forward; its backward is
        # planned from the order that forward recorded. The root holds no parameters.
        assert counts[0][0] == n, counts
        assert all(c == (buckets, buckets) for c in counts[1:]) and counts[0][1] == buckets, counts
        assert 1 <= peak <= 2 and live == 0, (peak, live)


def _refuses_negative(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    model = _sharded(mesh, torch.float32, cap=False)
    with pytest.raises(ValueError, match="E100"):
        model.set_all_gather_bucket_cap_mb(-1)
    with pytest.raises(ValueError, match="E100"):
        model.set_all_gather_bucket_cap_mb(float("nan"))
    return True


def test_negative_cap_is_refused():
    assert all(run_ranks(_refuses_negative, 1))
