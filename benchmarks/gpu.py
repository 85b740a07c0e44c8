"""mfsdp2 vs torch FSDP2 on CUDA GPUs (NCCL): a ~1B-parameter Llama-style decoder in bf16.

Launch one process per visible GPU::

    torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" benchmarks/gpu.py \\
        [--peak-tflops 989] [--steps 20] [--batch 2] [--seq 2048] [--json gpu.json]

Every framework (mfsdp2, FSDP2 as shipped, FSDP2 tuned) is built on every rank from the same seed
(``mfsdp2.models.llama.Transformer``:
dim 2048, 16 layers, 32 heads, 8 KV heads, SwiGLU 8192, vocab 32000, untied output: 1.14B params),
each ``TransformerBlock`` and then the root are ``fully_shard``-ed, and both train with AdamW on the
same random token batches. Timing alternates blocks of ``--block`` steps (mfsdp2, FSDP2, FSDP2,
mfsdp2, ...) so clock and thermal drift hit both; every step is synchronised and its time is the max
over ranks. Reported per framework: median step (p10/p90), tokens/s (global), MFU =
``6 * N * tokens / step_time / (peak_tflops * world_size)`` with ``N`` all parameters (no attention
term), collectives and bytes per step (``torch.distributed`` wrapped, as in ``compare_fsdp2.py``),
and peak allocated CUDA memory attributable to that framework (its own steady-state memory plus
its transient peak; the other framework's resident memory is subtracted), and the process's
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over that framework's timed steps
(max over ranks; process-wide, so they include the other frameworks' resident memory -- run one
framework, ``--frameworks mfsdp2``, for its own; reserved adds the caching allocator's
fragmentation and cache). At world size 1 no collective runs (mfsdp2 and FSDP2 both
short-circuit them): the step measures framework overhead and memory only. Unless ``--no-floor``:
compute-only time (unsharded bf16 model, this rank's batch, AdamW on one shard's worth of fp32
tensors) and comm-only time (mfsdp2's recorded collectives of one step re-issued back to back).

``--peak-tflops``: dense bf16 peak of one GPU (H100/H200 SXM 989, A100 312); guessed from the device
name when omitted. ``--config`` takes the CPU benchmark's names (default ``bf16``: bf16 params,
fp32 reduce). ``--device cpu --model-size tiny`` runs the same code on gloo CPU ranks (a smoke test
for machines without a GPU: ``torchrun --nproc-per-node 2 benchmarks/gpu.py --device cpu
--model-size tiny --steps 4``).

Profiling with Nsight Systems -- one report per rank, capturing only ``--nsys-steps`` steps of each
framework (``torch.cuda.profiler.start/stop``); mfsdp2's lifecycle ranges (``mfsdp2.unshard
layers.3``, ``mfsdp2.reduce_grad ...``) are NVTX ranges on the CPU thread, FSDP2's show as
``FSDP::...`` when ``--nvtx`` emits the autograd ranges too::

    torchrun --standalone --nproc-per-node 8 --no-python \\
        nsys profile -t cuda,nvtx,osrt,cublas --capture-range=cudaProfilerApi \\
            --capture-range-end=stop -o gpu_rank%q{LOCAL_RANK} --force-overwrite true \\
        python benchmarks/gpu.py --frameworks mfsdp2,fsdp2 --steps 6 --nsys-steps 3 --no-floor

    nsys stats -r nvtx_sum,cuda_gpu_kern_sum gpu_rank0.nsys-rep   # summaries; or open in the GUI

In the timeline, check that the all-gather kernels of layer k+1 run under layer k's GEMMs (forward)
and that reduce-scatters overlap the previous layer's backward; gaps on the compute stream before a
layer start are exposed communication.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0, "B200": 2250.0,
               "A100": 312.0, "A800": 312.0, "L40S": 362.0, "A10": 125.0}


def model_config(size: str, seq: int):
    from mfsdp2.models.llama import LlamaConfig

    if size == "1b":
        return LlamaConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                           ffn_dim=8192, max_seq_len=seq)
    if size == "tiny":
        cfg = LlamaConfig.tiny()
        cfg.max_seq_len = max(cfg.max_seq_len, seq)
        return cfg
    raise ValueError(size)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="mfsdp2 vs torch FSDP2 on CUDA/NCCL (torchrun, one process per GPU)",
        epilog="See the module docstring for the torchrun and nsys command lines.")
    p.add_argument("--frameworks", default="mfsdp2,fsdp2,fsdp2_tuned",
                   help="comma list of mfsdp2, fsdp2 (torch's defaults), fsdp2_tuned (_common.FSDP2_TUNED "
                        "for the device: explicit prefetch on CUDA)")
    p.add_argument("--config", default="bf16", choices=C.CONFIGS)
    p.add_argument("--model-size", default="1b", choices=("1b", "tiny"))
    p.add_argument("--batch", type=int, default=2, help="sequences per rank (default 2)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per framework (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per framework (default 3)")
    p.add_argument("--block", type=int, default=5, help="steps per alternation block (default 5)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak TFLOP/s of one GPU for MFU (default: from the device name)")
    p.add_argument("--prefetch", type=int, default=None, help="mfsdp2 prefetch depth (default: runtime's)")
    p.add_argument("--no-floor", action="store_true", help="skip the compute-only and comm-only floors")
    p.add_argument("--nsys-steps", type=int, default=0,
                   help="steps of each framework inside torch.cuda.profiler.start/stop (for nsys)")
    p.add_argument("--nvtx", action="store_true", help="emit autograd NVTX ranges (torch.autograd.profiler.emit_nvtx)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo smoke test")
    p.add_argument("--json", metavar="PATH", help="write results as JSON (rank 0)")
    a = p.parse_args(argv)
    a.frameworks = [f for f in a.frameworks.split(",") if f]
    for f in a.frameworks:
        if f not in C.FRAMEWORKS:
            p.error(f"unknown framework {f!r}")
    if a.steps < 1 or a.warmup < 2 or a.block < 1:
        p.error("--steps >= 1, --warmup >= 2 and --block >= 1 are required")
    return a


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _alloc(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def run(a: argparse.Namespace) -> int:
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu.py: no CUDA device visible (use --device cpu --model-size tiny for a CPU smoke test)",
              file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("gpu.py: launch with torchrun (see --help)", file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if a.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    try:
        res = _bench(a, device, rank, ws)
    finally:
        import gc

        gc.collect()
    if rank == 0 and res is not None:
        _report(a, res, device, ws)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _bench(a, device, rank: int, ws: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp2.models.llama import Transformer

    counter = C.CollectiveCounter().install()  # before any model is built
    mesh = init_device_mesh(device.type, (ws,))
    cfg = model_config(a.model_size, a.seq)
    base = _alloc(device)
    torch.manual_seed(0)
    with torch.device(device):
        ref = Transformer(cfg)
    n_params = sum(p.numel() for p in ref.parameters())
    tokens = a.batch * a.seq * ws

    def batch(step: int):
        g = torch.Generator(device=device).manual_seed(step * 1000 + rank)
        t = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), device=device, generator=g)
        return t[:, :-1], t[:, 1:]

    def step_fn(model, opt, s: int):
        x, y = batch(s)
        return C.train_step(model, opt, "llama", x, y)

    models, resident = {}, {}
    records = []
    for fw in a.frameworks:
        before = _alloc(device)
        m = C.shard(copy.deepcopy(ref), fw, a.config, mesh)
        if fw == "mfsdp2" and a.prefetch is not None:
            m.set_prefetch_depth(a.prefetch)
        opt = C.make_optimizer(m.parameters())
        for w in range(a.warmup):
            counter.enabled = fw == "mfsdp2" and w == a.warmup - 1
            step_fn(m, opt, w)
            counter.enabled = False
            recs = counter.take()
            if recs:
                records = recs
        _sync(device)
        models[fw] = (m, opt)
        resident[fw] = _alloc(device) - before  # shards, grads, optimizer state, caches
    floor = None
    replay = None
    if not a.no_floor:
        floor = C.ComputeFloor(ref, "llama", a.config, ws)
        for w in range(2):
            floor(*batch(w))
        if records:
            replay = C.CommReplay(records, ws, counter, device=str(device))
            replay()
    del ref
    _sync(device)

    times = {fw: [] for fw in a.frameworks}
    peaks = {fw: 0 for fw in a.frameworks}
    max_alloc = {fw: 0 for fw in a.frameworks}  # torch.cuda.max_memory_allocated, process-wide
    max_reserved = {fw: 0 for fw in a.frameworks}  # torch.cuda.max_memory_reserved, process-wide
    coll = {fw: [] for fw in a.frameworks}
    order = list(a.frameworks)
    done = {fw: 0 for fw in a.frameworks}
    blk = 0
    while any(done[fw] < a.steps for fw in order):
        seq = order if blk % 2 == 0 else list(reversed(order))
        for fw in seq:
            n = min(a.block, a.steps - done[fw])
            if n <= 0:
                continue
            m, opt = models[fw]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start_alloc = _alloc(device)
            for _ in range(n):
                s = a.warmup + done[fw]
                _sync(device)
                dist.barrier()
                counter.enabled = True
                t0 = time.perf_counter()
                step_fn(m, opt, s)
                _sync(device)
                times[fw].append(time.perf_counter() - t0)
                counter.enabled = False
                coll[fw].extend(counter.take())
                done[fw] += 1
            if device.type == "cuda":
                peaks[fw] = max(peaks[fw], torch.cuda.max_memory_allocated(device) - start_alloc)
                max_alloc[fw] = max(max_alloc[fw], torch.cuda.max_memory_allocated(device))
                max_reserved[fw] = max(max_reserved[fw], torch.cuda.max_memory_reserved(device))
        blk += 1

    floor_t = {"compute": [], "comm": []}
    if floor is not None:
        for i in range(max(3, a.steps // 2)):
            for k in (["compute", "comm"] if i % 2 == 0 else ["comm", "compute"]):
                if k == "comm" and replay is None:
                    continue
                _sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                floor(*batch(i)) if k == "compute" else replay()
                _sync(device)
                floor_t[k].append(time.perf_counter() - t0)

    if a.nsys_steps > 0 and device.type == "cuda":
        for fw in a.frameworks:
            m, opt = models[fw]
            _sync(device)
            torch.cuda.profiler.start()
            ctx = torch.autograd.profiler.emit_nvtx() if a.nvtx else _null()
            with ctx:
                for i in range(a.nsys_steps):
                    torch.cuda.nvtx.range_push(f"{fw} step {i}")
                    step_fn(m, opt, 10_000 + i)
                    torch.cuda.nvtx.range_pop()
            _sync(device)
            torch.cuda.profiler.stop()

    # max over ranks of every timed step
    def rank_max(xs: list[float]) -> list[float]:
        t = torch.tensor(xs, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    counter.enabled = False
    out = {"n_params": n_params, "tokens_per_step": tokens, "base_alloc": base}
    for fw in a.frameworks:
        others = sum(v for k, v in resident.items() if k != fw)
        own_peak = alloc_peak = reserved_peak = None
        if device.type == "cuda":
            own_peak = max(resident[fw], 0) + peaks[fw]
            # resident memory of the other framework is the only thing subtracted
            own_peak, alloc_peak, reserved_peak = (
                int(v) for v in rank_max([own_peak, max_alloc[fw], max_reserved[fw]]))
        out[fw] = {"times": rank_max(times[fw]), "collectives": C.summarize_records(coll[fw], a.steps),
                   "resident_bytes": resident[fw], "other_resident_bytes": others,
                   "peak_bytes": own_peak, "max_memory_allocated": alloc_peak,
                   "max_memory_reserved": reserved_peak}
    out["floor"] = {k: rank_max(v) if v else [] for k, v in floor_t.items()}
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _report(a, res: dict, device: torch.device, ws: int) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = a.peak_tflops
    if peak is None:
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    n, tok = res["n_params"], res["tokens_per_step"]
    fl = res["floor"]
    compute = C.summarize_times(fl["compute"])["median"] if fl["compute"] else None
    comm = C.summarize_times(fl["comm"])["median"] if fl["comm"] else None
    floor_s = max(x for x in (compute, comm) if x is not None) if (compute or comm) else None
    rows, cases = [], {}
    for fw in a.frameworks:
        s = C.summarize_times(res[fw]["times"])
        med = s["median"]
        mfu = 6 * n * tok / med / (peak * 1e12 * ws) if peak else None
        d = {"step_s_median": med, "step_s_p10": s["p10"], "step_s_p90": s["p90"], "tokens_per_s": tok / med,
             "mfu": mfu, "wire_bytes_per_step": C.wire_summary(res[fw]["collectives"], ws)["buffer_bytes"],
             "collectives_per_step": res[fw]["collectives"]["collectives_per_step"],
             "peak_tensor_bytes": res[fw]["peak_bytes"],
             "max_memory_allocated_bytes": res[fw]["max_memory_allocated"],
             "max_memory_reserved_bytes": res[fw]["max_memory_reserved"],
             "step_over_floor": med / floor_s if floor_s else None}
        cases[fw] = d
        rows.append([fw, f"{med*1e3:.1f} ({s['p10']*1e3:.0f}-{s['p90']*1e3:.0f})", f"{tok / med:,.0f}",
                     "n/a" if mfu is None else f"{mfu*100:.1f}%", C.fmt_bytes(d["wire_bytes_per_step"]),
                     f"{d['collectives_per_step']:g}", C.fmt_bytes(d["peak_tensor_bytes"]),
                     C.fmt_bytes(d["max_memory_allocated_bytes"]), C.fmt_bytes(d["max_memory_reserved_bytes"]),
                     "n/a" if d["step_over_floor"] is None else f"{d['step_over_floor']:.2f}"])
    print(f"\n{name} x{ws}, {a.model_size} ({n/1e9:.2f}B params), {a.config}, batch {a.batch}x{a.seq} per rank "
          f"({tok} tokens/step), peak {peak} TFLOP/s/GPU")
    if compute is not None:
        print(f"compute-only {compute*1e3:.1f} ms" + (f", comm-only {comm*1e3:.1f} ms" if comm else ""))
    C.print_table(["framework", "step ms (p10-p90)", "tokens/s", "MFU", "wire/step", "coll/step",
                   "peak mem", "max alloc", "max reserved", "step/floor"], rows)
    ratio = None
    for base, suffix in (("fsdp2", ""), ("fsdp2_tuned", "_vs_tuned")):
        if "mfsdp2" not in cases or base not in cases:
            continue
        A, B = cases["mfsdp2"], cases[base]
        r = {"step_time": A["step_s_median"] / B["step_s_median"],
             "peak_tensor_memory": (A["peak_tensor_bytes"] / B["peak_tensor_bytes"]
                                    if A["peak_tensor_bytes"] and B["peak_tensor_bytes"] else None),
             "wire_bytes": A["wire_bytes_per_step"] / B["wire_bytes_per_step"]
             if B["wire_bytes_per_step"] else None}
        print(f"mfsdp2 / {base}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if v is not None))
        ratio = ratio or {"step_over_floor": A["step_over_floor"]}
        ratio.update({k + suffix: v for k, v in r.items()})
    if a.json:
        out = {"cases": [{"model": f"llama-{a.model_size}", "config": a.config, **cases,
                          "floor": {"compute_s": compute, "comm_s": comm}, "ratio": ratio}],
               "machine": {"device": name, "world_size": ws, "torch": torch.__version__,
                           "peak_tflops": peak},
               "date": C.now_iso(), "command": " ".join(sys.argv)}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json}")


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
