"""The demo (make demo) runs end to end and its profiler trace shows the runtime's named ranges."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .._dist import free_port


@pytest.mark.slow
def test_demo_trains_and_its_trace_has_named_ranges(tmp_path):
    trace = tmp_path / "trace.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "mfsdp2.examples.demo", "--steps", "4", "--batch", "4", "--seq", "32",
        "--profile", str(trace),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "loss first / last" in out.stdout and "all-gathered / step" in out.stdout
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
    for prefix in ("mfsdp2.unshard", "mfsdp2.reshard", "mfsdp2.reduce_grad", "mfsdp2.final_callback"):
        assert any(n.startswith(prefix) for n in names), prefix
    assert any(n.startswith("gloo:") for n in names)  # the collectives themselves are in the trace
