"""Freezing after ``fully_shard`` (``block.requires_grad_(False)``, as FSDP2 users do for
fine-tuning) freezes: the block gets no gradient and the optimizer leaves it as it was, and the
rest trains exactly like the unsharded model frozen the same way (float64, 1e-10 relative).
Unfreezing parameters that were sharded frozen (a backbone frozen for the first steps) trains
them from the next step, as FSDP2 does, for every strategy; where the policy would give the
unfrozen group optimizer weights of another dtype it is refused (E101, tests/system)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks
from ..models import (
    F64, REL_F64, assert_close_rel, assert_losses_close, build, make_opt, reference_step, sharded_train_step,
    shard_blocks,
)

WS, STEPS, GB = 2, 3, 8


def _freeze_after(rank, ws):
    model = shard_blocks(build("net", dtype=F64), init_device_mesh("cpu", (ws,)))
    model.blocks[1].requires_grad_(False)
    model.head.bias.requires_grad_(False)  # one parameter of the root's group, the rest trains
    opt = make_opt("adamw", model.parameters())  # every parameter, as FSDP2 scripts pass them
    losses = [sharded_train_step(model, opt, s, rank, ws, GB) for s in range(STEPS)]
    grads_none = all(p.grad is None for p in model.blocks[1].parameters())
    return losses, {k: p.full_tensor() for k, p in model.named_parameters()}, grads_none


def test_requires_grad_false_after_fully_shard_freezes_like_unsharded():
    ref = build("net", dtype=F64)
    init = {k: p.detach().clone() for k, p in ref.named_parameters()}
    ref.blocks[1].requires_grad_(False)
    ref.head.bias.requires_grad_(False)
    opt = make_opt("adamw", ref.parameters())
    ref_losses = [reference_step(ref, opt, s, GB, F64) for s in range(STEPS)]
    for losses, full, grads_none in run_ranks(_freeze_after, WS):
        assert grads_none, "a frozen block got gradients"
        assert_losses_close(losses, ref_losses, "losses", REL_F64)
        for k, p in ref.named_parameters():
            assert_close_rel(full[k], p.detach(), k, REL_F64)
            if k.startswith("blocks.1.") or k == "head.bias":
                assert torch.equal(full[k], init[k]), f"{k} is frozen but changed"


# Unfrozen after the second step: a whole unit's frozen group (blocks.1) but one parameter
# (blocks.1.norm.bias stays frozen inside the now trainable group), and the frozen group of a unit
# that also trains (blocks.2.fc1).
UNFREEZE_AT = 2
UNFROZEN = ("blocks.1.fc1.weight", "blocks.1.fc1.bias", "blocks.1.fc2.weight", "blocks.1.fc2.bias",
            "blocks.1.norm.weight", "blocks.2.fc1.weight", "blocks.2.fc1.bias")
STRATEGIES = ("optim_grads_params", "optim_grads", "optim", "no_shard")


def _unfreeze(model) -> None:
    params = dict(model.named_parameters())
    for name in UNFROZEN:
        params[name].requires_grad_(True)


def _unfreeze_after(rank, ws):
    from torch.distributed.fsdp import fully_shard as torch_shard

    mesh = init_device_mesh("cpu", (ws,))
    runs = {"fsdp2": lambda m: shard_blocks(m, mesh, torch_shard)}
    for strategy in STRATEGIES:
        runs[strategy] = lambda m, st=strategy: shard_blocks(m, mesh, sharding_strategy=st)
    out = {}
    for name, shard in runs.items():
        model = shard(build("frozen", dtype=F64))  # blocks.1 and blocks.2.fc1 sharded frozen
        opt = make_opt("adamw", model.parameters())
        losses = []
        for s in range(STEPS + UNFREEZE_AT):
            if s == UNFREEZE_AT:
                _unfreeze(model)
            losses.append(sharded_train_step(model, opt, s, rank, ws, GB))
        out[name] = (losses, {k: p.full_tensor() for k, p in model.named_parameters()},
                     model.blocks[1].norm.bias.grad is None)
    return out


def test_unfreezing_parameters_sharded_frozen_trains_them_like_fsdp2_and_unsharded():
    ref = build("frozen", dtype=F64)
    init = {k: p.detach().clone() for k, p in ref.named_parameters()}
    opt = make_opt("adamw", ref.parameters())
    ref_losses = []
    for s in range(STEPS + UNFREEZE_AT):
        if s == UNFREEZE_AT:
            _unfreeze(ref)
        ref_losses.append(reference_step(ref, opt, s, GB, F64))
    for res in run_ranks(_unfreeze_after, WS):
        for name, (losses, full, still_frozen_has_no_grad) in res.items():
            assert still_frozen_has_no_grad, name
            assert_losses_close(losses, ref_losses, f"{name} losses", REL_F64)
            for k, p in ref.named_parameters():
                assert_close_rel(full[k], p.detach(), f"{name} {k}", REL_F64)
                if k in UNFROZEN:
                    assert not torch.equal(full[k], init[k]), f"{name}: {k} was unfrozen but never trained"
                elif k == "blocks.1.norm.bias":
                    assert torch.equal(full[k], init[k]), f"{name}: {k} is frozen but changed"
