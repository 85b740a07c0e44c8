"""Under CPU offload, every mfsdp2 load path waits for the copies that still read host memory.

On CUDA with pinned host memory, a gather copies the main weights to the device without blocking
the host; the copy reads the host memory whenever the stream gets to it. A load that writes the
main weights right after an eval forward (a checkpoint load, an EMA swap through a state dict)
would race it: the device could read half-old, half-new weights. mfsdp2's load paths settle the
outstanding copies first (``memory.offload.settle_host_reads``).

On the CPU the copies are synchronous, so the race is made visible here: each copy from main
memory is replaced by one that copies at once but leaves behind a "late" event remembering what it
read; when the event is settled it checks that the host memory still holds those values. A load
path that writes before settling leaves an event that finds other values -- a torn read.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

import mfsdp2
from mfsdp2.groups import weight_changes
from mfsdp2.memory import buffer, offload

from .._dist import run_ranks


class _LateRead:
    """Stands for the CUDA event after a non-blocking copy: settling it is when the copy "ran"."""

    torn: list = []

    def __init__(self, src: torch.Tensor) -> None:
        self.src, self.seen = src, src.detach().clone()

    def synchronize(self) -> None:
        if not torch.equal(self.src, self.seen):
            _LateRead.torn.append(tuple(self.src.shape))


def _late_copy_from_main(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)
    offload._host_reads[(dst.device, id(src))] = _LateRead(src)


def _model(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for m in (model[0], model[2]):
        mfsdp2.fully_shard(m, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    mfsdp2.fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model


def _run(rank: int, ws: int, tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from mfsdp2.checkpoint.state_dict import load_hf_safetensors, save_hf_safetensors

    mesh = init_device_mesh("cpu", (ws,))
    model = _model(mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    new = {k: v.full_tensor() * 0 + 0.5 for k, v in model.state_dict().items()}
    other = _model(mesh)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.0)
    dcp.save(other.state_dict(), checkpoint_id=f"{tmp}/dcp")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(3.0)
    save_hf_safetensors(other, f"{tmp}/hf")  # values neither of the loads before holds
    buffer.copy_from_main, weight_changes.copy_from_main = _late_copy_from_main, _late_copy_from_main
    torn = {}
    for name, load in (
        ("load_state_dict", lambda: model.load_state_dict(new)),
        ("dcp.load", lambda: dcp.load(model.state_dict(), checkpoint_id=f"{tmp}/dcp")),
        ("load_hf_safetensors", lambda: load_hf_safetensors(model, f"{tmp}/hf")),
    ):
        _LateRead.torn.clear()
        with torch.no_grad():
            model(x)  # an eval forward: its gathers copy the main weights out "late"
        assert offload._host_reads, "the forward made no copy from main memory"
        load()
        offload.settle_host_reads()
        torn[name] = list(_LateRead.torn)
    return torn


def test_every_load_path_settles_host_reads_first(tmp_path):
    for torn in run_ranks(_run, 2, str(tmp_path)):
        assert torn == {k: [] for k in torn}, f"writes before the copies that read host memory ended: {torn}"
