"""mfsdp2 step time with prefetch depth 0 / 1 / 2 on CPU ranks (gloo), alternating in one run.

    python benchmarks/prefetch.py [--model mlp] [--config fp32] [--depths 0,1,2] [--steps N] [--json PATH]

Each rank builds one mfsdp2 model per depth from the same seed (``set_prefetch_depth(d)`` on the
root; 0 = every unit gathers on demand) and trains them with AdamW on the same batches. Timed rounds
run one step of every depth, then the comm-only replay and the compute-only step (as in
``compare_fsdp2.py``), in an order reversed every other round, a barrier before each item; a step's
time is the max over ranks, summaries are medians.

hidden fraction of depth d = (t_depth0 - t_depth_d) / comm_only: the share of the communication time
that prefetching took off the step (1.0 = all of it).
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


def worker(rank: int, ws: int, spec: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    counter = C.CollectiveCounter().install()
    name, config, depths = spec["model"], spec["config"], spec["depths"]
    mesh = init_device_mesh("cpu", (ws,))
    ref = C.build_model(name, seed=0)
    models = {}
    for d in depths:
        m = C.shard(copy.deepcopy(ref), "mfsdp2", config, mesh)
        m.set_prefetch_depth(d)
        models[d] = (m, C.make_optimizer(m.parameters()))
    floor = C.ComputeFloor(ref, name, config, ws)
    records = []
    losses = {d: [] for d in depths}
    for w in range(spec["warmup"]):
        x, y = C.make_batch(name, w, rank, ws)
        for d in depths:
            counter.enabled = d == depths[0] and w == spec["warmup"] - 1
            losses[d].append(C.train_step(*models[d], name, x, y).item())
            counter.enabled = False
            recs = counter.take()
            if recs:
                records = recs
        floor(x, y)
    replay = C.CommReplay(records, ws, counter)
    replay()
    keys = [f"depth{d}" for d in depths] + ["comm", "compute"]
    times = {k: [] for k in keys}
    for i in range(spec["steps"]):
        x, y = C.make_batch(name, spec["warmup"] + i, rank, ws)
        items = [(f"depth{d}", (lambda d=d: losses[d].append(C.train_step(*models[d], name, x, y).item())))
                 for d in depths]
        items += [("comm", replay), ("compute", lambda: floor(x, y))]
        if i % 2:
            items.reverse()
        for k, fn in items:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {"times": times, "losses": {str(d): v for d, v in losses.items()},
            "replayed": C.summarize_records(records, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp", choices=C.MODELS)
    p.add_argument("--config", default="fp32", choices=C.CONFIGS)
    p.add_argument("--depths", default="0,1,2", help="comma list of prefetch depths (default 0,1,2)")
    p.add_argument("--steps", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mmap-max0", action="store_true", help="start the ranks with MALLOC_MMAP_MAX_=0")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    depths = [int(d) for d in a.depths.split(",")]
    if 0 not in depths:
        depths = [0] + depths
    spec = {"model": a.model, "config": a.config, "depths": depths, "steps": a.steps, "warmup": a.warmup}
    env = {"MALLOC_MMAP_MAX_": "0"} if a.mmap_max0 else None
    t0 = time.time()
    per_rank = C.run_ranks(worker, a.world_size, spec, timeout=1800, env=env)
    t = {k: C.max_over_ranks([r["times"][k] for r in per_rank]) for k in per_rank[0]["times"]}
    s = {k: C.summarize_times(v) for k, v in t.items()}
    comm, compute, base = s["comm"]["median"], s["compute"]["median"], s["depth0"]["median"]
    rows, res = [], []
    for d in depths:
        m = s[f"depth{d}"]
        hidden = (base - m["median"]) / comm
        rows.append([str(d), f"{m['median']*1e3:.1f}", f"{m['p10']*1e3:.0f}-{m['p90']*1e3:.0f}",
                     f"{m['median'] / base:.3f}", f"{hidden:.3f}",
                     f"{m['median'] / max(compute, comm):.2f}"])
        res.append({"depth": d, "step_s_median": m["median"], "step_s_p10": m["p10"], "step_s_p90": m["p90"],
                    "ratio_to_depth0": m["median"] / base, "hidden_fraction": hidden})
    print(f"\nmfsdp2 prefetch, {a.model}/{a.config}, world size {a.world_size}, gloo, 1 thread/rank, "
          f"{a.steps} alternating rounds ({time.time() - t0:.0f}s)")
    print(f"comm-only {comm*1e3:.1f} ms ({s['comm']['p10']*1e3:.0f}-{s['comm']['p90']*1e3:.0f}), "
          f"compute-only {compute*1e3:.1f} ms ({s['compute']['p10']*1e3:.0f}-{s['compute']['p90']*1e3:.0f})")
    C.print_table(["depth", "step ms", "p10-p90", "vs depth 0", "comm hidden", "step/floor"], rows)
    la = per_rank[0]["losses"]
    same = all(v == la[str(depths[0])] for v in la.values())
    print(f"losses identical across depths: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": C.machine_info(), "date": C.now_iso(),
                       "command": "python " + " ".join([os.path.relpath(sys.argv[0], C.REPO)] + sys.argv[1:]),
                       "model": a.model, "config": a.config, "world_size": a.world_size,
                       "comm_s": s["comm"], "compute_s": s["compute"], "depths": res,
                       "losses_identical": same}, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
