"""``make gpu-check``: everything a lent GPU machine should run, in one command, within a budget.

Runs from the source tree with the machine's own python and torch (``PYTHONPATH`` = the tree; no
venv, no pip, nothing installed), and writes ``summary.txt`` and ``summary.json`` into ``$OUT``
when set (the device tool brings back what is written there), else into ``--out`` /
``gpu-check-results``. The summary is rewritten after every step, so a run cut short still
reports what it did. Steps, in order:

1. ``env``: python, torch, CUDA, the device, the tree's commit.
2. ``native``: the native kernels are built only with ``--native`` (a C++ build against torch's
   headers takes minutes on a fresh machine); otherwise every step runs with ``MFSDP2_NATIVE=0``,
   mfsdp2's PyTorch reference paths.
3. ``gates``: which device-side gate the late-collectives harness can use on this driver
   (``python -m tests._late_streams``, each in a subprocess with a timeout); the one that works
   is passed on as ``MFSDP2_SLOW_GATE``.
4. ``cuda_tests``: ``tests/test_cuda.py``, ``tests/optim/test_optim_cuda.py`` and the two-ranks-on-one-GPU suite
   (``tests/comm/test_slow_collectives.py`` and its harness tests), ``pytest -n`` by file.
5. ``benchmark``: ``benchmarks/gpu.py`` at world size 1 (mfsdp2 and FSDP2: step time, memory
   including ``max_memory_allocated`` / ``max_memory_reserved``).
6. ``profile``: one profiled step of two ranks on the one GPU (``tools/gpu_profile.py``): mfsdp2's
   named ranges, device work per stream, and how much of the side streams' work ran beside the
   compute stream's kernels.
7. ``suite``: the rest of the test suite with ``pytest -n 14`` (ports cannot collide: the test
   ranks' rendezvous stores are held by their parent, see tests/_dist.py).

``--dry-run`` runs the same plumbing on a machine without a GPU, fast: the steps that need CUDA
are recorded as skipped, the pytest steps run a trivial selection each, and the benchmark runs a
tiny model on gloo (``tests/test_gpu_check.py`` checks the summary it writes).
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
CUDA_TESTS = ["tests/test_cuda.py", "tests/optim/test_optim_cuda.py", "tests/comm/test_slow_collectives.py",
              "tests/comm/test_slow_collectives_harness.py"]
# --dry-run: one fast CPU test per pytest step (the plumbing, not the suite)
DRY_TESTS = {
    "cuda_tests": ["tests/memory/test_offload_copies.py::test_copies_between_host_memories_block_and_record_nothing"],
    "suite": ["tests/comm/test_comm_backend.py::test_only_nccl_like_backends_on_cuda_are_stream_ordered"],
}
STEPS = ("env", "native", "gates", "cuda_tests", "benchmark", "profile", "suite")


class Run:
    """The steps' results and the summary files (rewritten after each step)."""

    def __init__(self, out: str, dry_run: bool, budget_s: float) -> None:
        self.out = out
        self.dry_run = dry_run
        self.budget_s = budget_s
        self.t0 = time.monotonic()
        self.steps: list[dict] = []
        self.info: dict = {}
        os.makedirs(out, exist_ok=True)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def add(self, step: dict) -> dict:
        self.steps.append(step)
        self.write()
        return step

    def summary(self) -> dict:
        bad = [s["name"] for s in self.steps if s["status"] in ("failed", "timeout", "error")]
        return {
            "ok": not bad and len(self.steps) == len(STEPS),
            "failed_steps": bad,
            "dry_run": self.dry_run,
            "budget_s": self.budget_s,
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


def _call(cmd: list[str], timeout: float, env: dict, log: str) -> tuple[Optional[int], float, str]:
    """(return code -- None on timeout --, seconds, output tail); the full output goes to ``log``.

    On timeout the command gets SIGINT first (pytest then stops, reports what ran and writes its
    junit file), and is killed 20 s later if it is still running."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: Optional[int] = p.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            rc = None
            os.killpg(p.pid, signal.SIGINT)
            try:
                p.wait(timeout=20)
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
    for case in ET.parse(path).getroot().iter("testcase"):
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


def pytest_step(run: Run, name: str, targets: list[str], workers: int, timeout: float, env: dict,
                extra: Optional[list[str]] = None, dist: str = "loadfile") -> dict:
    xml = os.path.join(run.out, f"{name}.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *targets, *(extra or [])]
    note = ""
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        # loadgroup: the tests of one multi-process launch (an xdist_group) stay on one worker,
        # the rest are spread one by one; the suite keeps each file on one worker (its module
        # fixtures launch ranks once per worker that runs them)
        cmd += ["-n", str(workers), "--dist", dist]
    elif workers > 1:
        note = "pytest-xdist not installed: serial"
    rc, secs, tail = _call(cmd, timeout, env, os.path.join(run.out, f"{name}.log"))
    counts, failed = junit_counts(xml)
    status = "timeout" if rc is None else "passed" if rc == 0 else "failed"
    if rc not in (None, 0, 1):  # 1: tests failed; others: usage / internal errors / no tests
        status = "error"
    return run.add({"name": name, "status": status, "seconds": round(secs, 1), "command": " ".join(cmd),
                    "counts": counts, "failed_tests": failed[:100], "note": note,
                    **({"output_tail": tail[-1500:]} if status != "passed" else {})})


def step_env(run: Run) -> None:
    import torch

    cuda = torch.cuda.is_available()
    commit = ""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - a tree without .git
        pass
    run.info.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                    device=torch.cuda.get_device_name(0) if cuda else "cpu", gpus=torch.cuda.device_count() if cuda else 0,
                    xdist=importlib.util.find_spec("xdist") is not None, cpus=os.cpu_count(), commit=commit or "?")
    status = "passed" if cuda or run.dry_run else "failed"
    run.add({"name": "env", "status": status, "seconds": 0.0,
             "note": "" if cuda else ("no CUDA (dry run)" if run.dry_run else "no CUDA device visible")})


def step_native(run: Run, build: bool, env: dict) -> None:
    if not build:
        env["MFSDP2_NATIVE"] = "0"
        run.add({"name": "native", "status": "skipped", "seconds": 0.0,
                 "note": "not built (--native builds it); MFSDP2_NATIVE=0: PyTorch reference paths"})
        return
    rc, secs, tail = _call([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], min(240.0, run.left() - 60),
                           env, os.path.join(run.out, "native.log"))
    if rc != 0:
        env["MFSDP2_NATIVE"] = "0"
    run.add({"name": "native", "status": "passed" if rc == 0 else "failed", "seconds": round(secs, 1),
             "note": "" if rc == 0 else "build failed or timed out: MFSDP2_NATIVE=0 for the other steps",
             **({"output_tail": tail[-1500:]} if rc != 0 else {})})


def step_gates(run: Run, env: dict) -> None:
    if run.dry_run:
        run.add({"name": "gates", "status": "skipped", "seconds": 0.0, "note": "needs CUDA"})
        return
    t0 = time.monotonic()
    found = {}
    for gate in ("memop", "hostfunc"):
        rc, _, tail = _call([sys.executable, "-m", "tests._late_streams", gate], 60, env,
                            os.path.join(run.out, f"gate_{gate}.log"))
        try:
            found[gate] = json.loads(tail.strip().splitlines()[-1]) if rc == 0 else {"error": f"rc {rc}"}
        except (ValueError, IndexError):
            found[gate] = {"error": tail[-300:]}
    works = [g for g, r in found.items() if r.get("armed") and r.get("held") and r.get("released")]
    if works:
        env["MFSDP2_SLOW_GATE"] = works[0]
    run.add({"name": "gates", "status": "passed" if works else "failed", "seconds": round(time.monotonic() - t0, 1),
             "note": f"using {works[0]}" if works else "no device-side gate works", "gates": found})


def step_benchmark(run: Run, env: dict, steps: int) -> None:
    path = os.path.join(run.out, "gpu_ws1.json")
    bench_env = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(_free_port()))
    cmd = [sys.executable, "benchmarks/gpu.py", "--frameworks", "mfsdp2,fsdp2", "--json", path]
    if run.dry_run:
        cmd += ["--device", "cpu", "--model-size", "tiny", "--steps", "1", "--warmup", "2", "--block", "1",
                "--seq", "16", "--batch", "1", "--no-floor"]
    else:
        cmd += ["--steps", str(steps), "--warmup", "3"]
    rc, secs, tail = _call(cmd, min(120.0, run.left() - 30), bench_env, os.path.join(run.out, "benchmark.log"))
    results = {}
    if rc == 0 and os.path.exists(path):
        with open(path) as f:
            case = json.load(f)["cases"][0]
        keys = ("step_s_median", "tokens_per_s", "mfu", "collectives_per_step", "peak_tensor_bytes",
                "max_memory_allocated_bytes", "max_memory_reserved_bytes")
        results = {fw: {k: case[fw].get(k) for k in keys} for fw in ("mfsdp2", "fsdp2") if fw in case}
    status = "timeout" if rc is None else "passed" if rc == 0 and results else "failed"
    run.add({"name": "benchmark", "status": status, "seconds": round(secs, 1), "command": " ".join(cmd),
             "results": results, "world_size": 1,
             **({"output_tail": tail[-1500:]} if status != "passed" else {})})


def step_profile(run: Run, env: dict) -> None:
    cmd = [sys.executable, "tools/gpu_profile.py", "--out", run.out] + (["--cpu", "--warmup", "1"] if run.dry_run else [])
    rc, secs, tail = _call(cmd, min(90.0, max(run.left() - 60, 10.0)), env, os.path.join(run.out, "profile.log"))
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
    run.add({"name": "profile", "status": status, "seconds": round(secs, 1), "command": " ".join(cmd), "results": summary,
             **({"output_tail": tail[-1500:]} if status != "passed" else {})})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu-check-results"),
                   help="where summary.txt / summary.json and the logs go (default: $OUT, else gpu-check-results)")
    p.add_argument("--dry-run", action="store_true", help="CPU: the plumbing with trivial selections (see the docstring)")
    p.add_argument("--budget", type=float, default=285.0, help="seconds for all steps (default 285)")
    p.add_argument("--native", action="store_true", help="build the native kernels first")
    p.add_argument("--workers", type=int, default=14, help="pytest -n for the whole suite (default 14)")
    p.add_argument("--bench-steps", type=int, default=10)
    a = p.parse_args(argv)
    run = Run(a.out, a.dry_run, a.budget)
    env = _env()
    step_env(run)
    step_native(run, a.native, env)
    step_gates(run, env)
    cuda_targets = DRY_TESTS["cuda_tests"] if a.dry_run else CUDA_TESTS
    pytest_step(run, "cuda_tests", cuda_targets, 1 if a.dry_run else 8, min(150.0, run.left() - 90), env,
                dist="loadgroup")
    step_benchmark(run, env, a.bench_steps)
    step_profile(run, env)
    suite = DRY_TESTS["suite"] if a.dry_run else ["tests"] + [f"--ignore={t}" for t in CUDA_TESTS]
    pytest_step(run, "suite", suite, 1 if a.dry_run else a.workers, max(run.left() - 5, 10.0), env)
    s = run.summary()
    print(render(s), end="")
    print(f"gpu-check: summary in {os.path.join(a.out, 'summary.json')}")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
