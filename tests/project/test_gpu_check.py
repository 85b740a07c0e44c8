"""``make gpu-check`` (tools/gpu_check.py) on a machine without a GPU: its ``--dry-run`` runs every
step's plumbing -- environment, native-kernel decision, pytest with junit counting, the world-size-1
benchmark (a tiny model on gloo), the summary files -- with trivial selections, and the summary it
writes says what ran, what was skipped for want of CUDA, and the benchmark's figures. A step that
runs over its budget and a test file that fails to collect are reported with their causes while
the other steps still run; the budgets fit five minutes; every CUDA test carries the ``cuda``
marker; a machine without ``hypothesis`` or ``pytest`` gets skips and a named cause, not a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gpu_check  # noqa: E402


@pytest.mark.slow
def test_dry_run_writes_a_summary_of_every_step(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("OUT", None)
    res = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=330)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    steps = {st["name"]: st for st in s["steps"]}
    assert list(steps) == list(gpu_check.STEPS)
    assert s["ok"] and s["dry_run"] and s["failed_steps"] == []
    assert s["torch"] and s["python"] and s["device"] == "cpu"
    assert steps["native"]["status"] == "skipped" and "MFSDP2_NATIVE=0" in steps["native"]["note"]
    assert steps["gates"]["status"] == "skipped"
    for name in ("cuda_tests",):
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
    run = gpu_check.Run(str(tmp_path / "out"), dry_run=False, budgets=dict(gpu_check.BUDGETS))
    run.add({"name": "cuda_tests", "status": "failed", "seconds": 1.0, "counts": counts, "failed_tests": failed})
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert not s["ok"] and s["failed_steps"] == ["cuda_tests"]
    assert "FAILED tests.test_a::bad" in (tmp_path / "out" / "summary.txt").read_text()


def test_budgets_fit_five_minutes():
    """Each mode's step budgets -- each including its commands' start and kill grace -- sum to
    under the device call's five minutes, with and without the native build."""
    import argparse

    for native in (False, True):
        budgets = gpu_check.budgets_from(argparse.Namespace(native=native, budgets=""))
        assert sum(budgets[n] for n in gpu_check.STEPS) <= 285, (native, budgets)
        assert all(budgets[n] > gpu_check.GRACE for n in gpu_check.STEPS if n not in ("native", "env") or native)
    assert sum(gpu_check.BUDGETS[n] for n in gpu_check.SUITE_STEPS) <= 285


@pytest.mark.slow
def test_a_timeout_and_a_collection_error_are_reported_and_the_rest_runs(tmp_path):
    """The benchmark hangs (simulated) and one test file cannot be imported: the run still ends
    within its budgets, the other steps run, and the summary names each step and its cause."""
    broken = tmp_path / "test_broken_collect.py"
    broken.write_text("import a_module_that_is_not_there  # noqa\n\ndef test_never():\n    pass\n")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("OUT", None)
    good = gpu_check.DRY_TESTS["cuda_tests"][0]
    res = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(out),
                          "--budgets", "benchmark=6", "--simulate-timeout", "benchmark",
                          "--dry-tests", f"{good},{broken}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=330)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    steps = {st["name"]: st for st in s["steps"]}
    assert list(steps) == list(gpu_check.STEPS)  # every step ran or was recorded
    assert not s["ok"] and s["failed_steps"] == ["cuda_tests", "benchmark"], s["failed_steps"]
    bench = steps["benchmark"]
    assert bench["status"] == "timeout" and bench["seconds"] <= 6 + 2, bench
    assert "timed out" in s["causes"]["benchmark"] and "6 s budget" in s["causes"]["benchmark"]
    tests = steps["cuda_tests"]
    assert tests["counts"]["passed"] == 1, tests  # the good test still ran
    assert "collection errors in" in s["causes"]["cuda_tests"] and "test_broken_collect.py" in s["causes"]["cuda_tests"]
    assert steps["profile"]["status"] == "passed"  # the step after the timeout ran
    text = (out / "summary.txt").read_text()
    assert "cause: timed out" in text and "cause: collection errors in" in text


@pytest.mark.slow
def test_suite_mode_dry_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("OUT", None)
    res = subprocess.run([sys.executable, "tools/gpu_check.py", "--suite", "--dry-run", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=330)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert [st["name"] for st in s["steps"]] == ["env", "suite"] and s["ok"]
    assert s["steps"][1]["counts"]["passed"] >= 1 and s["steps"][1]["counts"]["failed"] == 0


def test_missing_pytest_is_a_named_error(tmp_path, monkeypatch):
    real = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda n, *a: None if n == "pytest" else real(n, *a))
    run = gpu_check.Run(str(tmp_path), dry_run=True, budgets=dict(gpu_check.BUDGETS))
    st = gpu_check.pytest_step(run, "cuda_tests", ["tests/x.py"], 1, {})
    assert st["status"] == "error" and "pytest is not installed" in st["cause"]
    assert json.loads((tmp_path / "summary.json").read_text())["causes"]["cuda_tests"] == st["cause"]


def test_every_cuda_test_carries_the_cuda_marker():
    """No test decides by itself whether CUDA is there (a skipif of its own would hide it from
    ``-m cuda``); the marker's files are the ones gpu-check collects."""
    import re

    offenders = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "tests")):
        for f in files:
            if f.endswith(".py") and f != "conftest.py":
                text = open(os.path.join(dirpath, f)).read()
                if re.search(r"skipif\(\s*not torch\.cuda\.is_available\(\)", text):
                    offenders.append(f)
    assert offenders == []
    files = gpu_check.cuda_test_files()
    for expected in ("tests/system/test_cuda_parity.py", "tests/system/test_cuda_zero_copy.py",
                     "tests/system/test_cuda_streams.py", "tests/optim/test_optim_cuda.py",
                     "tests/runtime/test_host_sync.py", "tests/runtime/test_profiling.py",
                     "tests/comm/test_slow_collectives.py"):
        assert expected in files, files


@pytest.mark.slow
def test_without_hypothesis_its_tests_skip_with_the_reason(tmp_path):
    """A machine without ``hypothesis``: the property tests are skipped and say why; the other
    tests of the same files run (no collection error)."""
    hidden = tmp_path / "hidden" / "hypothesis"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hypothesis hidden for this test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "hidden"), ROOT]))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "-p", "no:hypothesispytest",
                          "tests/memory/test_layout_planner.py", "tests/memory/test_layout_optimality.py",
                          "tests/precision/test_fp8_tiles.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "hypothesis is not installed" in res.stdout and "error" not in res.stdout.splitlines()[-1]
