"""mfsdp2's allocators (dynamic, caching, trace_pool) side by side with torch FSDP2 (as shipped and
tuned, ``_common.FSDP2_TUNED``), in one run.

    python benchmarks/allocators.py [--model mlp] [--config fp32] [--steps N] [--json PATH]

Each rank builds one model per framework from the same seed (mfsdp2 with each allocator, and
FSDP2) and trains them with AdamW on the same batches; the losses must agree. Timed rounds run one
step of each in an order reversed every other round, a barrier before each; a step's time is the
max over the two ranks, summaries are medians. Per framework, on rank 0:

* ``underlying allocations / step``: new memory requests the runtime's allocator made per timed
  step (0 = no churn; FSDP2 allocates its all-gather / reduce-scatter buffers every time: "n/a");
* ``transient peak``: the allocator's peak live bytes over a step (mfsdp2's own accounting);
* ``held``: what the allocator keeps between steps (caching: free blocks; trace_pool: its pools);
* ``peak RSS over idle``: the kernel's high-water mark during two steps of that framework alone,
  minus the RSS just before (all models stay built, so only what the step adds shows).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch.distributed as dist  # noqa: E402

ALLOCATORS = ("dynamic", "caching", "trace_pool")


FSDP2 = ("fsdp2", "fsdp2_tuned")


def _shard(model, framework: str, config: str, mesh, allocator=None):
    if framework in FSDP2:
        return C.shard(model, framework, config, mesh)
    from mfsdp2 import MixedPrecisionPolicy, fully_shard

    o = C.config_options(config)
    mp = MixedPrecisionPolicy(param_dtype=o["param_dtype"], reduce_dtype=o["reduce_dtype"])
    for u in C.units(model):
        fully_shard(u, mesh=mesh, mp_policy=mp, reshard_after_forward=o["reshard_after_forward"])
    root_kw = {} if o["reshard_after_forward"] else {"reshard_after_forward": False}  # None: the root keeps them
    fully_shard(model, mesh=mesh, mp_policy=mp, allocator=allocator, **root_kw)
    return model


def worker(rank: int, ws: int, spec: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    name, config = spec["model"], spec["config"]
    mesh = init_device_mesh("cpu", (ws,))
    ref = C.build_model(name, seed=0)
    keys = list(ALLOCATORS) + list(FSDP2)
    models = {}
    for k in keys:
        m = _shard(copy.deepcopy(ref), k if k in FSDP2 else "mfsdp2", config, mesh, None if k in FSDP2 else k)
        models[k] = (m, C.make_optimizer(m.parameters()))
    del ref
    losses = {k: [] for k in keys}
    step = 0
    for _ in range(spec["warmup"]):
        x, y = C.make_batch(name, step, rank, ws)
        for k in keys:
            losses[k].append(C.train_step(*models[k], name, x, y).item())
        step += 1
    allocs_before = {k: models[k][0].allocator.stats.underlying_allocations for k in ALLOCATORS}
    times = {k: [] for k in keys}
    for i in range(spec["steps"]):
        x, y = C.make_batch(name, step, rank, ws)
        order = keys if i % 2 == 0 else keys[::-1]
        for k in order:
            dist.barrier()
            t0 = time.perf_counter()
            losses[k].append(C.train_step(*models[k], name, x, y).item())
            times[k].append(time.perf_counter() - t0)
        step += 1
    out = {"times": times, "losses": losses, "alloc": {}, "rss": {}}
    for k in ALLOCATORS:
        a = models[k][0].allocator
        out["alloc"][k] = {
            "underlying_allocations_per_step": (a.stats.underlying_allocations - allocs_before[k]) / spec["steps"],
            "held_bytes": a.cached_bytes() if hasattr(a, "cached_bytes") else 0,
        }
    # Memory: each framework alone, two steps, fresh peaks.
    for k in keys:
        m, opt = models[k]
        if k not in FSDP2:
            m.allocator.stats.reset_peak()
        dist.barrier()
        C.reset_peak_rss()
        idle = C.rss_bytes()
        for _ in range(2):
            x, y = C.make_batch(name, step, rank, ws)
            losses[k].append(C.train_step(m, opt, name, x, y).item())
        out["rss"][k] = C.peak_rss_bytes() - idle
        if k not in FSDP2:
            out["alloc"][k]["transient_peak_bytes"] = m.allocator.stats.peak_bytes
    step += 2
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mlp", choices=["mlp", "llama", "tiny"])
    ap.add_argument("--config", default="fp32", choices=list(C.CONFIGS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec = {"model": args.model, "config": args.config, "steps": args.steps, "warmup": args.warmup}
    t0 = time.time()
    res = C.run_ranks(worker, args.world_size, spec)
    keys = list(ALLOCATORS) + list(FSDP2)
    step_s = {k: C.summarize_times(C.max_over_ranks([r["times"][k] for r in res])) for k in keys}
    l0 = res[0]["losses"]
    max_loss_diff = max(abs(a - b) for k in keys for a, b in zip(l0[k], l0["fsdp2"]))
    rows, cases = [], []
    for k in keys:
        a = res[0]["alloc"].get(k, {})
        s = step_s[k]
        case = {
            "framework": k if k in FSDP2 else f"mfsdp2/{k}",
            "step_s_median": s["median"],
            "step_s_p10": s["p10"],
            "step_s_p90": s["p90"],
            "step_ratio_vs_fsdp2": s["median"] / step_s["fsdp2"]["median"],
            "step_ratio_vs_fsdp2_tuned": s["median"] / step_s["fsdp2_tuned"]["median"],
            "underlying_allocations_per_step": a.get("underlying_allocations_per_step"),
            "transient_peak_bytes": a.get("transient_peak_bytes"),
            "held_bytes": a.get("held_bytes"),
            "peak_rss_over_idle_bytes": res[0]["rss"][k],
            "rss_ratio_vs_fsdp2": res[0]["rss"][k] / max(res[0]["rss"]["fsdp2"], 1),
            "rss_ratio_vs_fsdp2_tuned": res[0]["rss"][k] / max(res[0]["rss"]["fsdp2_tuned"], 1),
        }
        cases.append(case)
        rows.append([
            case["framework"],
            f"{s['median'] * 1e3:.0f} ({s['p10'] * 1e3:.0f}-{s['p90'] * 1e3:.0f})",
            f"{case['step_ratio_vs_fsdp2_tuned']:.2f}", f"{case['step_ratio_vs_fsdp2']:.2f}",
            ("n/a" if a.get("underlying_allocations_per_step") is None
             else f"{a['underlying_allocations_per_step']:.1f}"),
            C.fmt_bytes(a.get("transient_peak_bytes")),
            C.fmt_bytes(a.get("held_bytes")),
            C.fmt_bytes(case["peak_rss_over_idle_bytes"]),
            f"{case['rss_ratio_vs_fsdp2_tuned']:.2f}",
        ])
    print(f"{args.model}/{args.config}, world size {args.world_size}, {args.steps} timed steps; "
          f"max loss difference vs FSDP2 {max_loss_diff:.1e}")
    C.print_table(["framework", "step ms median (p10-p90)", "step / FSDP2 tuned", "step / FSDP2 default",
                   "new allocations/step", "transient peak", "held between steps", "peak RSS over idle",
                   "RSS / FSDP2 tuned"], rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": C.now_iso(), "command": " ".join(sys.argv), "machine": C.machine_info(),
                       "wall_s": time.time() - t0, "model": args.model, "config": args.config,
                       "world_size": args.world_size, "max_loss_diff_vs_fsdp2": max_loss_diff, "cases": cases},
                      f, indent=2)


if __name__ == "__main__":
    main()
