"""The plots of the benchmark pages (``docs/images/bench_*.png``): step time and peak memory against
FSDP2, what is live at the peak, memory and step time at scale, the strategies' step ratios and the
memory estimate's error, drawn from the same JSON as the tables.

They are the only part of the report that needs matplotlib (the ``bench`` extra,
``pip install -e '.[bench]'``), imported inside the functions, so the tables render and
``benchmarks/report.py --check`` / ``--no-plots`` run without it.
"""

from __future__ import annotations

import os

from _report_data import FRAMEWORKS, GiB, MiB, REPO, case_name, load

IMAGES = os.path.join(REPO, "docs", "images")
COLORS = {"mfsdp2": "#1f77b4", "fsdp2_tuned": "#ff7f0e", "fsdp2": "#bbbbbb"}


def _save(fig, name: str) -> str:
    os.makedirs(IMAGES, exist_ok=True)
    path = os.path.join(IMAGES, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


PEAK_CATEGORIES = (("weights (sharded)", "#1f77b4"), ("gathered weights", "#aec7e8"), ("gradients", "#ff7f0e"),
                   ("reduction buffers", "#ffbb78"), ("optimizer state", "#2ca02c"), ("activations", "#d62728"),
                   ("temporaries", "#9467bd"), ("mfsdp2 allocator blocks", "#8c564b"))
_PEAK_MAP = {"Parameter": "weights (sharded)", "Sharded Param": "weights (sharded)",
             "Unsharded Param": "gathered weights", "All Gather": "gathered weights",
             "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
             "Reduce Scatter": "reduction buffers", "Optstate": "optimizer state", "OptState": "optimizer state",
             "Activation": "activations", "Temp": "temporaries", "Other": "mfsdp2 allocator blocks"}


def _peak_categories(breakdown: dict) -> dict:
    out: dict = {}
    for k, v in breakdown.items():
        if k != "Total":
            name = _PEAK_MAP.get(k, "temporaries")
            out[name] = out.get(name, 0) + v
    return out


def _grouped_bars(ax, labels: list[str], series: list[tuple[str, str, list[float]]], ylabel: str) -> None:
    n = len(series)
    width = 0.8 / n
    for j, (label, color, vals) in enumerate(series):
        xs = [i + (j - (n - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, vals, width, label=label, color=color)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    _legend_outside(ax)
    ax.grid(axis="y", alpha=0.3)


def _legend_outside(ax, **kw) -> None:
    """The legend beside the axes, never over the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8, **kw)


def plot_compare(fig_fn) -> list[str]:
    d = load("compare")
    if d is None:
        return []
    labels = [case_name(c).replace("_no_reshard", " nr") for c in d["cases"]]
    out = []
    fig, (a, b) = fig_fn(1, 2, figsize=(12, 4.5))
    _grouped_bars(a, labels, [(lab, COLORS[k], [c[k]["step_s_median"] / c["fsdp2_tuned"]["step_s_median"]
                                                for c in d["cases"]]) for k, lab in FRAMEWORKS],
                  "step time / FSDP2 tuned")
    a.axhline(0.8, color="k", ls="--", lw=0.8)
    a.set_title("Step time (lower is better; dashed: 0.8 goal)")
    _grouped_bars(b, labels, [(lab, COLORS[k], [c[k]["peak_tensor_bytes"] / MiB for c in d["cases"]])
                              for k, lab in FRAMEWORKS], "peak tensor memory, MiB")
    b.set_yscale("log")
    b.set_title("Peak tensor memory per rank")
    out.append(_save(fig, "bench_compare.png"))

    # What is live at the peak, by the trackers' categories mapped onto common names, for the two
    # larger models (FSDPMemTracker names FSDP2's buffers by role, MemTracker mfsdp2's by kind).
    cases = [c for c in d["cases"] if c["config"] == "fp32" and c["model"] in ("mlp", "llama")]
    fig, axes = fig_fn(1, len(cases), figsize=(6 * len(cases), 4.5))
    for ax, c in zip(axes if len(cases) > 1 else [axes], cases):
        stacks = [_peak_categories(c[k]["peak_tensor_breakdown_rank0"]) for k, _ in FRAMEWORKS]
        bottoms = [0.0] * len(FRAMEWORKS)
        for cat, color in PEAK_CATEGORIES:
            vals = [st.get(cat, 0) / MiB for st in stacks]
            ax.bar(range(len(FRAMEWORKS)), vals, bottom=bottoms, label=cat, color=color)
            bottoms = [x + y for x, y in zip(bottoms, vals)]
        ax.set_ylim(0, max(bottoms) * 1.3)
        ax.set_xticks(range(len(FRAMEWORKS)))
        ax.set_xticklabels([lab for _, lab in FRAMEWORKS])
        ax.set_ylabel("MiB at the peak (rank 0)")
        ax.set_title(f"{case_name(c)}: what is live at the peak")
        _legend_outside(ax)
    out.append(_save(fig, "bench_peak_breakdown.png"))
    return out


def plot_scale(fig_fn) -> list[str]:
    d = load("scale")
    if d is None:
        return []
    out = []
    fig, (a, b) = fig_fn(1, 2, figsize=(12, 4.5))
    for model in sorted({x["model"] for x in d["memory"]}, key=lambda m: int(m.rstrip("B"))):
        pts = sorted((x["shard_group"], x["total_bytes"] / GiB, x["formula_bytes"] / GiB)
                     for x in d["memory"] if x["model"] == model and len(x["mesh"]) == 1)
        line, = a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"Llama-3 {model}")
        a.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=line.get_color())
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("ranks (1-D mesh)")
    a.set_ylabel("GiB per rank")
    a.set_title("Memory per rank (dotted: 16 P / N + 6 P_u)")
    _legend_outside(a)
    a.grid(alpha=0.3)
    for layers in sorted({x["layers"] for x in d["steps"]}):
        pts = sorted((x["mesh"][0], x) for x in d["steps"] if x["layers"] == layers and len(x["mesh"]) == 1)
        ns = [p[0] for p in pts]
        line, = b.plot(ns, [p[1]["step_s"] * 1e3 for p in pts], "o-", label=f"{layers} layers: step")
        b.plot(ns, [p[1]["own_s"] * 1e3 for p in pts], "s--", color=line.get_color(), label=f"{layers} layers: own")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("ranks (fake process group)")
    b.set_ylabel("ms per step")
    b.set_title("Narrow model: step and mfsdp2's own time")
    _legend_outside(b)
    b.grid(alpha=0.3)
    out.append(_save(fig, "bench_scale.png"))
    return out


def plot_misc(fig_fn) -> list[str]:
    out = []
    s, fp8, est = load("strategies"), load("fp8"), load("estimate")
    if s is not None:
        fig, ax = fig_fn(figsize=(10, 4.5))
        xs = [f"{x['case'].split('/')[0]}: {x['comparison']}" for x in s["comparisons"]]
        ax.barh(range(len(xs)), [x["step_ratio"] for x in s["comparisons"]], color=COLORS["mfsdp2"])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(range(len(xs)))
        ax.set_yticklabels(xs, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("step time ratio (below 1: mfsdp2 faster)")
        ax.set_title("Sharding strategies vs their torch counterparts")
        out.append(_save(fig, "bench_strategies.png"))
    if est is not None:
        fig, ax = fig_fn(figsize=(10, 4.5))
        names = list(dict.fromkeys(f"{c['model']}/{c['config']}" for c in est["cases"]))
        sizes = sorted({c["world_size"] for c in est["cases"]})
        err = {(f"{c['model']}/{c['config']}", c["world_size"]): c["estimate_error"] * 100 for c in est["cases"]}
        palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
        _grouped_bars(ax, names, [(f"world size {ws}", palette[i % 4], [err.get((n, ws), 0.0) for n in names])
                                  for i, ws in enumerate(sizes)], "(estimate - measured) / measured, %")
        ax.axhline(1.0, color="k", ls="--", lw=0.8)
        ax.axhline(-1.0, color="k", ls="--", lw=0.8)
        ax.set_title("estimate_memory error against the measured peak (dashed: the 1 % goal)")
        out.append(_save(fig, "bench_estimate.png"))
    if fp8 is not None:
        pass  # the FP8 table's quartiles say what a plot would
    return out


def plot_all() -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9})
    return plot_compare(plt.subplots) + plot_scale(plt.subplots) + plot_misc(plt.subplots)
