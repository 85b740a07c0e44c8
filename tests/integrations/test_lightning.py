"""Lightning 2.6's own ``Trainer`` with ``ModelParallelStrategy`` on mfsdp2, against torch FSDP2
in the same launch (world size 2, CPU/gloo).

The LightningModule's ``configure_model`` shards each block and the root; the mfsdp2 runs
differ from the FSDP2 runs in the ``fully_shard`` it imports, nothing else
(``tests/integrations/_lightning.py`` has the harness). Every run: torch AdamW (fused, or
foreach), ``accumulate_grad_batches=2``, ``gradient_clip_val`` (Lightning's
``clip_grad_norm_`` on the DTensor parameters), 2 epochs of 2 optimizer steps; the checkpoint
runs save with ``trainer.save_checkpoint`` (a DCP folder) at the end of epoch 1 and resume with
``fit(ckpt_path=...)``.

What is compared:

* With the clip threshold above the gradient norms (the clip path runs and multiplies by 1.0):
  every micro-batch's loss, the full gradients before and after clipping at every step, the
  full parameters and every AdamW state after the last step are bit-identical, for fused and
  foreach AdamW, and for epoch 2 resumed from either runtime's checkpoint by mfsdp2 (and from
  mfsdp2's by FSDP2).
* The total gradient norm is a float32 sum over each rank's pieces, which the runtimes cut
  differently: within ``NORM_REL`` (the probabilistic bound of tests/integrations/
  test_torchtitan.py: ``lam * sqrt(n) * u``, n the number of squares summed, lam = 6) of
  FSDP2's and of the float64 norm of the full gradients.
* With the threshold below the norm (clipping on): the clip coefficients ``max / (norm +
  1e-6)`` then differ by the norms' relative difference ``d`` (plus one rounding), so each
  clipped gradient is within ``(d + 2u) |g|`` of FSDP2's; a clip computed from one rank's piece
  (or skipped) would be off by whole percent. One AdamW step moves a parameter by ``lr *
  m_hat / (sqrt(v_hat) + eps)``; its derivative with respect to a relative change of the
  current gradient is at most ``(1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2)) +
  |m_hat| / sqrt(v_hat)`` <= 3 for the two steps run here (t <= 2), so the parameters are
  within ``lr * 3 * (d + 4u) + 2u |p|`` (the last term: the rounding of ``p - lr * update``).

Lightning's Trainer accumulates with gradient sync *on*: ``ModelParallelStrategy`` leaves
``block_backward_sync`` to DDP, so every micro-batch is reduced under both runtimes.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is in the test extras: pip install -e '.[test]'")

from .._dist import run_ranks  # noqa: E402
from . import _lightning  # noqa: E402
from ._trainer_model import after_two_steps, equal_dicts, same_training  # noqa: E402
from ._lightning import LR, Run  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

U = 2.0**-24
N_PARAMS = 2 * (64 * 64 + 64) + 2 * (2 * 64 + 64 * 256 + 256 + 256 * 64 + 64)
NORM_REL = 6.0 * math.sqrt(N_PARAMS) * U
CLIP = 0.5  # between the first two steps' norms (~0.50 and ~0.53): the second step is clipped

RUNS = [
    Run("fsdp2", "fsdp2", save=True),
    Run("mfsdp2", "mfsdp2", save=True),
    Run("mfsdp2_from_mfsdp2", "mfsdp2", resume_from="mfsdp2"),
    Run("mfsdp2_from_fsdp2", "mfsdp2", resume_from="fsdp2"),
    Run("fsdp2_from_mfsdp2", "fsdp2", resume_from="mfsdp2"),
    Run("fsdp2_foreach", "fsdp2", optimizer="foreach", epochs=1),
    Run("mfsdp2_foreach", "mfsdp2", optimizer="foreach", epochs=1),
    Run("fsdp2_clipped", "fsdp2", clip=CLIP, epochs=1),
    Run("mfsdp2_clipped", "mfsdp2", clip=CLIP, epochs=1),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lightning"))
    out = run_ranks(_lightning.worker, 2, root, RUNS, timeout=280)
    for name, r in out[0].items():
        assert r.error is None, f"{name} failed on rank 0:\n{r.error}"
        assert out[1][name].error is None, f"{name} failed on rank 1:\n{out[1][name].error}"
    return out


def _same_run(ours, ref, first_step: int = 0) -> None:
    """Bit-identical losses, gradients (before and after clipping), parameters and AdamW
    states; gradient norms within NORM_REL of FSDP2's."""
    same_training(ours, ref, first_step)
    for a, b in zip(ours.norms, ref.norms):
        assert abs(a - b) <= NORM_REL * b


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_adamw_matches_fsdp2(results, rank):
    ours, ref = results[rank]["mfsdp2"], results[rank]["fsdp2"]
    assert ours.global_step == ref.global_step == 4
    _same_run(ours, ref)
    assert ref.losses[-1] < ref.losses[0]  # the model learns: the comparison has signal


def test_foreach_adamw_matches_fsdp2(results):
    for rank in (0, 1):
        _same_run(results[rank]["mfsdp2_foreach"], results[rank]["fsdp2_foreach"])


def test_gradient_norm_is_the_full_norm(results):
    """The norm Lightning's clip sees (``get_total_norm`` on the DTensor gradients) is the norm of
    the full gradients, on every rank and step."""
    for rank in (0, 1):
        r = results[rank]["mfsdp2"]
        for step, (norm, grads) in enumerate(zip(r.norms, r.grads)):
            exact = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads.values()])).item()
            assert abs(norm - exact) <= NORM_REL * exact, f"step {step}: {norm} vs {exact}"


@pytest.mark.parametrize(
    "resumed, saved",
    [("mfsdp2_from_mfsdp2", "mfsdp2"), ("mfsdp2_from_fsdp2", "fsdp2"), ("fsdp2_from_mfsdp2", "mfsdp2")],
)
def test_checkpoint_resume(results, resumed, saved):
    """Epoch 2 after ``fit(ckpt_path=...)`` from the checkpoint saved at the end of epoch 1
    (model, AdamW states, loop state) equals the uninterrupted run's epoch 2 bit for bit -- of
    the run that saved it, and so (test above) of the other runtime's."""
    for rank in (0, 1):
        new, old = results[rank][resumed], results[rank][saved]
        assert new.global_step == old.global_step == 4
        _same_run(new, after_two_steps(old), first_step=2)


def test_active_clipping_within_bound(results):
    for rank in (0, 1):
        ours, ref = results[rank]["mfsdp2_clipped"], results[rank]["fsdp2_clipped"]
        assert ours.losses == ref.losses
        equal_dicts(ours.grads[0], ref.grads[0], "step 0: gradients")
        assert ref.norms[0] < CLIP < ref.norms[1], ref.norms  # step 1 is clipped, step 0 is not
        d = abs(ours.norms[1] - ref.norms[1]) / ref.norms[1]
        assert d <= NORM_REL
        for name, g in ref.clipped[1].items():
            # the clip did scale: FSDP2's clipped gradient is the unclipped one times the coefficient
            coef = CLIP / (ref.norms[1] + 1e-6)
            torch.testing.assert_close(g, ref.grads[1][name] * coef, rtol=4 * U, atol=0)
            err = (ours.clipped[1][name] - g).abs()
            assert (err <= (d + 2 * U) * g.abs()).all(), f"clipped gradient {name}: max error {err.max()}"
        for name, p in ref.params.items():
            err = (ours.params[name] - p).abs()
            bound = LR * 3 * (d + 4 * U) + 2 * U * p.abs()
            assert (err <= bound).all(), f"parameter {name}: max error {err.max()}, bound {bound.min()}"
