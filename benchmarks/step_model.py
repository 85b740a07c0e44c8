"""Per-rank memory and step time of ZeRO-3 / HSDP on paper: the model docs/scaling.md describes.

    python benchmarks/step_model.py [--json PATH]

Pure arithmetic, nothing runs on a device. Three parts, each a function the CPU check
(``benchmarks/alpha_beta.py``) reuses with its own measured inputs:

* :func:`memory_per_rank` -- ZeRO-3 bytes per rank: ``16 P / N`` (fp32 main weights, fp32 main
  gradients, AdamW's two fp32 states) plus the transient buffers of the largest unit: its gathered
  bf16 weights, once per unit in flight (``1 + prefetch depth``), and the fp32 flat gradient its
  reduce-scatter reads. HSDP divides by the shard-group size only. Compared with the
  layout-exact counts of ``benchmarks/results/scale.json``.
* :func:`ring_time` -- an alpha-beta model of a ring collective: NCCL's own tuning model
  (latency = base + per-step hop latencies, intra-node steps over NVLink and inter-node steps over
  the network), bandwidth term ``(N-1)/N * bytes / bus bandwidth``.
* :func:`simulate_step` -- one training step as a list of units on one compute stream and FIFO
  links: each unit's all-gather must end before its forward / backward compute starts; the
  schedule issues the gathers of the next ``depth`` units (mfsdp2's recorded-order prefetch) when
  a unit starts; the reduce-scatter is issued when a unit's backward ends; HSDP's all-reduce
  follows its reduce-scatter on the inter-node link. The root (embedding + output layer) is
  gathered first and kept until backward (FSDP2's default for the root), reduced last.

Published figures used (sources in docs/scaling.md; each named constant below cites it):
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field

# -- published figures -------------------------------------------------------------------------
# NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 Tensor Core 1,979 TFLOPS "with sparsity",
# specifications one half lower without it.
H100_BF16_DENSE_FLOPS = 1979e12 / 2
# Same datasheet: NVLink 900 GB/s per GPU, both directions together (NVLink 4: 18 links).
NVLINK_BYTES_PER_S = 900e9 / 2
# NVIDIA DGX H100 datasheet: eight single-port ConnectX-7 400 Gb/s InfiniBand (NDR) per node, one per GPU.
IB_BYTES_PER_S = 400e9 / 8
GPUS_PER_NODE = 8
# NCCL's tuning model (NVIDIA/nccl, src/graph/tuning.cc, Ring / Simple protocol), microseconds:
# base latency per collective, plus per ring step over NVLink or over the network.
NCCL_BASE_LAT_S = 8.4e-6
NCCL_NVLINK_STEP_S = 3.4e-6
NCCL_NET_STEP_S = 9.6e-6
# PaLM (Chowdhery et al. 2022), appendix B: training FLOPs per token = 6 N + 12 L H Q T
# (N parameters in matmuls, L layers, H heads, Q head dim, T sequence length).

LLAMA3 = {  # as published (Llama 3 model card / paper): hidden, layers, heads, KV heads, FFN, vocab
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab=128256),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab=128256),
    "405B": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab=128256),
}
SEQ = 8192  # tokens per sequence (Llama 3 pre-training); one sequence per GPU per step (an input of the model)


# -- geometry ----------------------------------------------------------------------------------
def layer_params(g: dict) -> int:
    hd = g["dim"] // g["n_heads"]
    attn = 2 * g["dim"] * g["n_heads"] * hd + 2 * g["dim"] * g["n_kv_heads"] * hd
    return attn + 3 * g["dim"] * g["ffn_dim"] + 2 * g["dim"]


def root_params(g: dict) -> int:
    return 2 * g["vocab"] * g["dim"] + g["dim"]  # embedding, output layer, final norm


def total_params(g: dict) -> int:
    return g["n_layers"] * layer_params(g) + root_params(g)


# -- memory ------------------------------------------------------------------------------------
def memory_per_rank(params: int, largest_unit: int, shard_group: int, depth: int = 1) -> dict:
    """ZeRO-3 bytes per rank (mixed precision: bf16 gathers, fp32 main weights / grads / reduce)."""
    persistent = 16 * params / shard_group  # main weights 4 + main grads 4 + AdamW 8 bytes per parameter
    gathered = 2 * largest_unit * (1 + depth)  # bf16: the unit computing and `depth` prefetched
    grad_buffer = 4 * largest_unit  # fp32 flat gradient of the unit being reduced
    return {"persistent": persistent, "gathered": gathered, "grad_buffer": grad_buffer,
            "total": persistent + gathered + grad_buffer}


# -- collectives -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """A ring's alpha-beta parameters: latency per collective (``base + per-step``) and bus bandwidth."""

    base_s: float
    intra_step_s: float
    inter_step_s: float
    bus_bytes_per_s: float
    ranks_per_node: int = GPUS_PER_NODE


def ring_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for a ring collective over ``n`` ranks of a ``nbytes`` full buffer (all-gather
    output, reduce-scatter input, all-reduce tensor): NCCL's latency model, ``(n-1)/n`` of the bytes
    over the bus bandwidth per pass (two passes for an all-reduce)."""
    if n <= 1:
        return 0.0
    passes = 2 if kind == "all_reduce" else 1
    nodes = max(1, math.ceil(n / link.ranks_per_node))
    steps, inter = passes * (n - 1), passes * (nodes - 1)
    latency = link.base_s + (steps - inter) * link.intra_step_s + inter * link.inter_step_s
    return latency + passes * (n - 1) / n * nbytes / link.bus_bytes_per_s


NVLINK = Link(NCCL_BASE_LAT_S, NCCL_NVLINK_STEP_S, NCCL_NET_STEP_S, NVLINK_BYTES_PER_S)
IB = Link(NCCL_BASE_LAT_S, NCCL_NVLINK_STEP_S, NCCL_NET_STEP_S, IB_BYTES_PER_S)


def ring_link(n: int) -> Link:
    """Within one node the ring runs over NVLink; across nodes each GPU's NIC is the bottleneck."""
    return NVLINK if n <= GPUS_PER_NODE else IB


# -- one step ----------------------------------------------------------------------------------
@dataclass
class Unit:
    name: str
    fwd_s: float
    bwd_s: float
    ag_s: float  # all-gather (forward and, except the root, again in backward)
    rs_s: float  # reduce-scatter
    ar_s: float = 0.0  # HSDP: all-reduce across replicas, on the inter-node link


@dataclass
class StepTime:
    step_s: float
    compute_s: float
    comm_s: float  # sum of every collective's time
    exposed_s: float = field(init=False)
    exposed_fraction: float = field(init=False)

    def __post_init__(self) -> None:
        self.exposed_s = self.step_s - self.compute_s
        self.exposed_fraction = self.exposed_s / self.step_s if self.step_s else 0.0


def simulate_step(root: Unit, layers: list[Unit], depth: int, shared_link: bool = True) -> StepTime:
    """Forward then backward of ``[root] + layers`` on one compute stream (see the module docstring).

    Collectives run one at a time per link, in issue order. ``shared_link``: all-gathers and
    reduce-scatters share one link (one network; HSDP's all-reduce is on a second, inter-node one)."""
    free = {"ag": 0.0, "rs": 0.0, "ar": 0.0}

    def issue(kind: str, dur: float, at: float) -> float:
        lane = "ag" if shared_link and kind == "rs" else kind
        start = max(at, free[lane])
        free[lane] = start + dur
        return start + dur

    t = 0.0
    comm = 0.0
    order = [root] + layers  # units are keyed by position: one Unit object may stand for every layer
    done: dict[int, float] = {}
    for k, u in enumerate(order):  # forward
        for j in range(k, min(k + 1 + depth, len(order))):
            if j not in done:
                done[j] = issue("ag", order[j].ag_s, t)
                comm += order[j].ag_s
        t = max(t, done[k]) + u.fwd_s
    back = [0] + list(range(len(order) - 1, 0, -1))  # root (output layer) first, then the layers in reverse
    done = {0: 0.0}  # the root is kept gathered from forward to backward
    last = 0.0
    for k, i in enumerate(back):
        u = order[i]
        for j in back[k : k + 1 + depth]:
            if j not in done:
                done[j] = issue("ag", order[j].ag_s, t)
                comm += order[j].ag_s
        t = max(t, done[i]) + u.bwd_s
        if i != 0:  # the root's gradients (embedding) are complete only at the end
            end = issue("rs", u.rs_s, t)
            comm += u.rs_s
            if u.ar_s:
                end = issue("ar", u.ar_s, end)
                comm += u.ar_s
            last = max(last, end)
    end = issue("rs", root.rs_s, t)
    if root.ar_s:
        end = issue("ar", root.ar_s, end)
    comm += root.rs_s + root.ar_s
    compute = sum(u.fwd_s + u.bwd_s for u in order)
    return StepTime(max(t, end, last), compute, comm)


# -- Llama-3 on H100s ----------------------------------------------------------------------------
def llama_units(g: dict, mesh: tuple[int, int], tokens: int = SEQ) -> tuple[Unit, list[Unit]]:
    """Units of a Llama-3 geometry on ``mesh`` = (replicas, shard group): compute at the H100's
    dense bf16 peak from PaLM's FLOPs formula; bf16 all-gathers, fp32 reduce-scatters / all-reduces."""
    replicas, n = mesh
    hd = g["dim"] // g["n_heads"]
    attn_flops = 12 * g["n_heads"] * hd * SEQ  # per token per layer (fwd + bwd)

    def unit(name: str, params: int, extra_flops: float) -> Unit:
        flops = (6 * params + extra_flops) * tokens
        ag = ring_time("all_gather", 2 * params, n, ring_link(n))
        rs = ring_time("reduce_scatter", 4 * params, n, ring_link(n))
        ar = ring_time("all_reduce", 4 * params / n, replicas, IB) if replicas > 1 else 0.0
        return Unit(name, flops / 3 / H100_BF16_DENSE_FLOPS, 2 * flops / 3 / H100_BF16_DENSE_FLOPS, ag, rs, ar)

    root = unit("root", g["vocab"] * g["dim"], 0)  # the output layer's matmul; the embedding is a lookup
    root.ag_s = ring_time("all_gather", 2 * root_params(g), n, ring_link(n))
    root.rs_s = ring_time("reduce_scatter", 4 * root_params(g), n, ring_link(n))
    if replicas > 1:
        root.ar_s = ring_time("all_reduce", 4 * root_params(g) / n, replicas, IB)
    layer = unit("layer", layer_params(g), attn_flops)
    return root, [layer] * g["n_layers"]


def gpu_table(depths=(0, 1, 2, 4)) -> list[dict]:
    rows = []
    for name, g in LLAMA3.items():
        P, Pu = total_params(g), max(layer_params(g), root_params(g))
        for world in (8, 64, 256, 1024):
            meshes = [("zero3", (1, world))]
            if world > GPUS_PER_NODE:
                meshes.append(("hsdp", (world // GPUS_PER_NODE, GPUS_PER_NODE)))
            for kind, mesh in meshes:
                root, layers = llama_units(g, mesh)
                sims = {d: simulate_step(root, layers, d) for d in depths}
                mem = {d: memory_per_rank(P, Pu, mesh[1], d)["total"] for d in depths}
                rows.append({
                    "model": name, "gpus": world, "kind": kind, "mesh": list(mesh),
                    "compute_s": sims[depths[0]].compute_s,
                    "comm_s": sims[depths[0]].comm_s,
                    "step_s": {d: s.step_s for d, s in sims.items()},
                    "exposed_fraction": {d: s.exposed_fraction for d, s in sims.items()},
                    "memory_bytes": mem,
                    "layer_all_gather_s": layers[0].ag_s, "layer_reduce_scatter_s": layers[0].rs_s,
                    "layer_all_reduce_s": layers[0].ar_s, "layer_fwd_s": layers[0].fwd_s,
                })
    return rows


def memory_check(scale_json: str) -> list[dict]:
    """The formula (depth 0: one unit gathered, as part 1 counts) against part 1's layout counts."""
    with open(scale_json) as f:
        measured = json.load(f)["memory"]
    out = []
    for r in measured:
        g = LLAMA3[r["model"]]
        P, Pu = total_params(g), max(layer_params(g), root_params(g))
        assert P == r["params"], (r["model"], P, r["params"])  # the geometry is the one measured
        f = memory_per_rank(P, Pu, r["shard_group"], depth=0)
        out.append({"model": r["model"], "mesh": r["mesh"], "formula_bytes": f["total"],
                    "measured_bytes": r["total_bytes"], "ratio": r["total_bytes"] / f["total"],
                    "padding_fraction": r["padding_fraction"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--scale-json",
                    default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "scale.json"))
    args = ap.parse_args()
    depths = (0, 1, 2, 4)
    rows = gpu_table(depths)
    print(f"Llama-3 on H100s at dense bf16 peak, {SEQ} tokens per GPU per step; "
          "exposed communication by prefetch depth")
    print(f"{'model':>5} {'gpus':>5} {'kind':>5} {'compute':>8} {'comm':>8} "
          + " ".join(f"{'step d' + str(d):>8}" for d in depths)
          + " " + " ".join(f"{'exp d' + str(d):>6}" for d in depths) + f" {'mem d1 GiB':>10}")
    for r in rows:
        print(f"{r['model']:>5} {r['gpus']:>5} {r['kind']:>5} {r['compute_s']:8.3f} {r['comm_s']:8.3f} "
              + " ".join(f"{r['step_s'][d]:8.3f}" for d in depths) + " "
              + " ".join(f"{100 * r['exposed_fraction'][d]:5.1f}%" for d in depths)
              + f" {r['memory_bytes'][1] / 2**30:10.1f}")
    result = {"gpu": rows}
    if os.path.exists(args.scale_json):
        check = memory_check(args.scale_json)
        result["memory_check"] = check
        ratios = [c["ratio"] for c in check]
        print(f"\nMemory formula vs part 1's layout counts ({len(check)} cases): measured / formula "
              f"{min(ratios):.4f} .. {max(ratios):.4f} (the excess is the layout's padding)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
