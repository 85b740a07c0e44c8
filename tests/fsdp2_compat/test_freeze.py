"""Freezing after ``fully_shard`` (``block.requires_grad_(False)``, as FSDP2 users do for
fine-tuning) freezes: the block gets no gradient and the optimizer leaves it as it was, and the
rest trains exactly like the unsharded model frozen the same way (float64, 1e-10 relative).
Unfreezing a parameter that was sharded frozen is refused with what to do (it has no gradient
buffers), never silently ignored."""

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


def _unfreeze_after(rank, ws):
    model = build("frozen", dtype=F64)  # blocks[1] sharded frozen
    shard_blocks(model, init_device_mesh("cpu", (ws,)))
    model.blocks[1].requires_grad_(True)
    opt = make_opt("adamw", model.parameters())
    try:
        sharded_train_step(model, opt, 0, rank, ws, GB)
    except RuntimeError as e:
        return str(e)
    return None


def test_unfreezing_a_parameter_sharded_frozen_is_refused():
    for msg in run_ranks(_unfreeze_after, WS):
        assert msg is not None and "before fully_shard" in msg and "blocks.1" in msg, msg
