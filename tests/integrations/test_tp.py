"""FSDP x TP on a (dp=2, tp=2) mesh of 4 CPU ranks: blocks tensor-parallel (colwise fc1, rowwise
fc2) over ``mesh['tp']``, then ``fully_shard`` over ``mesh['dp']``. Checked against the unsharded
single-process reference: losses, parameters, and state dicts whose global shapes and DCP offsets
come from the DTensors (a checkpoint loaded into plain full tensors equals the reference); also a
meta-device build (torchtitan's order: parallelize, shard, ``to_empty``, write the values) against
FSDP2 running the same script. Float64, to REL_F64 (see tests/models.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from mfsdp2 import fully_shard

from .._dist import run_ranks
from ._dp_tp import shard_dp_tp
from ..models import (
    F64, REL_F64, Net, assert_close_rel, assert_losses_close, build, make_opt, reference_run, reference_step,
    sharded_train_step,
)

STEPS = 6
GLOBAL_BATCH = 8


def _build(mesh, strategy, **kw):
    return shard_dp_tp(build("net", dtype=F64), mesh, fully_shard, sharding_strategy=strategy, **kw)


def _dp_tp(rank, ws, path, strategy):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank(0)
    model = _build(mesh, strategy)
    w = model.blocks[0].fc1.weight
    assert isinstance(w, DTensor) and w.shape == (40, 16), (w.shape, w.placements)
    assert w.placements[0] == Shard(0), w.placements  # the TP placement comes first: (tp, dp) mesh
    opt = make_opt("adamw", model.parameters())
    losses = [sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH, dp=(dp_rank, 2)) for step in range(STEPS)]
    full = {k: p.full_tensor() for k, p in model.named_parameters()}

    sd = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    dcp.save(sd, checkpoint_id=path)
    # Into plain full tensors: every element must land at its global offset.
    plain = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    dcp.load(plain, checkpoint_id=path)
    # Into a fresh FSDP x TP model (DCP reads straight into its sharded parameters).
    fresh = _build(mesh, strategy)
    fresh_sd = fresh.state_dict()
    dcp.load(fresh_sd, checkpoint_id=path)
    fresh.load_state_dict(fresh_sd)
    reloaded = {k: p.full_tensor() for k, p in fresh.named_parameters()}
    # And back from plain full tensors through load_state_dict (sliced by placements).
    other = _build(mesh, strategy)
    other.load_state_dict(plain)
    from_plain = {k: p.full_tensor() for k, p in other.named_parameters()}
    return losses, full, shapes, plain, reloaded, from_plain


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_dp_x_tp_2x2_matches_reference_with_correct_state_dicts(tmp_path, strategy):
    ref_losses, ref_params = reference_run("net", "adamw", STEPS, GLOBAL_BATCH, dtype=F64)
    for rank, (losses, full, shapes, plain, reloaded, from_plain) in enumerate(
        run_ranks(_dp_tp, 4, str(tmp_path / "ckpt"), strategy)
    ):
        assert_losses_close(losses, ref_losses, f"rank {rank}", REL_F64)
        for name, ref in ref_params.items():
            assert_close_rel(full[name], ref, f"rank {rank} {name}", REL_F64)
            assert shapes[name] == tuple(ref.shape), (name, shapes[name])  # global, not TP-local
            # The checkpoint copies must equal the trained weights bit for bit.
            assert torch.equal(plain[name], full[name]), f"checkpoint {name}"
            assert torch.equal(reloaded[name], full[name]), f"reloaded {name}"
            assert torch.equal(from_plain[name], full[name]), f"loaded from full tensors {name}"


class _TiedNet(Net):
    """Net plus a root-level projection whose weight is ``blocks[0].fc1.weight``: the root takes
    the tied weight over from block 0's unit, whose group is rebuilt around its other TP weights."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 40)
        self.back = nn.Linear(40, 16)
        self.proj.weight = self.blocks[0].fc1.weight

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        h = h + self.back(F.gelu(self.proj(h)))
        return self.head(h)


def _tied_model(tp_mesh=None, dp_mesh=None):
    torch.manual_seed(0)
    model = _TiedNet().to(F64)  # .to() converts in place: the tie survives
    assert model.proj.weight is model.blocks[0].fc1.weight
    if tp_mesh is None:
        return model
    for b in model.blocks:
        parallelize_module(b, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    parallelize_module(model, tp_mesh, {"proj": ColwiseParallel(), "back": RowwiseParallel()})
    model.proj.weight = model.blocks[0].fc1.weight  # re-tie after TP (as with tied embeddings)
    for b in model.blocks:
        fully_shard(b, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _tied_reference():
    torch.set_num_threads(1)
    model = _tied_model()
    opt = make_opt("adamw", model.parameters())
    losses = [reference_step(model, opt, step, GLOBAL_BATCH, F64) for step in range(STEPS)]
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _tied_dp_tp(rank, ws):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tied_model(mesh["tp"], mesh["dp"])
    # Block 0's rebuilt group still holds tensor-parallel weights (fc2 rowwise: Shard(1) over TP).
    w = model.blocks[0].fc2.weight
    assert isinstance(w, DTensor) and w.shape == (16, 40) and w.placements[0] == Shard(1), (w.shape, w.placements)
    assert model.proj.weight is model.blocks[0].fc1.weight
    opt = make_opt("adamw", model.parameters())
    losses = [sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH, dp=(mesh.get_local_rank(0), 2))
              for step in range(STEPS)]
    return losses, {k: p.full_tensor() for k, p in model.named_parameters()}


@pytest.mark.slow
def test_tied_weight_taken_over_from_a_tp_unit_keeps_its_other_tp_weights():
    ref_losses, ref_params = _tied_reference()
    for rank, (losses, full) in enumerate(run_ranks(_tied_dp_tp, 4)):
        assert_losses_close(losses, ref_losses, f"rank {rank}", REL_F64)
        assert set(full) == set(ref_params)
        for name, ref in ref_params.items():
            assert_close_rel(full[name], ref, f"rank {rank} {name}", REL_F64)


def _meta_dp_tp(rank, ws):
    """torchtitan's order: build on meta, parallelize, ``fully_shard``, ``to_empty``, then write
    every parameter's values (here the normal build's, as ``Replicate`` DTensors redistributed
    into each parameter's layout), then train. The same script for FSDP2 and mfsdp2."""
    from torch.distributed.fsdp import fully_shard as torch_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank(0)
    full = {k: v.detach() for k, v in build("net", dtype=F64).named_parameters()}
    out = {}
    for name, shard in (("fsdp2", torch_shard), ("mfsdp2", fully_shard)):
        with torch.device("meta"):
            model = build("net", dtype=F64)
        shard_dp_tp(model, mesh, shard)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(distribute_tensor(full[k], p.device_mesh, [Replicate()] * p.device_mesh.ndim))
        inited = {k: p.full_tensor() for k, p in model.named_parameters()}
        opt = make_opt("adamw", model.parameters())
        losses = [sharded_train_step(model, opt, s, rank, ws, GLOBAL_BATCH, dp=(dp_rank, 2)) for s in range(STEPS)]
        out[name] = (inited, losses, {k: p.full_tensor() for k, p in model.named_parameters()})
    return full, out


@pytest.mark.slow
def test_meta_init_of_a_dp_x_tp_model_trains_like_fsdp2_and_the_reference():
    ref_losses, ref_params = reference_run("net", "adamw", STEPS, GLOBAL_BATCH, dtype=F64)
    for rank, (full, out) in enumerate(run_ranks(_meta_dp_tp, 4)):
        for name, (inited, losses, final) in out.items():
            for k, v in full.items():
                assert torch.equal(inited[k], v), f"rank {rank} {name}: {k} not initialised as written"
            assert_losses_close(losses, ref_losses, f"rank {rank} {name}", REL_F64)
            for k, v in ref_params.items():
                assert_close_rel(final[k], v, f"rank {rank} {name} {k}", REL_F64)
