"""``torch.optim.AdamW.step()`` on mfsdp2's parameters vs FSDP2's, on the Llama-style demo model,
in one run; and the same AdamW over each flat main-weight shard as one plain tensor, the floor a
flat-shard optimizer could reach (how much of the step is per-parameter DTensor dispatch).

    python benchmarks/optimizer_step.py [--model llama] [--rounds 20] [--json PATH]

World size 2 (gloo, one thread per rank). Each rank builds the model twice from one seed, shards
one copy with mfsdp2 and one with FSDP2 (fp32, ``_common.shard``), runs one forward/backward on
each (the gradients then stay as they are), and builds one ``AdamW(lr=1e-3, weight_decay=0.01)``
per (model, implementation): ``foreach=True`` (torch's default on CPU), ``fused=True``, and the
for-loop (``foreach=False``). "flat" steps mfsdp2's flat main-weight shards as plain tensors (one
per parameter group, its flat main-gradient shard as ``.grad``; padding included). A timed round
steps every optimizer once, the order rotated each round, a barrier before each step; a step's
time is the max over the ranks, the figure the median over the rounds. Stepping changes the
weights, which does not change the work.
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

IMPLS = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}


def _rank(rank: int, ws: int, name: str, rounds: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    models = {f: C.shard(C.build_model(name), f, "fp32", mesh) for f in ("mfsdp2", "fsdp2")}
    for m in models.values():
        x, y = C.make_batch(name, 0, rank, ws)
        C.loss_fn(name, m(x), y).backward()
    flat = []
    for g in C.mfsdp2_groups(models["mfsdp2"]):
        p = torch.nn.Parameter(g.main_weight.detach())  # shares the main weights' storage
        p.grad = g.main_grad
        flat.append(p)
    params = {"mfsdp2": lambda: list(models["mfsdp2"].parameters()),
              "FSDP2": lambda: list(models["fsdp2"].parameters()), "flat": lambda: flat}
    opts, errors = {}, {}
    for impl, kw in IMPLS.items():
        for who, ps in params.items():
            key = f"{who} {impl}"
            try:
                opts[key] = torch.optim.AdamW(ps(), lr=1e-3, weight_decay=0.01, **kw)
                opts[key].step()  # warm-up: states created
            except Exception as e:  # an implementation the parameters do not support: reported
                errors[key] = f"{type(e).__name__}: {e}"
                opts.pop(key, None)
    keys = list(opts)
    times = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            dist.barrier()
            t0 = time.perf_counter()
            opts[k].step()
            times[k].append(time.perf_counter() - t0)
    return {"times": times, "errors": errors, "params": {k: len(v()) for k, v in params.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = C.run_ranks(_rank, 2, args.model, args.rounds)
    keys = list(res[0]["times"])
    med = {k: C.summarize_times(C.max_over_ranks([r["times"][k] for r in res]))["median"] for k in keys}
    print(f"{args.model}: optimizer.step() per rank (median of {args.rounds}, max over 2 ranks); "
          f"tensors stepped: {res[0]['params']}")
    for impl in IMPLS:
        row = {who: med.get(f"{who} {impl}") for who in ("mfsdp2", "FSDP2", "flat")}
        cells = [f"{who} {v * 1e3:7.2f} ms" if v is not None else f"{who} n/a" for who, v in row.items()]
        ratio = (f"  mfsdp2/FSDP2 {row['mfsdp2'] / row['FSDP2']:.2f}  flat/mfsdp2 {row['flat'] / row['mfsdp2']:.2f}"
                 if None not in row.values() else "")
        print(f"  AdamW {impl:<8} " + "  ".join(cells) + ratio)
    for k, e in res[0]["errors"].items():
        print(f"  {k}: not run ({e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": C.machine_info(), "date": C.now_iso(), "model": args.model, "rounds": args.rounds,
                       "median_s": med, "errors": res[0]["errors"], "tensors": res[0]["params"]}, f, indent=1)


if __name__ == "__main__":
    main()
