"""torch.compile with mfsdp2, as torch FSDP2 users run it (torchtitan compiles each block).

Checked against the single-process unsharded model in float64 (same steps, same data): full
parameters and losses agree to float64 rounding (1e-10 relative leaves ~1e6 ulps for kernel
reordering by the compiler; a wrong gradient or a stale weight is off by many orders more), and
no graph is compiled again after the warm-up steps (dynamo's frame count stays flat).

Each case runs in freshly spawned ranks: dynamo's caches must not carry state in from other tests.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard

from .._dist import run_ranks
from ..models import REL_F64, assert_close_rel, build, make_opt, reference_run, sharded_train_step

STEPS = 5
WARMUP = 2  # the first step runs without prefetch; the second sees every unit in steady state
GLOBAL_BATCH = 8
REL = REL_F64


def _train(rank, ws, where, backend, compile_step):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(backend)
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=torch.float64)
    for b in model.blocks:
        if where == "before":
            b.compile(backend=counter)
        fully_shard(b, mesh=mesh)
        if where == "after":
            b.compile(backend=counter)
    fully_shard(model, mesh=mesh)
    if where == "model":
        model.compile(backend=counter)
    opt = make_opt("adamw", model.parameters())
    if compile_step:
        opt.step = torch.compile(opt.step, backend=counter)
    losses, frames = [], []
    for step in range(STEPS):
        losses.append(sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH))
        frames.append(counter.frame_count)
    full = {k: p.full_tensor() for k, p in model.named_parameters()}
    return losses, full, frames


def _reference(compile_step: bool):
    return reference_run("net", "adamw", STEPS, GLOBAL_BATCH, dtype=torch.float64, compile_step=compile_step)


CASES = [
    ("after", "aot_eager", False),
    ("before", "aot_eager", False),
    ("model", "aot_eager", False),
    ("after", "aot_eager", True),  # the optimizer step compiled too: dynamo sees RowShard DTensors
    pytest.param("after", "inductor", False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("where,backend,compile_step", CASES)
def test_compiled_training_matches_reference_without_recompiles(where, backend, compile_step):
    ref_losses, ref_params = _reference(compile_step)
    results = run_ranks(_train, 2, where, backend, compile_step, timeout=600)
    for rank, (losses, full, frames) in enumerate(results):
        assert frames[0] > 0, "nothing was compiled"
        assert frames[-1] == frames[WARMUP - 1], f"rank {rank}: recompiled after warm-up, frames per step {frames}"
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= REL * abs(b), f"rank {rank} step {step}: loss {a} vs reference {b}"
        for name, ref in ref_params.items():
            assert_close_rel(full[name], ref, f"rank {rank} {name}", rel=REL)
    # The reference must have moved (different data each step, but the same loss twice in a row
    # would mean the weights never changed), or the comparison proves nothing.
    assert all(abs(a - b) > 1e-6 for a, b in zip(ref_losses, ref_losses[1:])), ref_losses
