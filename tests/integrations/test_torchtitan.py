"""torchtitan 0.3.0's own trainer on mfsdp2, against torch FSDP2 in the same test.

torchtitan builds the llama3 debug model on meta, shards it through its own ``fully_shard``
call sites (``apply_fsdp_to_decoder``: each block, ``[norm, lm_head]`` as one unit, the root),
materialises it with ``to_empty`` + ``init_weights``, loads a seed checkpoint, and trains with
its data loader, loss, clipping, optimizer and LR-scheduler containers and DCP checkpointer.
The mfsdp2 runs differ from the FSDP2 runs only in the one name a user changes, the
``fully_shard`` torchtitan's ``distributed.fsdp`` imports from torch; torchtitan's
``isinstance(m, FSDPModule)`` checks still test torch's class, which mfsdp2 units are instances
of (the gradient divide factor of 1.0 depends on it). See ``tests/integrations/_titan.py`` for
everything the test sets around the trainer on CPU.

One launch (world size 2, gloo) runs every configuration in turn, each once with FSDP2 and once
with mfsdp2, from the same seed checkpoint and data:

* CE loss, fused AdamW (torchtitan's default optimizer), DCP save at step 3, 6 steps;
* resumes at step 3 for steps 4-6: mfsdp2 from mfsdp2's checkpoint, mfsdp2 from FSDP2's, FSDP2
  from mfsdp2's;
* torchtitan's chunked loss (``ChunkedLossWrapper``, 8 chunks), foreach AdamW;
* per-block ``torch.compile`` (aot_eager), foreach AdamW.

What is compared, step by step:

* Losses, the full gradients after every backward and the full parameters after the last step
  are bit-identical (equal floats; SHA-256 of the gathered tensors) in every configuration.
* The gradient norm torchtitan logs is a float32 reduction over each rank's piece of each
  gradient, and the two runtimes split rows between ranks differently (FSDP2: each parameter's
  dim 0 in halves; mfsdp2: the unit's flat buffer in halves), so the same bit-identical
  gradients are summed in another order. Bound: the sum of n squares in float32 is within
  ``lam * sqrt(n) * u`` (relative) of the exact sum with probability at least
  ``1 - 2 exp(-lam^2 / 2)`` whatever the order (Higham and Mary, probabilistic rounding error
  analysis, 2019); with n the largest number of addends, ``lam = 6`` and both runs off in
  opposite directions, the two norms differ by at most ``lam * sqrt(n) * u`` (half of it for
  the square root, twice for the two runs).
* Step times (torchtitan's ``train_step``, median after the first step) are reported, not
  asserted: this machine's CPUs are shared.
"""

from __future__ import annotations

import math
import statistics

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is in the test extras: pip install -e '.[test]'")

from .._dist import run_ranks  # noqa: E402
from . import _titan  # noqa: E402
from ._titan import Run  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

U = 2.0**-24  # float32 unit roundoff
LAM = 6.0
# The most float32 squares one rank adds up for one gradient's norm: a whole embedding or
# lm_head weight, 2048 x 256 (FSDP2 gives each rank half of it, mfsdp2 may give one rank all).
N_MAX = 2048 * 256
NORM_REL = LAM * math.sqrt(N_MAX) * U

STEPS, SAVE = 6, 3
RUNS = [
    Run("fsdp2", "fsdp2", optimizer="fused", steps=STEPS, save_every=SAVE),
    Run("mfsdp2", "mfsdp2", optimizer="fused", steps=STEPS, save_every=SAVE),
    Run("mfsdp2_from_mfsdp2", "mfsdp2", optimizer="fused", steps=STEPS, resume_from="mfsdp2", resume_step=SAVE),
    Run("mfsdp2_from_fsdp2", "mfsdp2", optimizer="fused", steps=STEPS, resume_from="fsdp2", resume_step=SAVE),
    Run("fsdp2_from_mfsdp2", "fsdp2", optimizer="fused", steps=STEPS, resume_from="mfsdp2", resume_step=SAVE),
    Run("fsdp2_chunked", "fsdp2", loss="chunked", steps=3),
    Run("mfsdp2_chunked", "mfsdp2", loss="chunked", steps=3),
    Run("fsdp2_compile", "fsdp2", compile=True, steps=3),
    Run("mfsdp2_compile", "mfsdp2", compile=True, steps=3),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("torchtitan"))
    _titan.make_assets(root)
    out = run_ranks(_titan.worker, 2, root, RUNS, timeout=840)
    # both ranks log the same global loss and norm; rank 0's record is the one compared
    assert [r.losses for r in out[0].values()] == [r.losses for r in out[1].values()]
    _report(out[0])
    return out[0]


def _report(res: dict) -> None:
    lines = ["torchtitan llama3 debug model, world size 2, CPU/gloo: median step time (s) after step 1"]
    for name, r in res.items():
        if r.error:
            lines.append(f"  {name:<22} failed: {r.error.strip().splitlines()[-1]}")
            continue
        med = statistics.median(r.step_times[1:]) if len(r.step_times) > 1 else float("nan")
        lines.append(f"  {name:<22} {med:6.3f}   first {r.step_times[0]:6.3f}   "
                     f"losses {['%.6f' % x for x in r.losses]}")
    print("\n".join(lines))


def _ok(res: dict, *names: str) -> list:
    for name in names:
        assert res[name].error is None, f"{name} failed:\n{res[name].error}"
    return [res[n] for n in names]


def _same_run(ours, ref, first_step: int = 1) -> None:
    """Bit-identical losses, gradients and final parameters; gradient norms within NORM_REL."""
    assert ours.steps == ref.steps == list(range(first_step, first_step + len(ref.steps)))
    assert ours.losses == ref.losses
    for step, (a, b) in enumerate(zip(ours.grad_param_digests, ref.grad_param_digests), first_step):
        differ = [n for n in b if a.get(n) != b[n]]
        assert not differ, f"step {step}: gradients differ from FSDP2's for {differ}"
    assert ours.grad_digests == ref.grad_digests
    assert ours.param_digest == ref.param_digest
    for step, (a, b) in enumerate(zip(ours.grad_norms, ref.grad_norms), first_step):
        assert abs(a - b) <= NORM_REL * b, f"step {step}: gradient norm {a} vs FSDP2's {b}"


def test_ce_fused_adamw_matches_fsdp2(results):
    ours, ref = _ok(results, "mfsdp2", "fsdp2")
    _same_run(ours, ref)
    assert ref.losses[-1] < ref.losses[0] - 0.1  # the model learns: the comparison has signal


@pytest.mark.parametrize(
    "resumed, saved",
    [("mfsdp2_from_mfsdp2", "mfsdp2"), ("mfsdp2_from_fsdp2", "fsdp2"), ("fsdp2_from_mfsdp2", "mfsdp2")],
)
def test_dcp_resume(results, resumed, saved):
    """Steps 4-6 after torchtitan loads the step-3 checkpoint (model, optimizer, LR
    schedulers, data loader, step) equal the uninterrupted run's steps 4-6 bit for bit -- of the
    run that saved it, and so (previous test) of the other runtime's."""
    new, old = _ok(results, resumed, saved)
    tail = type(old)(
        steps=old.steps[SAVE:],
        losses=old.losses[SAVE:],
        grad_norms=old.grad_norms[SAVE:],
        grad_digests=old.grad_digests[SAVE:],
        grad_param_digests=old.grad_param_digests[SAVE:],
        param_digest=old.param_digest,
    )
    _same_run(new, tail, first_step=SAVE + 1)


def test_chunked_loss_matches_fsdp2(results):
    """torchtitan's ``ChunkedLossWrapper`` recognises the lm_head unit as an FSDP unit
    (``isinstance`` against torch's class) and keeps it gathered across the chunks with gradient
    sync off until the last one: one reduction, as under FSDP2, so the runs are bit-identical."""
    ours, ref = _ok(results, "mfsdp2_chunked", "fsdp2_chunked")
    _same_run(ours, ref)


def test_compile_matches_fsdp2(results):
    """Per-block compile (torchtitan's ``apply_compile``, fullgraph) before ``fully_shard``."""
    ours, ref = _ok(results, "mfsdp2_compile", "fsdp2_compile")
    assert ours.compiled_graphs > 0 and ref.compiled_graphs > 0, "nothing was compiled"
    _same_run(ours, ref)
