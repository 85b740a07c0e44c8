"""``MemoryEstimate``: what :func:`mfsdp2.estimate_memory` returns -- per-rank bytes by category
at the predicted peak, the sizes of every kind of buffer, and a readable table / JSON form."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["MemoryEstimate", "AT_PEAK_ORDER"]

# The categories of ``MemoryEstimate.at_peak``, in the table's order.
AT_PEAK_ORDER = (
    "model_weights",  # full weights kept by ZeRO-1/2/no_shard (compute dtype)
    "main_weights",  # the sharded weights the optimizer updates
    "optimizer_states",  # over this rank's rows (+ step tensors)
    "buffers",  # module buffers (not sharded)
    "inputs",  # the step's inputs
    "gathered_weights",  # ZeRO-3 units gathered at the peak (current + prefetched + kept), FP8 bytes, partial shards
    "main_grads",  # main gradients alive at the peak
    "reduction_buffers",  # flat gradients, reduce-scatter outputs / receive scratch, all-reduce buckets
    "activations",  # the trace's bytes: saved activations, autograd's gradients, temporaries
    "optimizer_temporaries",  # when the peak is the optimizer step
    "allocator_slack",  # what the runtime's allocator holds beyond its live blocks
)

_ROLE_CATEGORY = {
    "weight": "gathered_weights", "fp8": "gathered_weights", "staging": "gathered_weights",
    "main_grad": "main_grads",
    "grad": "reduction_buffers", "rs_out": "reduction_buffers", "rs_recv": "reduction_buffers",
    "grad_bucket": "reduction_buffers",
}


def _fmt(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class MemoryEstimate:
    """Per-rank memory of one training step under mfsdp2, predicted before launch.

    ``peak_bytes``: the predicted peak on the compute device of rank ``rank`` (the rank that
    holds the most); ``at_peak``: the same bytes by category (they sum to ``peak_bytes``);
    ``peak_at``: the moment of the step it happens; ``sizes``: the full size of each kind of buffer
    whatever is alive at the peak (the exact per-rank bytes of the parameter categories, the
    largest unit's gathered weights and flat gradient); ``host``: what ``CPUOffloadPolicy`` keeps in
    host memory; ``units``: per unit, its layout and buffers; ``config``: what was estimated."""

    peak_bytes: int
    at_peak: dict[str, int]
    peak_at: str
    sizes: dict[str, int]
    host: dict[str, int]
    units: list[dict[str, Any]]
    config: dict[str, Any]
    rank: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), indent=kw.pop("indent", 1), default=str, **kw)

    def __str__(self) -> str:
        c = self.config
        mesh = "x".join(str(x) for x in c.get("mesh_shape", ()))
        lines = [
            f"mfsdp2 memory estimate: rank {self.rank} of mesh {mesh}, {c.get('strategy')}, "
            f"{c.get('precision')}, {c.get('optimizer')}, prefetch {c.get('prefetch_depth')}, "
            f"allocator {c.get('allocator')}, {c.get('device')}"
            + (f", expert parallel {c['expert_parallel']}" if c.get("expert_parallel", 1) > 1 else ""),
            f"predicted peak: {_fmt(self.peak_bytes)} ({self.peak_bytes:,} B) at {self.peak_at}",
            "",
            f"{'at the peak':<24}{'bytes':>18}{'':>14}{'share':>8}",
        ]
        for k in AT_PEAK_ORDER:
            v = self.at_peak.get(k, 0)
            if v:
                lines.append(f"{k:<24}{v:>18,}{_fmt(v):>14}{100 * v / max(self.peak_bytes, 1):>7.1f}%")
        lines += ["", f"{'buffer sizes (per rank)':<24}{'bytes':>18}{'':>14}"]
        for k, v in self.sizes.items():
            lines.append(f"{k:<24}{v:>18,}{_fmt(v):>14}")
        if any(self.host.values()):
            lines += ["", "host memory (CPU offload)"]
            for k, v in self.host.items():
                if v:
                    lines.append(f"{k:<24}{v:>18,}{_fmt(v):>14}")
        if self.units:
            lines += ["", f"{'unit':<20}{'params':>14}{'shard elems':>14}{'padding':>10}"
                          f"{'gathered':>14}{'flat grad':>14}"]
            shown = self.units if len(self.units) <= 12 else self.units[:5] + [None] + self.units[-5:]
            for u in shown:
                if u is None:
                    lines.append(f"{'...':<20}")
                    continue
                lines.append(f"{u['name'][:19]:<20}{u['params']:>14,}{u['shard_numel']:>14,}{u['padding']:>10,}"
                             f"{_fmt(u['gathered_bytes']):>14}{_fmt(u['flat_grad_bytes']):>14}")
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)
