"""gloo's reduce-scatter vs a ring reduce-scatter built from point-to-point steps (CPU, gloo).

    python benchmarks/ring_reduce_scatter.py [--world-sizes 2,4] [--sizes-mib 1,2,4,8,16,32,64]
                                             [--iters N] [--json PATH] [--no-all-gather]

gloo runs ``reduce_scatter_tensor`` / ``reduce_scatter_single`` as an all-reduce of a clone of the
whole input followed by a copy of this rank's chunk: twice the bytes of a true reduce-scatter, plus a
full-size allocation and copy on the calling thread. A ring reduce-scatter moves ``(N-1)/N`` of the
input per rank in ``N-1`` steps: at step ``s`` rank ``r`` sends its running sum of chunk
``(r-s-1) mod N`` to rank ``r+1`` (``isend``) while receiving the running sum of chunk
``(r-s-2) mod N`` from rank ``r-1`` (``irecv``) and adds its own copy of that chunk; after ``N-1``
steps it holds the full sum of chunk ``r``. Buffers are allocated once, outside the timing.

Variants timed (alternating every iteration, order reversed every other round, a barrier before
each op; the time of an op is the max over ranks; medians over iterations):

* ``gloo_rs``: ``dist.reduce_scatter_single(out, inp, op=AVG)`` -- what mfsdp2 and FSDP2 call;
* ``ring_rs``: the p2p ring above (AVG: one division of the output chunk);
* ``gloo_ar_inplace``: ``dist.all_reduce(inp)`` in place then copy this rank's chunk -- the same
  bytes as gloo_rs without the clone, legal whenever the input is scratch (as the flat gradient
  buffer is);

and, unless ``--no-all-gather``, for the all-gather of the same full size:

* ``gloo_ag``: ``dist.all_gather_single(out, out[chunk r])`` (in place, like mfsdp2);
* ``ring_ag``: a p2p ring (``N-1`` steps) receiving straight into the output's chunks.

Sizes are the full (unsharded) buffer in MiB of fp32. Results are measured, not integrated.
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


class RingReduceScatter:
    """Ring reduce-scatter of ``inp`` (N equal chunks) into ``out`` with isend/irecv; AVG or SUM."""

    def __init__(self, numel: int, dtype: torch.dtype, rank: int, ws: int):
        self.rank, self.ws = rank, ws
        self.chunk = numel // ws
        self.recv = torch.empty(self.chunk, dtype=dtype)
        self.acc = [torch.empty(self.chunk, dtype=dtype), torch.empty(self.chunk, dtype=dtype)]

    def __call__(self, out: torch.Tensor, inp: torch.Tensor, avg: bool = True) -> None:
        r, n, c = self.rank, self.ws, self.chunk
        right, left = (r + 1) % n, (r - 1) % n
        send = inp[((r - 1) % n) * c:((r - 1) % n + 1) * c]
        for s in range(n - 1):
            idx = (r - s - 2) % n
            reqs = [dist.isend(send, right), dist.irecv(self.recv, left)]
            for q in reqs:
                q.wait()
            dst = out if s == n - 2 else self.acc[s % 2]
            torch.add(self.recv, inp[idx * c:(idx + 1) * c], out=dst)
            send = dst
        if avg:
            out.div_(n)


class RingAllGather:
    """Ring all-gather into ``out`` (chunk ``r`` already holds this rank's shard) with isend/irecv."""

    def __init__(self, rank: int, ws: int):
        self.rank, self.ws = rank, ws

    def __call__(self, out: torch.Tensor) -> None:
        r, n = self.rank, self.ws
        c = out.numel() // n
        right, left = (r + 1) % n, (r - 1) % n
        for s in range(n - 1):
            si, ri = (r - s) % n, (r - s - 1) % n
            reqs = [dist.isend(out[si * c:(si + 1) * c], right), dist.irecv(out[ri * c:(ri + 1) * c], left)]
            for q in reqs:
                q.wait()


def worker(rank: int, ws: int, sizes_mib: list[int], iters: int, all_gather: bool) -> list[dict]:
    results = []
    dtype = torch.float32
    for mib in sizes_mib:
        numel = (mib * 2**20 // 4) // ws * ws
        c = numel // ws
        g = torch.Generator().manual_seed(rank)
        src = torch.randn(numel, generator=g)
        inp = src.clone()
        out = torch.empty(c, dtype=dtype)
        ring = RingReduceScatter(numel, dtype, rank, ws)
        ag_out = torch.empty(numel, dtype=dtype)
        ring_ag = RingAllGather(rank, ws)

        # correctness: ring == gloo
        ref = torch.empty(c, dtype=dtype)
        dist.reduce_scatter_single(ref, src.clone(), op=dist.ReduceOp.AVG)
        ring(out, src)
        rs_ok = torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
        ag_out.zero_()
        ag_out[rank * c:(rank + 1) * c].copy_(src[:c])
        ring_ag(ag_out)
        ag_ref = torch.empty(numel, dtype=dtype)
        dist.all_gather_single(ag_ref, src[:c].clone())
        ag_ok = torch.equal(ag_out, ag_ref)

        def gloo_rs():
            dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.AVG)

        def ring_rs():
            ring(out, inp)

        def gloo_ar_inplace():
            dist.all_reduce(inp, op=dist.ReduceOp.AVG)
            out.copy_(inp[rank * c:(rank + 1) * c])

        def gloo_ag():
            dist.all_gather_single(ag_out, ag_out[rank * c:(rank + 1) * c])

        def ring_ag_fn():
            ring_ag(ag_out)

        variants = [("gloo_rs", gloo_rs), ("ring_rs", ring_rs), ("gloo_ar_inplace", gloo_ar_inplace)]
        if all_gather:
            variants += [("gloo_ag", gloo_ag), ("ring_ag", ring_ag_fn)]
        times: dict[str, list[float]] = {k: [] for k, _ in variants}
        for k, fn in variants:  # warm-up
            fn()
        for i in range(iters):
            order = variants if i % 2 == 0 else list(reversed(variants))
            for k, fn in order:
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        results.append({"mib": mib, "numel": numel, "times": times, "rs_ok": rs_ok, "ag_ok": ag_ok})
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="2,4", help="comma list (default 2,4)")
    p.add_argument("--sizes-mib", default="1,2,4,8,16,32,64", help="full buffer sizes in MiB (fp32)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per size (default 15; 9 at ws>2)")
    p.add_argument("--no-all-gather", action="store_true", help="skip the all-gather variants")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes_mib.split(",")]
    out = {"machine": C.machine_info(), "date": C.now_iso(),
           "command": "python " + " ".join([os.path.relpath(sys.argv[0], C.REPO)] + sys.argv[1:]), "runs": []}
    for ws in [int(w) for w in a.world_sizes.split(",")]:
        iters = a.iters or (15 if ws <= 2 else 9)
        t0 = time.time()
        per_rank = C.run_ranks(worker, ws, sizes, iters, not a.no_all_gather, timeout=1800)
        rows = []
        run = {"world_size": ws, "iters": iters, "sizes": []}
        for i, mib in enumerate(sizes):
            r0 = per_rank[0][i]
            med = {k: statistics.median(C.max_over_ranks([pr[i]["times"][k] for pr in per_rank]))
                   for k in r0["times"]}
            ok = all(pr[i]["rs_ok"] and pr[i]["ag_ok"] for pr in per_rank)
            run["sizes"].append({"mib": mib, "median_s": med, "correct": ok})
            gb = lambda k: mib * 2**20 / med[k] / 1e9  # noqa: E731  (full-buffer GB/s)
            row = [f"{mib}", f"{med['gloo_rs']*1e3:.2f}", f"{med['ring_rs']*1e3:.2f}",
                   f"{med['gloo_ar_inplace']*1e3:.2f}", f"{med['gloo_rs'] / med['ring_rs']:.2f}x",
                   "ring" if med["ring_rs"] < med["gloo_rs"] else "gloo"]
            if "gloo_ag" in med:
                row += [f"{med['gloo_ag']*1e3:.2f}", f"{med['ring_ag']*1e3:.2f}",
                        f"{med['gloo_ag'] / med['ring_ag']:.2f}x"]
            row += [f"{gb('gloo_rs'):.2f}/{gb('ring_rs'):.2f}", "yes" if ok else "NO"]
            rows.append(row)
        out["runs"].append(run)
        print(f"\nworld size {ws}, fp32, {iters} alternating iterations, median ms (max over ranks); "
              f"{time.time() - t0:.0f}s")
        hdr = ["MiB", "gloo_rs", "ring_rs", "gloo_ar_inplace", "gloo/ring", "faster RS"]
        if not a.no_all_gather:
            hdr += ["gloo_ag", "ring_ag", "gloo/ring AG"]
        hdr += ["RS GB/s gloo/ring", "ring correct"]
        C.print_table(hdr, rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
