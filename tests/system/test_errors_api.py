"""The rows of docs/errors.md for misused arguments of the public API (E77-E99) and for a
parameter unfrozen after ``fully_shard`` whose optimizer copy would change dtype (E101).

Provoked at world size 1 in one spawned process, as ``test_errors.py`` does for the other rows;
``test_errors.test_every_documented_error_is_exercised`` counts these rows too. Each case calls
the API the way a script ported from FSDP2 could get it wrong and checks the type, a fragment of
the message and its code.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks
from ..models import Net, batch

# row id -> (exception type name, fragment of the message)
EXPECTED_API = {
    "E77": ("ValueError", "Linear has no method 'generate' to register"),
    "E78": ("ValueError", "share_comm_ctx expects FSDP modules"),
    "E79": ("TypeError", "_set_unshard_async_op takes a bool, got int"),
    "E80": ("ValueError", "fully_shard got an empty list of modules"),
    "E81": ("TypeError", "fully_shard expects an nn.Module or a list of them, got int"),
    "E82": ("ValueError", "fully_shard got the same module twice in its list"),
    "E83": ("ValueError", "needs a mesh with mesh_dim_names"),
    "E84": ("ValueError", "dp_mesh_dims names 'x'"),
    "E85": ("ValueError", "leaves mesh dims ['tp'] that are not data-parallel"),
    "E86": ("ValueError", "has no shard dim (DDP) but sharding_strategy='optim'"),
    "E87": ("ValueError", "FSDP2 and mfsdp2 need Replicate() there"),
    "E88": ("ValueError", "MixedPrecisionPolicy.param_dtype must be a floating-point torch.dtype"),
    "E89": ("ValueError", "param_dtype is the compute dtype; float8 goes in all_gather_dtype"),
    "E90": ("TypeError", "must be a MixedPrecisionPolicy (mfsdp2's or torch.distributed.fsdp's), got int"),
    "E91": ("TypeError", "must be an OffloadPolicy"),
    "E92": ("AssertionError", "cannot be deep-copied"),
    "E93": ("RuntimeError", "reset_iter_state() called on 'blocks.0', which is not the root"),
    "E94": ("ValueError", "set_all_reduce_hook(stream=...) cannot be used with HSDP"),
    "E95": ("ValueError", "set_custom_all_gather on 'Linear', which gathers in float8"),
    "E96": ("ValueError", "a custom reduce-scatter is supported with the sharded-gradient strategies only"),
    "E97": ("TypeError", "max_input_buffers must be an int, got float"),
    "E98": ("ValueError", "max_input_buffers must be >= 1, got 0"),
    "E99": ("ValueError", "set_symm_mem_for_comm backend must be 'NCCL'"),
    "E101": ("RuntimeError", "'weight' of unit 'root' was made trainable (requires_grad_(True)) after fully_shard, "
                             "but it was sharded frozen in bfloat16 and a trainable one keeps float32 main weights"),
}


def _capture(out: dict, row: str, fn) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the type is what the row checks
        out[row] = (type(e).__name__, str(e))
    else:
        out[row] = (None, "no error raised")


def _dp_dims(**kw):
    from torch.distributed.fsdp import DataParallelMeshDims

    return DataParallelMeshDims(**kw)


def _rows(rank, ws):
    from torch.distributed.tensor import Shard, distribute_tensor

    from mfsdp2 import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method, share_comm_ctx

    mesh = init_device_mesh("cpu", (ws,))
    out: dict = {}

    unit = fully_shard(nn.Linear(4, 4), mesh=mesh)
    _capture(out, "E77", lambda: register_fsdp_forward_method(unit, "generate"))
    _capture(out, "E78", lambda: share_comm_ctx([unit, nn.Linear(2, 2)]))
    _capture(out, "E79", lambda: unit._set_unshard_async_op(1))
    _capture(out, "E80", lambda: fully_shard([], mesh=mesh))
    _capture(out, "E81", lambda: fully_shard(3, mesh=mesh))
    twice = nn.Linear(4, 4)
    _capture(out, "E82", lambda: fully_shard([twice, twice], mesh=mesh))

    named = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    _capture(out, "E83", lambda: fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=_dp_dims(shard="dp")))
    _capture(out, "E84", lambda: fully_shard(nn.Linear(4, 4), mesh=named, dp_mesh_dims=_dp_dims(shard="x")))
    spmd = init_device_mesh("cpu", (ws, 1), mesh_dim_names=("dp", "tp"))
    _capture(out, "E85", lambda: fully_shard(nn.Linear(4, 4), mesh=spmd, dp_mesh_dims=_dp_dims(shard="dp")))
    _capture(out, "E86", lambda: fully_shard(nn.Linear(4, 4), mesh=named, dp_mesh_dims=_dp_dims(replicate="dp"),
                                             sharding_strategy="optim"))
    sharded = nn.Linear(4, 4)
    sharded.weight = nn.Parameter(distribute_tensor(sharded.weight.detach(), named, [Shard(0)]))
    _capture(out, "E87", lambda: fully_shard(sharded, mesh=named, dp_mesh_dims=_dp_dims(shard="dp")))

    _capture(out, "E88", lambda: MixedPrecisionPolicy(param_dtype="bf16"))
    _capture(out, "E89", lambda: MixedPrecisionPolicy(param_dtype=torch.float8_e4m3fn,
                                                      all_gather_dtype=torch.float8_e4m3fn))
    _capture(out, "E90", lambda: fully_shard(nn.Linear(4, 4), mesh=mesh, mp_policy=3))
    _capture(out, "E91", lambda: fully_shard(nn.Linear(4, 4), mesh=mesh, offload_policy=3))
    _capture(out, "E92", lambda: copy.deepcopy(unit))

    net = Net()
    for b in net.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    x, _ = batch(0, 4, 12)
    net(x).sum().backward()
    _capture(out, "E93", lambda: net.blocks[0].reset_iter_state())

    hsdp = init_device_mesh("cpu", (1, ws), mesh_dim_names=("rep", "shard"))
    replicated = fully_shard(nn.Linear(4, 4), mesh=hsdp)
    _capture(out, "E94", lambda: replicated.set_all_reduce_hook(lambda t: None, stream=torch.Stream("cpu")))
    fp8_policy = MixedPrecisionPolicy(all_gather_dtype=torch.float8_e4m3fn)
    fp8 = fully_shard(nn.Linear(16, 16), mesh=mesh, mp_policy=fp8_policy)
    _capture(out, "E95", lambda: fp8.set_custom_all_gather(object()))
    zero1 = fully_shard(nn.Linear(4, 4), mesh=mesh, sharding_strategy="optim")
    _capture(out, "E96", lambda: zero1.set_custom_reduce_scatter(object()))
    _capture(out, "E97", lambda: unit.set_reduce_scatter_max_input_buffers(1.5))
    _capture(out, "E98", lambda: unit.set_reduce_scatter_max_input_buffers(0))
    _capture(out, "E99", lambda: unit.set_symm_mem_for_comm("gloo"))
    # bf16 parameters sharded frozen keep bf16 main weights; trainable ones get the policy's fp32.
    frozen = nn.Linear(4, 4, dtype=torch.bfloat16).requires_grad_(False)
    fully_shard(frozen, mesh=mesh)
    frozen.requires_grad_(True)
    _capture(out, "E101", lambda: frozen(torch.ones(2, 4, dtype=torch.bfloat16)))
    return out


@pytest.fixture(scope="module")
def api_messages() -> dict:
    return run_ranks(_rows, 1)[0]


@pytest.mark.parametrize("row", sorted(EXPECTED_API))
def test_api_error_row(api_messages, row):
    etype, fragment = EXPECTED_API[row]
    got_type, msg = api_messages[row]
    assert got_type == etype, f"{row}: expected {etype}, got {got_type}: {msg}"
    assert fragment in msg, f"{row}: {fragment!r} not in {msg!r}"
    assert f"mfsdp2 {row}: " in msg, f"{row}: the message does not carry its code ('mfsdp2 {row}: ...'): {msg!r}"
