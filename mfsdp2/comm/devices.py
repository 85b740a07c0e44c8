"""Which device a mesh computes on, and which backend of a process group serves a device.

Why not ``dist.get_backend(group) == "nccl"``: a process group may hold one backend per device
type, and ``get_backend`` names the group, not the backend a tensor's collective goes to.
``init_process_group()`` without a backend reports ``"undefined"`` (its backends are
``cpu:gloo,cuda:nccl`` where CUDA is present), and ``init_process_group("cpu:gloo,cuda:nccl")``
reports that whole string: a string test takes both for "not NCCL" -- a GPU job then gets a CPU
mesh, and its reductions lose NCCL's ``PREMUL_SUM`` and native ``AVG``. The group's backend
*config* (``dist.get_backend_config``, e.g. ``"cpu:gloo,cuda:nccl"``) says which backend runs a
collective on tensors of each device type; everything here asks it that question (also
``placement.communicable``: can a mesh's groups communicate host tensors where they are).

The decisions are plain functions of that string (and of the accelerator present), so they are
tested on machines without one; tests also point a mesh of a device this machine lacks (a CUDA
mesh on a CPU-only torch) at the CPU through :func:`mesh_compute_device`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = [
    "parse_backend_config",
    "backend_for_device",
    "group_backend",
    "default_mesh_device_type",
    "mesh_compute_device",
    "reduce_op_support",
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


def default_mesh_device_type(accelerator: Optional[str], config: str) -> str:
    """The device type of ``fully_shard``'s default mesh (no ``mesh`` given).

    ``accelerator``: the accelerator's device type if one is present (``"cuda"``), else ``None``;
    ``config``: the default group's backend config. The accelerator when the group runs its
    collectives with a backend built for it (NCCL, ...): ``init_process_group()``,
    ``"nccl"``, ``"cpu:gloo,cuda:nccl"``. The CPU when it has none, or only gloo (an explicit
    ``init_process_group("gloo")``: gloo moves accelerator tensors through host memory, so a gloo
    job is taken for a CPU job; FSDP2 would pick the accelerator here -- pass a mesh to say so).
    """
    if not accelerator:
        return "cpu"
    backend = backend_for_device(config, accelerator)
    return accelerator if backend not in (None, "gloo") else "cpu"


def mesh_compute_device(mesh) -> torch.device:
    """The device a mesh's units compute on: ``cuda:<current device>`` for a CUDA mesh (as FSDP2's
    ``_get_device_from_mesh``), else the mesh's device type."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def reduce_op_support(backend: Optional[str]) -> tuple[bool, bool]:
    """``(PREMUL_SUM, native AVG)`` for collectives run by ``backend``: NCCL has both; gloo neither
    (there, gradients are pre-scaled while packing and AVG is a SUM then a division)."""
    nccl = backend == "nccl"
    return nccl and hasattr(dist, "_make_nccl_premul_sum"), nccl
