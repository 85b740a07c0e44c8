"""Default device and reduction ops follow the backend that serves each device, not the group's name.

``dist.get_backend()`` names the group: ``"undefined"`` after ``init_process_group()`` without a
backend, the whole ``"cpu:gloo,cuda:nccl"`` string for a two-backend group. Testing it against
``"nccl"`` gave a GPU job a CPU mesh (with advice to move the model to the CPU) and turned off NCCL's
PREMUL_SUM and native AVG. These checks run without a GPU: the backend configs are the strings
torch reports on a GPU machine, and CUDA's presence is patched where the decision reads it.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mfsdp2.comm import devices

from .._dist import free_port

# (what dist.get_backend() says, what dist.get_backend_config() says) on a GPU machine
GPU_GROUPS = {
    "nccl": ("nccl", "cuda:nccl"),
    "no backend": ("undefined", "cpu:gloo,cuda:nccl"),
    "cpu:gloo,cuda:nccl": ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
    "gloo": ("gloo", "cpu:gloo,cuda:gloo"),
}
EXPECTED_MESH = {"nccl": "cuda", "no backend": "cuda", "cpu:gloo,cuda:nccl": "cuda", "gloo": "cpu"}


def test_backend_config_parsing():
    assert devices.parse_backend_config("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert devices.parse_backend_config(" cuda:NCCL ") == {"cuda": "nccl"}
    assert devices.backend_for_device("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert devices.backend_for_device("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert devices.backend_for_device("cuda:nccl", "cpu") is None
    assert devices.backend_for_device("cpu:gloo", "cuda") is None
    assert devices.backend_for_device("mybackend", "cuda") == "mybackend"  # a bare name serves all


@pytest.mark.parametrize("case", GPU_GROUPS)
def test_default_mesh_device_type(case):
    _, config = GPU_GROUPS[case]
    assert devices.default_mesh_device_type("cuda", config) == EXPECTED_MESH[case]
    assert devices.default_mesh_device_type(None, config) == "cpu"


def test_reduce_op_support():
    assert devices.reduce_op_support("nccl") == (hasattr(dist, "_make_nccl_premul_sum"), True)
    assert devices.reduce_op_support("gloo") == (False, False)
    assert devices.reduce_op_support(None) == (False, False)


@pytest.fixture
def world_of_one():
    """A real one-rank group from ``init_process_group()`` without a backend (this CPU machine's
    report: ``"undefined"`` / ``"cpu:gloo"``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group()
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_no_backend_group_on_this_machine(world_of_one):
    config = dist.get_backend_config()
    assert devices.group_backend(world_of_one, "cpu") == devices.backend_for_device(config, "cpu") == "gloo"
    accelerator = "cuda" if torch.cuda.is_available() else None
    # No CUDA here: a CPU mesh. (With CUDA, torch gives such a group NCCL for it: a CUDA mesh.)
    assert devices.default_mesh_device_type(accelerator, config) == (
        "cuda" if accelerator and "cuda:" in config else "cpu")


@pytest.mark.parametrize("case", GPU_GROUPS)
def test_fully_shard_default_mesh_on_a_gpu_machine(case, world_of_one, monkeypatch):
    """``fully_shard`` without a mesh, as on a GPU machine whose default group is ``case``."""
    import sys

    fs = sys.modules["mfsdp2.frontend.fully_shard"]  # the module (``mfsdp2.fully_shard`` is the function)
    name, config = GPU_GROUPS[case]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    made = []
    monkeypatch.setattr(fs, "init_device_mesh", lambda device_type, shape, **kw: made.append(device_type))
    fs._default_mesh()
    assert made == [EXPECTED_MESH[case]], case


@pytest.mark.parametrize("case", GPU_GROUPS)
def test_communicator_reduce_ops_follow_the_cuda_backend(case, world_of_one, monkeypatch):
    """A CUDA communicator over ``case``'s group uses NCCL's PREMUL_SUM and native AVG exactly
    when NCCL serves CUDA there (streams stubbed: there is no GPU here)."""
    from mfsdp2.comm.communicator import Communicator

    name, config = GPU_GROUPS[case]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0: None)
    comm = Communicator(world_of_one, torch.device("cuda", 0))
    nccl = devices.backend_for_device(config, "cuda") == "nccl"
    assert comm.backend == ("nccl" if nccl else "gloo"), (case, comm.backend)
    assert (comm.premul_sum(0.5) is not None) == nccl, case
    assert comm._native_avg == nccl, case
    # NCCL: async_op=False inside the side streams; gloo's CUDA collectives: async_op=True
    assert comm.stream_ordered == nccl, case
    if devices.backend_for_device(config, "cpu") == "gloo":  # its CPU collectives: gloo's
        cpu = Communicator(world_of_one, torch.device("cpu"))
        assert cpu.backend == "gloo" and cpu.premul_sum(0.5) is None and not cpu._native_avg, case
