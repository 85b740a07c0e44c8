"""mfsdp2 at 8 to 1024 ranks, simulated in one process with torch's fake process group.

    python benchmarks/scale.py [--quick] [--json PATH]

``FakeStore`` + the ``"fake"`` backend: rank 0 of a world of any size; collectives return without
exchanging data, so what is measured is mfsdp2's own work on one rank (plus the fake backend's
own per-call cost, which is measured and subtracted, see 3). Each case runs in a fresh
interpreter (the fake group is process-wide), one intra-op thread.

1. **Memory per rank, Llama-3 geometries** (8B, 70B, 405B as published: hidden size, layers,
   heads, GQA, FFN, vocabulary) built on the meta device, ``fully_shard`` per decoder layer + root,
   bf16 compute with fp32 main weights/gradients, AdamW. Nothing is allocated (the shards stay on
   meta until init; the bytes ``fully_shard`` allocated are counted by torch's profiler and must
   be 0): bytes per rank of every buffer kind are counted from the groups' layouts -- fp32 main
   weights and main gradients (one shard each), AdamW's two fp32 states (this rank's rows),
   and the transient buffers of the largest unit (gathered bf16 weights, the fp32 flat gradient
   its reduce-scatter reads) -- against the ZeRO-3 formula ``16 P / N`` plus that unit's
   ``2 P_u + 4 P_u`` unpadded, and the padding. Plain FSDP at 8-1024 ranks and HSDP meshes
   (replicate x shard: 8 x 128, 2 x 512), where ``N`` is the shard-group size.
2. **Runtime costs**: a narrow Llama (dim 64: compute negligible) with 16 and 126 decoder layers,
   at 8-1024 ranks and HSDP 8 x 128: ``fully_shard`` time, the root's lazy-init time, layout
   planning time, the trace-pool allocator's planning time, and the steady-state step split into
   forward+backward, time inside the fake backend's collectives, the same model's unsharded
   forward+backward (the compute), and the optimizer step (torch's AdamW on DTensors), in the
   thread's CPU time (wall time of the step beside it). What is left of forward+backward is
   mfsdp2's hooks and collective bookkeeping ("own"). Targets: linear in units, flat in world
   size, a 126-layer model planned in under 1 s.
3. **The fake backend alone**: one ``all_gather_single`` / ``reduce_scatter_single`` at the narrow
   model's unit size, per world size: its per-call cost grows with the world size (it is not a
   real network), which is why step times at 1024 fake ranks are subtracted, not compared raw.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

GEOMETRIES = {
    "8B": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "70B": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "405B": dict(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248),
}
NARROW = dict(vocab_size=256, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
STEPS, WARMUP = 8, 3


# ------------------------------------------------------------------------------------------------
# cases (each in its own interpreter: `scale.py _case KIND JSON`)
# ------------------------------------------------------------------------------------------------
def _init_fake(shape: list[int]):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)


def _timed(obj, attr: str, acc: dict, key: str, clock=time.perf_counter):
    """Wrap ``obj.attr`` to add its time (``clock``) to ``acc[key]`` and count calls in ``acc[key + '_n']``."""
    fn = getattr(obj, attr)

    def wrapped(*a, **k):
        t = clock()
        try:
            return fn(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + clock() - t
            acc[key + "_n"] = acc.get(key + "_n", 0) + 1

    setattr(obj, attr, wrapped)


def _shard_all(model, mesh, **kw) -> None:
    from mfsdp2 import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **{k: v for k, v in kw.items() if k != "allocator"})
    fully_shard(model, mesh=mesh, **kw)


def _units(model) -> dict:
    """id(unit state) -> its groups."""
    from mfsdp2.runtime.state import unit_state

    out = {}
    for m in model.modules():
        s = unit_state(m)
        if s is not None:
            out[id(s)] = s.groups
    return out


def memory_case(spec: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import mfsdp2
    import mfsdp2.groups.param_group as PG
    from mfsdp2.models.llama import LlamaConfig, Transformer

    mesh = _init_fake(spec["mesh"])
    shard_mesh = mesh["shard"]
    acc: dict = {}
    _timed(PG, "plan_layout", acc, "plan")
    mp = mfsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cfg = LlamaConfig(**GEOMETRIES[spec["model"]])
    with torch.device("meta"):
        model = Transformer(cfg)
    t0 = time.perf_counter()
    _shard_all(model, mesh, mp_policy=mp)
    shard_s = time.perf_counter() - t0
    plan_s = acc.get("plan", 0.0)
    # The same again under torch's profiler: every byte the CPU allocator hands out.
    with torch.device("meta"):
        probe = Transformer(cfg)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _shard_all(probe, mesh, mp_policy=mp)
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    units = _units(model)
    groups = [g for gs in units.values() for g in gs]
    shard = sum(g.layout.shard_numel for g in groups)
    local = sum(p.to_local().numel() for p in model.parameters())
    unit_total = {u: sum(g.layout.total_numel for g in gs) for u, gs in units.items()}
    unit_params = {u: sum(g.layout.param_numel for g in gs) for u, gs in units.items()}
    big = max(unit_total, key=unit_total.get)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "units": len(units),
        "shard_group": shard_mesh.size(),
        "fully_shard_s": shard_s,
        "layout_planning_s": plan_s,
        "fully_shard_allocated_bytes": allocated,
        "meta_parameters": all(p.is_meta for p in model.parameters()),
        "main_weight_bytes": 4 * shard,
        "main_grad_bytes": 4 * shard,
        "adam_bytes": 8 * local,
        "gathered_bytes": 2 * unit_total[big],
        "grad_buffer_bytes": 4 * unit_total[big],
        "largest_unit_params": unit_params[big],
        "padding_numel": sum(g.layout.padding_numel for g in groups),
    }


def step_case(spec: dict) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    import mfsdp2.groups.param_group as PG
    from mfsdp2.models.llama import LlamaConfig, Transformer
    from mfsdp2.runtime.hooks import lazy_init
    from mfsdp2.runtime.state import unit_state
    from mfsdp2.memory.trace_pool import TracePoolAllocator

    mesh = _init_fake(spec["mesh"])
    acc: dict = {}
    _timed(PG, "plan_layout", acc, "plan")
    _timed(TracePoolAllocator, "_make_plan", acc, "pool_plan")
    # Step parts are timed in this thread's CPU time: everything here runs on it (the fake
    # backend's collectives, and CPU autograd's backward), and it does not count the time the
    # thread waited for a core, so a busy machine inflates it far less than wall time.
    clock = time.thread_time
    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
        if hasattr(dist, name):
            _timed(dist, name, acc, "coll", clock)
    torch.manual_seed(0)
    model = Transformer(LlamaConfig(n_layers=spec["layers"], **NARROW))
    plain = copy.deepcopy(model)
    tok = torch.randint(0, NARROW["vocab_size"], (2, 16))

    def fwd_bwd(m) -> None:
        m(tok).float().mean().backward()

    compute = []
    for _ in range(WARMUP + STEPS):  # the unsharded model: what forward+backward costs alone
        t = clock()
        fwd_bwd(plain)
        compute.append(clock() - t)
        plain.zero_grad()
    t0 = time.perf_counter()
    _shard_all(model, mesh, allocator="trace_pool")
    t1 = time.perf_counter()
    lazy_init(unit_state(model))
    t2 = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = []
    for _ in range(WARMUP + STEPS):
        c0, n0 = acc.get("coll", 0.0), acc.get("coll_n", 0)
        w, s = time.perf_counter(), clock()
        fwd_bwd(model)
        f = clock()
        opt.step()
        opt.zero_grad()
        e = clock()
        rows.append((e - s, f - s, e - f, acc["coll"] - c0, acc["coll_n"] - n0, time.perf_counter() - w))
    steady = rows[WARMUP:]

    def med(i: int) -> float:
        return statistics.median(r[i] for r in steady)

    fb, coll, base = med(1), med(3), statistics.median(compute[WARMUP:])
    return {
        "units": spec["layers"] + 1,
        "fully_shard_s": t1 - t0,
        "lazy_init_s": t2 - t1,
        "layout_planning_s": acc.get("plan", 0.0),
        "trace_pool_planning_s": acc.get("pool_plan", 0.0),
        "step_wall_s": med(5),
        "step_s": med(0),
        "fwd_bwd_s": fb,
        "optimizer_s": med(2),
        "collective_s": coll,
        "collectives_per_step": steady[-1][4],
        "compute_s": base,
        "own_s": fb - coll - base,
        "padding_fraction": sum(g.layout.padding_numel for gs in _units(model).values() for g in gs)
        / sum(p.numel() for p in model.parameters()),
    }


def fake_collective_case(spec: dict) -> dict:
    """The fake backend alone: one all-gather / reduce-scatter of a narrow unit's padded size."""
    import torch
    import torch.distributed as dist

    from mfsdp2.base import compat
    from mfsdp2.models.llama import LlamaConfig, Transformer
    from mfsdp2.memory.layout import plan_layout

    mesh = _init_fake(spec["mesh"])
    group = mesh["shard"].get_group()
    n = mesh["shard"].size()
    with torch.device("meta"):
        layer = Transformer(LlamaConfig(n_layers=1, **NARROW)).layers[0]
    layout = plan_layout([tuple(p.shape) for p in layer.parameters()], n, align=4)  # fp32 main weights
    S = layout.shard_numel
    out = {}
    gathered = torch.empty(n * S, dtype=torch.bfloat16)
    grads, shard = torch.empty(n * S), torch.empty(S)
    cases = {
        "all_gather": lambda: compat.all_gather_single(gathered, gathered[:S], group=group, async_op=True).wait(),
        "reduce_scatter": lambda: compat.reduce_scatter_single(shard, grads, op=dist.ReduceOp.AVG, group=group,
                                                               async_op=True).wait(),
    }
    for name, fn in cases.items():
        for _ in range(5):
            fn()
        reps = 200
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name + "_us"] = (time.perf_counter() - t) / reps * 1e6
    out["unit_numel"] = n * S
    return out


CASES = {"memory": memory_case, "step": step_case, "fake_collective": fake_collective_case}


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------
def _run(kind: str, spec: dict) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "_case", kind, json.dumps(spec)],
                         capture_output=True, text=True, timeout=900, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} {spec}: {out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r.update(spec)
    return r


def _mesh_name(shape: list[int]) -> str:
    return "x".join(map(str, shape))


def _gib(b: float) -> str:
    return f"{b / 2**30:8.3f}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_case":
        print(json.dumps(CASES[sys.argv[2]](json.loads(sys.argv[3]))))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8B and 70B only; 8 and 1024 ranks; 16 layers")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [8, 1024] if args.quick else [8, 64, 256, 1024]
    hsdp = [[8, 128]] if args.quick else [[8, 128], [2, 512]]
    geoms = ["8B", "70B"] if args.quick else list(GEOMETRIES)
    meshes = [[n] for n in sizes] + hsdp
    t_start = time.time()
    from _common import machine_info, now_iso  # noqa: E402 (benchmarks/ is on sys.path as the script's dir)

    result: dict = {"machine": machine_info(), "date": now_iso(), "memory": [], "steps": [], "fake_collective": []}
    result["machine"]["backend"] = "fake"

    print("Memory per rank (GiB): bf16 compute, fp32 main weights and grads, AdamW; meta build, nothing allocated")
    print(f"{'model':>5} {'mesh':>6} {'main':>8} {'grads':>8} {'adam':>8} {'gathered':>8} {'gradbuf':>8} {'total':>8} "
          f"{'formula':>8} {'ratio':>6} {'padding':>8} {'alloc_B':>7} {'shard_s':>7} {'plan_s':>6}")
    for name in geoms:
        for shape in meshes:
            r = _run("memory", {"model": name, "mesh": shape})
            n, P, Pu = r["shard_group"], r["params"], r["largest_unit_params"]
            r["total_bytes"] = sum(r[k] for k in ("main_weight_bytes", "main_grad_bytes", "adam_bytes",
                                                  "gathered_bytes", "grad_buffer_bytes"))
            r["formula_bytes"] = 16 * P / n + 6 * Pu  # ZeRO-3 + the largest unit gathered (bf16) and its fp32 grads
            r["padding_fraction"] = r["padding_numel"] / P
            result["memory"].append(r)
            print(f"{name:>5} {_mesh_name(shape):>6} {_gib(r['main_weight_bytes'])} {_gib(r['main_grad_bytes'])} "
                  f"{_gib(r['adam_bytes'])} {_gib(r['gathered_bytes'])} {_gib(r['grad_buffer_bytes'])} "
                  f"{_gib(r['total_bytes'])} {_gib(r['formula_bytes'])} {r['total_bytes'] / r['formula_bytes']:6.3f} "
                  f"{100 * r['padding_fraction']:7.3f}% {r['fully_shard_allocated_bytes']:7d} "
                  f"{r['fully_shard_s']:7.2f} {r['layout_planning_s']:6.3f}")

    print("\nNarrow model (dim 64), trace-pool allocator: setup times (s) and steady-state step (ms)")
    print(f"{'layers':>6} {'mesh':>6} {'shard_s':>7} {'init_s':>6} {'plan_s':>6} {'pool_ms':>7} {'step':>7} "
          f"{'fwd_bwd':>7} {'colls':>5} {'coll':>7} {'compute':>7} {'own':>7} {'own/u':>6} {'optim':>7}")
    for layers in ([16] if args.quick else [16, 126]):
        for shape in meshes:
            r = _run("step", {"layers": layers, "mesh": shape})
            result["steps"].append(r)
            print(f"{layers:>6} {_mesh_name(shape):>6} {r['fully_shard_s']:7.2f} {r['lazy_init_s']:6.3f} "
                  f"{r['layout_planning_s']:6.3f} {1e3 * r['trace_pool_planning_s']:7.1f} {1e3 * r['step_s']:7.1f} "
                  f"{1e3 * r['fwd_bwd_s']:7.1f} {r['collectives_per_step']:5d} {1e3 * r['collective_s']:7.1f} "
                  f"{1e3 * r['compute_s']:7.1f} {1e3 * r['own_s']:7.1f} {1e3 * r['own_s'] / r['units']:6.2f} "
                  f"{1e3 * r['optimizer_s']:7.1f}")

    print("\nThe fake backend alone: one collective of a narrow unit's size (us per call)")
    print(f"{'mesh':>6} {'numel':>8} {'all_gather':>10} {'reduce_scatter':>14}")
    for shape in meshes:
        r = _run("fake_collective", {"mesh": shape})
        result["fake_collective"].append(r)
        print(f"{_mesh_name(shape):>6} {r['unit_numel']:8d} {r['all_gather_us']:10.1f} {r['reduce_scatter_us']:14.1f}")
    result["wall_s"] = time.time() - t_start
    print(f"\n{result['wall_s']:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
