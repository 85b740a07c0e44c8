"""Render benchmark JSON files as the Markdown tables used in docs/benchmarks.md.

    python benchmarks/report.py compare benchmarks/results/compare_fsdp2_full.json
    python benchmarks/report.py ring benchmarks/results/ring_reduce_scatter.json
    python benchmarks/report.py prefetch benchmarks/results/prefetch.json
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))



def _md(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def compare(d: dict) -> str:
    parts = [f"`{d['command']}` -- {d['date']}, {d['machine']['cpu']} ({d['machine']['cores']} cores), "
             f"gloo, torch {d['machine']['torch']}, 1 thread/rank, world size 2, "
             f"mfsdp2 {d['machine']['mfsdp2_commit']}"
             + "".join(f", {k}={v}" for k, v in d["machine"].get("env", {}).items())
             + (f", MALLOC_MMAP_MAX_={d['machine']['malloc_mmap_max']}"
                if d["machine"].get("malloc_mmap_max") and "MALLOC_MMAP_MAX_" not in d["machine"].get("env", {}) else "")
             + f"; wall {d.get('wall_s', 0):.0f} s.", ""]
    tuned = all("fsdp2_tuned" in c for c in d["cases"])  # runs before the tuned baseline: default only
    fws = ("mfsdp2", "fsdp2", "fsdp2_tuned") if tuned else ("mfsdp2", "fsdp2")
    rows = []
    for c in d["cases"]:
        for fw in fws:
            x = c[fw]
            rate = x.get("tokens_per_s", x.get("samples_per_s"))
            rows.append([
                f"{c['model']}/{c['config']}" if fw == "mfsdp2" else "", fw,
                f"{x['step_s_median']*1e3:.0f} ({x['step_s_p10']*1e3:.0f}-{x['step_s_p90']*1e3:.0f})",
                f"{rate:,.1f} {c['item_unit']}/s" if rate < 100 else f"{rate:,.0f} {c['item_unit']}/s",
                _mib(x["wire_bytes_per_step"]),
                f"{x['collectives_per_step']:g}" + (f" + {x['p2p_ops_per_step']:g} p2p" if x.get("p2p_ops_per_step") else ""),
                _mib(x["peak_tensor_bytes"]), _mib(x["peak_rss_bytes"]),
                f"{x['step_over_floor']:.2f}", f"{x['cpu_s_per_step_per_rank'] / x['step_s_median']:.2f}",
            ])
    parts.append(_md(["case", "framework", "step ms median (p10-p90)", "throughput", "wire MiB/step",
                      "collectives/step", "peak tensor MiB", "peak RSS MiB", "step / max(compute, comm)",
                      "CPU/wall per rank"], rows))
    parts.append("")
    rows = []

    def f2(x) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    for c in d["cases"]:
        r, f = c["ratio"], c["floor"]
        floor_s = max(f["compute_s"], f["comm_s"])
        base = c["fsdp2_tuned"] if tuned else c["fsdp2"]
        # overhead = step - max(compute, comm); meaningless when a step is within noise of the floor
        small = min(c["mfsdp2"]["overhead_s"], base["overhead_s"]) < 0.05 * floor_s
        overhead = r.get("overhead_vs_tuned") if tuned else r["overhead"]
        row = [f"{c['model']}/{c['config']}", f"{f['compute_s']*1e3:.0f}",
               f"{f['comm_s']*1e3:.0f} ({f['comm_cpu_s_per_rank'] / f['comm_s']:.2f})"]
        if tuned:
            row += [f"**{f2(r['step_time_vs_tuned'])}**", f2(r["step_time"])]
        else:
            row += [f"**{f2(r['step_time'])}**"]
        row += [f"{floor_s / base['step_s_median']:.2f}", f"**{r['step_over_floor']:.2f}**",
                f"{c['mfsdp2']['step_over_serial_floor']:.2f}",
                f"{r['mfsdp2_wire_over_theoretical']:.4f} ({c['mfsdp2']['padding']*100:.2f} %)",
                f"{(r['wire_bytes_vs_tuned'] if tuned else r['wire_bytes']):.3f}"]
        if tuned:
            row += [f"**{f2(r['peak_tensor_memory_vs_tuned'])}**", f2(r["peak_tensor_memory"]),
                    f2(r["peak_rss_vs_tuned"])]
        else:
            row += [f"**{f2(r['peak_tensor_memory'])}**", f2(r["peak_rss"])]
        row += ["n/a (at floor)" if overhead is None or small else f"{overhead:.2f}"]
        if tuned:
            row += ["n/a (at floor)" if r["overhead"] is None or small else f"{r['overhead']:.2f}"]
        row += [f"{c['loss_max_abs_diff']:.1e}", f"{c.get('foreign_cpu_fraction', 0)*100:.0f} %"]
        rows.append(row)
    if tuned:
        hdr = ["case", "compute-only ms", "comm-only ms (CPU/wall)", "step mfsdp2 / FSDP2 tuned",
               "step mfsdp2 / FSDP2 default", "lowest possible (floor / FSDP2 tuned)", "mfsdp2 step/floor",
               "mfsdp2 step/(compute+comm)", "mfsdp2 wire/theory (padding)", "wire mfsdp2 / FSDP2 tuned",
               "peak tensor mfsdp2 / FSDP2 tuned", "peak tensor mfsdp2 / FSDP2 default",
               "peak RSS mfsdp2 / FSDP2 tuned", "overhead mfsdp2 / FSDP2 tuned", "overhead mfsdp2 / FSDP2 default",
               "max loss diff", "other load"]
    else:
        hdr = ["case", "compute-only ms", "comm-only ms (CPU/wall)", "step mfsdp2/FSDP2",
               "lowest possible (floor/FSDP2)", "mfsdp2 step/floor", "mfsdp2 step/(compute+comm)",
               "mfsdp2 wire/theory (padding)", "wire mfsdp2/FSDP2", "peak tensor mfsdp2/FSDP2",
               "peak RSS mfsdp2/FSDP2", "overhead mfsdp2/FSDP2", "max loss diff", "other load"]
    parts.append(_md(hdr, rows))
    return "\n".join(parts)


def ring(d: dict) -> str:
    parts = [f"`{d['command']}` -- {d['date']}", ""]
    for run in d["runs"]:
        rows = []
        for s in run["sizes"]:
            m = s["median_s"]
            row = [s["mib"], f"{m['gloo_rs']*1e3:.2f}", f"{m['ring_rs']*1e3:.2f}", f"{m['gloo_ar_inplace']*1e3:.2f}",
                   f"{m['gloo_rs'] / m['ring_rs']:.2f}x", "ring" if m["ring_rs"] < m["gloo_rs"] else "gloo"]
            if "gloo_ag" in m:
                row += [f"{m['gloo_ag']*1e3:.2f}", f"{m['ring_ag']*1e3:.2f}", f"{m['gloo_ag'] / m['ring_ag']:.2f}x"]
            row.append("yes" if s["correct"] else "NO")
            rows.append(row)
        hdr = ["MiB (fp32, full buffer)", "gloo reduce_scatter ms", "p2p ring RS ms", "gloo all_reduce in place ms",
               "gloo/ring", "faster RS"]
        if "gloo_ag" in run["sizes"][0]["median_s"]:
            hdr += ["gloo all_gather ms", "p2p ring AG ms", "gloo/ring AG"]
        hdr.append("ring == gloo")
        parts += [f"World size {run['world_size']} ({run['iters']} alternating iterations, medians):", "",
                  _md(hdr, rows), ""]
    return "\n".join(parts)


def prefetch(d: dict) -> str:
    rows = [[x["depth"], f"{x['step_s_median']*1e3:.0f}", f"{x['step_s_p10']*1e3:.0f}-{x['step_s_p90']*1e3:.0f}",
             f"{x['ratio_to_depth0']:.3f}", f"{x['hidden_fraction']:.2f}"] for x in d["depths"]]
    head = (f"`{d['command']}` -- {d['date']}; {d['model']}/{d['config']}, world size {d['world_size']}; "
            f"comm-only {d['comm_s']['median']*1e3:.0f} ms, compute-only {d['compute_s']['median']*1e3:.0f} ms; "
            f"losses identical across depths: {d['losses_identical']}.")
    return head + "\n\n" + _md(["prefetch depth", "step ms median", "p10-p90", "vs depth 0",
                               "comm hidden = (t0 - t) / comm"], rows)


def main(argv=None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    if len(argv) != 2 or argv[0] not in ("compare", "ring", "prefetch"):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        d = json.load(f)
    print({"compare": compare, "ring": ring, "prefetch": prefetch}[argv[0]](d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
