"""torchao's quantised weights on mfsdp2 and on torch FSDP2 (CPU, gloo, world size 2).

    python benchmarks/quantised_weights.py [--rounds 8] [--json PATH]

Two cases, each trained by both runtimes in the same ranks from the same seed on the same batches
(losses compared every step), timed and measured **alternately**: every round runs one step of
each runtime (FSDP2 default, FSDP2 tuned, mfsdp2), the order reversed every other round, a
barrier before each step; a step's time is the max over ranks, reported as the median over rounds.

* ``qlora``: 8 blocks of a QLoRA transformer MLP at width 1024 (each: a LayerNorm, a frozen NF4
  ``1024 x 4096`` up and ``4096 x 1024`` down projection with rank-16 LoRA adapters, as
  torchtune's ``FrozenNF4Linear`` + LoRA, built from torchao's NF4), 64 tokens per rank, AdamW on
  the adapters and norms. Measured: **peak memory per rank** -- the RSS high-water mark during a
  step above the RSS at its start (``VmHWM`` after ``clear_refs``, freed memory returned to the
  OS first), the max over ranks, median over rounds, with glibc's mmap threshold fixed at 64 KiB
  (``MEMORY_ENV``) so that the RSS follows the live tensors -- and the step time.
* ``float8``: 4 blocks (LayerNorm, ``Linear(1024, 4096)``, ReLU, ``Linear(4096, 1024)``) converted
  by torchao's ``convert_to_float8_training`` with ``enable_fsdp_float8_all_gather=True`` and
  ``emulate=True`` (the float8 matmuls as float32 ones on the float8 values: oneDNN's ``_scaled_mm``
  on CPUs without float8 instructions is a scalar reference loop, 7.7 s for one ``64 x 1024 x 4096``
  product on an Intel Xeon without AMX-FP8, which would make the matmul the whole measurement; the
  runtimes' part -- float8 all-gathers, casts, scales -- is unchanged by it),
  ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step (torchtitan's recipe),
  64 tokens per rank, AdamW. Measured: **step time** (forward, backward, optimizer step, the scale
  precompute).

"FSDP2 tuned" is the configuration ``benchmarks/fsdp2_tuning.py`` measured fastest on this
machine (``_models.fsdp2_tuned``: async unshard with one unit of explicit prefetch). The machine
is shared: the run records the other processes' share of the CPUs before and during it.
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
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TOKENS = 64
RUNTIMES = ("fsdp2", "fsdp2_tuned", "mfsdp2")


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 16) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        self.weight = nn.Parameter(to_nf4(torch.randn(d_out, d_in) / d_in**0.5), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) / d_in**0.5)
        self.lora_b = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + F.linear(F.linear(x, self.lora_a), self.lora_b)


class Block(nn.Module):
    def __init__(self, d: int, qlora: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = LoRALinear(d, 4 * d) if qlora else nn.Linear(d, 4 * d)
        self.down = LoRALinear(4 * d, d) if qlora else nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, blocks: list) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build(case: str) -> Stack:
    torch.manual_seed(0)
    if case == "qlora":
        return Stack([Block(1024, True) for _ in range(8)])
    model = Stack([Block(1024, False) for _ in range(4)])
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))
    return model


def shard(model: Stack, runtime: str, mesh) -> Stack:
    if runtime == "mfsdp2":
        from mfsdp2 import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if runtime == "fsdp2_tuned":
        C.tune_fsdp2(model, C.fsdp2_tuned("cpu"))
    return model


def worker(rank: int, ws: int, case: str, rounds: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    import copy

    ref = build(case)  # quantised once (NF4 is slow to build on the CPU), copied per runtime
    models = {r: shard(copy.deepcopy(ref), r, mesh) for r in RUNTIMES}
    del ref
    opts = {r: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for r, m in models.items()}

    def step(r: str, i: int) -> float:
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(ws * TOKENS, 1024, generator=g)[rank * TOKENS : (rank + 1) * TOKENS]
        loss = models[r](x).float().pow(2).mean()
        loss.backward()
        opts[r].step()
        opts[r].zero_grad()
        if case == "float8":
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(models[r])
        return loss.item()

    losses = {r: [] for r in RUNTIMES}
    for i in range(2):  # warm-up: lazy init, allocator caches
        for r in RUNTIMES:
            losses[r].append(step(r, i))
    times = {r: [] for r in RUNTIMES}
    peaks = {r: [] for r in RUNTIMES}
    busy0, cpu0, wall0 = C.machine_busy_s(), C.process_cpu_s(), time.monotonic()
    for i in range(rounds):
        order = RUNTIMES if i % 2 == 0 else tuple(reversed(RUNTIMES))
        for r in order:
            C.reset_peak_rss()
            base = C.rss_bytes()
            dist.barrier()
            t0 = time.perf_counter()
            losses[r].append(step(r, 2 + i))
            times[r].append(time.perf_counter() - t0)
            peaks[r].append(C.peak_rss_bytes() - base)
    busy = C.machine_busy_s() - busy0
    own = C.process_cpu_s() - cpu0
    wall = time.monotonic() - wall0
    return {"times": times, "peaks": peaks, "losses": losses, "busy_s": busy, "own_cpu_s": own, "wall_s": wall}


# Memory: every allocation of 64 KiB or more gets its own mapping, returned to the OS when freed,
# so the RSS high-water mark follows the live tensors (glibc's adaptive threshold, up to 32 MiB,
# otherwise keeps freed blocks resident and the peak depends on what ran before). Time: glibc's
# defaults, as a training job runs.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
MEASURES = {"qlora": "memory", "float8": "time"}


def run_case(case: str, rounds: int, ws: int = 2) -> dict:
    env = MEMORY_ENV if MEASURES.get(case) == "memory" else None
    per_rank = C.run_ranks(worker, ws, case, rounds, env=env)
    out = {"case": case, "rounds": rounds, "world_size": ws, "env": env or {}}
    for r in RUNTIMES:
        step = C.max_over_ranks([pr["times"][r] for pr in per_rank])
        peak = [max(pr["peaks"][r][i] for pr in per_rank) for i in range(rounds)]
        out[r] = {"step_s_median": statistics.median(step), "step_s_p10": C.quantile(step, 0.1),
                  "step_s_p90": C.quantile(step, 0.9), "peak_bytes_median": statistics.median(peak),
                  "peak_bytes_max": max(peak)}
    out["losses_identical"] = all(pr["losses"]["mfsdp2"] == pr["losses"]["fsdp2"] == pr["losses"]["fsdp2_tuned"]
                                  for pr in per_rank)
    ncpu = os.cpu_count() or 1
    wall = max(pr["wall_s"] for pr in per_rank)
    busy = per_rank[0]["busy_s"]  # the whole machine's CPU seconds over the timed rounds
    ranks_cpu = sum(pr["own_cpu_s"] for pr in per_rank)
    out["foreign_cpu_fraction"] = max(0.0, (busy - ranks_cpu) / (ncpu * wall))
    a, b, t = out["mfsdp2"], out["fsdp2"], out["fsdp2_tuned"]
    out["ratio"] = {
        "step_vs_default": a["step_s_median"] / b["step_s_median"],
        "step_vs_tuned": a["step_s_median"] / t["step_s_median"],
        "peak_vs_default": a["peak_bytes_median"] / b["peak_bytes_median"],
        "peak_vs_tuned": a["peak_bytes_median"] / t["peak_bytes_median"],
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cases", default="qlora,float8")
    ap.add_argument("--wait-quiet", type=float, default=60.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    quiet = C.wait_until_quiet(args.wait_quiet)
    load_before = os.getloadavg()
    t0 = time.time()
    results = [run_case(c, args.rounds) for c in args.cases.split(",")]
    rows = []
    for res in results:
        for r in RUNTIMES:
            x = res[r]
            rows.append([res["case"], r, f"{x['step_s_median'] * 1e3:.0f}", C.fmt_bytes(x["peak_bytes_median"])])
    print(f"other processes used {quiet:.0%} of the CPUs before the run (load average {load_before[0]:.1f})")
    for res in results:
        print(f"{res['case']}: other processes used {res['foreign_cpu_fraction']:.0%} of the CPUs during it; "
              f"ratios {json.dumps({k: round(v, 3) for k, v in res['ratio'].items()})}; "
              f"losses identical: {res['losses_identical']}")
    C.print_table(["case", "runtime", "step ms (median)", "step peak RSS (median)"], rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=C.machine_info(), when=C.now_iso(), rounds=args.rounds, quiet_before=quiet,
                           load_average_before=load_before, wall_s=time.time() - t0, results=results,
                           command="python benchmarks/quantised_weights.py "
                                   "--json benchmarks/results/quantised_weights.json"), f, indent=1)


if __name__ == "__main__":
    main()
