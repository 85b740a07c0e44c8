"""torch's own ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``) on mfsdp2 units.

The tracker instruments FSDP2's internals: it replaces each unit's forward hooks through the
state's hook handles and wraps its group's ``pre_backward`` / ``post_backward``. mfsdp2's units
answer those names (``runtime/fsdp2_state.py``) and call their backward hooks through the wrapped
methods, so the tracker runs as on FSDP2 and sees every phase. Checked against FSDP2 on the same
model in the same ranks: the same categories are reported, and the persistent ones hold the bytes
mfsdp2 keeps -- the sharded parameters are this rank's main-weight pieces, the optimizer states
AdamW's two moments over them. What the tracker cannot see as FSDP2's (docs/memory.md): a
gathered unit's zero-copy storage aliases an allocator block, which it counts again as its
all-gather output, so its total is an upper bound of mfsdp2's peak
(``memory.memory_bound.StepMemoryTracker`` measures it exactly).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from ..fsdp2_compat import runtimes
from .._dist import run_ranks


def _track(rank: int, ws: int) -> dict:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from mfsdp2.memory.memory_bound import StepMemoryTracker

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, shard in runtimes().items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        for m in (model[0], model[2]):
            shard(m, mesh=mesh)
        shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(8, 64)

        def step():
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

        step()
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs((x,))
        with tracker:
            step()
        peak = {str(k).split(".")[-1]: v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
        pieces = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        states = sum(v.to_local().numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
                     if k != "step")
        r = {"peak": peak, "pieces": pieces, "states": states,
             "modules": sorted(str(type(m).__name__) for m in tracker.memory_tracking)}
        if name == "mfsdp2":
            own = StepMemoryTracker(model, opt, x)
            with own:
                step()
            r["own_peak"] = own.result().peak_bytes
        out[name] = r
    return out


def test_torch_fsdp_mem_tracker_runs_on_units():
    for res in run_ranks(_track, 2):
        ours, theirs = res["mfsdp2"], res["fsdp2"]
        assert set(ours["peak"]) == set(theirs["peak"])
        assert ours["modules"] == theirs["modules"], (ours["modules"], theirs["modules"])
        for cat in ("SHARDED_PARAM", "OPT", "ACT", "ALL_GATHER", "UNSHARDED_GRAD"):
            assert ours["peak"][cat] > 0, (cat, ours["peak"])
        # Sharded parameters: this rank's main-weight pieces, to the byte (rows of 16-byte
        # aligned pieces: up to one row more or less than FSDP2's halves).
        assert abs(ours["peak"]["SHARDED_PARAM"] - ours["pieces"]) <= 1024, ours
        assert ours["peak"]["OPT"] >= ours["states"], ours
        assert ours["peak"]["Total"] >= ours["own_peak"], ours  # an upper bound (aliased storages)
