"""``make gpu-check`` (tools/gpu_check.py) on a machine without a GPU: its ``--dry-run`` runs every
step's plumbing -- environment, native-kernel decision, pytest with junit counting, the world-size-1
benchmark (a tiny model on gloo), the summary files -- with trivial selections, and the summary it
writes says what ran, what was skipped for want of CUDA, and the benchmark's figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gpu_check  # noqa: E402


@pytest.mark.slow
def test_dry_run_writes_a_summary_of_every_step(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("OUT", None)
    res = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(tmp_path), "--budget", "280"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=330)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    steps = {st["name"]: st for st in s["steps"]}
    assert list(steps) == list(gpu_check.STEPS)
    assert s["ok"] and s["dry_run"] and s["failed_steps"] == []
    assert s["torch"] and s["python"] and s["device"] == "cpu"
    assert steps["native"]["status"] == "skipped" and "MFSDP2_NATIVE=0" in steps["native"]["note"]
    assert steps["gates"]["status"] == "skipped"
    for name in ("cuda_tests", "suite"):
        st = steps[name]
        assert st["status"] == "passed" and st["counts"]["passed"] >= 1 and st["counts"]["failed"] == 0, st
        assert (tmp_path / f"{name}.xml").exists() and (tmp_path / f"{name}.log").exists()
    bench = steps["benchmark"]
    assert bench["status"] == "passed" and bench["world_size"] == 1, bench
    for fw in ("mfsdp2", "fsdp2"):
        r = bench["results"][fw]
        assert r["step_s_median"] > 0 and r["collectives_per_step"] == 0, r  # world size 1: none
        assert "max_memory_allocated_bytes" in r and "max_memory_reserved_bytes" in r  # None on the CPU
    prof = steps["profile"]
    assert prof["status"] == "passed" and prof["results"]["device"] == "cpu", prof
    assert prof["results"]["ranges"].get("mfsdp2.unshard", 0) >= 1, prof
    text = (tmp_path / "summary.txt").read_text()
    assert text.startswith("gpu-check (dry run): OK") and "benchmark" in text


def test_junit_counts_and_a_failed_step_in_the_summary(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_a" name="ok"/>'
        '<testcase classname="tests.test_a" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_b" name="err"><error message="y"/></testcase>'
        '<testcase classname="tests.test_b" name="skip"><skipped message="z"/></testcase></testsuite></testsuites>'
    )
    counts, failed = gpu_check.junit_counts(str(xml))
    assert counts == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert failed == ["tests.test_a::bad", "tests.test_b::err"]
    run = gpu_check.Run(str(tmp_path / "out"), dry_run=False, budget_s=10)
    run.add({"name": "cuda_tests", "status": "failed", "seconds": 1.0, "counts": counts, "failed_tests": failed})
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert not s["ok"] and s["failed_steps"] == ["cuda_tests"]
    assert "FAILED tests.test_a::bad" in (tmp_path / "out" / "summary.txt").read_text()
