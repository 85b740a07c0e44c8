"""Lightning Fabric 2.6 (``ModelParallelStrategy``) on mfsdp2 against torch FSDP2 in the same
launch (world size 2, CPU/gloo; ``tests/integrations/_fabric.py`` has the harness): gradient
accumulation under ``no_backward_sync``, ``clip_gradients``, fused AdamW, and full (single-file)
checkpoints saved after the first epoch and resumed from in all three directions.

What is compared, bit for bit: every micro-batch's loss, the full gradients before and after
clipping at every step, the final parameters and every AdamW state (the model's pieces are whole
CPU vectors under both runtimes, tests/integrations/_trainer_model.py); that the first
micro-batch of each step leaves no reduced gradient (``no_backward_sync`` reached the units) and
the second does; the clip norm within the float32 summation bound of test_lightning.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lightning", reason="lightning is in the test extras: pip install -e '.[test]'")

from .._dist import run_ranks  # noqa: E402
from . import _fabric  # noqa: E402
from ._fabric import Run  # noqa: E402
from ._trainer_model import after_two_steps, same_training  # noqa: E402
from .test_lightning import NORM_REL  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUNS = [
    Run("fsdp2", "fsdp2", save=True),
    Run("mfsdp2", "mfsdp2", save=True),
    Run("mfsdp2_from_mfsdp2", "mfsdp2", resume_from="mfsdp2"),
    Run("mfsdp2_from_fsdp2", "mfsdp2", resume_from="fsdp2"),
    Run("fsdp2_from_mfsdp2", "fsdp2", resume_from="mfsdp2"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fabric"))
    out = run_ranks(_fabric.worker, 2, root, RUNS, timeout=280)
    for rank in (0, 1):
        for name, r in out[rank].items():
            assert r.error is None, f"{name} failed on rank {rank}:\n{r.error}"
    return out


def _same(ours, ref, first_step=0):
    assert ours.steps == ref.steps > 0
    same_training(ours, ref, first_step)
    for a, b in zip(ours.norms, ref.norms):
        assert abs(a - b) <= NORM_REL * b


def test_no_backward_sync_and_training_equal_fsdp2(results):
    for rank in (0, 1):
        ours, ref = results[rank]["mfsdp2"], results[rank]["fsdp2"]
        _same(ours, ref)
        assert ours.reductions == ref.reductions == [False, True] * ours.steps
        assert ref.losses[-1] < ref.losses[0]


@pytest.mark.parametrize("resumed, saved", [("mfsdp2_from_mfsdp2", "mfsdp2"), ("mfsdp2_from_fsdp2", "fsdp2"),
                                            ("fsdp2_from_mfsdp2", "mfsdp2")])
def test_full_checkpoint_resume(results, resumed, saved):
    for rank in (0, 1):
        new, old = results[rank][resumed], results[rank][saved]
        _same(new, after_two_steps(old, steps=2), first_step=2)
