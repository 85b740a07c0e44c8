"""Accelerate 1.15's ``Accelerator`` with an FSDP2 plugin on mfsdp2, against torch FSDP2 in the
same launch (world size 2, CPU/gloo; ``tests/integrations/_accelerate.py`` has the harness).

A user of mfsdp2 shards the model (each block, then the root) before ``prepare(model,
optimizer, loader)``; the references are the same with torch's ``fully_shard``, and Accelerate
sharding the plain model itself (transformer-based wrap of the blocks). Each run: fused torch
AdamW, ``accumulate`` over 2 micro-batches (``set_requires_gradient_sync``), ``backward``,
``clip_grad_norm_``, 2 passes of 2 steps; ``save_state`` after the first pass (DCP), and runs
that ``load_state`` it and do the second pass.

What is compared: every micro-batch's loss, the full gradients before and after clipping, the
final parameters, every AdamW state and ``get_state_dict``'s full state dict are bit-identical
to FSDP2's (the model has every parameter piece a whole number of CPU vectors:
tests/integrations/_trainer_model.py says why fused AdamW needs that), also after resuming from
either runtime's checkpoint; ``clip_grad_norm_``'s returned norm within the float32 summation
bound of tests/integrations/test_lightning.py.

``prepare`` re-points the optimizer at the model's parameters by ``_local_tensor.data_ptr()``,
which is 0 on every rank that holds no rows of a parameter -- common under mfsdp2, which keeps
whole parameters on one rank where a unit's row split allows -- so those parameters collapse into
one on that rank's optimizer. mfsdp2's step guard restores the lists from the model's parameter
order where that is provable (mfsdp2/runtime/optimizer_repair.py, else E61): the run that leaves
them as ``prepare`` made them trains, checkpoints and resumes bit for bit as the run that puts
them back by hand.
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="accelerate is in the test extras: pip install -e '.[test]'")

from .._dist import run_ranks  # noqa: E402
from . import _accelerate  # noqa: E402
from ._trainer_model import after_two_steps, equal_dicts, same_training  # noqa: E402
from ._accelerate import Run  # noqa: E402
from .test_lightning import NORM_REL  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUNS = [
    Run("fsdp2", "fsdp2", save=True),
    Run("mfsdp2", "mfsdp2", save=True),
    Run("fsdp2_auto", "fsdp2_auto", epochs=1),
    Run("mfsdp2_from_mfsdp2", "mfsdp2", resume_from="mfsdp2"),
    Run("mfsdp2_from_fsdp2", "mfsdp2", resume_from="fsdp2"),
    Run("fsdp2_from_mfsdp2", "fsdp2", resume_from="mfsdp2"),
    Run("mfsdp2_unrestored", "mfsdp2", save=True, restore_params=False),
    Run("fsdp2_from_unrestored", "fsdp2", resume_from="mfsdp2_unrestored"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("accelerate"))
    out = run_ranks(_accelerate.worker, 2, root, RUNS, timeout=280)
    for rank in (0, 1):
        for name, r in out[rank].items():
            assert r.error is None, f"{name} failed on rank {rank}:\n{r.error}"
    return out


def _same_run(ours, ref, first_step: int = 0, norms_exact: bool = False) -> None:
    assert ours.steps == ref.steps == len(ref.grads) > 0
    same_training(ours, ref, first_step)
    equal_dicts(ours.state_dict, ref.state_dict, "get_state_dict")
    for a, b in zip(ours.norms, ref.norms):
        assert a == b if norms_exact else abs(a - b) <= NORM_REL * b


def test_matches_fsdp2(results):
    for rank in (0, 1):
        ours, ref = results[rank]["mfsdp2"], results[rank]["fsdp2"]
        assert ours.units == ref.units == ["", "blocks.0", "blocks.1"]
        assert ours.optimizer_params == list(ours.params)
        _same_run(ours, ref)
        assert ref.losses[-1] < ref.losses[0]
    assert len(results[0]["fsdp2"].state_dict) == 16  # the full state dict, on rank 0


def test_manual_sharding_matches_accelerates_own(results):
    """The reference itself: torch's ``fully_shard`` by hand equals Accelerate's auto-wrap."""
    for rank in (0, 1):
        auto, manual = results[rank]["fsdp2_auto"], results[rank]["fsdp2"]
        assert auto.units == manual.units
        assert auto.losses == manual.losses[: len(auto.losses)]
        for a, b in zip(auto.clipped, manual.clipped):
            equal_dicts(a, b, "clipped gradients")


@pytest.mark.parametrize(
    "resumed, saved",
    [("mfsdp2_from_mfsdp2", "mfsdp2"), ("mfsdp2_from_fsdp2", "fsdp2"), ("fsdp2_from_mfsdp2", "mfsdp2")],
)
def test_load_state_resume(results, resumed, saved):
    for rank in (0, 1):
        new, old = results[rank][resumed], results[rank][saved]
        _same_run(new, after_two_steps(old, steps=2), first_step=2)


def test_lists_collapsed_by_prepare_are_restored(results):
    """Without the parameter lists put back by hand, ``prepare`` leaves each rank's optimizer
    holding one empty-piece parameter several times; the first step restores them, and the run
    equals the one restored by hand: training, states, the checkpoint (FSDP2 resumes from it)."""
    for rank in (0, 1):
        ours, ref = results[rank]["mfsdp2_unrestored"], results[rank]["mfsdp2"]
        assert ours.optimizer_params == list(ours.params)
        _same_run(ours, ref, norms_exact=True)
        _same_run(results[rank]["fsdp2_from_unrestored"], after_two_steps(ref, steps=2), first_step=2)
