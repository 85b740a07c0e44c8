"""Where a training step's time goes: forward, backward, ``optimizer.step()`` and ``zero_grad``,
timed apart, for mfsdp2's strategies, torch DDP and torch FSDP2 on one model.

    python benchmarks/step_phases.py [--model tiny|mlp|llama] [--frameworks plain,ddp,no_shard,...]
                                     [--steps N] [--foreach] [--optimizer torch|mfsdp2]
                                     [--world-size N] [--json PATH]

Why: the whole-step ratios of ``strategies.py`` say *that* mfsdp2's no_shard / ZeRO-1 are slower
than DDP on the 64-unit ``tiny`` model, not *where*. Splitting the step separates what the runtime
does (hooks in forward and backward, collectives) from what the optimizer does: torch's
``AdamW`` picks its per-parameter for-loop on CPU (its foreach path is CUDA's default), and over
DTensor parameters -- mfsdp2's and FSDP2's alike -- every per-parameter op goes through DTensor's
dispatch, while DDP steps plain tensors. ``--foreach`` runs every framework with
``AdamW(foreach=True)`` (the default a CUDA user gets) to show that part with the dispatch
amortised over the parameter list.

Per-unit host time (``--world-size 1`` with ``plain`` among the frameworks): forward + backward
beyond the plain module's (the min over the timed steps), divided by the wrapped units. At world
size 1 the collectives are local copies, so what is left is what each framework's hooks and
runtime do on the host per unit per step -- the figure that decides a GPU step when the host
cannot stay ahead of the kernels.

Frameworks: ``plain`` (the module alone), ``ddp`` (torch DistributedDataParallel), ``no_shard`` /
``optim`` / ``optim_grads`` / ``zero3`` (mfsdp2's strategies, ``zero3`` = ``optim_grads_params``),
``zero3_buckets`` (ZeRO-3 with ``set_all_gather_bucket_cap_mb(4)``: small units share all-gathers),
any of mfsdp2's with ``_hooked`` appended (``no_shard_hooked``: quiet passes off, every unit's forward
hooks run: the A/B of :mod:`mfsdp2.runtime.quiet_units` in one run),
``fsdp2`` / ``fsdp2_tuned`` (torch FSDP2 as shipped / with ``_common.FSDP2_TUNED``), ``zero3_bf16``
/ ``zero3_fp8`` (ZeRO-3 with bf16 compute, the second with FP8 all-gathers: where FP8's extra work
lands). Each rank trains every framework on the same seeded model and batches (fp32 unless named,
world size 2) in alternating rounds: round ``s`` runs one step of each framework on batch ``s``,
the order rotated by one each round and reversed every other round, so the machine's drift lands
on all of them alike. Per phase: the median over the timed rounds of rank 0, after a barrier
before each step. Phases are timed on the host: asynchronous collectives left in flight by one phase are
paid in the phase that waits for them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

PHASES = ("forward", "backward", "optimizer_step", "zero_grad")
ZERO3_GATHER_BUCKET_MB = 4  # zero3_buckets: set_all_gather_bucket_cap_mb
MFSDP2 = {"no_shard": "no_shard", "optim": "optim", "optim_grads": "optim_grads", "zero3": "optim_grads_params"}


def _build(fw: str, ref, mesh):
    if fw.endswith("_hooked"):  # quiet passes are turned off after the first step (the root context exists then)
        return _build(fw[: -len("_hooked")], ref, mesh)
    if fw == "plain":  # the module itself, no wrapper: what the per-unit figures subtract
        return copy.deepcopy(ref)
    if fw == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(copy.deepcopy(ref), broadcast_buffers=False, gradient_as_bucket_view=True)
    if fw in MFSDP2:
        return C.shard(copy.deepcopy(ref), "mfsdp2", "fp32", mesh, sharding_strategy=MFSDP2[fw])
    if fw == "zero3_buckets":  # small units gather in shared all-gathers (off by default)
        model = C.shard(copy.deepcopy(ref), "mfsdp2", "fp32", mesh, sharding_strategy="optim_grads_params")
        model.set_all_gather_bucket_cap_mb(ZERO3_GATHER_BUCKET_MB)
        return model
    if fw in ("zero3_bf16", "zero3_fp8"):
        import torch

        fp8 = torch.float8_e4m3fn if fw == "zero3_fp8" else None
        return C.shard(copy.deepcopy(ref), "mfsdp2", "bf16", mesh, all_gather_dtype=fp8)
    if fw in ("fsdp2", "fsdp2_tuned"):
        return C.shard(copy.deepcopy(ref), fw, "fp32", mesh)
    raise ValueError(f"unknown framework {fw!r}")


def _round_order(fws: list, r: int) -> list:
    """Round ``r``'s framework order: rotated by one each round and reversed every other round
    (as ``strategies.py``), so no framework always runs first, or right after the same one."""
    k = r % len(fws)
    order = fws[k:] + fws[:k]
    return order[::-1] if r % 2 else order


def worker(rank: int, ws: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    ref = C.build_model(args["model"], seed=0)
    kw = {"foreach": True} if args["foreach"] else {}
    if args.get("optimizer", "torch") == "mfsdp2":  # plain parameters (DDP) take torch's own step
        from mfsdp2.optim import AdamW
    else:
        AdamW = torch.optim.AdamW
    fws = list(args["frameworks"])
    runs = {}
    for fw in fws:  # every framework lives through the whole run: the rounds alternate between them
        model = _build(fw, ref, mesh)
        runs[fw] = {"model": model, "opt": AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **kw),
                    "times": {p: [] for p in PHASES}, "losses": []}
    for s in range(args["warmup"] + args["steps"]):
        # Round s: one step of every framework on batch s. Alternating rounds, not one framework's
        # steps after another's: this machine's speed drifts (and jumps) over a run, and a drift
        # must land on every framework alike for their ratios to mean anything.
        x, y = C.make_batch(args["model"], s, rank, ws)
        for fw in _round_order(fws, s):
            run = runs[fw]
            model, opt = run["model"], run["opt"]
            dist.barrier()
            t0 = time.perf_counter()
            loss = C.loss_fn(args["model"], model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            run["losses"].append(loss.item())
            if s == 0 and fw.endswith("_hooked"):
                model._mfsdp2_state.ctx.quiet_allowed = False
            if s >= args["warmup"]:
                for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    run["times"][p].append(dt)
    out = {}
    for fw in fws:
        times = runs[fw]["times"]
        med = {p: statistics.median(v) for p, v in times.items()}
        # Host time of forward + backward as the min over the timed steps (the noise-free part).
        fb = min(f + b for f, b in zip(times["forward"], times["backward"]))
        out[fw] = {"median_s": med, "step_s": sum(med.values()), "losses": runs[fw]["losses"], "fwd_bwd_min_s": fb}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=C.MODELS)
    ap.add_argument("--frameworks", default="ddp,no_shard,optim,optim_grads,zero3,zero3_buckets,fsdp2_tuned")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--foreach", action="store_true", help="AdamW(foreach=True) for every framework")
    ap.add_argument("--optimizer", default="torch", choices=("torch", "mfsdp2"),
                    help="torch.optim.AdamW or mfsdp2.optim.AdamW (which steps DDP's plain tensors with torch's code)")
    ap.add_argument("--world-size", type=int, default=2,
                    help="ranks (1: collectives are local copies; with 'plain' among the frameworks the "
                         "per-unit host time is reported)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    args = {"model": a.model, "frameworks": a.frameworks.split(","), "steps": a.steps, "warmup": a.warmup,
            "foreach": a.foreach, "optimizer": a.optimizer, "world_size": a.world_size}
    t0 = time.time()
    res = C.run_ranks(worker, a.world_size, args)[0]
    n_units = len(C.units(C.build_model(a.model)))
    plain = res.get("plain")
    if plain is not None:
        for r in res.values():
            # Framework host time per unit per step: forward + backward beyond the plain module's,
            # over the wrapped units (the root's share included). At world size 1 the collectives
            # are local copies, so this is the hooks' and the runtime's own work.
            r["per_unit_us"] = (r["fwd_bwd_min_s"] - plain["fwd_bwd_min_s"]) / n_units * 1e6
    base = res.get("ddp")
    rows = []
    for fw, r in res.items():
        m = r["median_s"]
        ratio = f"{r['step_s'] / base['step_s']:.2f}" if base else "-"
        rows.append([fw] + [f"{m[p] * 1e3:.1f}" for p in PHASES] + [f"{r['step_s'] * 1e3:.1f}", ratio])
    opt_name = "mfsdp2.optim.AdamW" if a.optimizer == "mfsdp2" else "AdamW"
    flags = "(foreach=True)" if a.foreach else " (default flags)"
    print(f"model {a.model}, world size {a.world_size}, {opt_name}{flags}; ms, rank 0 medians")
    C.print_table(["framework", *PHASES, "step", "step / DDP"], rows)
    if plain is not None:
        ref = res.get("fsdp2_tuned") or res.get("fsdp2")
        C.print_table(["framework", "host us per unit (fwd+bwd - plain)", "/ FSDP2"],
                      [[fw, f"{r['per_unit_us']:.0f}", f"{r['per_unit_us'] / ref['per_unit_us']:.2f}" if ref else "-"]
                       for fw, r in res.items() if fw != "plain"])
    if a.json:
        payload = {"results": res, "args": args, "machine": C.machine_info(), "date": C.now_iso(),
                   "command": "python benchmarks/step_phases.py " + " ".join(sys.argv[1:]), "wall_s": time.time() - t0}
        with open(a.json, "w") as f:
            json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
