"""mfsdp2 at 8 to 1024 ranks, simulated in one process with torch's fake process group.

    python benchmarks/scale.py [--quick] [--json PATH]

``FakeStore`` + the ``"fake"`` backend: rank 0 of a world of any size; collectives return at once
without exchanging data, so everything measured here is mfsdp2's own work on one rank. Each case
runs in a fresh interpreter.

1. **Memory per rank, Llama-3 geometries** (8B, 70B, 405B as published: hidden size, layers,
   heads, GQA, FFN, vocabulary) built on the meta device, ``fully_shard`` per decoder layer + root:
   bytes per rank of each buffer kind from the groups' layouts (fp32 main weights, fp32 main
   gradients, AdamW's two fp32 states, the largest unit's gathered bf16 weights) against the
   ZeRO-3 formula ``16 * P / N`` bytes + one unit gathered, and the padding. Also the time of the
   ``fully_shard`` calls and the share of it spent planning layouts. Cases whose fp32 main-weight
   shard alone would not fit this machine are skipped and listed (mfsdp2 allocates the main
   weights at ``fully_shard``, also for a meta model).
2. **Runtime cost per step**: a narrow Llama (dim 64) with 16 and 126 decoder layers at world
   sizes 8 to 1024, steady-state step time (compute negligible: this is the hooks, the
   collectives' Python side, and AdamW on DTensors), and the trace-pool allocator's planning time
   for the recorded step. Targets (issue 17): linear in the number of units, flat in world size,
   planning a 126-layer model under 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

GEOMETRIES = {
    "8B": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "70B": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "405B": dict(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248),
}
PARAMS = {"8B": 8.03e9, "70B": 70.55e9, "405B": 405.9e9}
MAX_MAIN_BYTES = 6 * 2**30  # this machine: 24 GiB, and the case runs beside the suite's tools

_PRELUDE = """
import json, sys, time, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
ws = int(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ws)
import mfsdp2, mfsdp2.param_group as PG
from mfsdp2 import fully_shard
from mfsdp2.examples.llama import LlamaConfig, Transformer
from mfsdp2.state import unit_state
mesh = init_device_mesh("cpu", (ws,))
planning = [0.0]
_plan = PG.plan_layout
def timed_plan(*a, **k):
    t = time.perf_counter(); r = _plan(*a, **k); planning[0] += time.perf_counter() - t; return r
PG.plan_layout = timed_plan
def groups_of(model):
    gs = {}
    for m in model.modules():
        s = unit_state(m)
        if s is not None:
            for g in s.groups:
                gs[id(g)] = (id(s), g)
    return list(gs.values())
"""

MEMORY_CASE = _PRELUDE + textwrap.dedent(
    """
    cfg = LlamaConfig(**json.loads(sys.argv[2]))
    with torch.device("meta"):
        model = Transformer(cfg)
    P = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    mp = mfsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    t1 = time.perf_counter()
    gs = groups_of(model)
    shard = sum(g.layout.shard_numel for _, g in gs)
    units = {}
    for name, g in gs:
        units[name] = units.get(name, 0) + g.layout.total_numel * 2  # bf16 gathered
    print(json.dumps({
        "params": P, "units": len(units), "fully_shard_s": t1 - t0, "layout_planning_s": planning[0],
        "main_weight_bytes": 4 * shard, "grad_bytes": 4 * shard, "adam_bytes": 8 * shard,
        "largest_unit_gathered_bytes": max(units.values()),
        "padding_numel": sum(g.layout.padding_numel for _, g in gs),
    }))
    """
)

STEP_CASE = _PRELUDE + textwrap.dedent(
    """
    layers = int(sys.argv[2])
    from mfsdp2.trace_pool import TracePoolAllocator
    plan_s = [0.0]
    _make = TracePoolAllocator._make_plan
    def timed_make(self, events):
        t = time.perf_counter(); r = _make(self, events); plan_s[0] += time.perf_counter() - t; return r
    TracePoolAllocator._make_plan = timed_make
    torch.manual_seed(0)
    model = Transformer(LlamaConfig(vocab_size=256, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=128))
    t0 = time.perf_counter()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, allocator="trace_pool")
    t1 = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tok = torch.randint(0, 256, (2, 16))
    times = []
    for step in range(8):
        s = time.perf_counter()
        model(tok).float().mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - s)
    steady = sorted(times[3:])
    print(json.dumps({"fully_shard_s": t1 - t0, "step_s": steady[len(steady) // 2],
                      "trace_pool_planning_s": plan_s[0], "units": layers + 1}))
    """
)


def _run(script: str, *args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                         timeout=1200, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gib(b: float) -> str:
    return f"{b / 2**30:8.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8B only; world sizes 8 and 1024; 16 layers")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [8, 1024] if args.quick else [8, 64, 256, 1024]
    geoms = ["8B"] if args.quick else list(GEOMETRIES)
    result = {"memory": [], "skipped": [], "steps": []}

    print("Memory per rank (GiB), bf16 compute / fp32 main weights and grads, AdamW")
    print(f"{'model':>5} {'ranks':>6} {'main':>8} {'grads':>8} {'adam':>8} {'gathered':>8} {'total':>8} "
          f"{'ZeRO-3':>8} {'ratio':>6} {'padding':>8} {'shard_s':>8} {'plan_s':>7}")
    for name in geoms:
        for ws in sizes:
            if 4 * PARAMS[name] / ws > MAX_MAIN_BYTES:
                result["skipped"].append({"model": name, "world_size": ws})
                continue
            r = _run(MEMORY_CASE, ws, json.dumps(GEOMETRIES[name]))
            total = r["main_weight_bytes"] + r["grad_bytes"] + r["adam_bytes"] + r["largest_unit_gathered_bytes"]
            formula = 16 * r["params"] / ws + r["largest_unit_gathered_bytes"]  # ZeRO-3 + one unit gathered
            r.update(model=name, world_size=ws, total_bytes=total, zero3_bytes=formula,
                     padding_fraction=r["padding_numel"] / r["params"])
            result["memory"].append(r)
            print(f"{name:>5} {ws:>6} {_gib(r['main_weight_bytes'])} {_gib(r['grad_bytes'])} {_gib(r['adam_bytes'])} "
                  f"{_gib(r['largest_unit_gathered_bytes'])} {_gib(total)} {_gib(formula)} {total / formula:6.3f} "
                  f"{100 * r['padding_fraction']:7.3f}% {r['fully_shard_s']:8.2f} {r['layout_planning_s']:7.2f}")
    for s in result["skipped"]:
        print(f"  skipped {s['model']} at {s['world_size']} ranks: its fp32 main-weight shard alone exceeds "
              f"{MAX_MAIN_BYTES / 2**30:.0f} GiB here")

    print("\nNarrow model (dim 64): steady-state step, trace-pool planning")
    print(f"{'layers':>6} {'ranks':>6} {'step_ms':>8} {'plan_ms':>8} {'shard_s':>8}")
    for layers in ([16] if args.quick else [16, 126]):
        for ws in sizes:
            r = _run(STEP_CASE, ws, layers)
            r.update(layers=layers, world_size=ws)
            result["steps"].append(r)
            print(f"{layers:>6} {ws:>6} {1e3 * r['step_s']:8.1f} {1e3 * r['trace_pool_planning_s']:8.1f} "
                  f"{r['fully_shard_s']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
