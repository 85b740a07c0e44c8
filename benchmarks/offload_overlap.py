"""CPU offload's step time, side by side in one run: mfsdp2 with ``mfsdp2.optim.AdamW`` stepping
after backward, the same stepping in backward (``step_in_backward=True``), that with bfloat16
moments (``state_dtype=torch.bfloat16``: half the host optimizer state, fewer bytes per step), and
torch FSDP2 with ``CPUOffloadPolicy`` and ``torch.optim.AdamW`` (its default, foreach).

    python benchmarks/offload_overlap.py [--models llama mlp] [--steps 6] [--warmup 2] [--json PATH]

World size 2 (gloo, one intra-op thread per rank), fp32, ZeRO-3 with ``CPUOffloadPolicy``. Each
rank builds the three models from one seed; the steps of the three alternate (one step of each per
round) so that a busy machine slows them alike. A step is forward + backward + ``step()`` +
``zero_grad()``, timed after a barrier; its time is the max over the ranks, the summary the
median. Ratios are against mfsdp2 without overlap. The losses of the last step of the three
float32-moment runs must agree (relative 1e-3: the same model and data, sums in different orders);
the bfloat16-moment run's is reported beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

VARIANTS = ("mfsdp2 offload", "mfsdp2 offload, step in backward", "FSDP2 offload",
            "mfsdp2 offload, step in backward, bf16 moments")
EXACT = VARIANTS[:3]  # the same arithmetic up to summation order: their losses must agree


def _build(name: str, variant: str, mesh):
    from torch.distributed.fsdp import CPUOffloadPolicy

    if variant.startswith("mfsdp2"):
        from mfsdp2 import fully_shard
        from mfsdp2.optim import AdamW
    else:
        from torch.distributed.fsdp import fully_shard
        from torch.optim import AdamW
    model = C.build_model(name)
    off = CPUOffloadPolicy(pin_memory=False)
    for u in C.units(model):
        fully_shard(u, mesh=mesh, offload_policy=off)
    fully_shard(model, mesh=mesh, offload_policy=off)
    kw = {"step_in_backward": True} if "in backward" in variant else {}
    if "bf16 moments" in variant:
        kw["state_dtype"] = torch.bfloat16
    return model, AdamW(model.parameters(), lr=1e-4, **kw)


def _rank(rank: int, ws: int, name: str, steps: int, warmup: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    runs = {v: _build(name, v, mesh) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    losses = {}
    for step in range(warmup + steps):
        x, y = C.make_batch(name, step, rank, ws)
        for v, (model, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = C.loss_fn(name, model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            if step >= warmup:
                times[v].append(dt)
            losses[v] = float(loss.detach())
    return {"times": times, "losses": losses}


def run(models, steps: int, warmup: int) -> dict:
    out = {"world_size": 2, "threads_per_rank": 1, "steps": steps, "warmup": warmup, "models": {}}
    for name in models:
        res = C.run_ranks(_rank, 2, name, steps, warmup)
        per_step = {v: [max(r["times"][v][i] for r in res) for i in range(steps)] for v in VARIANTS}
        med = {v: statistics.median(ts) for v, ts in per_step.items()}
        base = med[VARIANTS[0]]
        losses = res[0]["losses"]
        ref = losses[VARIANTS[0]]
        agree = all(abs(losses[v] - ref) <= 1e-3 * abs(ref) for v in EXACT)
        out["models"][name] = {
            "step_ms_median": {v: round(m * 1e3, 2) for v, m in med.items()},
            "ratio_vs_mfsdp2_offload": {v: round(m / base, 3) for v, m in med.items()},
            "speedup_of_step_in_backward_vs_fsdp2": round(med[VARIANTS[2]] / med[VARIANTS[1]], 3),
            "speedup_of_bf16_moments_vs_fsdp2": round(med[VARIANTS[2]] / med[VARIANTS[3]], 3),
            "step_ms_all": {v: [round(t * 1e3, 2) for t in ts] for v, ts in per_step.items()},
            "last_losses": losses,
            "losses_agree": agree,
        }
        print(name, json.dumps(out["models"][name]["step_ms_median"]),
              json.dumps(out["models"][name]["ratio_vs_mfsdp2_offload"]), flush=True)
        if not agree:
            raise SystemExit(f"{name}: the losses differ: {losses}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama", "mlp"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "offload_overlap.json"))
    a = ap.parse_args()
    out = run(a.models, a.steps, a.warmup)
    out["torch"] = torch.__version__
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
