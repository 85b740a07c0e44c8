"""``mfsdp2.estimate_memory`` against measured peaks on the CPU benchmark cases.

    python benchmarks/memory_estimate.py [--world-sizes 1,2,4] [--cases mlp:fp32,...] [--json PATH]

For each world size, spawned gloo ranks run ``compare_fsdp2``'s memory phase for mfsdp2 alone
(fresh model, one warm-up step, then steps under ``mfsdp2.memory.memory_bound.StepMemoryTracker``:
torch's ``MemTracker`` with mfsdp2's shards and everything its allocator holds registered, the
``peak_tensor_bytes`` that ``compare_fsdp2.py`` reports, the max over ranks); beside it,
:func:`estimate_for` predicts the same case from a meta-device build in the
parent, before any rank exists. Reported per case: both peaks and ``estimate_error`` =
(estimate - measured) / measured. ``compare_fsdp2.py`` reports the same error per case under
``ratio`` from :func:`estimate_for`.
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

MEM_STEPS = 2


def estimate_for(name: str, config: str, world_size: int, allocator: str = "caching", prefetch_depth: int = 1):
    """The estimate of one benchmark case: the model built on the meta device, every block a unit,
    the config's precision and resharding, AdamW (single-tensor on CPU), this rank's batch and the
    benchmark's loss, on gloo."""
    import mfsdp2

    with torch.device("meta"):
        model = C.build_model(name)
    o = C.config_options(config)
    mp = mfsdp2.MixedPrecisionPolicy(param_dtype=o["param_dtype"], reduce_dtype=o["reduce_dtype"])
    per_rank = C.GLOBAL_BATCH[name] // world_size

    def inputs():
        if name == "llama":
            return (torch.randint(0, model.tok_embeddings.num_embeddings, (per_rank, C.LLAMA_SEQ)),)
        return (torch.randn(per_rank, 1024 if name == "mlp" else 64),)

    def loss(out):
        if name == "llama":
            return C.loss_fn(name, out, torch.randint(0, out.shape[-1], out.shape[:-1]))
        return C.loss_fn(name, out, torch.randn(out.shape))

    return mfsdp2.estimate_memory(
        model, units=C.units(model), mesh_shape=world_size, mp_policy=mp,
        reshard_after_forward=o["reshard_after_forward"], optimizer="adamw", optimizer_impl="single",
        prefetch_depth=prefetch_depth, inputs=inputs, loss_fn=loss, device="cpu", allocator=allocator,
    )


def _worker(rank: int, ws: int, cases: list) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    import compare_fsdp2 as CF

    mesh = init_device_mesh("cpu", (ws,))
    out = []
    for name, config in cases:
        ref = C.build_model(name, seed=0)
        r = CF._tensor_phase("mfsdp2", ref, name, config, mesh, rank, ws, MEM_STEPS, 5)
        out.append({"peak": r["peak_tensor_bytes"], "breakdown": r["peak_tensor_breakdown"]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="1,2,4")
    p.add_argument("--cases", default=",".join(f"{m}:{c}" for m, c in
                                               [("mlp", "fp32"), ("mlp", "bf16"), ("mlp", "fp32_no_reshard"),
                                                ("llama", "fp32"), ("llama", "bf16"), ("llama", "fp32_no_reshard"),
                                                ("tiny", "fp32")]))
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    rows = []
    t0 = time.time()
    for ws in [int(w) for w in args.world_sizes.split(",")]:
        est = {c: estimate_for(*c, ws) for c in cases}  # before any rank exists
        per_rank = C.run_ranks(_worker, ws, cases, timeout=3600.0)
        for i, (name, config) in enumerate(cases):
            measured = max(r[i]["peak"] for r in per_rank)
            e = est[(name, config)]
            rows.append({"model": name, "config": config, "world_size": ws, "measured_peak_bytes": measured,
                         "estimate_peak_bytes": e.peak_bytes, "estimate_error": (e.peak_bytes - measured) / measured,
                         "estimate_at_peak": e.at_peak, "estimate_peak_at": e.peak_at,
                         "measured_breakdown_rank0": per_rank[0][i]["breakdown"]})
            print(f"{name}/{config:<16} ws {ws}: measured {measured:>14,}  estimate {e.peak_bytes:>14,}  "
                  f"error {100 * rows[-1]['estimate_error']:+.2f} %", flush=True)
    worst = max(abs(r["estimate_error"]) for r in rows)
    print(f"worst |error| {100 * worst:.2f} % over {len(rows)} cases; {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": rows, "machine": C.machine_info(), "date": C.now_iso(),
                       "command": "python " + " ".join([os.path.relpath(sys.argv[0], C.REPO)] + sys.argv[1:])},
                      f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
