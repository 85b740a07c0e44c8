"""Training under ``torch.autocast`` instead of a ``MixedPrecisionPolicy``: what Lightning's
``precision="bf16-mixed"`` and Accelerate's ``autocast()`` do around an FSDP2 model. The weights
stay float32 and autocast casts per op, so the runtime's hooks, its input function and the
activation-checkpoint recompute all run inside the autocast region.

mfsdp2 and torch FSDP2 train the same float32 model on the same data, at world size 2, for three
AdamW steps under ``torch.autocast("cpu", dtype=torch.bfloat16)``; losses, full gradients and full
parameters after each step must be equal to the bit: both compute the same ops on the same
gathered weights, and a sum of two ranks' gradients is the same float in either order. Cases:
ZeRO-3; ZeRO-3 with non-reentrant activation checkpointing inside the blocks (the recompute runs
under the autocast state saved with the forward); no_shard (from the second step a quiet pass:
the units run with no forward hooks). FSDP2 runs in its own launch (see test_multi_backward.py
on comparing in one process).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks
from ..models import batch, build, checkpoint_blocks, loss_fn, shard_blocks

WS, STEPS, PER_RANK = 2, 3, 4
CASES = ("zero3", "zero3_checkpoint", "no_shard")


def _train(rank, ws, runtime: str) -> dict:
    if runtime == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from mfsdp2 import fully_shard
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for case in CASES:
        model = build("net")
        if case == "zero3_checkpoint":
            checkpoint_blocks(model)
        kw = {"sharding_strategy": "no_shard"} if case == "no_shard" and runtime == "mfsdp2" else {}
        shard_blocks(model, mesh, fully_shard, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        steps = []
        for step in range(STEPS):
            x, y = batch(step, PER_RANK * ws, model.inp.in_features)
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(x[rows]).float(), y[rows])
            loss.backward()
            # clone: a replicated (no_shard) DTensor's full_tensor() is its live local tensor
            grads = {k: p.grad.full_tensor().clone() for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            params = {k: p.full_tensor().clone() for k, p in model.named_parameters()}
            steps.append((loss.detach(), grads, params))
        out[case] = steps
    return out


@pytest.fixture(scope="module")
def runs():
    return {rt: run_ranks(_train, WS, rt, timeout=300) for rt in ("mfsdp2", "fsdp2")}


@pytest.mark.parametrize("case", CASES)
def test_autocast_training_equals_fsdp2_bitwise(runs, case):
    for rank in range(WS):
        ours, theirs = runs["mfsdp2"][rank][case], runs["fsdp2"][rank][case]
        for step, ((l1, g1, p1), (l2, g2, p2)) in enumerate(zip(ours, theirs)):
            assert torch.equal(l1, l2), (rank, step, l1, l2)
            for what, a, b in (("grad", g1, g2), ("param", p1, p2)):
                assert a.keys() == b.keys()
                for k in a:
                    assert a[k].dtype == b[k].dtype == torch.float32, (what, k, a[k].dtype, b[k].dtype)
                    assert torch.equal(a[k], b[k]), (rank, step, what, k, (a[k] - b[k]).abs().max().item())
