"""Persistent-weight all-gathers bucketed across units (ZeRO-1 ``optim``, ZeRO-2 ``optim_grads``;
mfsdp2/groups/gather_buckets.py).

* Parity in float64 against the unsharded single-process model (REL_F64, see tests/models.py),
  world sizes 2 and 4 and an HSDP (2, 2) mesh, on a model of many small units and one unit above
  the bucket cap, over steps that stress the plan: a write through ``.data`` (bumps no counter:
  the fingerprint must re-gather it), a unit skipped in the forward (its bucket rows are copied
  out at the end of the forward), the forward order changed (members waited before their bucket
  was issued), an explicit ``unshard()`` before the forward, and an eval (``no_grad``) pass.
  Each step's all-gather count is checked: one per bucket plus the large unit, against one per
  unit without a recorded order; and no ``gather_bucket`` block outlives a forward. The same run
  with every collective issued 20 ms late (tests/_slow_collectives.py) and the trace-pool
  allocator: rows copied out before the wait, or a block reused early, would show there.
* Bitwise: bucketed against per-unit gathers (cap 0) in the same process -- the same bytes are
  moved, so losses and weights must be identical -- with bf16 compute (the cast before the
  gather), no_shard + bf16 (nothing to bucket: a shard group of one rank), CPU offload and the
  trace-pool allocator.
* The tiny benchmark's shape (many identical ``Linear`` units, a parameter-free root): a forward
  issues ceil(units / units-per-bucket) all-gathers, not one per unit.
* ZeRO-2 against torch FSDP2 with ``reshard_after_forward=False`` in the same process: losses,
  parameters and gradients.
* Fail fast: a peer that stalls before its buckets makes the waiting rank raise a
  CollectiveError naming the bucket within the timeout; ``reset()`` leaks the blocks in flight
  and leaves their groups to be gathered again.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from torch.distributed.fsdp import CPUOffloadPolicy

from mfsdp2 import MixedPrecisionPolicy, fully_shard
from mfsdp2.comm.communicator import comm_stats

from .._dist import run_ranks
from .._slow_collectives import SlowCollectives
from ..fsdp2_compat import assert_same_snapshots, runtimes, snapshot
from ..models import (
    F64, REL_F64, assert_close_rel, assert_losses_close, batch, loss_fn, make_opt, reference_step, sharded_train_step,
)

GLOBAL_BATCH = 8
D = 8
N_LAYERS = 8
BIG = 4  # layers[BIG] is wider than the cap; the others are Linear(D, D)


class ManyNet(nn.Module):
    """``inp``, ``layers`` (square, so any order works; one wide block) and ``head``: each its own
    unit, the root holds no parameters. ``skip`` leaves a layer out, ``order`` reorders them."""

    def __init__(self, n: int = N_LAYERS, big_at: int = BIG, wide: int = 64, d_out: int = 2):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(D, wide), nn.Tanh(), nn.Linear(wide, D)) if i == big_at else nn.Linear(D, D)
            for i in range(n)
        )
        self.head = nn.Linear(D, d_out)
        self.skip = None
        self.order = None

    def forward(self, x):
        h = self.inp(x)
        for i in self.order or range(len(self.layers)):
            if i != self.skip:
                h = torch.tanh(self.layers[i](h))
        return self.head(h)


def _build(dtype=F64, **kw) -> ManyNet:
    torch.manual_seed(0)
    return ManyNet(**kw).to(dtype)


def _shard(model, shard=fully_shard, **kw):
    for m in [model.inp, *model.layers, model.head, model]:
        shard(m, **kw)
    return model


def _cap_mb(model) -> float:
    """Three small units per bucket; the wide unit and only it above the cap."""
    small = model.layers[0]._mfsdp2_state.groups[0].weights.nbytes
    big = model.layers[BIG]._mfsdp2_state.groups[0].weights.nbytes
    head = model.head._mfsdp2_state.groups[0].weights.nbytes
    cap = 3.5 * small
    assert big > cap and head <= 0.5 * small, (small, big, head)
    return cap / 2**20


PER_UNIT = N_LAYERS + 2
BUCKETED = 3 + 1


def _edit(model, step: int, eval_pass: bool) -> None:
    """What each forward changes (the same on the reference). Step 3's eval pass leaves out
    layer 6 (in a bucket with layer 7 and the head: its rows must still be copied out, as the
    training forward that follows, after no optimizer step, uses them without a gather); step 6's
    training forward leaves it out; step 4 runs layer 7 (in the last bucket) first, layer 0 last."""
    model.skip = 6 if (step, eval_pass) in ((3, True), (6, False)) else None
    model.order = [7, 1, 2, 3, 4, 5, 6, 0] if step == 4 else None


def _data_write(model, sharded: bool) -> None:
    """Step 2: a write through ``.data`` (no counter moves; the fingerprint sees it)."""
    with torch.no_grad():
        w = model.layers[2].weight
        (w.to_local() if sharded else w).data.mul_(0.5)
        # every rank writes its own rows (all of them on the reference)


def _gathers(fn) -> int:
    before = comm_stats.all_gather_calls
    fn()
    return comm_stats.all_gather_calls - before


def _live_bucket_blocks(model) -> int:
    stats = model._mfsdp2_state.ctx.allocator.stats
    assert stats.leaked_buffers == 0
    return stats.live_by_role.get("gather_bucket", 0)


def _train(model, opt, rank, ws, steps, sharded=True, counts=None) -> tuple[list, list]:
    """The scripted steps; returns (losses, eval outputs). ``counts``: all-gathers per step."""
    losses, evals = [], []

    def step_fn(step: int) -> None:
        if step == 2:
            _data_write(model, sharded)
        if step in (1, 3, 4):
            # An eval pass first: it gathers the stepped weights, training then nothing.
            _edit(model, step, eval_pass=True)
            x = batch(50 + step, 4, D, dtype=model.inp.weight.dtype)[0]
            with torch.no_grad():
                evals.append(model(x).detach().clone())
            if sharded:
                assert _live_bucket_blocks(model) == 0, step
        _edit(model, step, eval_pass=False)
        if not sharded:
            losses.append(reference_step(model, opt, step, GLOBAL_BATCH, F64))
            return
        if step == 5:  # explicit unshard of one unit before the root's forward: not in the plan
            model.layers[3].unshard()
        losses.append(sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH))

    for step in range(steps):
        n = _gathers(lambda: step_fn(step))
        if counts is not None:
            counts.append(n)
        if sharded:
            assert _live_bucket_blocks(model) == 0, step
    return losses, evals


# All-gathers per step. Units in recorded order: inp, layers 0..7, head; the small ones bucketed
# three by three and the wide layer alone (4). Step 0: no recorded order, one per unit. Steps 1,
# 3, 4: the eval pass gathers, training then nothing. Step 5: the explicit unshard gathers layer
# 3 alone and the forward's plan leaves it out (1 + 4). Step 6's training forward skips layer 6,
# so step 7's plan lacks it and it gathers alone (4 + 1).
EXPECTED_COUNTS = [PER_UNIT, BUCKETED, BUCKETED, BUCKETED, BUCKETED, 1 + BUCKETED, BUCKETED, BUCKETED + 1]


STEPS = 8


def _reference():
    torch.set_num_threads(1)
    model = _build()
    opt = make_opt("adamw", model.parameters())
    losses, evals = _train(model, opt, 0, 1, STEPS, sharded=False)
    return losses, evals, {k: p.detach().clone() for k, p in model.named_parameters()}


def check_against_reference(model, losses: list, evals: list, ref: tuple, where: str) -> None:
    """The scripted run's losses, eval outputs and final weights against ``_reference()``'s."""
    ref_losses, ref_evals, ref_params = ref
    assert_losses_close(losses, ref_losses, where, REL_F64)
    for i, (a, b) in enumerate(zip(evals, ref_evals)):
        assert_close_rel(a, b, f"{where} eval {i}", REL_F64)
    for k, p in model.named_parameters():
        assert_close_rel(p.full_tensor(), ref_params[k], f"{where} {k}", REL_F64)


def _parity_run(rank, ws, hsdp):
    ref = _reference()
    if hsdp:  # persistent gathers over the shard group, gradients also across replicas
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (ws,))
    for strategy in ("optim", "optim_grads"):
        where = f"{strategy} ws{ws}{' hsdp' if hsdp else ''} rank {rank}"
        model = _shard(_build(), mesh=mesh, sharding_strategy=strategy)
        model.set_all_reduce_bucket_cap_mb(_cap_mb(model))
        opt = make_opt("adamw", model.parameters())
        counts = []
        losses, evals = _train(model, opt, rank, ws, STEPS, counts=counts)
        check_against_reference(model, losses, evals, ref, where)
        assert counts == EXPECTED_COUNTS, (where, counts)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("ws,hsdp", [(2, False), (4, False), (4, True)])
def test_parity_with_unsharded_model(ws, hsdp):
    assert all(run_ranks(_parity_run, ws, hsdp))


def _slow_run(rank, ws):
    """The parity run with every collective issued 20 ms late (tests/_slow_collectives.py): a
    member's rows copied out, or a bucket's block reused, before its all-gather ended would
    train to other numbers."""
    ref_losses, ref_evals, ref_params = _reference()
    mesh = init_device_mesh("cpu", (ws,))
    model = _build()
    for m in [model.inp, *model.layers, model.head]:
        fully_shard(m, mesh=mesh, sharding_strategy="optim")
    fully_shard(model, mesh=mesh, sharding_strategy="optim", allocator="trace_pool")
    model.set_all_reduce_bucket_cap_mb(_cap_mb(model))
    opt = make_opt("adamw", model.parameters())
    with SlowCollectives(0.02) as slow:
        losses, evals = _train(model, opt, rank, ws, STEPS)
    assert slow.issued > 0 and slow.waited_early > 0
    assert_losses_close(losses, ref_losses, f"slow rank {rank}", REL_F64)
    for a, b in zip(evals, ref_evals):
        assert_close_rel(a, b, f"slow rank {rank} eval", REL_F64)
    for k, p in model.named_parameters():
        assert_close_rel(p.full_tensor(), ref_params[k], f"slow rank {rank} {k}", REL_F64)
    return True


@pytest.mark.slow
def test_parity_with_slow_collectives():
    assert all(run_ranks(_slow_run, 2))


# -- bitwise: buckets against per-unit gathers -------------------------------------------------
CASES = {
    "optim bf16": dict(sharding_strategy="optim", mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
    "optim_grads bf16": dict(sharding_strategy="optim_grads",
                             mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
    "no_shard bf16": dict(sharding_strategy="no_shard", mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
    "optim_grads offload": dict(sharding_strategy="optim_grads", offload_policy=CPUOffloadPolicy(pin_memory=False)),
    "optim trace_pool": dict(sharding_strategy="optim", allocator="trace_pool"),
}


def _bitwise_run(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, kw in CASES.items():
        runs = {}
        for cap in ("default", 0):
            kw = dict(kw)
            alloc = kw.pop("allocator", None)
            model = _build(torch.float32)
            for m in [model.inp, *model.layers, model.head]:
                fully_shard(m, mesh=mesh, **kw)
            fully_shard(model, mesh=mesh, **kw, **({"allocator": alloc} if alloc else {}))
            model.set_all_reduce_bucket_cap_mb(_cap_mb(model) if cap == "default" else 0)
            opt = make_opt("adamw", model.parameters())
            counts = []
            losses, evals = _train(model, opt, rank, ws, STEPS, counts=counts)
            params = {k: p.full_tensor().clone() for k, p in model.named_parameters()}
            runs[cap] = (losses, evals, params, counts)
        (la, ea, pa, ca), (lb, eb, pb, cb) = runs["default"], runs[0]
        assert la == lb, (name, la, lb)
        for a, b in zip(ea, eb):
            assert torch.equal(a, b), name
        for k in pa:
            assert torch.equal(pa[k], pb[k]), (name, k)
        # Buckets did form (no_shard: a shard group of one rank, nothing is gathered).
        if not name.startswith("no_shard"):
            assert ca == EXPECTED_COUNTS and cb[1] == PER_UNIT, (name, ca, cb)
        out[name] = ca
    return out


def test_bitwise_against_per_unit_gathers():
    run_ranks(_bitwise_run, 2)


# -- a write during the forward, after the bucket placed its members ---------------------------
def _announced_write_run(rank, ws, strategy):
    """Bucketed (every unit in one bucket) and per-unit gathers: a forward pre-hook of layer 1
    (after the bucket's first wait, at the input unit, placed every member) halves layer 6's
    weight in place and announces it. Layer 6 must compute with the halved weight."""
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for cap in (64.0, 0.0):
        model = _shard(_build(), mesh=mesh, sharding_strategy=strategy)
        model.set_all_reduce_bucket_cap_mb(cap)
        target = model.layers[6]

        def halve_layer_6(module, args):
            with torch.no_grad():
                target.weight.mul_(0.5)
            target.mark_weights_changed()  # every rank; a persistent group reads no counter mid-forward

        model.layers[1].register_forward_pre_hook(halve_layer_6)
        opt = make_opt("adamw", model.parameters())
        losses = [sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH) for step in range(4)]
        out[cap] = (losses, {k: p.full_tensor().clone() for k, p in model.named_parameters()})
    assert out[64.0][0] == out[0.0][0], (strategy, out[64.0][0], out[0.0][0])
    assert all(torch.equal(out[64.0][1][k], out[0.0][1][k]) for k in out[0.0][1]), strategy
    return True


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_announced_write_after_the_bucket_placed_its_members_is_gathered_afresh(strategy):
    assert all(run_ranks(_announced_write_run, 2, strategy))


# -- the tiny benchmark's shape: collective counts ---------------------------------------------
class Tiny(nn.Module):
    def __init__(self, n: int, d: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def sharded_tiny(ws: int, n: int, strategy: str) -> tuple:
    """The tiny shape sharded at world size ``ws``: ``(model, one unit's gathered bytes)``."""
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = Tiny(n)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, sharding_strategy=strategy)
    fully_shard(model, mesh=mesh, sharding_strategy=strategy)
    return model, model.layers[0]._mfsdp2_state.groups[0].weights.nbytes


def tiny_gather_counts(model, steps: int = 4) -> list[tuple[int, int]]:
    """Train ``steps`` steps of the tiny shape; all-gathers issued in each (forward, backward)."""
    opt = make_opt("adamw", model.parameters())
    counts = []
    for step in range(steps):
        x = batch(step, 4, 16)[0]
        before = comm_stats.all_gather_calls
        loss = model(x).sum()
        mid = comm_stats.all_gather_calls
        loss.backward()
        counts.append((mid - before, comm_stats.all_gather_calls - mid))
        opt.step()
        opt.zero_grad()
    return counts


def _tiny_counts(rank, ws, n, per_bucket):
    model, unit = sharded_tiny(ws, n, "optim")
    model.set_all_reduce_bucket_cap_mb((per_bucket + 0.5) * unit / 2**20)
    return [forward for forward, _ in tiny_gather_counts(model)]


@pytest.mark.parametrize("per_bucket", [5, 64])
def test_tiny_model_gathers_in_buckets(per_bucket):
    n = 32
    buckets = math.ceil(n / per_bucket)
    for counts in run_ranks(_tiny_counts, 2, n, per_bucket):
        # First forward: no step yet, nothing stale but the initial gather, one per unit (no
        # recorded order); after each step: one all-gather per bucket.
        assert counts == [n, buckets, buckets, buckets], counts


# -- ZeRO-2 against torch FSDP2 (reshard_after_forward=False) ----------------------------------
def compare_with_fsdp2(rank: int, ws: int, ours: dict, theirs: dict, configure) -> bool:
    """Train the scripted order changes and skipped layer under mfsdp2 (``fully_shard`` keywords
    ``ours``, then ``configure(root)``) and torch FSDP2 (``theirs``) in this process, in float64:
    losses, parameters and gradients must agree at every step."""
    mesh = init_device_mesh("cpu", (ws,))
    n = GLOBAL_BATCH // ws
    snaps, losses = {}, {}
    for name, shard in runtimes().items():
        model = _shard(_build(), shard, mesh=mesh, **(ours if name == "mfsdp2" else theirs))
        if name == "mfsdp2":
            configure(model)
        opt = make_opt("adamw", model.parameters())
        snaps[name], losses[name] = [], []
        for step in range(STEPS):  # layer 6 skipped at step 6, the order changed at step 4
            _edit(model, step, eval_pass=False)
            x, y = batch(step, GLOBAL_BATCH, D, dtype=F64)
            loss = loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
            loss.backward()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses[name].append(t.item() / ws)
            snaps[name].append(snapshot(model))
            opt.step()
            opt.zero_grad()
    assert_losses_close(losses["mfsdp2"], losses["fsdp2"], "vs FSDP2", REL_F64)
    for step, (a, b) in enumerate(zip(snaps["mfsdp2"], snaps["fsdp2"])):
        assert_same_snapshots(a, b, f"step {step} rank {rank}", REL_F64)
    return True


def _fsdp2_run(rank, ws):
    return compare_with_fsdp2(rank, ws, dict(sharding_strategy="optim_grads"), dict(reshard_after_forward=False),
                              lambda m: m.set_all_reduce_bucket_cap_mb(_cap_mb(m)))


def test_zero2_matches_fsdp2_without_reshard_after_forward():
    assert all(run_ranks(_fsdp2_run, 2))


# -- fail fast ---------------------------------------------------------------------------------
TIMEOUT = 3.0


class _Stop(Exception):
    pass


def _bucket_peer_hangs(rank, ws):
    """Rank 1 takes part in the step's agreement, then stalls before issuing any bucket: rank 0
    must raise a CollectiveError naming the bucket within the timeout, and ``reset()`` must leak
    the blocks of the buckets in flight (never reuse them) and leave no member waiting."""
    import time

    import mfsdp2

    mfsdp2.set_collective_timeout(TIMEOUT)
    try:
        mesh = init_device_mesh("cpu", (ws,))
        model = _shard(_build(torch.float32), mesh=mesh, sharding_strategy="optim")
        model.set_all_reduce_bucket_cap_mb(_cap_mb(model))
        opt = make_opt("adamw", model.parameters())
        sharded_train_step(model, opt, 0, rank, ws, GLOBAL_BATCH)  # records the order everywhere
        ctx = model._mfsdp2_state.ctx
        if rank == 1:
            def stall(*args, **kwargs):
                time.sleep(3 * TIMEOUT)
                raise _Stop

            ctx.gathers.start = stall
            try:
                model(batch(1, 4, D)[0])
            except _Stop:
                return "stalled"
        t0 = time.monotonic()
        try:
            model(batch(1, 4, D)[0])
            return ("no error", 0.0, None)
        except mfsdp2.CollectiveError as e:
            took = time.monotonic() - t0
            model.reset()
            groups = [g for s in ctx.states for g in s.groups]
            return (str(e), took, dict(
                leaked=ctx.allocator.stats.leaked_buffers,
                live=ctx.allocator.stats.live_by_role.get("gather_bucket", 0),
                waiting=sum(g.pending_gather is not None for g in groups),
                regather=all(g.stale for g in groups),  # rows that never came are gathered again
            ))
    finally:
        mfsdp2.set_collective_timeout(None)


@pytest.mark.slow
def test_bucket_peer_that_stalls_fails_fast_and_reset_leaks_blocks():
    res = run_ranks(_bucket_peer_hangs, 2, timeout=120)
    msg, took, after = res[0]
    assert "persistent-weight bucket 0" in msg and "step 1" in msg and "did not finish" in msg, msg
    assert took < TIMEOUT + 5, took
    # Buckets 0 and 1 were in flight (at most two at a time): both blocks leaked, none live.
    assert after == dict(leaked=2, live=0, waiting=0, regather=True), after
    assert res[1] == "stalled"


# -- the batched fingerprint -------------------------------------------------------------------
def test_batched_fingerprints_equal_the_per_tensor_ones():
    """A bucket fingerprints its members in one batch; the values must be exactly those of
    ``fingerprint`` one tensor at a time (what the next root forward compares against): sizes
    around the 1024-word rows and tails, words whose weighted sums wrap modulo 2^32, dtypes whose
    bytes are not int32 words (the per-tensor fallback), and views at offsets of one buffer.
    Sizes that repeat take the stacked rows, the others the segment sums, mixed in one batch."""
    from mfsdp2.groups.weight_watch import fingerprint, fingerprints

    g = torch.Generator().manual_seed(0)
    sizes = [1, 7, 1023, 1024, 1025, 2080, 3 * 1024 + 5, 70000, 2080, 1, 3 * 1024 + 5, 2080, 70000]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        ts = [(torch.randn(n, generator=g) * 1e4).to(dtype) for n in sizes]
        for batch_ in (ts, ts[1:2] + ts[4:5], [t for t in ts if t.numel() % 2 == 0], ts[5::3], ts[6:8] + ts[10:]):
            got = fingerprints(batch_)
            assert len(got) == len(batch_)
            for t, f in zip(batch_, got):
                assert f.dtype == torch.int32 and torch.equal(f, fingerprint(t)), (dtype, t.numel())
    flat = torch.randn(5000, generator=g)
    views = [flat[0:1000], flat[1000:3100], flat[3100:5000], flat[1:1001], flat[2:2102]]
    assert all(torch.equal(a, fingerprint(v)) for a, v in zip(fingerprints(views), views))


def test_batched_fingerprints_need_no_device_data_on_the_host():
    """The batched fingerprint sizes everything from host facts: it runs on the meta device,
    where any step that reads device data back to the host (``repeat_interleave`` without
    ``output_size`` sums its counts on the host: a CUDA synchronisation per bucket) raises. The
    counts reach the device as ``device_ints`` makes them: on CUDA a non-blocking copy from
    page-locked memory, elsewhere the same int64 values."""
    from mfsdp2.comm.communicator import device_ints
    from mfsdp2.groups.weight_watch import fingerprints

    ts = [torch.empty(n, device="meta") for n in (7, 1024, 3000, 5000, 3000, 3000)]
    got = fingerprints(ts)
    assert [(f.device.type, f.dtype, tuple(f.shape)) for f in got] == [("meta", torch.int32, (3,))] * len(ts)
    counts = device_ints([3, 0, 5], torch.device("cpu"))
    assert counts.dtype == torch.int64 and counts.tolist() == [3, 0, 5]
