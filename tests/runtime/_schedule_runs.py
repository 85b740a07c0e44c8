"""The scheduler tests' shared harness: the model, the unsharded reference, and the rank-side
runner that trains a configuration and records what each step observed.

``SchedNet`` is ``Net`` with 4 blocks, each block its own unit and the root a unit too; a
configuration (a dict) picks the optimizer, batch, number of steps and what varies: activation
checkpointing, micro-batches, skipped blocks, eval passes, reshard settings, explicit unshards.

Spawning ranks costs several seconds, so each ``run_ranks`` call (``_spawn``) runs several
configurations one after the other on fresh models and returns what each step observed (event log,
allocator peaks, collective counts, schedule counters); the test files share one spawn between the
test functions that check different aspects of the same runs through module-scoped fixtures, and
the checks run in the parent. A configuration that raises inside a rank fails its spawn (a rank
that stops mid-collective would leave its peer hanging, so there is no carrying on), and every test
of that fixture reports the rank's traceback.

``assert_parity`` compares against a single-process, unsharded reference that runs the same model
class on the whole global batch (float64, losses, eval outputs and final parameters within REL_F64
relative: see tests/models.py).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from mfsdp2 import FSDPModule, fully_shard
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
    # These runs check the per-unit reduce-scatter schedule; small units at two ranks on gloo would
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
