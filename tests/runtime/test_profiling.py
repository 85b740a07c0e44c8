"""mfsdp2's named ranges reach NVTX without the ``nvtx`` package, and the profiler always; no
NVTX call is made while no NVTX tool is attached.

Many GPU machines (our lent one among them) have no ``nvtx`` Python package; mfsdp2's NVTX ranges
then fall back to torch's own binding, ``torch.cuda.nvtx``. This machine's torch is CPU-only, so
its ``torch.cuda.nvtx`` raises: the fallback run stands in a working one that records each
push / pop (what a CUDA build's binding would hand to nsys), with ``nvtx`` blocked from import.
The ``record_function`` ranges must show in a ``torch.profiler`` trace either way.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from mfsdp2.base import profiling

ROOT = pathlib.Path(__file__).resolve().parents[2]

# One ZeRO-3 training step at world size 1 on the CPU (bfloat16 compute, so the units gather), in
# a fresh interpreter where ``nvtx`` cannot be imported and torch.cuda.nvtx records instead of
# calling libnvtx.
_SCRIPT = r"""
import json, os, sys
sys.modules["nvtx"] = None  # `import nvtx` raises ImportError, as on a machine without it
import torch
pushed, popped = [], []
torch.cuda.nvtx.range_push = lambda msg: pushed.append(msg)
torch.cuda.nvtx.range_pop = lambda: popped.append(1)
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from mfsdp2 import MixedPrecisionPolicy, fully_shard
from mfsdp2.base import profiling
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
mesh = init_device_mesh("cpu", (1,))
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # gathers (casts) at one rank too
fully_shard(model[0], mesh=mesh, mp_policy=mp)
fully_shard(model, mesh=mesh, mp_policy=mp)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    model(torch.randn(2, 4)).sum().backward()
events = sorted({e.name for e in prof.events() if e.name.startswith("mfsdp2.")})
print(json.dumps({"source": getattr(profiling, "nvtx_source", None), "pushed": pushed, "popped": len(popped),
                  "events": events}))
dist.destroy_process_group()
"""


def test_nvtx_falls_back_to_torch_cuda_nvtx():
    from .._dist import free_port

    env = dict(os.environ, MFSDP2_NVTX="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(free_port())], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ranges = [m for m in out["pushed"] if m.startswith("mfsdp2.")]
    assert any(m.startswith("mfsdp2.unshard") for m in ranges), f"no unshard range went to NVTX: {out}"
    assert out["source"] == "torch.cuda.nvtx", out
    assert out["popped"] == len(out["pushed"]), "every NVTX range pushed must be popped"
    # The same names, through record_function, in the profiler's trace.
    assert set(ranges) <= set(out["events"]) and any(e.startswith("mfsdp2.unshard") for e in out["events"]), out


def test_nvtx_selection(monkeypatch):
    """The ``nvtx`` package first; without it torch.cuda.nvtx where it works; else none (a
    CPU-only torch, whose torch.cuda.nvtx raises), and ranges still reach the profiler."""
    calls = []
    fake = types.SimpleNamespace(push_range=lambda msg: calls.append(("push", msg)),
                                 pop_range=lambda: calls.append(("pop",)))
    monkeypatch.setitem(sys.modules, "nvtx", fake)
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.delenv("NVTX_INJECTION32_PATH", raising=False)
    monkeypatch.delenv("MFSDP2_NVTX", raising=False)
    assert profiling.select_nvtx() == (None, None, None)  # no tool attached: no NVTX calls at all
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsys/libToolsInjection64.so")
    assert profiling.select_nvtx()[0] == "nvtx"

    monkeypatch.setitem(sys.modules, "nvtx", None)
    if torch.version.cuda is None:
        assert profiling.select_nvtx() == (None, None, None)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: calls.append(("push", msg)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    source, push, pop = profiling.select_nvtx()
    assert source == "torch.cuda.nvtx"

    calls.clear()
    monkeypatch.setattr(profiling, "_nvtx_push", push)
    monkeypatch.setattr(profiling, "_nvtx_pop", pop)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with profiling.trace_range("mfsdp2.test outer"):
            with profiling.trace_range("mfsdp2.test inner"):
                torch.ones(2).sum()
    assert calls == [("push", "mfsdp2.test outer"), ("push", "mfsdp2.test inner"), ("pop",), ("pop",)]
    names = {e.name for e in prof.events()}
    assert {"mfsdp2.test outer", "mfsdp2.test inner"} <= names


@pytest.mark.cuda
def test_nvtx_source_on_cuda():
    """On a CUDA machine with a tool attached some NVTX binding is chosen (the package or torch's)."""
    assert profiling.select_nvtx(attached=True)[0] in ("nvtx", "torch.cuda.nvtx")


def test_nvtx_tool_attached():
    assert not profiling.nvtx_tool_attached({})
    assert profiling.nvtx_tool_attached({"NVTX_INJECTION64_PATH": "/x/libToolsInjection64.so"})
    assert profiling.nvtx_tool_attached({"MFSDP2_NVTX": "1"})
    assert not profiling.nvtx_tool_attached({"MFSDP2_NVTX": "0", "NVTX_INJECTION64_PATH": ""})
