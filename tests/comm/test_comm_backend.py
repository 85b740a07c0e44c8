"""How ``mfsdp2.comm.communicator`` decides how to issue a collective, on the CPU: whether the backend that
serves the device's tensors (``mfsdp2.comm.devices``, tested in tests/comm/test_devices.py) is stream-ordered
-- NCCL's path (``async_op=False`` inside the side streams, an event after) -- or not (gloo with
CUDA tensors: ``async_op=True``, the work waited; with ``async_op=False`` the call would block the
host until the data moved).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mfsdp2.comm.communicator import Communicator, stream_ordered_backend
from mfsdp2.comm.devices import group_backend

from .._dist import run_ranks


@pytest.mark.parametrize(
    "name, device, ordered",
    [("nccl", "cuda", True), ("xccl", "cuda", True), ("gloo", "cuda", False), ("nccl", "cpu", False),
     ("gloo", "cpu", False), ("", "cuda", False), ("mpi", "cuda", False), ("local", "cuda", False)],
)
def test_only_nccl_like_backends_on_cuda_are_stream_ordered(name, device, ordered):
    assert stream_ordered_backend(name, device) is ordered


def _decisions(rank, ws):
    g = dist.group.WORLD
    comm = Communicator(g, torch.device("cpu"))
    calls = []
    handle = comm._launch(None, lambda async_op: calls.append(async_op), "probe")
    return {
        "cpu": group_backend(g, "cpu"),
        "cuda": group_backend(g, "cuda"),
        "cuda_ordered": stream_ordered_backend(group_backend(g, "cuda"), "cuda"),
        "comm_backend": comm.backend,
        "comm_ordered": comm.stream_ordered,
        "launch_async": calls,
        "pending": handle.pending,
    }


def test_a_gloo_group_is_not_stream_ordered_on_either_device():
    (d,) = run_ranks(_decisions, 1)
    assert d["cpu"] == "gloo" and d["cuda"] == "gloo", d  # gloo also serves CUDA tensors
    assert d["cuda_ordered"] is False
    assert d["comm_backend"] == "gloo" and d["comm_ordered"] is False
    assert d["launch_async"] == [True]  # the CPU path always issues asynchronously
