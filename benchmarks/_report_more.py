"""The generated tables of docs/benchmarks_more.md: mfsdp2's parts measured on their own (host time
per unit, allocators, the flat AdamW step, native kernels, gradient clipping, the memory estimate)
and its scaling (memory and step time at many ranks, the alpha-beta model, sharding dimensions).

Each ``block_*`` renders one ``<!-- report:NAME -->`` block of that page from the JSON named in
``_report_data.SOURCES``; these are the figures besides the comparison with FSDP2
(``_report_compare``). :func:`optimizer_summary` is shared with the scorecard (``_report_goals``).
No matplotlib.
"""

from __future__ import annotations

from typing import Optional

from _report_data import GiB, SOURCES, load, md, mib, missing, ms, r2, run_line


def block_phases_host() -> str:
    """Framework host time per unit per step (world size 1: collectives are local copies)."""
    d = load("phases_host")
    if d is None:
        return missing("phases_host")
    res = d["results"]
    ref = res.get("fsdp2_tuned") or res.get("fsdp2")
    rows = [[k, ms(v["fwd_bwd_min_s"], 2), f"{v['per_unit_us']:.0f}", r2(v["per_unit_us"] / ref["per_unit_us"])]
            for k, v in res.items() if k != "plain"]
    head = (f"Plain module: forward + backward {ms(res['plain']['fwd_bwd_min_s'], 2)} ms (min over the timed "
            "steps). Host time per unit = (forward + backward - plain's) / units.")
    return "\n".join([head, "", md(["framework", "forward + backward ms", "host us per unit", "/ FSDP2 tuned"], rows),
                      "", run_line("phases_host", d)])


def block_allocators() -> str:
    rows = []
    lines = []
    for key in ("allocators_mlp", "allocators_llama"):
        d = load(key)
        if d is None:
            lines.append(missing(key))
            continue
        for i, c in enumerate(d["cases"]):
            fw = c["framework"]
            mine = fw.startswith("mfsdp2")
            rows.append([f"{d['model']}/{d['config']}" if i == 0 else "", fw,
                         f"{ms(c['step_s_median'])} ({ms(c['step_s_p10'])}-{ms(c['step_s_p90'])})",
                         r2(c["step_ratio_vs_fsdp2"]),
                         f"{c['underlying_allocations_per_step']:g}" if mine else "n/a",
                         mib(c["transient_peak_bytes"]) if mine else "n/a", mib(c["held_bytes"]) if mine else "n/a",
                         mib(c["peak_rss_over_idle_bytes"]), r2(c["rss_ratio_vs_fsdp2"])])
        lines.append(run_line(key, d))
    hdr = ["case", "allocator", "step ms (p10-p90)", "step / FSDP2 default", "allocations from torch / step",
           "transient peak MiB", "held between steps MiB", "peak RSS over idle MiB", "RSS / FSDP2 default"]
    return md(hdr, rows) + "\n\n" + "\n".join(lines)


def optimizer_summary(d: dict) -> Optional[dict]:
    s = d.get("summary")
    return s if s and s.get("ours_s") else None


def block_optimizer() -> str:
    d = load("optimizer")
    if d is None:
        return missing("optimizer")
    med = d["median_s"]
    impls = [k.split(" ", 1)[1] for k in med if k.startswith("FSDP2 ")]
    rows = []
    for impl in impls:
        a, b, c = med.get(f"mfsdp2 {impl}"), med.get(f"FSDP2 {impl}"), med.get(f"flat {impl}")
        rows.append([f"torch AdamW {impl}", ms(a, 1), ms(b, 1), ms(c, 1)])
    s = optimizer_summary(d)
    parts = []
    if s is not None:
        rows.insert(0, ["`mfsdp2.optim.AdamW`", ms(s["ours_s"], 1), "", ""])
        if "bf16_states_s" in s:
            rows.insert(1, ["`mfsdp2.optim.AdamW(state_dtype=torch.bfloat16)`", ms(s["bf16_states_s"], 1), "", ""])
    parts.append(md(["optimizer", "on mfsdp2's parameters ms", "on FSDP2's parameters ms",
                     f"on the flat shards as plain tensors ms ({d['tensors'].get('flat', '?')} tensors)"], rows))
    parts.append("")
    if s is not None:
        parts.append(f"`mfsdp2.optim.AdamW` vs torch's fastest (`{s['torch_fastest']}`): "
                     f"**{s['speedup_vs_torch_fastest']:.2f}x**; it moves "
                     f"{s['adamw_bytes_per_s'] / GiB:.1f} GiB/s, {s['fraction_of_bandwidth'] * 100:.0f} % of the "
                     f"in-place triad bandwidth measured in the same run.")
        if "bf16_states_s" in s:
            parts.append(f"With bfloat16 moments (20 bytes per element instead of 28): "
                         f"**{s['bf16_states_speedup_vs_torch_fastest']:.2f}x**, "
                         f"{s['bf16_states_bytes_per_s'] / GiB:.1f} GiB/s, "
                         f"{s['bf16_states_fraction_of_bandwidth'] * 100:.0f} % of the triad.")
    else:
        parts.append(f"This recording predates `mfsdp2.optim.AdamW` ({d['model']}, {d['tensors'].get('mfsdp2', '?')} "
                     f"parameters, median of {d['rounds']} rounds, max over 2 ranks): torch's AdamW only. "
                     f"`optimizer_step.py` records the flat optimizer beside them.")
    parts += ["", run_line("optimizer", d)]
    return "\n".join(parts)


def block_native() -> str:
    d = load("native")
    if d is None:
        return missing("native")
    rows = []
    for model, kernels in d["cases"].items():
        for name, k in kernels.items():
            t = k["median_s"]
            best = k["best_pytorch"]
            rows.append([model, name, ms(t["native"], 2), ms(t["reference"], 2),
                         f"{ms(t[best], 2)} ({'the reference' if best == 'reference' else best})",
                         f"**{k['speedup_vs_best_pytorch']:.2f}x**", f"{k['speedup_vs_reference']:.1f}x",
                         "yes" if k["ships"] else "no"])
    return (md(["model", "kernel", "native ms", "reference ms", "best bit-identical PyTorch ms", "native vs best",
                "native vs reference", f"ships (>= {d['ship_threshold']}x)"], rows)
            + f"\n\n{d['threads']} thread, {d['rounds']} rounds. " + run_line("native", d))


def block_clip() -> str:
    d = load("clip")
    if d is None:
        return missing("clip")
    keys = ["mfsdp2.clip_grad_norm_ (mfsdp2 model)", "torch clip_grad_norm_ (mfsdp2 model)",
            "torch clip_grad_norm_ (FSDP2 model)"]
    rows = []
    for model, v in d.items():
        if not isinstance(v, dict) or "median_s" not in v:
            continue
        base = v["median_s"][keys[0]]
        norms = [v["norms"][k] for k in keys]
        rows.append([f"{model} ({v['params']} parameters)"]
                    + [f"{ms(v['median_s'][k], 1)} ({v['median_s'][k] / base:.2f})" for k in keys]
                    + [f"{max(norms) - min(norms):.1e}"])
    return (md(["model", "`mfsdp2.clip_grad_norm_` ms", "torch's, mfsdp2 model", "torch's, FSDP2 model",
                "spread of the three norms"], rows)
            + "\n\nMilliseconds per call (ratio to mfsdp2's), median of the per-call max over 2 ranks. Reproduce: `"
            + SOURCES["clip"][1] + "`.")


def block_estimate() -> str:
    d = load("estimate")
    if d is None:
        return missing("estimate")
    rows = [[f"{c['model']}/{c['config']}", c["world_size"], mib(c["measured_peak_bytes"]),
             mib(c["estimate_peak_bytes"]),
             f"{c['estimate_error'] * 100:+.2f} %"] for c in d["cases"]]
    worst = max(abs(c["estimate_error"]) for c in d["cases"])
    return (md(["case", "world size", "measured peak MiB", "estimate MiB", "error"], rows)
            + f"\n\nWorst |error|: **{worst * 100:.2f} %** over {len(rows)} cases. " + run_line("estimate", d))


def _mesh(m) -> str:
    return "x".join(str(x) for x in m) if isinstance(m, list) else str(m)


def block_scale_memory() -> str:
    d = load("scale")
    if d is None:
        return missing("scale")
    rows = []
    for x in d["memory"]:
        rows.append([x["model"], _mesh(x["mesh"]), f"{x['main_weight_bytes'] / GiB:.3f}",
                     f"{x['main_grad_bytes'] / GiB:.3f}",
                     f"{x['adam_bytes'] / GiB:.3f}", f"{x['gathered_bytes'] / GiB:.3f}",
                     f"{x['grad_buffer_bytes'] / GiB:.3f}", f"**{x['total_bytes'] / GiB:.3f}**",
                     f"{x['formula_bytes'] / GiB:.3f}", f"{x['total_bytes'] / x['formula_bytes']:.3f}",
                     f"{x['padding_fraction'] * 100:.3f} %", f"{x['fully_shard_allocated_bytes']:,}",
                     r2(x["fully_shard_s"]), r2(x["layout_planning_s"], 3)])
    hdr = ["model", "mesh", "main weights GiB", "main grads", "AdamW states", "gathered (largest unit)",
           "flat grad (largest unit)", "total", "formula", "total / formula", "padding", "bytes allocated",
           "fully_shard s", "planning s"]
    return md(hdr, rows) + "\n\n" + run_line("scale", d)


def block_scale_steps() -> str:
    d = load("scale")
    if d is None:
        return missing("scale")
    rows = []
    for x in d["steps"]:
        own = x["own_s"]
        rows.append([x["layers"], _mesh(x["mesh"]), r2(x["fully_shard_s"]), r2(x["lazy_init_s"], 3),
                     ms(x["trace_pool_planning_s"], 1), ms(x["step_s"], 1), ms(x["fwd_bwd_s"], 1),
                     x["collectives_per_step"], ms(x["collective_s"], 1), ms(x["compute_s"], 1), ms(own, 1),
                     r2(own * 1e3 / x["units"]), ms(x["optimizer_s"], 1)])
    hdr = ["layers", "mesh", "fully_shard s", "lazy init s", "trace-pool plan ms", "step ms", "fwd+bwd ms",
           "collectives", "in fake collectives ms", "compute ms", "mfsdp2's own ms", "own ms / unit", "optimizer ms"]
    fake = [[_mesh(x["mesh"]), f"{x['unit_numel']:,}", r2(x["all_gather_us"], 1), r2(x["reduce_scatter_us"], 1)]
            for x in d["fake_collective"]]
    return "\n".join([md(hdr, rows), "", "The fake backend's own cost, one collective of a narrow unit's size:", "",
                      md(["mesh", "elements", "all_gather us", "reduce_scatter us"], fake)])


def block_alpha_beta() -> str:
    d = load("alpha_beta")
    if d is None:
        return missing("alpha_beta")
    rows = []
    for ws, w in sorted(d["world_sizes"].items(), key=lambda kv: int(kv[0])):
        for model, m in w["models"].items():
            for depth, t in sorted(m["measured_s"].items()):
                p = m["predicted"][depth]
                rows.append([model, ws, depth, ms(t), ms(p["model_s"]), r2(t / p["model_s"]), ms(p["serial_s"]),
                             r2(t / p["serial_s"])])
    ab = d["world_sizes"][min(d["world_sizes"], key=int)]["alpha_beta"]
    fit = ", ".join(f"{k} alpha {v['alpha_s'] * 1e3:.2f} ms, beta {v['beta_s_per_byte'] * GiB * 1e3:.0f} ms/GiB"
                    for k, v in ab.items())
    return (md(["model", "world size", "prefetch depth", "measured step ms", "model (overlap) ms", "measured / model",
                "serial (no overlap) ms", "measured / serial"], rows)
            + f"\n\ngloo fit at the smallest world size: {fit}. " + run_line("alpha_beta", d))


def block_shard_dim() -> str:
    d = load("shard_dim")
    if d is None:
        return missing("shard_dim")
    rows = [[x["case"], x["dim"], x["lib"], ms(x["unshard_s"], 0), ms(x["step_s"], 0), mib(x["peak_bytes"]),
             f"`{x['placement']}`"] for x in d["results"]]
    return (md(["case", "Shard dim", "runtime", "unshard ms", "step ms", "peak MiB", "placement"], rows)
            + f"\n\n{d['iters']} iterations. " + run_line("shard_dim", d))
