"""The recorded runs behind the benchmark pages, and the cell formats every generated table shares.

:data:`SOURCES` names, for each part of the pages, the JSON in ``benchmarks/results/`` it is drawn
from and the command that records it; :func:`load` reads one (``None`` when it is absent) and
:func:`missing` / :func:`run_line` say how to record or reproduce it. The table modules
(``_report_compare``, ``_report_more``, ``_report_goals``) and the plots (``_report_plots``) all read
the JSON through here, so :data:`RESULTS` is the one place that says where it lives. No matplotlib.
"""

from __future__ import annotations

import json
import os
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

# The current run behind each part of the page, and the command that records it.
SOURCES = {
    "tuning": ("fsdp2_tuning.json", "python benchmarks/fsdp2_tuning.py --json benchmarks/results/fsdp2_tuning.json"),
    "compare": ("compare_fsdp2_full.json",
                "python benchmarks/compare_fsdp2.py --wait-quiet 30 --json benchmarks/results/compare_fsdp2_full.json"),
    "profile": ("profile_llama.json", "python benchmarks/profile_step.py --model llama --framework all "
                "--json benchmarks/results/profile_llama.json"),
    "strategies": ("strategies.json", "python benchmarks/strategies.py --json benchmarks/results/strategies.json"),
    "accum": ("strategies_accum4.json", "python benchmarks/strategies.py --cases mlp:fp32,llama:fp32,tiny:fp32 "
              "--accum 4 --json benchmarks/results/strategies_accum4.json"),
    "fp8": ("strategies_fp8_paired.json", "python benchmarks/strategies.py --cases llama:fp8,mlp:fp8 --steps 80 "
            "--wait-quiet 60 --json benchmarks/results/strategies_fp8_paired.json"),
    "phases": ("step_phases_tiny.json", "python benchmarks/step_phases.py --model tiny "
               "--json benchmarks/results/step_phases_tiny.json"),
    "phases_foreach": ("step_phases_tiny_foreach.json", "python benchmarks/step_phases.py --model tiny --foreach "
                       "--json benchmarks/results/step_phases_tiny_foreach.json"),
    "phases_host": ("step_phases_tiny_ws1.json", "python benchmarks/step_phases.py --model tiny --world-size 1 "
                    "--frameworks plain,ddp,no_shard,optim,zero3,fsdp2,fsdp2_tuned --steps 60 "
                    "--json benchmarks/results/step_phases_tiny_ws1.json"),
    "allocators_mlp": ("allocators_mlp.json",
                       "python benchmarks/allocators.py --json benchmarks/results/allocators_mlp.json"),
    "allocators_llama": ("allocators_llama.json", "python benchmarks/allocators.py --model llama "
                         "--json benchmarks/results/allocators_llama.json"),
    "optimizer": ("optimizer_step.json",
                  "python benchmarks/optimizer_step.py --json benchmarks/results/optimizer_step.json"),
    "native": ("native_kernels.json",
               "python benchmarks/native_kernels.py --json benchmarks/results/native_kernels.json"),
    "clip": ("clip_grad.json", "python benchmarks/clip_grad.py --json benchmarks/results/clip_grad.json"),
    "estimate": ("memory_estimate.json",
                 "python benchmarks/memory_estimate.py --json benchmarks/results/memory_estimate.json"),
    "scale": ("scale.json", "python benchmarks/scale.py --json benchmarks/results/scale.json"),
    "alpha_beta": ("alpha_beta.json", "python benchmarks/alpha_beta.py --json benchmarks/results/alpha_beta.json"),
    "shard_dim": ("shard_dim.json", "python benchmarks/shard_dim.py --json benchmarks/results/shard_dim.json"),
    "quantised": ("quantised_weights.json",
                  "python benchmarks/quantised_weights.py --json benchmarks/results/quantised_weights.json"),
    "moe": ("moe.json", "python benchmarks/moe.py --steps 16 --wait-quiet 60 --json benchmarks/results/moe.json"),
}

FRAMEWORKS = (("mfsdp2", "mfsdp2"), ("fsdp2_tuned", "FSDP2 tuned"), ("fsdp2", "FSDP2 default"))
MiB = 2 ** 20
GiB = 2 ** 30


def load(key: str) -> Optional[dict]:
    path = os.path.join(RESULTS, SOURCES[key][0])
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def missing(key: str) -> str:
    name, cmd = SOURCES[key]
    return f"Not recorded (`benchmarks/results/{name}` is absent). Record it with `{cmd}`."


def md(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def ms(s: Optional[float], digits: int = 0) -> str:
    return "n/a" if s is None else f"{s * 1e3:.{digits}f}"


def r2(x: Optional[float], digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def mib(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / MiB:.1f}"


def when(d: dict) -> str:
    date = d.get("date") or d.get("when") or ""
    return date[:16].replace("T", " ") + (" UTC" if date else "")


def run_line(key: str, d: dict) -> str:
    """One line naming the run: command, date, commit, machine."""
    m = d.get("machine", {})
    env = "".join(f" {k}={v}" for k, v in sorted(m.get("env", {}).items()))
    cmd = SOURCES[key][1]
    return (f"Reproduce: `{env.strip() + ' ' if env else ''}{cmd}` -- recorded {when(d) or 'n/a'}, "
            f"mfsdp2 {m.get('mfsdp2_commit', 'n/a')}, {m.get('cpu', 'n/a')} ({m.get('cores', '?')} cores), "
            f"torch {m.get('torch', 'n/a')}.")


def case_name(c: dict) -> str:
    return f"{c['model']}/{c['config']}"
