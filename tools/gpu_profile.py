"""One profiled training step of two mfsdp2 ranks sharing one GPU, summarised: mfsdp2's named
ranges, the device work per stream, and how much of the side streams' work overlaps the compute
stream's kernels.

Why: the stream design (all-gathers and reductions on side streams, ordered by events) is only
worth its complexity if the collectives' device work really runs beside the compute; a profile of
one step says it without nsys (which the lent machine cannot write reports with). The two ranks
talk over gloo with CUDA tensors (NCCL refuses two ranks on one GPU): gloo moves the data through
host memory on its own threads and streams, so the *amounts* are not NCCL's, but the ordering --
what waits for what, and which stream each piece of work lands on -- is mfsdp2's.

``python tools/gpu_profile.py --out DIR`` writes ``profile_summary.json`` (and rank 0's Chrome
trace, ``profile_rank0.json``, to open in Perfetto; not meant to be committed). Without CUDA it
profiles the same step on the CPU: the ranges are there, the device part is empty
(``tests/project/test_gpu_profile.py``). ``tools/gpu_check.py`` runs it as its ``profile`` step.

The summary (:func:`summarise`, a pure function of the profile's events):

* ``ranges``: how many ``mfsdp2.*`` ranges of each kind (``mfsdp2.unshard``, ``mfsdp2.reduce``...);
* ``streams``: per device stream, kernels / memory copies and busy milliseconds; the *compute
  stream* is the one with the most kernel time;
* ``overlap_ms``: the time during which some other stream was busy while the compute stream ran a
  kernel (interval intersection of the two unions), and ``overlap_fraction`` = that / the other
  streams' busy time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterable, NamedTuple, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DeviceEvent(NamedTuple):
    name: str
    stream: int
    start_ns: int
    end_ns: int
    kind: str  # "kernel" or "memcpy" (memcpy / memset)


def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _intersection_ns(x: list[tuple[int, int]], y: list[tuple[int, int]]) -> int:
    i = j = total = 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarise(range_names: Iterable[str], device_events: Iterable[DeviceEvent]) -> dict:
    """The summary of one profiled step (see the module docstring)."""
    ranges: dict[str, int] = {}
    for name in range_names:
        if name.startswith("mfsdp2."):
            kind = name.split(" ", 1)[0]
            ranges[kind] = ranges.get(kind, 0) + 1
    streams: dict[int, dict] = {}
    busy: dict[int, list] = {}
    kernel_busy: dict[int, list] = {}
    for e in device_events:
        s = streams.setdefault(e.stream, {"kernels": 0, "memcpy": 0, "busy_ms": 0.0, "kernel_ms": 0.0})
        s["kernels" if e.kind == "kernel" else "memcpy"] += 1
        busy.setdefault(e.stream, []).append((e.start_ns, e.end_ns))
        if e.kind == "kernel":
            kernel_busy.setdefault(e.stream, []).append((e.start_ns, e.end_ns))
    for sid, iv in busy.items():
        streams[sid]["busy_ms"] = sum(b - a for a, b in _union(iv)) / 1e6
        streams[sid]["kernel_ms"] = sum(b - a for a, b in _union(kernel_busy.get(sid, []))) / 1e6
    compute: Optional[int] = max(streams, key=lambda s: streams[s]["kernel_ms"]) if streams else None
    others = _union(iv for sid, ivs in busy.items() if sid != compute for iv in ivs)
    compute_kernels = _union(kernel_busy.get(compute, [])) if compute is not None else []
    side_ns = sum(b - a for a, b in others)
    overlap_ns = _intersection_ns(others, compute_kernels)
    return {
        "ranges": dict(sorted(ranges.items())),
        "streams": {str(k): v for k, v in sorted(streams.items())},
        "compute_stream": compute,
        "side_busy_ms": side_ns / 1e6,
        "overlap_ms": overlap_ns / 1e6,
        "overlap_fraction": overlap_ns / side_ns if side_ns else None,
    }


def events_of(prof) -> tuple[list[str], list[DeviceEvent]]:
    """``(CPU range names, device events)`` of a finished ``torch.profiler.profile``."""
    import torch

    names, device = [], []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CPU:
            names.append(e.name())
            continue
        name = e.name()
        kind = "memcpy" if ("Memcpy" in name or "Memset" in name or "memcpy" in name) else "kernel"
        device.append(DeviceEvent(name, int(e.device_resource_id()), int(e.start_ns()), int(e.end_ns()), kind))
    return names, device


def _rank(rank: int, ws: int, device: str, out: str, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tests import models
    from tests._dist import world_mesh

    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
    torch.manual_seed(0)
    model = models.Net(d_in=256, d=512, hidden=2048, d_out=16, n_blocks=4).to(device)
    mesh = world_mesh(device)  # gloo asserted: both ranks share the one GPU
    models.shard_blocks(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device=device)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(steps):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    if rank == 0:
        prof.export_chrome_trace(os.path.join(out, "profile_rank0.json"))
    names, events = events_of(prof)
    return summarise(names, events)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu-check-results"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="profile on the CPU even where CUDA is available")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the two ranks to finish")
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    import torch

    from tests._dist import run_ranks

    device = "cuda" if torch.cuda.is_available() and not a.cpu else "cpu"
    os.makedirs(a.out, exist_ok=True)
    per_rank = run_ranks(_rank, 2, device, a.out, a.warmup, timeout=a.timeout)
    summary = {"device": device, "world_size": 2, "ranks": per_rank}
    with open(os.path.join(a.out, "profile_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    r0 = per_rank[0]
    sys.stdout.write(
        f"gpu_profile ({device}): ranges {r0['ranges']}; side streams busy {r0['side_busy_ms']:.2f} ms, "
        f"{r0['overlap_ms']:.2f} ms of it beside compute kernels\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
