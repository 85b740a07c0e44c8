"""The generated tables of docs/benchmarks.md: mfsdp2 against torch's FSDP2 (default and tuned), its
sharding strategies against their torch counterparts (DDP, ZeRO), FP8 and quantised weights, MoE,
the step's phases, and the list of recorded runs.

Each ``block_*`` renders one ``<!-- report:NAME -->`` block of that page from the JSON named in
``_report_data.SOURCES`` (``benchmarks/report.py`` maps the names to these functions). The page's
blocks live apart from docs/benchmarks_more.md's (``_report_more``) and the scorecard's
(``_report_goals``) so that each page's tables can be read in one file. No matplotlib.
"""

from __future__ import annotations

from _report_data import FRAMEWORKS, SOURCES, case_name, load, md, mib, missing, ms, r2, run_line, when


def block_runs() -> str:
    rows = []
    for key, (name, cmd) in SOURCES.items():
        d = load(key)
        if d is None:
            rows.append([f"`{name}`", "not recorded", "", "", f"`{cmd}`"])
            continue
        m = d.get("machine", {})
        rows.append([f"`{name}`", when(d) or "n/a", m.get("mfsdp2_commit", "n/a"),
                     f"{m.get('cpu', 'n/a')}, {m.get('backend', 'n/a')}", f"`{cmd}`"])
    return md(["file", "recorded", "mfsdp2 commit", "machine", "command"], rows)


def block_tuning() -> str:
    d = load("tuning")
    if d is None:
        return missing("tuning")
    names = [k for k in d["geomean_ratio_vs_default"] if k != "default"]
    rows = []
    for c in d["cases"]:
        best = min(names, key=lambda n: c["candidates"][n]["ratio_vs_default"])
        rows.append([case_name(c)] + [("**%.3f**" if n == best else "%.3f") % c["candidates"][n]["ratio_vs_default"]
                                      for n in names])
    g = d["geomean_ratio_vs_default"]
    rows.append(["geometric mean"] + [("**%.3f**" if n == d["winner"] else "%.3f") % g[n] for n in names])
    same = all(c["losses_identical"] for c in d["cases"])
    return "\n".join([md(["case (step / default)"] + [f"`{n}`" for n in names], rows), "",
                      f"Chosen: **`{d['winner']}`** (lowest geometric mean). Losses identical across all "
                      f"candidates in every case: {'yes' if same else 'NO'}.", "", run_line("tuning", d)])


def block_compare_step() -> str:
    d = load("compare")
    if d is None:
        return missing("compare")
    rows = []
    for c in d["cases"]:
        r, f = c["ratio"], c["floor"]
        rows.append([case_name(c)]
                    + [f"{ms(c[k]['step_s_median'])} ({ms(c[k]['step_s_p10'])}-{ms(c[k]['step_s_p90'])})"
                       for k, _ in FRAMEWORKS]
                    + [f"**{r2(r['step_time_vs_tuned'], 3)}**", r2(r["step_time"], 3),
                       f"{ms(f['compute_s'])} / {ms(f['comm_s'])}", r2(r["floor_over_tuned_fsdp2"], 3),
                       r2(c["mfsdp2"]["step_over_floor"]), f"{c['loss_max_abs_diff']:.1e}",
                       f"{c.get('foreign_cpu_fraction', 0) * 100:.0f} %"])
    hdr = ["case", "mfsdp2 ms (p10-p90)", "FSDP2 tuned ms", "FSDP2 default ms", "mfsdp2 / tuned",
           "mfsdp2 / default", "floor ms: compute / comm", "floor / tuned", "mfsdp2 step / floor",
           "max loss diff", "other load"]
    return md(hdr, rows) + "\n\n" + run_line("compare", d)


def block_compare_memory() -> str:
    d = load("compare")
    if d is None:
        return missing("compare")
    rows = []
    for c in d["cases"]:
        r = c["ratio"]
        rows.append([case_name(c)] + [mib(c[k]["peak_tensor_bytes"]) for k, _ in FRAMEWORKS]
                    + [f"**{r2(r['peak_tensor_memory_vs_tuned'], 3)}**", r2(r["peak_tensor_memory"], 3)]
                    + [mib(c[k]["peak_rss_bytes"]) for k, _ in FRAMEWORKS]
                    + [r2(r["peak_rss_vs_tuned"], 3)])
    hdr = ["case", "peak tensor MiB mfsdp2", "FSDP2 tuned", "FSDP2 default", "mfsdp2 / tuned", "mfsdp2 / default",
           "peak RSS MiB mfsdp2", "FSDP2 tuned", "FSDP2 default", "RSS mfsdp2 / tuned"]
    return md(hdr, rows) + "\n\n" + run_line("compare", d)


def block_compare_wire() -> str:
    d = load("compare")
    if d is None:
        return missing("compare")
    rows = []
    for c in d["cases"]:
        m, t = c["mfsdp2"], c["fsdp2_tuned"]
        p2p = f" + {m['p2p_ops_per_step']:g} p2p" if m.get("p2p_ops_per_step") else ""
        coll = f"{m['collectives_per_step']:g}" + p2p
        rate = m.get("tokens_per_s", m.get("samples_per_s"))
        rows.append([case_name(c), f"{rate:,.1f} {c['item_unit']}/s", mib(m["wire_bytes_per_step"]),
                     mib(t["wire_bytes_per_step"]), coll, f"{t['collectives_per_step']:g}",
                     f"{c['ratio']['mfsdp2_wire_over_theoretical']:.4f}", f"{m['padding'] * 100:.2f} %"])
    hdr = ["case", "mfsdp2 throughput", "wire MiB/step mfsdp2", "FSDP2 tuned", "collectives/step mfsdp2",
           "FSDP2 tuned", "mfsdp2 wire / theory", "padding"]
    return md(hdr, rows)


def block_profile() -> str:
    d = load("profile")
    if d is None:
        return missing("profile")
    rows = []
    for k, label in FRAMEWORKS:
        f = d["frameworks"].get(k)
        if f is None:
            continue
        rows.append([label, ms(f["wall_s"]), ms(f["cpu_s"]), r2(f["cpu_s"] / f["wall_s"]), f"{f['minor_faults']:,.0f}"])
    parts = [md(["framework", "step wall ms", "process CPU ms", "CPU / wall", "minor page faults"], rows), ""]
    ranges = d["frameworks"]["mfsdp2"].get("ranges_by_kind", [])
    if ranges:
        parts += ["mfsdp2's named ranges in that step (rank 0, CPU time including children):", "",
                  md(["range", "calls", "CPU ms"], [[f"`{x['range']}`", x["calls"], r2(x["cpu_total_ms"], 1)]
                                                     for x in ranges]), ""]
    parts.append(run_line("profile", d))
    return "\n".join(parts)


def _comparison_rows(d: dict, with_second: bool = True) -> list[list]:
    rows = []
    for x in d["comparisons"]:
        v, b = x["step_s"]
        rows.append([x["case"], x["comparison"], f"**{r2(x['step_ratio'], 3)}** ({ms(v)} / {ms(b)})"]
                    + ([r2(x.get("step_ratio_second"), 3)] if with_second else [])
                    + [r2(x["wire_buffer_ratio"]), r2(x["all_gather_ratio"]), r2(x["persistent_ratio"]),
                       r2(x["weights_ratio"]), r2(x["grads_ratio"]),
                       "identical" if x["loss_max_rel_diff"] == 0 else f"max rel. diff {x['loss_max_rel_diff']:.3g}"])
    return rows


STRATEGY_HDR = ["case", "variant / baseline", "step ratio (ms / ms)", "vs FSDP2 default", "wire bytes",
                "all-gather bytes",
                "persistent bytes / rank", "weights", "grads", "losses"]


def block_strategies() -> str:
    d = load("strategies")
    if d is None:
        return missing("strategies")
    return md(STRATEGY_HDR, _comparison_rows(d)) + "\n\n" + run_line("strategies", d)


def block_accum() -> str:
    d = load("accum")
    if d is None:
        return missing("accum")
    return md(STRATEGY_HDR, _comparison_rows(d)) + "\n\n" + run_line("accum", d)


def block_fp8() -> str:
    d = load("fp8")
    if d is None:
        return missing("fp8")
    rows = []
    for x in d["comparisons"]:
        v, b = x["step_s"]
        p = x.get("paired_step_ratio") or {}
        rows.append([x["case"], x["comparison"], f"**{r2(x['step_ratio'], 3)}** ({ms(v)} / {ms(b)})",
                     r2(p.get("median"), 3), f"{r2(p.get('q25'), 3)}-{r2(p.get('q75'), 3)}",
                     f"{p.get('fraction_below_1', 0) * 100:.0f} %", r2(x["all_gather_ratio"]),
                     r2(x["wire_buffer_ratio"])])
    hdr = ["case", "variant / baseline", "step ratio of medians (ms / ms)", "paired per-round ratio: median",
           "quartiles", "rounds below 1", "all-gather bytes", "wire bytes"]
    return md(hdr, rows) + "\n\n" + run_line("fp8", d)


PHASES = ("forward", "backward", "optimizer_step", "zero_grad")


def block_phases() -> str:
    parts = []
    for key, label in (("phases", "torch AdamW default (for-loop on CPU)"), ("phases_foreach", "AdamW `foreach=True`")):
        d = load(key)
        if d is None:
            parts += [missing(key), ""]
            continue
        res = d["results"]
        ddp = res["ddp"]["step_s"]
        rows = [[k] + [ms(v["median_s"][p], 1) for p in PHASES] + [ms(v["step_s"], 1), r2(v["step_s"] / ddp)]
                for k, v in res.items()]
        parts += [f"{label}:", "", md(["framework", "forward ms", "backward ms", "optimizer step ms", "zero_grad ms",
                                       "step ms", "step / DDP"], rows), "", run_line(key, d), ""]
    return "\n".join(parts).rstrip()


def block_quantised() -> str:
    d = load("quantised")
    if d is None:
        return missing("quantised")
    goals = {"qlora": ("peak", "peak memory per rank <= 1.0x FSDP2"), "float8": ("step", "step time <= 0.9x FSDP2")}
    rows = []
    for x in d["results"]:
        kind, goal = goals.get(x["case"], ("step", ""))
        rat = x["ratio"]
        vs_t, vs_d = rat[f"{kind}_vs_tuned"], rat[f"{kind}_vs_default"]
        bound = 1.0 if kind == "peak" else 0.9
        met = "met" if vs_t <= bound and vs_d <= bound else "not met"
        for fw, label in FRAMEWORKS:
            r = x[fw]
            rows.append([x["case"], label, ms(r["step_s_median"]), f"{ms(r['step_s_p10'])}-{ms(r['step_s_p90'])}",
                         mib(r["peak_bytes_median"]),
                         f"{goal}: {r2(vs_t)}x tuned, {r2(vs_d)}x default ({met})" if fw == "mfsdp2" else "",
                         f"{x['foreign_cpu_fraction']:.0%}" if fw == "mfsdp2" else "",
                         ("yes" if x["losses_identical"] else "no") if fw == "mfsdp2" else ""])
    headers = ["case", "runtime", "step ms", "p10-p90", "step peak MiB", "goal", "other load", "losses identical"]
    return (md(headers, rows)
            + f"\n\n{d['rounds']} alternating rounds per case; other processes used {d['quiet_before']:.0%} "
            f"of the CPUs before the run (load average {d['load_average_before'][0]:.1f}). " + run_line("quantised", d))


def block_moe() -> str:
    d = load("moe")
    if d is None:
        return missing("moe")
    rows = []
    for c in d["cases"]:
        for f, label in FRAMEWORKS:
            x = c[f]
            t = x["step_s"]
            rows.append([c["case"], label, f"{ms(t['median'])} ({ms(t['p10'])}-{ms(t['p90'])})",
                         mib(x["peak_tensor_bytes"]), mib(x["peak_rss_above_base"])])
        r = c["ratio"]
        rows.append([c["case"], "**mfsdp2 / FSDP2 tuned**", f"**{r['step_time_vs_tuned']:.3f}**",
                     f"**{r['peak_tensor_memory_vs_tuned']:.3f}**", f"{r['peak_rss_vs_tuned']:.3f}"])
    notes = "; ".join(f"{c['case']}: other load {c['foreign_cpu_fraction']:.0%} of the CPUs, loss difference "
                      f"vs tuned FSDP2 {c['loss_max_abs_diff_vs_tuned']:.2g}" for c in d["cases"])
    return (md(["case", "runtime", "step ms, median (p10-p90)", "peak tensor MiB", "peak RSS MiB"], rows)
            + f"\n\n{d['cases'][0]['steps']} alternating rounds per case, world size {d['cases'][0]['world_size']}, "
            + f"FSDP2 tuned = `{d.get('fsdp2_tuned', 'n/a')}`; {notes}. " + run_line("moe", d))
