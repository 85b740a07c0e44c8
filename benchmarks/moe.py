"""A mixture-of-experts decoder, mfsdp2 vs torch FSDP2 at world size 4 (CPU, gloo), alternating in one run.

    python benchmarks/moe.py [--steps N] [--cases ep2,ep1] [--wait-quiet S] [--json PATH]

The model is ``mfsdp2.models.moe``'s ``MoEConfig.bench()`` (4 MoE blocks of 8 experts, top-2, a
shared expert; 13.2M parameters, 80 % in the experts), float32, global batch 4 x 2 sequences of
128 tokens, AdamW. Each rank builds the same seeded model three times and shards it with mfsdp2,
FSDP2 as shipped and FSDP2 tuned (``_common.fsdp2_tuned``: the winner of
``benchmarks/fsdp2_tuning.py``, on CPU async unshard with explicit prefetch of the next block),
every block then the root, as torchtitan's ``apply_fsdp_to_decoder`` does it:

* ``ep2``: expert parallelism 2 -- the experts are DTensors ``Shard(0)`` on the ``ep`` dimension of
  a (efsdp, ep) mesh, tokens exchanged by all-to-all, and ``shard_placement_fn`` returns
  ``ShardPlacementResult(Shard(0), FSDPMeshInfo(mesh["efsdp"]))`` for them: per-parameter meshes,
  every block a group over 4 ranks and a group over 2;
* ``ep1``: no expert parallelism, the experts ``Shard(0)`` over the 4 ranks with the rest.

Timed phase: rounds of one training step per framework (order reversed every other round, a
barrier before each; a step's time is the max over ranks), medians with p10/p90. Memory phase,
each framework alone in fresh rank processes (one warm-up step, two steps measured): peak tensor
memory by
the same tool for both -- torch's ``MemTracker`` (every tensor an op creates, plus the model's
and optimizer's: FSDP2's shards, states and gathers), for mfsdp2 with its shards, main grads and
all its allocator holds registered (``StepMemoryTracker``; torch's ``FSDPMemTracker`` refuses a
unit with several parameter groups, FSDP2's own per-parameter meshes) --, and the
RSS high-water mark above the rank's RSS before the model was built (which includes what gloo
allocates itself: its reduce-scatter's clone of the whole input under FSDP2). Losses of the timed steps
are compared too (FSDP2's reduce-scatter sums in gloo's ring order, mfsdp2's in rank order: at
four ranks they may differ in the last bits, see docs/comm.md "Order of additions").

Results are measured, not integrated; the machine's other load during the run is recorded
(``foreign_cpu_fraction``: CPU time of other processes / the run's wall time x cores).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

WS = 4
SEQS_PER_RANK, SEQ = 2, 128
CASES = ("ep2", "ep1")
FRAMEWORKS = ("mfsdp2", "fsdp2", "fsdp2_tuned")


def _tokens(step: int, rank: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randint(0, vocab, (SEQS_PER_RANK, SEQ + 1), generator=g)


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _build(case: str, framework: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    import mfsdp2
    from mfsdp2.models.moe import MoEConfig, MoETransformer, expert_shard_placement_fn, parallelize_experts

    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.bench())
    dense = init_device_mesh("cpu", (WS,), mesh_dim_names=("dp",))
    fn = None
    if case == "ep2":
        sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        parallelize_experts(model, sparse["ep"])
        fn = expert_shard_placement_fn(model, FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0), shard_ranks=WS)
    shard = mfsdp2.fully_shard if framework == "mfsdp2" else torch_shard
    for block in model.layers:
        shard(block, mesh=dense, shard_placement_fn=fn)
    shard(model, mesh=dense)
    if framework != "mfsdp2":
        tuning = C.fsdp2_tuning_name(framework, "cpu")
        if tuning != "default":
            C.tune_fsdp2(model, tuning)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _step(model, opt, step: int, rank: int) -> float:
    loss = _loss(model, _tokens(step, rank, model.cfg.vocab_size))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def memory_worker(rank: int, ws: int, case: str, framework: str) -> dict:
    """Peak tensor memory (torch's trackers) and peak RSS of one framework alone, in fresh rank
    processes (so no framework inherits another's heap): RSS above the process's RSS before the
    model was built, and the process's whole high-water mark."""
    from torch.distributed._tools.mem_tracker import MemTracker

    import mfsdp2  # noqa: F401  (imported before the base is taken, as torch is)

    gc.collect()
    C.malloc_trim()
    C.reset_peak_rss()
    base = C.rss_bytes()
    model, opt = _build(case, framework)
    _step(model, opt, 0, rank)
    out: dict = {}
    x = _tokens(1, rank, model.cfg.vocab_size)
    if framework == "mfsdp2":
        from mfsdp2.memory.memory_bound import StepMemoryTracker

        tracker = StepMemoryTracker(model, opt, x[:, :-1], x[:, 1:])
    else:
        tracker = MemTracker()
        tracker.track_external(model, opt, x)
    with tracker:
        for s in (1, 2):
            _step(model, opt, s, rank)
            tracker.reset_mod_stats()
    out["peak_rss_above_base"] = C.peak_rss_bytes() - base
    out["peak_rss"] = C.peak_rss_bytes()
    snap = tracker.get_tracker_snapshot("peak")
    dev = next(iter(snap.values())) if snap else {}
    breakdown = {(k.value if hasattr(k, "value") else str(k)): int(v) for k, v in dev.items() if v}
    out["peak_tensor_bytes"] = int(breakdown.get("Total", 0))
    out["peak_tensor_breakdown"] = breakdown
    return out


def worker(rank: int, ws: int, cases: list[str], steps: int, wait_quiet: float) -> dict:
    out = {}
    for case in cases:
        if wait_quiet > 0:
            if rank == 0:
                C.wait_until_quiet(wait_quiet)
            dist.barrier()
        t0, busy0, own0 = time.time(), C.machine_busy_s(), C.process_cpu_s()
        models = {f: _build(case, f) for f in FRAMEWORKS}
        for f, (m, o) in models.items():  # warm-up: lazy init, allocator caches, first-step plans
            _step(m, o, 0, rank)
            _step(m, o, 1, rank)
        times = {f: [] for f in FRAMEWORKS}
        losses = {f: [] for f in FRAMEWORKS}
        for i in range(steps):
            order = FRAMEWORKS if i % 2 == 0 else tuple(reversed(FRAMEWORKS))
            for f in order:
                m, o = models[f]
                dist.barrier()
                s0 = time.perf_counter()
                losses[f].append(_step(m, o, 2 + i, rank))
                times[f].append(time.perf_counter() - s0)
        del models
        gc.collect()
        wall = time.time() - t0
        own = torch.tensor([C.process_cpu_s() - own0], dtype=torch.float64)
        dist.all_reduce(own)  # the ranks' own CPU time: the rest of the machine's busy time is foreign
        foreign = max(0.0, (C.machine_busy_s() - busy0) - own.item()) / (wall * (os.cpu_count() or 1))
        out[case] = {"times": times, "losses": losses, "wall_s": wall, "foreign_cpu_fraction": foreign}
    return out


def summarize(per_rank: list[dict], memory: dict, cases: list[str], steps: int) -> dict:
    result = {"cases": []}
    for case in cases:
        r0 = per_rank[0][case]
        c = {"model": "moe_bench", "case": case, "steps": steps, "world_size": WS,
             "foreign_cpu_fraction": max(r[case]["foreign_cpu_fraction"] for r in per_rank)}
        for f in FRAMEWORKS:
            t = C.max_over_ranks([r[case]["times"][f] for r in per_rank])
            mem = memory[(case, f)]
            c[f] = {
                "step_s": C.summarize_times(t),
                "peak_tensor_bytes": max(m["peak_tensor_bytes"] for m in mem),
                "peak_rss_above_base": max(m["peak_rss_above_base"] for m in mem),
                "peak_rss": max(m["peak_rss"] for m in mem),
                "peak_tensor_breakdown_rank0": mem[0]["peak_tensor_breakdown"],
                "losses": r0["losses"][f],
            }
        tuned, default, ours = c["fsdp2_tuned"], c["fsdp2"], c["mfsdp2"]
        c["ratio"] = {
            "step_time_vs_tuned": ours["step_s"]["median"] / tuned["step_s"]["median"],
            "step_time_vs_default": ours["step_s"]["median"] / default["step_s"]["median"],
            "peak_tensor_memory_vs_tuned": ours["peak_tensor_bytes"] / tuned["peak_tensor_bytes"],
            "peak_rss_vs_tuned": ours["peak_rss_above_base"] / tuned["peak_rss_above_base"],
        }
        c["loss_max_abs_diff_vs_tuned"] = max(abs(a - b) for a, b in zip(ours["losses"], tuned["losses"]))
        result["cases"].append(c)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="timed rounds (one step per framework each)")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to S seconds for a quiet machine per case")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    cases = [c for c in a.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; one of {CASES}")
    t0 = time.time()
    per_rank = C.run_ranks(worker, WS, cases, a.steps, a.wait_quiet)
    memory = {(c, f): C.run_ranks(memory_worker, WS, c, f) for c in cases for f in FRAMEWORKS}
    result = summarize(per_rank, memory, cases, a.steps)
    result.update(machine=C.machine_info(), date=C.now_iso(), wall_s=time.time() - t0,
                  fsdp2_tuned=C.fsdp2_tuned("cpu"),
                  command=" ".join(["python", "benchmarks/moe.py"] + (argv or sys.argv[1:])))
    rows = []
    for c in result["cases"]:
        for f in FRAMEWORKS:
            x = c[f]
            rows.append([c["case"], f, f"{x['step_s']['median'] * 1e3:.0f}", f"{x['step_s']['p10'] * 1e3:.0f}",
                         f"{x['step_s']['p90'] * 1e3:.0f}", C.fmt_bytes(x["peak_tensor_bytes"]),
                         C.fmt_bytes(x["peak_rss_above_base"])])
        rows.append([c["case"], "ratio vs tuned", f"{c['ratio']['step_time_vs_tuned']:.3f}", "", "",
                     f"{c['ratio']['peak_tensor_memory_vs_tuned']:.3f}", f"{c['ratio']['peak_rss_vs_tuned']:.3f}"])
    C.print_table(["case", "framework", "step ms", "p10", "p90", "peak tensor", "peak RSS"], rows)
    for c in result["cases"]:
        print(f"{c['case']}: other load {c['foreign_cpu_fraction']:.0%} of the CPUs; "
              f"loss difference vs tuned FSDP2 {c['loss_max_abs_diff_vs_tuned']:.2g}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
