"""``mfsdp2/examples/fsdp2_compat.py``: a trainer written for torch FSDP2 (per-block compile,
gradient accumulation, ``clip_grad_norm_``, DSD + DCP checkpoints) gives torch FSDP2's losses
when only the ``fully_shard`` import changes, and resumes from its checkpoint exactly.

float64 throughout: the two runtimes sum gradients in different orders, so their losses agree
to float64 rounding (1e-10 relative over a few AdamW steps), not bit for bit; any real
difference (a lost gradient, an unclipped norm, a wrong checkpoint row) is orders larger.

The runtimes run in separate spawned ranks: mfsdp2's ``RowShard`` compares equal to
``Shard(0)``, and DTensor's process-wide caches must not mix the two models' plans.
"""

from __future__ import annotations

import pytest
import torch

from .._dist import run_ranks

STEPS = 4
REL = 1e-10


def _run(rank, ws, runtime, ckpt):
    from mfsdp2.examples.fsdp2_compat import import_fully_shard, train

    fully_shard = import_fully_shard(runtime)
    half = STEPS // 2
    losses = train(fully_shard, STEPS, dtype=torch.float64, checkpoint_dir=ckpt, save_at=half - 1)
    resumed = train(fully_shard, STEPS - half, dtype=torch.float64, checkpoint_dir=ckpt, resume=True, start=half)
    return losses, resumed


@pytest.mark.slow
def test_fsdp2_script_gives_fsdp2_losses_with_the_import_swapped(tmp_path):
    torch_losses, torch_resumed = run_ranks(_run, 2, "torch", str(tmp_path / "torch"), timeout=600)[0]
    ours, ours_resumed = run_ranks(_run, 2, "mfsdp2", str(tmp_path / "mfsdp2"), timeout=600)[0]
    half = STEPS // 2
    assert torch_losses[-1] < torch_losses[0], "the reference did not train"
    for step, (a, b) in enumerate(zip(ours, torch_losses)):
        assert abs(a - b) <= REL * abs(b), f"step {step}: mfsdp2 {a} vs FSDP2 {b}"
    for name, full, resumed in (("FSDP2", torch_losses, torch_resumed), ("mfsdp2", ours, ours_resumed)):
        for step, (a, b) in enumerate(zip(resumed, full[half:])):
            assert abs(a - b) <= REL * abs(b), f"{name} resumed step {half + step}: {a} vs uninterrupted {b}"
