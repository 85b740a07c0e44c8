"""What a benchmark reports: mfsdp2's persistent bytes and padding of a sharded model, statistics
over timed steps (median, p10 / p90, the max over ranks), byte formatting and the text tables.
"""

from __future__ import annotations

import statistics
from typing import Optional

import torch.nn as nn


# --------------------------------------------------------------------------------------------
# mfsdp2 byte counts
# --------------------------------------------------------------------------------------------


def mfsdp2_groups(model: nn.Module) -> list:
    gs = []
    for m in model.modules():
        st = getattr(m, "_mfsdp2_state", None)
        if st is not None:
            gs.extend(st.groups)
    return gs


def mfsdp2_persistent_bytes(model: nn.Module) -> dict:
    """Bytes of mfsdp2's persistent shards: main weights, model-weight shards (when a separate
    tensor)."""
    main_w = model_w = 0
    for g in mfsdp2_groups(model):
        main_w += g.main_weight.numel() * g.main_weight.element_size()
        sh = g.weights.shard
        if sh.untyped_storage().data_ptr() != g.main_weight.untyped_storage().data_ptr():
            model_w += sh.numel() * sh.element_size()
    # Main grads are blocks of mfsdp2's allocator (counted in its peak), not persistent.
    return {"main_weight": main_w, "model_weight_shard": model_w, "total": main_w + model_w}


def mfsdp2_padding(model: nn.Module) -> float:
    """Padding fraction of mfsdp2's flat buffers: total / sum(param numel) - 1."""
    tot = used = 0
    for g in mfsdp2_groups(model):
        tot += g.layout.total_numel
        used += sum(s.numel for s in g.layout.slots)
    return tot / used - 1 if used else 0.0


# --------------------------------------------------------------------------------------------
# statistics and reporting
# --------------------------------------------------------------------------------------------


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize_times(ts: list[float]) -> dict:
    return {
        "median": statistics.median(ts) if ts else float("nan"),
        "p10": quantile(ts, 0.1),
        "p90": quantile(ts, 0.9),
        "n": len(ts),
    }


def max_over_ranks(per_rank: list[list[float]]) -> list[float]:
    return [max(v) for v in zip(*per_rank)]


def fmt_bytes(n: Optional[float]) -> str:
    if n is None or n != n:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    line = " | ".join(str(h).ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))
