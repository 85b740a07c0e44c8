"""Forwards under ``torch.inference_mode()`` before and between training steps.

An evaluation under inference mode before the first training step (Lightning runs such a
"sanity check" by default) used to create the runtime's lasting tensors -- allocator blocks,
lazily built buffers -- as inference tensors; the first training step then failed ("Inplace
update to inference tensor outside InferenceMode", as torch FSDP2 does in the same script). Now
the runtime's own work runs outside inference mode and the module's computation inside it.

Float64 at world size 2, every strategy, against the unsharded model doing the same: training
losses, evaluation outputs and final weights to 1e-10 relative (tests/models.py); an explicit
``unshard()`` under inference mode too.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, build, loss_fn, shard_blocks, sharded_train_step

WS, GB, STEPS = 2, 8, 3
STRATEGIES = {
    "zero3": {},
    "zero3_keep": {"reshard_after_forward": False},
    "zero2": {"sharding_strategy": "optim_grads"},
    "zero1": {"sharding_strategy": "optim"},
    "no_shard": {"sharding_strategy": "no_shard"},
}


def _train(model, rank: int, ws: int, explicit_unshard: bool):
    """Eval under inference mode first, then per step: train, eval under inference mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    n = GB // ws
    evals, losses = [], []

    def evaluate(step):
        x, _ = batch(100 + step, GB, 12, dtype=F64)
        model.eval()
        with torch.inference_mode():
            if explicit_unshard and hasattr(model, "unshard"):
                model.unshard()
            out = model(x[rank * n : (rank + 1) * n])
            assert not torch.is_grad_enabled()
        model.train()
        evals.append(out.clone())

    evaluate(-1)
    for step in range(STEPS):
        losses.append(sharded_train_step(model, opt, step, rank, ws, GB))  # mean over ranks
        evaluate(step)
    return evals, losses


def _sharded(rank, ws, explicit_unshard):
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, kw in STRATEGIES.items():
        model = shard_blocks(build("net", dtype=F64), mesh, **kw)
        evals, losses = _train(model, rank, ws, explicit_unshard)
        params = {k: p.full_tensor().detach() for k, p in model.named_parameters()}
        out[name] = (evals, losses, params)
    return out


@pytest.mark.parametrize("explicit_unshard", [False, True])
def test_inference_mode_forwards_before_and_between_steps(explicit_unshard):
    results = run_ranks(_sharded, WS, explicit_unshard)
    for rank, res in enumerate(results):
        # The unsharded reference: evaluations on this rank's half; training on the mean of the
        # ranks' losses (the sharded runs average their gradients and report that mean).
        ref = build("net", dtype=F64)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        n = GB // WS
        ref_evals, ref_losses = [], []

        def evaluate(step):
            x, _ = batch(100 + step, GB, 12, dtype=F64)
            with torch.no_grad():
                ref_evals.append(ref(x[rank * n : (rank + 1) * n]))

        evaluate(-1)
        for step in range(STEPS):
            x, y = batch(step, GB, 12, dtype=F64)
            loss = sum(loss_fn(ref(x[r * n : (r + 1) * n]), y[r * n : (r + 1) * n]) for r in range(WS)) / WS
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
            evaluate(step)
        for name, (evals, losses, params) in res.items():
            for i, (a, b) in enumerate(zip(evals, ref_evals)):
                assert_close_rel(a, b, f"{name} rank {rank} eval {i}", REL_F64)
            for i, (a, b) in enumerate(zip(losses, ref_losses)):
                assert abs(a - b) <= REL_F64 * abs(b), f"{name} rank {rank} loss {i}: {a} vs {b}"
            for k, p in ref.named_parameters():
                assert_close_rel(params[k], p.detach(), f"{name} rank {rank} {k}", REL_F64)


def _fp8_run(rank, ws, use_inference_mode):
    from mfsdp2 import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (ws,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                              all_gather_dtype=torch.float8_e4m3fn)
    model = shard_blocks(build("net"), mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = GB // ws
    outs = []
    for step in range(STEPS):
        x, y = batch(step, GB, 12)
        with torch.inference_mode() if use_inference_mode else torch.no_grad():
            outs.append(model(x[rank * n : (rank + 1) * n]).clone())
        loss = loss_fn(model(x[rank * n : (rank + 1) * n]).float(), y[rank * n : (rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        outs.append(loss.detach())
    return outs


def test_bf16_fp8_gathers_under_inference_mode_match_no_grad_bitwise():
    """bf16 compute with FP8 all-gathers (their own blocks, scales agreed at the root's forward):
    evaluations under inference mode before each step give the same bits as under ``no_grad``, and
    so does the training they precede."""
    a = run_ranks(_fp8_run, WS, True)
    b = run_ranks(_fp8_run, WS, False)
    for rank in range(WS):
        for i, (x, y) in enumerate(zip(a[rank], b[rank])):
            assert torch.equal(x, y), f"rank {rank} output {i}"
