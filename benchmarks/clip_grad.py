"""Gradient clipping cost: ``mfsdp2.clip_grad_norm_`` (flat shards) vs ``torch.nn.utils.clip_grad_norm_``
on the same mfsdp2 model's DTensor gradients, and torch's on the same model sharded by FSDP2.

    python benchmarks/clip_grad.py [--models llama tiny] [--reps 30] [--json PATH]

World size 2 (gloo, one thread per rank). Each rank builds the model twice (mfsdp2, FSDP2) from
one seed, runs one forward/backward on each, then times each clipping call ``--reps`` times
(max_norm large enough that the scale is 1: the gradients stay the same), a barrier before each
call; a call's time is the max over the ranks, the summary is the median. The three total norms
must agree (relative 1e-3: fp32 sums of ~1e7 squares in different orders).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _rank(rank: int, ws: int, name: str, reps: int) -> dict:
    import mfsdp2
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    models = {f: C.shard(C.build_model(name), f, "fp32", mesh) for f in ("mfsdp2", "fsdp2")}
    for m in models.values():
        x, y = C.make_batch(name, 0, rank, ws)
        C.loss_fn(name, m(x), y).backward()
    calls = {
        "mfsdp2.clip_grad_norm_ (mfsdp2 model)": lambda: mfsdp2.clip_grad_norm_(models["mfsdp2"], 1e9),
        "torch clip_grad_norm_ (mfsdp2 model)":
            lambda: torch.nn.utils.clip_grad_norm_(models["mfsdp2"].parameters(), 1e9),
        "torch clip_grad_norm_ (FSDP2 model)":
            lambda: torch.nn.utils.clip_grad_norm_(models["fsdp2"].parameters(), 1e9),
    }
    times = {k: [] for k in calls}
    norms = {}
    for _ in range(reps):
        for k, f in calls.items():
            dist.barrier()
            t0 = time.perf_counter()
            n = f()
            times[k].append(time.perf_counter() - t0)
            norms[k] = float(n.full_tensor() if hasattr(n, "full_tensor") else n)
    return {"times": times, "norms": norms,
            "params": sum(1 for _ in models["mfsdp2"].parameters())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama", "tiny"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {}
    for name in args.models:
        res = C.run_ranks(_rank, 2, name, args.reps)
        keys = list(res[0]["times"])
        med = {k: C.summarize_times(C.max_over_ranks([r["times"][k] for r in res]))["median"] for k in keys}
        norms = res[0]["norms"]
        ref = norms[keys[2]]
        # fp32 sums of ~1e7 squares in different orders: relative differences up to ~sqrt(n)*u ~ 2e-4
        # (exactness is tested in float64, tests/integrations/test_clip_grad.py)
        assert all(abs(v - ref) <= 1e-3 * abs(ref) for v in norms.values()), norms
        base = med[keys[0]]
        print(f"\n{name}: {res[0]['params']} parameters, total norm {ref:.6g}")
        for k in keys:
            print(f"  {k:<42} {med[k] * 1e3:8.3f} ms   {med[k] / base:6.2f}x mfsdp2.clip_grad_norm_")
        out[name] = {"median_s": med, "norms": norms, "params": res[0]["params"]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
