"""tools/gpu_profile.py: the summary of a profiled step (ranges, per-stream device work, overlap
of side streams with compute kernels) from synthetic events, exactly; and the tool's run on the
CPU (two gloo ranks): mfsdp2's ranges are found, the device part is empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from gpu_profile import DeviceEvent, summarise  # noqa: E402


def test_overlap_is_the_intersection_of_side_work_with_compute_kernels():
    ms = 1_000_000
    events = [
        DeviceEvent("gemm", 7, 0, 10 * ms, "kernel"),  # compute stream: most kernel time
        DeviceEvent("gemm", 7, 12 * ms, 20 * ms, "kernel"),
        DeviceEvent("Memcpy HtoD", 7, 20 * ms, 21 * ms, "memcpy"),  # compute stream, not a kernel
        DeviceEvent("cast", 13, 5 * ms, 15 * ms, "kernel"),  # side: 5-10 and 12-15 beside compute
        DeviceEvent("Memcpy DtoH", 14, 14 * ms, 16 * ms, "memcpy"),  # side: 14-16 (union 5-16)
        DeviceEvent("Memcpy DtoH", 14, 30 * ms, 31 * ms, "memcpy"),  # alone
    ]
    s = summarise(["mfsdp2.unshard layers.0", "mfsdp2.unshard layers.1", "mfsdp2.reduce_grad root", "aten::mm"], events)
    assert s["ranges"] == {"mfsdp2.reduce_grad": 1, "mfsdp2.unshard": 2}
    assert s["compute_stream"] == 7
    assert s["streams"]["7"] == {"kernels": 2, "memcpy": 1, "busy_ms": 19.0, "kernel_ms": 18.0}
    assert s["side_busy_ms"] == 12.0  # 5-16 and 30-31
    assert s["overlap_ms"] == 9.0  # 5-10, 12-16
    assert s["overlap_fraction"] == 0.75


def test_no_device_events_no_overlap():
    s = summarise(["mfsdp2.reshard root"], [])
    assert s["compute_stream"] is None and s["overlap_fraction"] is None and s["ranges"] == {"mfsdp2.reshard": 1}


@pytest.mark.slow
def test_cpu_run_finds_the_ranges(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "tools/gpu_profile.py", "--cpu", "--out", str(tmp_path), "--warmup", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    s = json.loads((tmp_path / "profile_summary.json").read_text())
    assert s["device"] == "cpu" and len(s["ranks"]) == 2
    for r in s["ranks"]:
        assert r["ranges"]["mfsdp2.unshard"] >= 4 and r["ranges"]["mfsdp2.reduce_grad"] >= 4, r["ranges"]
        assert r["streams"] == {}
    assert (tmp_path / "profile_rank0.json").exists()
