"""The optimizer step on mfsdp2's parameters, side by side in one run: ``mfsdp2.optim.AdamW``
against torch's AdamW (``fused=True``, ``foreach=True``, the for-loop) on mfsdp2's and FSDP2's
parameters, the bytes per second it reaches against this machine's memory bandwidth measured
in the same run, and the whole ``no_shard`` training step on the ``tiny`` model against DDP.

    python benchmarks/optimizer_step.py [--model llama] [--rounds 20] [--tiny-steps 30] [--json PATH]

World size 2 (gloo, one thread per rank). Each rank builds the model twice from one seed, shards
one copy with mfsdp2 and one with FSDP2 (fp32, ``_common.shard``), runs one forward/backward on
each (the gradients then stay as they are), and builds one optimizer per (model, implementation),
all ``lr=1e-3, weight_decay=0.01``: torch's ``AdamW`` with ``foreach=True`` (its CPU default when
asked for speed), ``fused=True`` (torch's fastest CPU AdamW) and the for-loop (``foreach=False``,
its default on CPU), and ``mfsdp2.optim.AdamW`` (default flags: the native flat step; and with
``state_dtype=torch.bfloat16``: 20 bytes per element) on mfsdp2's parameters.
"flat" is torch's AdamW over mfsdp2's flat main-weight shards as plain tensors (one
per parameter group, its flat main-gradient shard as ``.grad``, padding included): the floor of
a per-shard torch step. A timed round steps every optimizer once, the order rotated each round, a
barrier before each step; a step's time is the max over the ranks, the figure the median over
the rounds. Stepping changes the weights, which does not change the work.

Bandwidth: both ranks at once (as they step), an in-place ``a += s * b`` over arrays of 256 MiB
or the last-level cache's size, whichever is larger (12 bytes per element: two reads, one write,
no write-allocate -- the access pattern of AdamW's in-place updates) and a copy (8 bytes per
element as STREAM counts it); the best of five, per rank.
AdamW must move 28 bytes per float32 element it steps (read parameter, gradient and both
moments; write parameter and moments; 36 with amsgrad): ``bytes/s = 28 x elements on the rank /
step time``, reported as a fraction of the in-place triad's rate.

Tiny: ``step_phases.worker`` on the 64-unit ``tiny`` model, ``ddp`` and ``no_shard`` with
``mfsdp2.optim.AdamW`` (which steps DDP's plain tensors with torch's own code: DDP's step is
torch's default AdamW); forward, backward, step and zero_grad medians of rank 0.
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
OURS = "mfsdp2.optim.AdamW"
OURS_BF16 = "mfsdp2.optim.AdamW bf16 states"
ADAMW_BYTES = 28  # per float32 element: read p, g, m, v; write p, m, v
ADAMW_BF16_BYTES = 20  # the same with bfloat16 moments (2 bytes each way for m and v)


def _llc_bytes() -> int:
    """The largest CPU cache's size (sysfs), 0 if unknown."""
    sizes = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    for d in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, d, "size")) as f:
                v = f.read().strip()
            sizes.append(int(v[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[v[-1]] if v[-1] in "KMG" else int(v))
        except (OSError, ValueError):
            pass
    return max(sizes, default=0)


def _bandwidth(repeats: int = 5) -> dict:
    """Best bytes/s of this rank over ``repeats`` (both ranks run together, a barrier before
    each), on arrays of 256 MiB or the size of the last-level cache, whichever is larger: memory,
    not cache (the two ranks' four arrays are at least four times the cache)."""
    numel = max(256 << 20, _llc_bytes()) // 4
    a = torch.ones(numel)
    b = torch.full((numel,), 0.5)
    out = {}
    for name, fn, nbytes in (("triad_inplace", lambda: a.add_(b, alpha=0.5), 12), ("copy", lambda: a.copy_(b), 8)):
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes * numel / best
    out["array_bytes"] = 4 * numel
    return out


def _step_times(rank: int, ws: int, name: str, rounds: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp2.optim import AdamW as FlatAdamW

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
    makers = {f"{who} {impl}": (lambda ps=ps, kw=kw: torch.optim.AdamW(ps(), lr=1e-3, weight_decay=0.01, **kw))
              for impl, kw in IMPLS.items() for who, ps in params.items()}
    makers[OURS] = lambda: FlatAdamW(params["mfsdp2"](), lr=1e-3, weight_decay=0.01)
    makers[OURS_BF16] = lambda: FlatAdamW(params["mfsdp2"](), lr=1e-3, weight_decay=0.01, state_dtype=torch.bfloat16)
    for key, make in makers.items():
        try:
            opts[key] = make()
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
    elements = sum(p.to_local().numel() for p in models["mfsdp2"].parameters())
    counts = {k: len(v()) for k, v in params.items()}
    return {"times": times, "errors": errors, "params": counts, "elements": elements}


def _rank(rank: int, ws: int, name: str, rounds: int) -> dict:
    # The models and optimizers are _step_times' locals: their memory is freed before the bandwidth arrays.
    return {**_step_times(rank, ws, name, rounds), "bandwidth": _bandwidth()}


def _tiny(steps: int) -> dict:
    import step_phases

    args = {"model": "tiny", "frameworks": ["ddp", "no_shard"], "steps": steps, "warmup": 5, "foreach": False,
            "optimizer": "mfsdp2"}
    return C.run_ranks(step_phases.worker, 2, args)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tiny-steps", type=int, default=30, help="timed steps of the tiny no_shard vs DDP run (0: skip)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t_start = time.time()
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

    summary: dict = {}
    ours = med.get(OURS)
    if ours is not None:
        torch_best = {k: med[k] for k in ("mfsdp2 fused", "mfsdp2 foreach") if k in med}
        best_key = "mfsdp2 fused" if "mfsdp2 fused" in torch_best else min(torch_best, key=torch_best.get)
        elements = max(r["elements"] for r in res)
        bw = {k: min(r["bandwidth"][k] for r in res) for k in ("triad_inplace", "copy")}
        achieved = ADAMW_BYTES * elements / ours
        summary = {"ours_s": ours, "bandwidth_array_bytes": res[0]["bandwidth"]["array_bytes"],
                   "torch_fastest": best_key, "torch_fastest_s": med[best_key],
                   "speedup_vs_torch_fastest": med[best_key] / ours,
                   "speedup_vs_flat_fused": med["flat fused"] / ours if "flat fused" in med else None,
                   "elements_per_rank": elements, "adamw_bytes_per_s": achieved,
                   "bandwidth_bytes_per_s": bw, "fraction_of_bandwidth": achieved / bw["triad_inplace"]}
        print(f"  {OURS:<14} {ours * 1e3:7.2f} ms: {summary['speedup_vs_torch_fastest']:.2f}x torch's fastest "
              f"({best_key}, {med[best_key] * 1e3:.2f} ms)"
              + (f", {summary['speedup_vs_flat_fused']:.2f}x fused AdamW on the flat shards"
                 if summary["speedup_vs_flat_fused"] else ""))
        print(f"  bandwidth per rank (both ranks at once): in-place triad {bw['triad_inplace'] / 1e9:.2f} GB/s, "
              f"copy {bw['copy'] / 1e9:.2f} GB/s; {OURS} moves {ADAMW_BYTES} B x {elements / 1e6:.2f} M elements "
              f"= {achieved / 1e9:.2f} GB/s ({100 * summary['fraction_of_bandwidth']:.0f} % of the triad)")
        bf16 = med.get(OURS_BF16)
        if bf16 is not None:
            moved = ADAMW_BF16_BYTES * elements / bf16
            summary.update(bf16_states_s=bf16, bf16_states_speedup_vs_torch_fastest=med[best_key] / bf16,
                           bf16_states_bytes_per_s=moved, bf16_states_fraction_of_bandwidth=moved / bw["triad_inplace"])
            print(f"  {OURS_BF16} {bf16 * 1e3:7.2f} ms: {summary['bf16_states_speedup_vs_torch_fastest']:.2f}x torch's "
                  f"fastest; {ADAMW_BF16_BYTES} B x {elements / 1e6:.2f} M elements = {moved / 1e9:.2f} GB/s "
                  f"({100 * summary['bf16_states_fraction_of_bandwidth']:.0f} % of the triad)")

    tiny = _tiny(args.tiny_steps) if args.tiny_steps > 0 else None
    if tiny is not None:
        print(f"tiny, world size 2, {OURS} (DDP's plain tensors: torch's own step); ms, rank 0 medians")
        base = tiny["ddp"]["step_s"]
        rows = [[fw] + [f"{r['median_s'][p] * 1e3:.1f}" for p in ("forward", "backward", "optimizer_step", "zero_grad")]
                + [f"{r['step_s'] * 1e3:.1f}", f"{r['step_s'] / base:.2f}"] for fw, r in tiny.items()]
        C.print_table(["framework", "forward", "backward", "optimizer_step", "zero_grad", "step", "step / DDP"], rows)
        summary["tiny_no_shard_over_ddp"] = tiny["no_shard"]["step_s"] / base

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": C.machine_info(), "date": C.now_iso(), "model": args.model, "rounds": args.rounds,
                       "command": "python benchmarks/optimizer_step.py " + " ".join(sys.argv[1:]),
                       "median_s": med, "errors": res[0]["errors"], "tensors": res[0]["params"], "summary": summary,
                       "tiny": tiny, "wall_s": time.time() - t_start}, f, indent=1)


if __name__ == "__main__":
    main()
