"""The step-time model of docs/scaling.md checked on this machine: gloo's alpha/beta fitted here,
then mfsdp2's measured steps predicted.

    python benchmarks/alpha_beta.py [--quick] [--json PATH]

At world sizes 2 and 4 (gloo on the loopback, one thread per rank), in one run of rank processes:

1. **alpha / beta**: mfsdp2's own collectives (``Communicator.all_gather``; ``reduce_scatter``,
   which on gloo is mfsdp2's point-to-point exchange) timed blocking over full-buffer sizes from
   64 KiB to 32 MiB; ``t = alpha + beta * bytes`` fitted by least squares per collective.
2. **compute**: the benchmarks' ``mlp`` and ``llama`` models unsharded in every rank at once (as in
   training), this rank's batch: each unit's forward and backward timed by module hooks, the root's
   as the rest; plus AdamW over plain fp32 tensors of one shard's size (the optimizer step).
3. **measured**: mfsdp2 ZeRO-3, fp32, trained on the same batches with prefetch depth 0, 1 and 2
   (``set_prefetch_depth``), median step time (max over ranks, a barrier before each step).
4. **predicted**, from 1 and 2 only: ``serial`` = compute + every collective + optimizer (no
   overlap), and ``model`` = :func:`step_model.simulate_step` (one compute stream, one link, the
   recorded-order prefetch of ``depth`` units) + optimizer. Reported as measured / predicted.

On a CPU the collectives' threads take cores from the compute, which the model (like a GPU with
its own copy engines / SMs for NCCL) does not charge for; the ``serial`` column bounds that case.
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
from step_model import Unit, simulate_step  # noqa: E402

SIZES = [1 << k for k in (14, 16, 18, 20, 21, 22, 23)]  # fp32 elements of the full buffer: 64 KiB .. 32 MiB
DEPTHS = (0, 1, 2)


def _timed_blocking(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``y = alpha + beta x`` minimising the *relative* residuals (weights 1/y^2): the sizes span
    three decades, and a plain fit lets the largest ones decide alpha alone."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    beta = (sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys))
            / sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs)))
    return my - beta * mx, beta


def _alpha_beta(ws: int, reps: int) -> dict:
    from mfsdp2.comm.communicator import Communicator

    comm = Communicator(dist.group.WORLD, torch.device("cpu"))
    out = {}
    for kind in ("all_gather", "reduce_scatter"):
        xs, ys = [], []
        for n in SIZES:
            full = torch.zeros(n)
            shard = torch.zeros(n // ws)
            if kind == "all_gather":
                fn = lambda: comm.all_gather(full, full[: n // ws]).wait()  # noqa: E731
            else:
                scratch = torch.zeros(comm.reduce_scatter_scratch_numel(n // ws))
                fn = lambda: comm.reduce_scatter(shard, full, dist.ReduceOp.AVG, scratch).wait()  # noqa: E731
            fn()
            xs.append(4.0 * n)
            ys.append(_timed_blocking(fn, reps))
        alpha, beta = fit(xs, ys)
        out[kind] = {"bytes": xs, "seconds": ys, "alpha_s": alpha, "beta_s_per_byte": beta}
    return out


class _UnitTimer:
    """Each unit's forward and backward seconds of the unsharded model, by module hooks (CPU
    autograd runs the backward on the calling thread, so the hook times bracket the unit's work)."""

    def __init__(self, model, name: str) -> None:
        self.model, self.name = model, name
        self.blocks = C.units(model)
        self.marks: dict = {}
        for i, b in enumerate(self.blocks):
            b.register_forward_pre_hook(self._mark(("f0", i)))
            b.register_forward_hook(self._mark(("f1", i)))
            b.register_full_backward_pre_hook(self._mark(("b0", i)))
            b.register_full_backward_hook(self._mark(("b1", i)))
        self.rows: list = []

    def _mark(self, key):
        def hook(*_):
            self.marks[key] = time.perf_counter()
        return hook

    def step(self, x, y) -> None:
        t0 = time.perf_counter()
        loss = C.loss_fn(self.name, self.model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        n = len(self.blocks)
        fwd = [self.marks[("f1", i)] - self.marks[("f0", i)] for i in range(n)]
        bwd = [self.marks[("b1", i)] - self.marks[("b0", i)] for i in range(n)]
        self.rows.append((t1 - t0 - sum(fwd), t2 - t1 - sum(bwd), fwd, bwd))

    def medians(self) -> dict:
        med, rows, n = statistics.median, self.rows, len(self.blocks)
        return {"root_fwd": med(r[0] for r in rows), "root_bwd": med(r[1] for r in rows),
                "fwd": [med(r[2][i] for r in rows) for i in range(n)],
                "bwd": [med(r[3][i] for r in rows) for i in range(n)]}


def _shard_optimizer(model, ws: int):
    """AdamW over plain fp32 tensors of one rank's share of every parameter (what a rank steps)."""
    shards = []
    for p in model.parameters():
        t = torch.zeros((-(-p.shape[0] // ws),) + tuple(p.shape[1:]), requires_grad=True)
        t.grad = torch.randn_like(t) * 1e-3
        shards.append(t)
    return C.make_optimizer(shards)


def _timed_step(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _model_case(name: str, rank: int, ws: int, steps: int) -> dict:
    """Rounds of: unsharded compute step | shard-size AdamW step | mfsdp2 step at each depth
    (alternating, so the machine's drift hits all alike)."""
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp2.comm.communicator import comm_stats

    timer = _UnitTimer(C.build_model(name), name)
    opt_floor = _shard_optimizer(timer.model, ws)
    model = C.shard(C.build_model(name), "mfsdp2", "fp32", init_device_mesh("cpu", (ws,)))
    opt = C.make_optimizer(model.parameters())
    # Full-buffer bytes of each unit's collectives (fp32 gathers and reductions), root first.
    sizes = [sum(4 * g.layout.total_numel for g in u._mfsdp2_state.groups) for u in [model] + C.units(model)]
    floor_opt, measured, comm = [], {d: [] for d in DEPTHS}, {}
    for s in range(steps + 1):
        x, y = C.make_batch(name, s, rank, ws)
        dist.barrier()
        timer.step(x, y)
        floor_opt.append(_timed_step(opt_floor.step))
        for depth in DEPTHS if s % 2 == 0 else DEPTHS[::-1]:
            model.set_prefetch_depth(depth)
            before = (comm_stats.all_gather_bytes, comm_stats.reduce_scatter_bytes)
            measured[depth].append(_timed_step(lambda: C.train_step(model, opt, name, x, y)))
            comm[depth] = (comm_stats.all_gather_bytes - before[0], comm_stats.reduce_scatter_bytes - before[1])
    timer.rows = timer.rows[1:]  # the first round warms up (and records the schedule)
    return {"compute": timer.medians(), "optimizer_s": statistics.median(floor_opt[1:]),
            "mfsdp2": {"unit_bytes": sizes, "step_s": {d: v[1:] for d, v in measured.items()},
                       "comm_bytes_per_step": comm}}


def _rank(rank: int, ws: int, models: list[str], steps: int, reps: int) -> dict:
    torch.manual_seed(0)
    out = {"alpha_beta": _alpha_beta(ws, reps), "models": {}}
    for name in models:
        out["models"][name] = _model_case(name, rank, ws, steps)
    return out


def predict(r0: dict, ab: dict, name: str) -> dict:
    """Serial and modelled step times of one model from rank 0's compute and the fitted alpha/beta."""
    m = r0["models"][name]
    comp, sizes = m["compute"], m["mfsdp2"]["unit_bytes"]

    def coll(kind: str, nbytes: float) -> float:
        return ab[kind]["alpha_s"] + ab[kind]["beta_s_per_byte"] * nbytes if nbytes else 0.0

    root = Unit("root", comp["root_fwd"], comp["root_bwd"], coll("all_gather", sizes[0]),
                coll("reduce_scatter", sizes[0]))
    layers = [Unit(f"unit{i}", f, b, coll("all_gather", n), coll("reduce_scatter", n))
              for i, (f, b, n) in enumerate(zip(comp["fwd"], comp["bwd"], sizes[1:]))]
    # The model's collectives are the ones mfsdp2 issued: every unit gathered in forward, all but
    # the root (kept) again in backward, every unit reduced.
    ag, rs = m["mfsdp2"]["comm_bytes_per_step"][DEPTHS[-1]]
    assert (ag, rs) == (sum(sizes) + sum(sizes[1:]), sum(sizes)), (name, ag, rs, sizes)
    opt = m["optimizer_s"]
    out = {"optimizer_s": opt}
    for depth in DEPTHS:
        sim = simulate_step(root, layers, depth)
        out[depth] = {"model_s": sim.step_s + opt, "serial_s": sim.compute_s + sim.comm_s + opt,
                      "compute_s": sim.compute_s, "comm_s": sim.comm_s}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="world size 2, llama only, fewer steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [2] if args.quick else [2, 4]
    models = ["llama"] if args.quick else ["mlp", "llama"]
    steps, reps = (3, 3) if args.quick else (5, 5)
    result = {"machine": C.machine_info(), "date": C.now_iso(), "world_sizes": {}}
    print("measured mfsdp2 step / predicted (gloo alpha-beta fitted here, compute measured unsharded)")
    print(f"{'ws':>3} {'model':>6} {'depth':>5} {'measured':>9} {'model':>9} {'serial':>9} {'meas/model':>10} "
          f"{'meas/serial':>11} {'compute':>8} {'comm':>8}")
    for ws in sizes:
        ranks = C.run_ranks(_rank, ws, models, steps, reps, timeout=3600)
        ab = {k: {"alpha_s": max(r["alpha_beta"][k]["alpha_s"] for r in ranks),
                  "beta_s_per_byte": max(r["alpha_beta"][k]["beta_s_per_byte"] for r in ranks)}
              for k in ("all_gather", "reduce_scatter")}
        entry = {"alpha_beta": ab, "alpha_beta_rank0": ranks[0]["alpha_beta"], "models": {}}
        for name in models:
            pred = predict(ranks[0], ab, name)
            measured = {d: statistics.median(C.max_over_ranks([r["models"][name]["mfsdp2"]["step_s"][d]
                                                               for r in ranks]))
                        for d in DEPTHS}
            entry["models"][name] = {"predicted": pred, "measured_s": measured,
                                     "comm_bytes_per_step": ranks[0]["models"][name]["mfsdp2"]["comm_bytes_per_step"],
                                     "unit_bytes": ranks[0]["models"][name]["mfsdp2"]["unit_bytes"]}
            for d in DEPTHS:
                p = pred[d]
                print(f"{ws:>3} {name:>6} {d:>5} {measured[d]:9.3f} {p['model_s']:9.3f} {p['serial_s']:9.3f} "
                      f"{measured[d] / p['model_s']:10.2f} {measured[d] / p['serial_s']:11.2f} {p['compute_s']:8.3f} "
                      f"{p['comm_s']:8.3f}")
        result["world_sizes"][ws] = entry
        for k, v in ab.items():
            print(f"    ws {ws} {k}: alpha {1e6 * v['alpha_s']:.0f} us, 1/beta {1e-9 / v['beta_s_per_byte']:.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
