"""The names of torch 2.13's FSDP2 API exist in mfsdp2; unsupported settings fail with a clear
error; ``register_fsdp_forward_method`` gathers like ``forward`` (float64 vs the unsharded model)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import mfsdp2

from .._dist import run_ranks
from ..models import assert_close_rel


def test_every_public_fsdp2_method_and_keyword_exists():
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    theirs = {n for n in dir(TorchFSDPModule) if not n.startswith("_") and callable(getattr(TorchFSDPModule, n))}
    ours = {n for n in dir(mfsdp2.FSDPModule) if callable(getattr(mfsdp2.FSDPModule, n, None))}
    assert theirs - ours == set()
    kw = set(inspect.signature(torch_fully_shard).parameters)
    assert kw - set(inspect.signature(mfsdp2.fully_shard).parameters) == set()
    for name in ("register_fsdp_forward_method", "share_comm_ctx", "UnshardHandle", "fully_shard"):
        assert hasattr(mfsdp2, name)
    from mfsdp2.frontend.module import fully_shard as via_module

    assert via_module is mfsdp2.fully_shard


class Enc(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 4)
        self.other = nn.Linear(4, 3)

    def forward(self, x):
        return self.other(self.proj(x))

    def encode(self, x):  # called instead of forward
        return torch.tanh(self.proj(x))


def _encode_rank(rank, ws):
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    base = Enc().double()
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = {}
    plain = copy.deepcopy(base)
    mfsdp2.fully_shard(plain, mesh=mesh)
    try:
        plain.encode(x)
        out["unregistered"] = "ran"
    except RuntimeError as e:  # the sharded DTensor weight meets a plain input
        out["unregistered"] = str(e)
    model = copy.deepcopy(base)
    mfsdp2.fully_shard(model, mesh=mesh)
    mfsdp2.register_fsdp_forward_method(model, "encode")
    y = model.encode(x)
    y.pow(2).sum().backward()
    out["y"] = y.detach()
    w = model.proj.weight  # a rank holding no rows of it has grad None: read the rows by hand
    local = w.grad._local_tensor if w.grad is not None else w._local_tensor.new_zeros(w._local_tensor.shape)
    out["grad"] = w.placements[0]._to_replicate_tensor(local, w.device_mesh, 0, w.shape).clone()
    out["sharded_after"] = all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    # Errors for what mfsdp2 cannot do, naming the parameter / module and what to do.
    errors = {}
    for kind, call in {
        "placement": lambda m: mfsdp2.fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: Shard(1)),
        "reset_non_root": None,
    }.items():
        if call is None:
            continue
        try:
            call(copy.deepcopy(base))
        except ValueError as e:
            errors[kind] = str(e)
    parent = nn.Sequential(copy.deepcopy(base)).double()
    mfsdp2.fully_shard(parent[0], mesh=mesh)
    mfsdp2.fully_shard(parent, mesh=mesh)
    parent(x).sum().backward()
    try:
        parent[0].reset_iter_state()
    except RuntimeError as e:
        errors["reset_non_root"] = str(e)
    parent.reset_iter_state()
    out["errors"] = errors
    return out


def test_register_fsdp_forward_method_and_errors():
    res = run_ranks(_encode_rank, 2)
    torch.manual_seed(0)
    ref = Enc().double()
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = ref.encode(x)
    y.pow(2).sum().backward()
    for r in res:
        assert "mixed torch.Tensor and DTensor" in r["unregistered"]
        assert_close_rel(r["y"], y.detach(), "encode output", rel=1e-10)
        assert_close_rel(r["grad"], ref.proj.weight.grad, "encode grad", rel=1e-10)
        assert r["sharded_after"]
        # A dimension the bias lacks is reported first (FSDP2's order and error type).
        assert "'proj.bias'" in r["errors"]["placement"] and "has 1 dims" in r["errors"]["placement"]
        assert "not the root" in r["errors"]["reset_non_root"]


def test_set_custom_and_knob_validation():
    with pytest.raises(TypeError):
        mfsdp2.FSDPModule.set_reduce_scatter_max_input_buffers(_Fake(), True)
    with pytest.raises(ValueError):
        mfsdp2.FSDPModule.set_reduce_scatter_max_input_buffers(_Fake(), 0)
    with pytest.raises(ValueError):
        mfsdp2.FSDPModule.set_symm_mem_for_comm(_Fake(), "NVSHMEM")


class _Fake:
    def _units(self, recurse):
        return []
