"""Which torch FSDP2 configuration is fastest on this backend: every candidate of
``_common.FSDP2_TUNINGS``, alternating in one run.

    python benchmarks/fsdp2_tuning.py [--cases mlp:fp32,llama:fp32,tiny:fp32] [--steps N] [--json PATH]

Why: the side-by-side benchmarks report mfsdp2 against FSDP2 twice, as shipped and *tuned*; the
tuned one must be the fastest configuration FSDP2's API offers, found by measuring, not assumed.
Each rank builds one FSDP2 model per candidate from the same seed (every block, then the root, as
``_common.shard``), trains all with AdamW on the same batches, and times rounds of one step per
candidate (the order rotated by one each round and reversed every other round, a barrier before
each step; a step's time is the max over ranks). Reported per case: median step (p10-p90) per
candidate, its ratio to the default, and the fastest; the losses of all candidates must be
identical (the options change scheduling, never arithmetic). The overall winner is the best
geometric mean of step / default over the cases; saved as ``benchmarks/results/fsdp2_tuning.json``
it becomes "tuned FSDP2" on CPU for every other script (``_common.fsdp2_tuned``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
from compare_fsdp2 import _timed  # noqa: E402

DEFAULT_CASES = [("mlp", "fp32"), ("mlp", "bf16"), ("llama", "fp32"), ("tiny", "fp32")]


def run_case(rank: int, ws: int, spec: dict, counter: C.CollectiveCounter) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    name, config = spec["model"], spec["config"]
    mesh = init_device_mesh("cpu", (ws,))
    ref = C.build_model(name, seed=0)
    cands = spec["candidates"]
    t0 = time.time()
    models = {c: C.shard(copy.deepcopy(ref), f"fsdp2:{c}", config, mesh) for c in cands}
    opts = {c: C.make_optimizer(m.parameters()) for c, m in models.items()}
    losses = {c: [] for c in cands}
    for w in range(spec["warmup"]):
        x, y = C.make_batch(name, w, rank, ws)
        for c in cands:
            losses[c].append(C.train_step(models[c], opts[c], name, x, y).item())
    phase_s = {"build_warmup": time.time() - t0}
    t0 = time.time()
    times = {c: [] for c in cands}
    for i in range(spec["steps"]):
        x, y = C.make_batch(name, spec["warmup"] + i, rank, ws)
        k = i % len(cands)
        order = cands[k:] + cands[:k]
        if i % 2:
            order.reverse()
        for c in order:
            wall, _ = _timed(lambda c=c: losses[c].append(C.train_step(models[c], opts[c], name, x, y).item()))
            times[c].append(wall)
    phase_s["timed"] = time.time() - t0
    return {"model": name, "config": config, "times": times, "losses": losses, "phase_s": phase_s}


def worker(rank: int, ws: int, specs: list[dict]) -> list[dict]:
    return C.run_cases(rank, ws, specs, run_case, "config")


def combine(per_rank: list[dict]) -> dict:
    r0 = per_rank[0]
    cands = list(r0["times"])
    summ = {c: C.summarize_times(C.max_over_ranks([r["times"][c] for r in per_rank])) for c in cands}
    base = summ["default"]["median"]
    fastest = min(cands, key=lambda c: summ[c]["median"])
    l0 = r0["losses"]
    return {
        "model": r0["model"], "config": r0["config"],
        "candidates": {c: {**C.FSDP2_TUNINGS[c], "step_s_median": summ[c]["median"], "step_s_p10": summ[c]["p10"],
                           "step_s_p90": summ[c]["p90"], "ratio_vs_default": summ[c]["median"] / base}
                       for c in cands},
        "fastest": fastest,
        "losses_identical": all(l0[c] == l0["default"] for c in cands),
        "phase_s": r0["phase_s"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=None,
                   help="comma list of model:config (default mlp:fp32,mlp:bf16,llama:fp32,tiny:fp32)")
    p.add_argument("--candidates", default=",".join(C.FSDP2_TUNINGS), help="comma list of _common.FSDP2_TUNINGS keys")
    p.add_argument("--steps", type=int, default=10, help="timed rounds (default 10; tiny x4)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--wait-quiet", type=float, default=60.0, metavar="S")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    cases = [tuple(c.split(":")) for c in a.cases.split(",")] if a.cases else DEFAULT_CASES
    cands = [c for c in a.candidates.split(",") if c]
    if "default" not in cands:
        cands.insert(0, "default")
    for c in cands:
        if c not in C.FSDP2_TUNINGS:
            p.error(f"unknown candidate {c!r}")
    specs = [{"model": m, "config": c, "candidates": cands, "warmup": a.warmup,
              "steps": a.steps * (4 if m == "tiny" else 1), "wait_quiet": a.wait_quiet} for m, c in cases]
    command = "python " + " ".join([os.path.relpath(sys.argv[0], C.REPO)] + sys.argv[1:])
    t0 = time.time()
    per_rank = C.run_ranks(worker, a.world_size, specs, timeout=3600.0)
    results = [combine([r[i] for r in per_rank]) for i in range(len(specs))]
    rows = []
    for r in results:
        for c, d in r["candidates"].items():
            rows.append([f"{r['model']}/{r['config']}", c + (" *" if c == r["fastest"] else ""),
                         f"{d['step_s_median']*1e3:.1f} ({d['step_s_p10']*1e3:.0f}-{d['step_s_p90']*1e3:.0f})",
                         f"{d['ratio_vs_default']:.3f}", "yes" if r["losses_identical"] else "NO"])
    C.print_table(["case", "FSDP2 configuration (* fastest)", "step ms median (p10-p90)", "step / default",
                   "losses identical"], rows)
    # The winner: the best geometric mean of step / default over the cases (what
    # _common.fsdp2_tuned reads back when this run is saved as benchmarks/results/fsdp2_tuning.json).
    geo = {c: math.exp(sum(math.log(r["candidates"][c]["ratio_vs_default"]) for r in results) / len(results))
           for c in cands}
    winner = min(geo, key=geo.get)
    print("\ngeometric mean of step / default: " + ", ".join(f"{c} {g:.3f}" for c, g in geo.items())
          + f"; winner: {winner}")
    wall = time.time() - t0
    print(f"wall time {wall:.0f}s")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        # Everything gathered before the file is opened: machine_info() reads the previous
        # benchmarks/results/fsdp2_tuning.json (the "tuned" choice), which "w" would truncate.
        payload = {"cases": results, "geomean_ratio_vs_default": geo, "winner": winner,
                   "machine": C.machine_info(), "date": C.now_iso(), "command": command,
                   "wall_s": wall, "world_size": a.world_size}
        with open(a.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
