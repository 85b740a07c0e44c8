"""torch.profiler CPU summary of one training step (rank 0 of 2, gloo), mfsdp2 and/or torch FSDP2.

    python benchmarks/profile_step.py [--model mlp|llama|tiny] [--config fp32|bf16|fp32_no_reshard]
                                      [--framework mfsdp2|fsdp2|fsdp2_tuned|both|all] [--steps 1] [--rows 25]
                                      [--trace DIR] [--prefetch N] [--json PATH]

Same models, configs, optimizer and data as ``compare_fsdp2.py``. After two warm-up steps it profiles
``--steps`` steps and prints, for rank 0: the top ops by self CPU time, the mfsdp2 lifecycle ranges
(``mfsdp2.*``), the time the main thread spends blocked in ``wait()`` on collectives, and CPU time
vs wall time of the process (all threads: compute, gloo's threads, the kernel's socket copies).
``--trace DIR`` also writes each rank's Chrome trace (open in Perfetto); ``--json PATH`` writes rank 0's
summary (per framework: wall, CPU, faults, the top ops and the mfsdp2 ranges) so that profile
figures quoted in docs/benchmarks.md come from a recorded file.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def worker(rank: int, ws: int, args: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    mesh = init_device_mesh("cpu", (ws,))
    ref = C.build_model(args["model"], seed=0)
    out = {}
    for fw in args["frameworks"]:
        model = C.shard(copy.deepcopy(ref), fw, args["config"], mesh)
        opt = C.make_optimizer(model.parameters())
        if fw == "mfsdp2" and args["prefetch"] is not None:
            model.set_prefetch_depth(args["prefetch"])
        for s in range(2):
            x, y = C.make_batch(args["model"], s, rank, ws)
            C.train_step(model, opt, args["model"], x, y)
        dist.barrier()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0, t0 = _cpu_s(), time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            for s in range(args["steps"]):
                x, y = C.make_batch(args["model"], 2 + s, rank, ws)
                C.train_step(model, opt, args["model"], x, y)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = _cpu_s() - c0
        ka = prof.key_averages()
        table = ka.table(sort_by="self_cpu_time_total", row_limit=args["rows"])
        events = sorted(
            ({"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
              "cpu_total_ms": e.cpu_time_total / 1e3} for e in ka),
            key=lambda d: -d["self_cpu_ms"])
        ranges = [d for d in events if d["name"].startswith("mfsdp2.")]
        if args["trace"]:
            os.makedirs(args["trace"], exist_ok=True)
            prof.export_chrome_trace(
                os.path.join(args["trace"], f"{fw}_{args['model']}_{args['config']}_rank{rank}.json"))
        out[fw] = {
            "wall_s": wall / args["steps"],
            "cpu_s": cpu / args["steps"],
            "user_s": (r1.ru_utime - r0.ru_utime) / args["steps"],
            "sys_s": (r1.ru_stime - r0.ru_stime) / args["steps"],
            "minor_faults": (r1.ru_minflt - r0.ru_minflt) / args["steps"],
            "table": table,
            "top": events[: args["rows"]],
            "ranges": ranges,
        }
        del model, opt, prof
    return out


def _grouped_ranges(ranges: list[dict]) -> list[tuple[str, int, float]]:
    """mfsdp2 ranges summed over units: 'mfsdp2.unshard layers.3' -> 'mfsdp2.unshard'."""
    agg: dict[str, list] = {}
    for d in ranges:
        k = d["name"].split(" ")[0]
        a = agg.setdefault(k, [0, 0.0])
        a[0] += d["calls"]
        a[1] += d["cpu_total_ms"]
    return sorted(((k, v[0], v[1]) for k, v in agg.items()), key=lambda t: -t[2])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp", choices=C.MODELS)
    p.add_argument("--config", default="fp32", choices=C.CONFIGS)
    p.add_argument("--framework", default="mfsdp2", choices=C.FRAMEWORKS + ("both", "all"),
                   help="both: mfsdp2 and FSDP2 default; all: also FSDP2 tuned")
    p.add_argument("--steps", type=int, default=1, help="profiled steps (default 1)")
    p.add_argument("--rows", type=int, default=25, help="rows of the op table (default 25)")
    p.add_argument("--trace", default=None, metavar="DIR", help="write Chrome traces to DIR")
    p.add_argument("--prefetch", type=int, default=None, help="mfsdp2 prefetch depth (default: runtime's)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mmap-max0", action="store_true", help="start the ranks with MALLOC_MMAP_MAX_=0")
    p.add_argument("--json", metavar="PATH", help="write rank 0's summary as JSON")
    a = p.parse_args(argv)
    fws = {"both": ["mfsdp2", "fsdp2"], "all": list(C.FRAMEWORKS)}.get(a.framework, [a.framework])
    args = {"model": a.model, "config": a.config, "frameworks": fws, "steps": a.steps, "rows": a.rows,
            "trace": a.trace, "prefetch": a.prefetch}
    env = {"MALLOC_MMAP_MAX_": "0"} if a.mmap_max0 else None
    res = C.run_ranks(worker, a.world_size, args, timeout=900, env=env)[0]
    for fw in fws:
        r = res[fw]
        print(f"=== {fw} {a.model}/{a.config}, rank 0, per step: wall {r['wall_s']*1e3:.0f} ms, "
              f"process CPU {r['cpu_s']*1e3:.0f} ms (user {r['user_s']*1e3:.0f}, sys {r['sys_s']*1e3:.0f}), "
              f"minor page faults {r['minor_faults']:.0f}")
        print(r["table"])
        if r["ranges"]:
            print("mfsdp2 ranges (summed over units, CPU total incl. children, per profiled steps):")
            for k, n, ms in _grouped_ranges(r["ranges"]):
                print(f"  {k:<28} calls {n:5d}  {ms:9.1f} ms")
        print()
    if a.json:
        import json

        out = {"command": "python " + " ".join([os.path.relpath(sys.argv[0], C.REPO)] + sys.argv[1:]),
               "date": C.now_iso(), "machine": C.machine_info(), "model": a.model, "config": a.config,
               "steps": a.steps,
               "frameworks": {fw: {k: v for k, v in res[fw].items() if k != "table"} for fw in fws}}
        for fw in fws:
            out["frameworks"][fw]["ranges_by_kind"] = [
                {"range": k, "calls": n, "cpu_total_ms": ms} for k, n, ms in _grouped_ranges(res[fw]["ranges"])]
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
