"""Which device a mesh computes on, and which backend of a process group serves a device.

A process group may hold one backend per device type; its backend *config*
(``dist.get_backend_config``, e.g. ``"cpu:gloo,cuda:nccl"``) says which backend runs a collective
on tensors of each device type. ``placement.communicable`` asks it whether a mesh's groups can
communicate host tensors (offloaded shards) where they are.

The decisions are plain functions of that string, so they are tested on machines without a GPU;
tests also point a mesh of a device this machine lacks (a CUDA mesh on a CPU-only torch) at the
CPU through :func:`mesh_compute_device`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = [
    "parse_backend_config",
    "backend_for_device",
    "group_backend",
    "mesh_compute_device",
]


def parse_backend_config(config: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``.

    A bare name (``"nccl"``: how older torch, or a custom backend, may report it) is returned
    under the key ``"*"``: that backend serves whatever it serves, which only it knows."""
    out: dict[str, str] = {}
    for part in str(config).split(","):
        part = part.strip().lower()
        if not part:
            continue
        if ":" in part:
            device, backend = part.split(":", 1)
            out[device.strip()] = backend.strip()
        else:
            out["*"] = part
    return out


def backend_for_device(config: str, device_type: str) -> Optional[str]:
    """The backend a group with backend config ``config`` runs collectives on ``device_type``
    tensors with; ``None`` when it has none for that device type."""
    backends = parse_backend_config(config)
    return backends.get(device_type, backends.get("*"))


def group_backend(group: Optional[dist.ProcessGroup], device_type: str) -> Optional[str]:
    """:func:`backend_for_device` of ``group`` (``None``: the default group)."""
    return backend_for_device(dist.get_backend_config(group), device_type)


def mesh_compute_device(mesh) -> torch.device:
    """The device a mesh's units compute on: ``cuda:<current device>`` for a CUDA mesh (as FSDP2's
    ``_get_device_from_mesh``), else the mesh's device type."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
