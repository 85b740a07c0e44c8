"""What sharding a weight on dim 1 instead of dim 0 costs (CPU, gloo, world size 2).

    python benchmarks/shard_dim.py [--iters 5] [--json PATH]

Two benchmark-sized weights, each one unit (the root, ``reshard_after_forward=True``, so every
step gathers in forward and again in backward), sharded with ``shard_placement_fn`` returning
``Shard(0)`` or ``Shard(1)``, by mfsdp2 and by torch FSDP2:

* ``ffn``: a Llama-3-8B FFN projection, ``nn.Linear(4096, 14336, bias=False)`` (fp32, 235 MB);
* ``experts``: torchtitan-shaped expert weights ``w1 (8, 1024, 2816)`` and ``w2 (8, 2816, 1024)``
  (fp32, 185 MB), every token through every expert with ``torch.bmm``.

Timed per iteration (after a barrier; max over ranks; medians): ``unshard`` -- ``unshard()`` then
``reshard()``: the all-gather and, for FSDP2, the copy-out into the unsharded parameters --, and a
whole training ``step`` (forward and backward of 64 tokens, both gathers, the gradient's
reduce-scatter; no optimizer). ``peak`` is the rank's RSS high-water mark during one step above its
RSS before it (VmHWM after ``clear_refs``): the transient bytes of gathers, copies and gradients.

Where the two dims differ in mfsdp2: nothing in the gather (same flat bytes, no copy either way;
the dim-1 parameter is a strided view). In compute: a dim-1 ``Linear`` weight is the transpose of
its contiguous storage, which GEMM reads natively; a dim-1 expert weight has a batch stride BLAS
cannot take, and autograd hands back gradients laid out like the parameter. FSDP2 copies a dim-1
parameter out of its gather output (``chunk_cat``) and its gradient back before the reduce-scatter.
Results are measured, not integrated (the machine is shared: see the quiet fraction printed).
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


class Experts(nn.Module):
    def __init__(self, experts: int = 8, dim: int = 1024, hidden: int = 2816):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * hidden**-0.5)

    def forward(self, x):
        xs = x.unsqueeze(0).expand(self.w1.shape[0], *x.shape)
        return torch.bmm(F.silu(torch.bmm(xs, self.w1)), self.w2).mean(0)


def _model(case: str) -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    if case == "ffn":
        return nn.Linear(4096, 14336, bias=False), 4096
    return Experts(), 1024


def _time(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def worker(rank: int, ws: int, iters: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_shard

    import mfsdp2

    mesh = init_device_mesh("cpu", (ws,))
    libs = {"mfsdp2": mfsdp2.fully_shard, "fsdp2": torch_shard}
    results = []
    for case in ("ffn", "experts"):
        for dim in (0, 1):
            for lib, shard in libs.items():
                results.append(_measure(rank, iters, mesh, case, dim, lib, shard))
                C.malloc_trim()  # after _measure returned: its model is no longer referenced
    return results


def _measure(rank: int, iters: int, mesh, case: str, dim: int, lib: str, shard) -> dict:
    from torch.distributed.tensor import Shard

    model, d_in = _model(case)
    shard(model, mesh=mesh, reshard_after_forward=True, shard_placement_fn=lambda p, d=dim: Shard(d))
    x = torch.randn(TOKENS, d_in, generator=torch.Generator().manual_seed(rank))

    def unshard():
        model.unshard()
        model.reshard()

    def step():
        model(x).sum().backward()
        for p in model.parameters():
            p.grad = None

    step()  # warm-up (lazy init, allocator caches)
    unshard()
    C.reset_peak_rss()
    base = C.rss_bytes()
    step()
    peak = C.peak_rss_bytes() - base
    t_unshard = _time(unshard, iters)
    t_step = _time(step, iters)
    up = next(iter(model.parameters()))
    return dict(
        case=case, dim=dim, lib=lib, unshard=t_unshard, step=t_step, peak=peak,
        placement=repr(up.placements[0]),
    )


def compute_only(iters: int) -> list[dict]:
    """One process, no collectives: forward + backward of each weight as mfsdp2 presents it after
    a gather -- ``Shard(0)``: a contiguous view of the buffer; ``Shard(1)``: the strided view of
    its dim-1-first storage -- and the gradient packed into a flat buffer in storage order (what
    the reduction reads). Variants alternate every iteration (order reversed every other one), so
    the machine's load hits both alike; medians."""
    from mfsdp2.dtensors.shard_dim import from_storage, storage_flat, storage_shape

    torch.set_num_threads(1)
    out = []
    for case in ("ffn", "experts"):
        model, d_in = _model(case)
        x = torch.randn(TOKENS, d_in, generator=torch.Generator().manual_seed(0))
        variants = {}
        for dim in (0, 1):
            params = {}
            for name, p in model.named_parameters():
                buf = torch.empty(p.numel())
                view = from_storage(buf.view(storage_shape(p.shape, dim)), dim)
                with torch.no_grad():
                    view.copy_(p)
                params[name] = nn.Parameter(view)
            flat = {name: torch.empty(p.numel()) for name, p in params.items()}

            def run(params=params, flat=flat, dim=dim):
                y = torch.func.functional_call(model, params, (x,))
                y.sum().backward()
                for name, p in params.items():
                    flat[name].copy_(storage_flat(p.grad, dim))
                    p.grad = None

            variants[dim] = run
            run()
        times = {0: [], 1: []}
        for i in range(iters):
            for dim in ((0, 1) if i % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                variants[dim]()
                times[dim].append(time.perf_counter() - t0)
        for dim in (0, 1):
            out.append(dict(case=case, dim=dim, step_s=statistics.median(times[dim])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compute-only", action="store_true", help="the single-process compute comparison only")
    args = ap.parse_args()
    if args.compute_only:
        res = compute_only(args.iters)
        C.print_table(["weight", "placement", "fwd+bwd+pack ms"],
                      [[r["case"], f"Shard({r['dim']})", f"{r['step_s'] * 1e3:.1f}"] for r in res])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(machine=C.machine_info(), when=C.now_iso(), iters=args.iters, results=res), f, indent=1)
        return
    ws = 2
    quiet = C.wait_until_quiet(60)
    per_rank = C.run_ranks(worker, ws, args.iters)
    rows, out = [], []
    for i, r0 in enumerate(per_rank[0]):
        rs = [pr[i] for pr in per_rank]
        unshard = statistics.median(C.max_over_ranks([r["unshard"] for r in rs]))
        step = statistics.median(C.max_over_ranks([r["step"] for r in rs]))
        peak = max(r["peak"] for r in rs)
        out.append(dict(case=r0["case"], dim=r0["dim"], lib=r0["lib"], unshard_s=unshard, step_s=step, peak_bytes=peak,
                        placement=r0["placement"]))
        rows.append([r0["case"], f"Shard({r0['dim']})", r0["lib"], f"{unshard * 1e3:.1f}", f"{step * 1e3:.1f}",
                     C.fmt_bytes(peak)])
    print(f"other processes used {quiet:.0%} of the CPUs before the run")
    C.print_table(["weight", "placement", "runtime", "unshard+reshard ms", "step ms", "step peak RSS"], rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=C.machine_info(), when=C.now_iso(), iters=args.iters, quiet=quiet, results=out), f,
                      indent=1)


if __name__ == "__main__":
    main()
