"""``make gpu-check``: everything a lent GPU machine should run first, in one command that fits
five minutes and reports -- it never trips over itself.

Runs from the source tree with the machine's own python and torch (``PYTHONPATH`` = the tree; no
venv, no pip, nothing installed), and writes ``summary.txt`` and ``summary.json`` into ``$OUT``
when set (the device tool brings back what is written there), else into ``--out`` /
``gpu-check-results``. The summary is rewritten after every step, so a run cut short still
reports what it did, and every step that did not pass names its cause (a timeout and its
budget, collection errors and their files, a missing tool, the failed tests).

Every step has a fixed budget (:data:`BUDGETS`, seconds); they sum to under five minutes
*including* each command's start, the kill grace of a step that runs over (SIGINT, then SIGKILL
:data:`GRACE` seconds later) and the gates. Steps, in order:

1. ``env``: python, torch, CUDA, the device, the tree's commit.
2. ``native``: the native kernels are built only with ``--native`` (its budget then comes out of
   the CUDA tests'); otherwise every step runs with ``MFSDP2_NATIVE=0``, mfsdp2's PyTorch
   reference paths.
3. ``gates``: which device-side gate the late-collectives harness can use on this driver
   (``python -m tests._late_streams``); the one that works is passed on as ``MFSDP2_SLOW_GATE``.
4. ``cuda_tests``: every test marked ``@pytest.mark.cuda`` (``-m cuda`` over the files that use
   the marker; ``tests/conftest.py`` skips them elsewhere), ``--continue-on-collection-errors``.
5. ``benchmark``: ``benchmarks/gpu.py`` at world size 1 (mfsdp2 and FSDP2: step time, memory
   including ``max_memory_allocated`` / ``max_memory_reserved``).
6. ``profile``: one profiled step of two ranks on the one GPU (``tools/gpu_profile.py``, a mesh
   built from the gloo world group, its backend asserted): mfsdp2's named ranges, device work per
   stream, and how much of the side streams' work ran beside the compute stream's kernels.

``--suite`` (``make gpu-suite``, a second device call) runs the rest of the test suite instead:
``-m "not cuda"`` with ``pytest -n 14``, within its own budget.

``--dry-run`` runs the same plumbing on a machine without a GPU, fast: the steps that need CUDA
are recorded as skipped, the pytest steps run a trivial selection each (``--dry-tests``), and the
benchmark runs a tiny model on gloo (``tests/project/test_gpu_check.py`` checks the summary it writes,
including a simulated timeout and a collection error).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("env", "native", "gates", "cuda_tests", "benchmark", "profile")
SUITE_STEPS = ("env", "suite")
# Seconds per step, each including its commands' start and the kill grace of one that runs over.
# Sum: 284 s (gpu-check) and 280 s (gpu-suite), under the device call's five minutes.
BUDGETS = {"env": 10.0, "native": 0.0, "gates": 24.0, "cuda_tests": 150.0, "benchmark": 55.0, "profile": 45.0,
           "suite": 270.0}
NATIVE_BUDGET = 80.0  # with --native: taken from the CUDA tests' budget
GRACE = 5.0  # a command past its budget gets SIGINT (pytest reports and writes its junit), SIGKILL after this
# --dry-run: one fast CPU test per pytest step (the plumbing, not the suite)
DRY_TESTS = {
    "cuda_tests": ["tests/memory/test_offload_copies.py::test_copies_between_host_memories_block_and_record_nothing"],
    "suite": ["tests/comm/test_comm_backend.py::test_only_nccl_like_backends_on_cuda_are_stream_ordered"],
}


def cuda_test_files(root: str = ROOT) -> list[str]:
    """The test files that use the ``cuda`` marker (collecting only them keeps ``-m cuda`` fast)."""
    found = []
    for dirpath, _, files in os.walk(os.path.join(root, "tests")):
        for f in sorted(files):
            if f.startswith("test_") and f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    if "mark.cuda" in fh.read():
                        found.append(os.path.relpath(path, root))
    return sorted(found)


class Run:
    """The steps' results and the summary files (rewritten after each step)."""

    def __init__(self, out: str, dry_run: bool, budgets: dict, steps: tuple = STEPS) -> None:
        self.out = out
        self.dry_run = dry_run
        self.budgets = budgets
        self.planned = steps
        self.t0 = time.monotonic()
        self.steps: list[dict] = []
        self.info: dict = {}
        os.makedirs(out, exist_ok=True)

    def budget(self, name: str) -> float:
        return self.budgets[name]

    def add(self, step: dict) -> dict:
        if step["status"] not in ("passed", "skipped") and not step.get("cause"):
            step["cause"] = step.get("note") or step["status"]
        self.steps.append(step)
        self.write()
        return step

    def summary(self) -> dict:
        bad = [s["name"] for s in self.steps if s["status"] in ("failed", "timeout", "error")]
        return {
            "ok": not bad and [s["name"] for s in self.steps] == list(self.planned),
            "failed_steps": bad,
            "causes": {s["name"]: s["cause"] for s in self.steps if s.get("cause")},
            "dry_run": self.dry_run,
            "budget_s": round(sum(self.budgets[n] for n in self.planned), 1),
            "budgets": {n: self.budgets[n] for n in self.planned},
            "elapsed_s": round(time.monotonic() - self.t0, 1),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **self.info,
            "steps": self.steps,
        }

    def write(self) -> None:
        s = self.summary()
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(s, f, indent=1)
        with open(os.path.join(self.out, "summary.txt"), "w") as f:
            f.write(render(s))


def render(s: dict) -> str:
    lines = [f"gpu-check{' (dry run)' if s['dry_run'] else ''}: {'OK' if s['ok'] else 'NOT OK'} "
             f"in {s['elapsed_s']:.0f} s of {s['budget_s']:.0f} s; {s.get('device', '?')}, "
             f"torch {s.get('torch', '?')}, python {s.get('python', '?')}, commit {s.get('commit', '?')}"]
    for st in s["steps"]:
        line = f"  {st['name']:<11} {st['status']:<8} {st.get('seconds', 0):6.1f} s"
        if "counts" in st:
            line += "  " + ", ".join(f"{k} {v}" for k, v in st["counts"].items() if v)
        if st.get("note"):
            line += f"  ({st['note']})"
        lines.append(line)
        if st.get("cause"):
            lines.append(f"      cause: {st['cause']}")
        for t in st.get("failed_tests", [])[:20]:
            lines.append(f"      FAILED {t}")
        for key, d in (st.get("results") or {}).items():
            if isinstance(d, dict):  # the benchmark: one line per framework
                lines.append(f"      {key}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in d.items()))
            else:
                lines.append(f"      {key}: {_fmt(d)}")
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def _call(cmd: list[str], budget: float, env: dict, log: str) -> tuple[Optional[int], float, str]:
    """(return code -- None when the command ran past ``budget`` --, seconds, output tail); the
    full output goes to ``log``.

    The command gets ``budget - GRACE`` seconds, then SIGINT (pytest stops, reports what ran and
    writes its junit file), and SIGKILL ``GRACE`` seconds later: it never outlives its budget."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: Optional[int] = p.wait(timeout=max(budget - GRACE, 1.0))
        except subprocess.TimeoutExpired:
            rc = None
            os.killpg(p.pid, signal.SIGINT)
            try:
                p.wait(timeout=GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    with open(log) as f:
        out = f.read()
    return rc, time.monotonic() - t0, out[-4000:]


def junit_counts(path: str) -> tuple[dict, list[str]]:
    """Passed / failed / errors / skipped counts and the failed tests' ids from a junit XML file."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    if not os.path.exists(path):
        return counts, failed
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:  # a file cut short by the kill
        return counts, failed
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if "failure" in kinds:
            counts["failed"] += 1
            failed.append(name)
        elif "error" in kinds:
            counts["errors"] += 1
            failed.append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failed


def collection_errors(output: str) -> list[str]:
    """The files pytest could not collect, from its output: ``ERROR collecting <path>``, or, where
    pytest names only the session, the module its import error names."""
    import re

    found: list[str] = []
    for m in re.finditer(r"ERROR collecting (\S+\.py)|while importing test module '([^']+\.py)'", output):
        path = os.path.relpath(m.group(1) or m.group(2), ROOT) if os.path.isabs(m.group(1) or m.group(2)) \
            else (m.group(1) or m.group(2))
        if path not in found:
            found.append(path)
    if not found and "ERROR collecting" in output:
        found.append("(the session: see the log)")
    return found


def pytest_cause(status: str, rc: Optional[int], budget: float, counts: dict, failed: list[str],
                 collect_errors: list[str], tail: str) -> str:
    """Why a pytest step did not pass, in one line."""
    parts = []
    if status == "timeout":
        parts.append(f"timed out: stopped at its {budget:.0f} s budget")
    if collect_errors:
        parts.append(f"collection errors in {', '.join(collect_errors[:5])}")
    if counts.get("failed") or counts.get("errors"):
        named = [f for f in failed if f.strip(":")]
        parts.append(f"{counts.get('failed', 0)} failed, {counts.get('errors', 0)} errors"
                     + (f" (first: {named[0]})" if named else ""))
    if not parts and rc not in (None, 0, 1):
        last = next((ln for ln in reversed(tail.strip().splitlines()) if ln.strip()), "")
        parts.append(f"pytest exited with code {rc} (usage or internal error): {last[:200]}")
    return "; ".join(parts) or status


def pytest_step(run: Run, name: str, targets: list[str], workers: int, env: dict,
                extra: Optional[list[str]] = None, dist: str = "loadfile") -> dict:
    budget = run.budget(name)
    if importlib.util.find_spec("pytest") is None:
        return run.add({"name": name, "status": "error", "seconds": 0.0, "counts": {},
                        "cause": "pytest is not installed for this python: nothing was tested"})
    xml = os.path.join(run.out, f"{name}.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--continue-on-collection-errors",
           f"--junitxml={xml}", *targets, *(extra or [])]
    note = ""
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        # loadgroup: the tests of one multi-process launch (an xdist_group) stay on one worker,
        # the rest are spread one by one; the suite keeps each file on one worker (its module
        # fixtures launch ranks once per worker that runs them)
        cmd += ["-n", str(workers), "--dist", dist]
    elif workers > 1:
        note = "pytest-xdist not installed: serial"
    rc, secs, tail = _call(cmd, budget, env, os.path.join(run.out, f"{name}.log"))
    counts, failed = junit_counts(xml)
    with open(os.path.join(run.out, f"{name}.log")) as f:
        errors = collection_errors(f.read())
    status = "timeout" if rc is None else "passed" if rc == 0 and not errors else "failed"
    if rc not in (None, 0, 1):  # 1: tests failed; others: usage / internal errors / no tests
        status = "error"
    step = {"name": name, "status": status, "seconds": round(secs, 1), "budget_s": budget, "command": " ".join(cmd),
            "counts": counts, "failed_tests": failed[:100], "collection_errors": errors, "note": note}
    if status != "passed":
        step["cause"] = pytest_cause(status, rc, budget, counts, failed, errors, tail)
        step["output_tail"] = tail[-1500:]
    return run.add(step)


def step_env(run: Run) -> None:
    t0 = time.monotonic()
    import torch

    cuda = torch.cuda.is_available()
    commit = ""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001 - a tree without .git
        pass
    missing = [m for m in ("pytest", "xdist", "hypothesis", "nvtx") if importlib.util.find_spec(m) is None]
    run.info.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                    device=torch.cuda.get_device_name(0) if cuda else "cpu",
                    gpus=torch.cuda.device_count() if cuda else 0,
                    xdist=importlib.util.find_spec("xdist") is not None, cpus=os.cpu_count(), commit=commit or "?",
                    missing_modules=missing)
    status = "passed" if cuda or run.dry_run else "failed"
    run.add({"name": "env", "status": status, "seconds": round(time.monotonic() - t0, 1),
             "note": ("" if cuda else "no CUDA (dry run)" if run.dry_run else "")
             + (f"; not installed: {', '.join(missing)}" if missing else ""),
             **({} if status == "passed" else {"cause": "no CUDA device visible to torch"})})


def step_native(run: Run, build: bool, env: dict) -> None:
    if not build:
        env["MFSDP2_NATIVE"] = "0"
        run.add({"name": "native", "status": "skipped", "seconds": 0.0,
                 "note": "not built (--native builds it); MFSDP2_NATIVE=0: PyTorch reference paths"})
        return
    budget = run.budget("native")
    rc, secs, tail = _call([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], budget,
                           env, os.path.join(run.out, "native.log"))
    if rc != 0:
        env["MFSDP2_NATIVE"] = "0"
    cause = f"timed out: stopped at its {budget:.0f} s budget" if rc is None else f"build failed (rc {rc})"
    run.add({"name": "native", "status": "passed" if rc == 0 else "failed", "seconds": round(secs, 1),
             "note": "" if rc == 0 else "MFSDP2_NATIVE=0 for the other steps",
             **({"cause": cause, "output_tail": tail[-1500:]} if rc != 0 else {})})


def step_gates(run: Run, env: dict) -> None:
    if run.dry_run:
        run.add({"name": "gates", "status": "skipped", "seconds": 0.0, "note": "needs CUDA"})
        return
    t0 = time.monotonic()
    found = {}
    each = run.budget("gates") / 2
    for gate in ("memop", "hostfunc"):
        rc, _, tail = _call([sys.executable, "-m", "tests._late_streams", gate], each, env,
                            os.path.join(run.out, f"gate_{gate}.log"))
        try:
            found[gate] = json.loads(tail.strip().splitlines()[-1]) if rc == 0 else {"error": f"rc {rc}"}
        except (ValueError, IndexError):
            found[gate] = {"error": tail[-300:]}
    works = [g for g, r in found.items() if r.get("armed") and r.get("held") and r.get("released")]
    if works:
        env["MFSDP2_SLOW_GATE"] = works[0]
    run.add({"name": "gates", "status": "passed" if works else "failed", "seconds": round(time.monotonic() - t0, 1),
             "note": f"using {works[0]}" if works else "", "gates": found,
             **({} if works else {"cause": "no device-side gate works: " + "; ".join(
                 f"{g}: {r.get('error', r)}" for g, r in found.items())[:300]})})


def _simulated(cmd: list[str], run: Run, name: str) -> list[str]:
    """``--simulate-timeout NAME``: the step's command sleeps past any budget instead (dry-run tests)."""
    if name in run.info.get("simulate_timeout", ()):
        return [sys.executable, "-c", "import time; time.sleep(3600)"]
    return cmd


def step_benchmark(run: Run, env: dict, steps: int) -> None:
    path = os.path.join(run.out, "gpu_ws1.json")
    budget = run.budget("benchmark")
    bench_env = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(_free_port()))
    cmd = [sys.executable, "benchmarks/gpu.py", "--frameworks", "mfsdp2,fsdp2", "--json", path]
    if run.dry_run:
        cmd += ["--device", "cpu", "--model-size", "tiny", "--steps", "1", "--warmup", "2", "--block", "1",
                "--seq", "16", "--batch", "1", "--no-floor"]
    else:
        cmd += ["--steps", str(steps), "--warmup", "3"]
    cmd = _simulated(cmd, run, "benchmark")
    rc, secs, tail = _call(cmd, budget, bench_env, os.path.join(run.out, "benchmark.log"))
    results = {}
    if rc == 0 and os.path.exists(path):
        with open(path) as f:
            case = json.load(f)["cases"][0]
        keys = ("step_s_median", "tokens_per_s", "mfu", "collectives_per_step", "peak_tensor_bytes",
                "max_memory_allocated_bytes", "max_memory_reserved_bytes")
        results = {fw: {k: case[fw].get(k) for k in keys} for fw in ("mfsdp2", "fsdp2") if fw in case}
    status = "timeout" if rc is None else "passed" if rc == 0 and results else "failed"
    cause = (f"timed out: stopped at its {budget:.0f} s budget" if rc is None
             else f"benchmarks/gpu.py exited with code {rc}" if rc else "no results written")
    run.add({"name": "benchmark", "status": status, "seconds": round(secs, 1), "command": " ".join(cmd),
             "results": results, "world_size": 1,
             **({"cause": cause, "output_tail": tail[-1500:]} if status != "passed" else {})})


def step_profile(run: Run, env: dict) -> None:
    budget = run.budget("profile")
    cmd = [sys.executable, "tools/gpu_profile.py", "--out", run.out, "--timeout", str(max(budget - GRACE - 5, 5))]
    cmd += ["--cpu", "--warmup", "1"] if run.dry_run else []
    cmd = _simulated(cmd, run, "profile")
    rc, secs, tail = _call(cmd, budget, env, os.path.join(run.out, "profile.log"))
    path = os.path.join(run.out, "profile_summary.json")
    summary = {}
    if rc == 0 and os.path.exists(path):
        with open(path) as f:
            full = json.load(f)
        r0 = full["ranks"][0]
        summary = {"device": full["device"], "ranges": r0["ranges"], "streams": len(r0["streams"]),
                   "side_busy_ms": r0["side_busy_ms"], "overlap_ms": r0["overlap_ms"],
                   "overlap_fraction": r0["overlap_fraction"]}
    status = "timeout" if rc is None else "passed" if rc == 0 and summary else "failed"
    cause = (f"timed out: stopped at its {budget:.0f} s budget" if rc is None
             else f"tools/gpu_profile.py exited with code {rc}" if rc else "no summary written")
    run.add({"name": "profile", "status": status, "seconds": round(secs, 1), "command": " ".join(cmd),
             "results": summary,
             **({"cause": cause, "output_tail": tail[-1500:]} if status != "passed" else {})})


def budgets_from(args) -> dict:
    budgets = dict(BUDGETS)
    if args.native:
        budgets["native"] = NATIVE_BUDGET
        budgets["cuda_tests"] -= NATIVE_BUDGET
    for item in filter(None, (args.budgets or "").split(",")):
        name, _, secs = item.partition("=")
        if name not in budgets:
            raise SystemExit(f"gpu_check: unknown step {name!r} in --budgets (steps: {', '.join(budgets)})")
        budgets[name] = float(secs)
    return budgets


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu-check-results"),
                   help="where summary.txt / summary.json and the logs go (default: $OUT, else gpu-check-results)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: the plumbing with trivial selections (see the docstring)")
    p.add_argument("--suite", action="store_true", help="run the rest of the suite (-m 'not cuda') instead")
    p.add_argument("--native", action="store_true", help="build the native kernels first")
    p.add_argument("--workers", type=int, default=14, help="pytest -n for the suite (default 14)")
    p.add_argument("--bench-steps", type=int, default=10)
    p.add_argument("--budgets", default="", help="override step budgets, e.g. benchmark=30,profile=20 (tests)")
    p.add_argument("--dry-tests", default="", help="comma-separated pytest targets for the dry run's pytest steps")
    p.add_argument("--simulate-timeout", default="", help="comma-separated steps whose command hangs (tests)")
    a = p.parse_args(argv)
    budgets = budgets_from(a)
    run = Run(a.out, a.dry_run, budgets, SUITE_STEPS if a.suite else STEPS)
    run.info["simulate_timeout"] = [x for x in a.simulate_timeout.split(",") if x]
    env = _env()
    step_env(run)
    dry = {k: (a.dry_tests.split(",") if a.dry_tests else v) for k, v in DRY_TESTS.items()}
    if a.suite:
        env["MFSDP2_NATIVE"] = env.get("MFSDP2_NATIVE", "0")
        targets = dry["suite"] if a.dry_run else ["tests", "-m", "not cuda"]
        pytest_step(run, "suite", targets, 1 if a.dry_run else a.workers, env)
    else:
        step_native(run, a.native, env)
        step_gates(run, env)
        targets = dry["cuda_tests"] if a.dry_run else [*cuda_test_files(), "-m", "cuda"]
        pytest_step(run, "cuda_tests", targets, 1 if a.dry_run else 8, env, dist="loadgroup")
        step_benchmark(run, env, a.bench_steps)
        step_profile(run, env)
    s = run.summary()
    print(render(s), end="")
    print(f"gpu-check: summary in {os.path.join(a.out, 'summary.json')}")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
