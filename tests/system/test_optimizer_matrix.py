"""Every ``torch.optim`` optimizer x every implementation a user may pick x every sharding strategy,
against the unsharded float64 model trained on the same global batch, and against torch FSDP2 run
in the same process.

Each case (tests/optim_cases.py) builds a fresh model, trains two steps with two parameter groups
of different hyperparameters (no weight decay on norms and biases: groups that cut through every
unit) and an LR scheduler stepping between the steps, then round-trips the model, optimizer and
scheduler state dicts into a fresh sharded model and optimizer and takes one more step. After the
steps, after the next step and after the resumed step, every parameter and every optimizer state
(LBFGS's history lists included) is compared with the unsharded run's, to ``REL_F64`` (float64:
sharding only reorders the gradient sums; see tests/models.py). The states are assembled in the
parent from every rank's pieces at the offsets their DTensor metadata claims, so a piece that
contradicts its placement, an element no rank holds, or replicas that disagree are failures too.

One launch per strategy runs every case; the parent lists every failing case at once.

Strategies: ZeRO-3 (default), ZeRO-2, ZeRO-1, no_shard, HSDP on a (2 replicas x 1 shard) mesh,
and FSDP2's ``CPUOffloadPolicy`` (world size 2). torch FSDP2 runs every case at ZeRO-3 in the same
launch: where it works it must match the unsharded run too, where it raises the error is asserted.

Muon's Newton-Schulz iteration computes in bfloat16 whatever the parameters' dtype (torch casts
the gradient), so a sharded run, whose matrix products sum the same terms in other groupings,
differs from the unsharded one by bf16 rounding amplified by the iteration (FSDP2's parameters: up
to ~4e-2 of their largest magnitude after two steps). The matrix runs Muon with that function
computing in the gradient's dtype (float64), unsharded and sharded alike: the sharded mechanics
(transposes of row-sharded matrices, partial products, norms) are then checked to ``REL_F64``.

The resumed run is compared with the unsharded run's own resumed step: torch's
``Optimizer.load_state_dict`` casts float32 scalar states (ASGD's ``eta`` / ``mu``, NAdam's
``mu_product``) to the parameters' dtype, so a resumed run differs from an uninterrupted one by that
cast, sharded or not (NAdam's parameters by ~1e-9 relative). For every other optimizer the resumed
step must also equal the run's own uninterrupted step bit for bit.

The matrix (``works``: equal to the unsharded run; the same in every column unless said):

==========  ===================  ===================================================  ===========================
optimizer   implementations      mfsdp2: ZeRO-3 / ZeRO-2 / ZeRO-1 / no_shard / HSDP   torch FSDP2 (ZeRO-3)
                                 / offload
==========  ===================  ===================================================  ===========================
ASGD        for-loop, foreach    works                                                works
Adadelta    for-loop, foreach    works                                                works
Adafactor   for-loop, foreach    works with no_shard; refused elsewhere, E60 (1)      raises (1)
Adagrad     for-loop, foreach    works                                                works
Adagrad     fused                works                                                raises (2)
Adam/AdamW  for-loop, foreach,   works                                                works
            fused
Adamax      for-loop, foreach    works                                                works
LBFGS       (closure)            works (3)                                            raises (3)
Muon        (one)                works (4)                                            works (4)
NAdam       for-loop, foreach    works                                                works
RAdam       for-loop, foreach    works                                                works
RMSprop     for-loop, foreach    works                                                works
Rprop       for-loop, foreach    works (5)                                            raises (5)
SGD         for-loop, foreach    works                                                works
SGD         fused                works                                                raises (2)
SparseAdam  (one)                raises (6)                                           raises (6)
==========  ===================  ===================================================  ===========================

(1) Adafactor factors the second moment of a matrix into row and column means; the column mean
    runs over rows that other ranks hold, a partial sum DTensor cannot update in place
    ("in-place operations that require placement changes are not supported"). mfsdp2 refuses at
    the step, naming the optimizer and the parameter; with no_shard every rank holds every row.
(2) DTensor has no sharding rule for ``_fused_sgd_`` / ``_fused_adagrad_`` ("does not have a
    sharding strategy registered"); mfsdp2 runs the element-wise kernel on each rank's rows.
(3) LBFGS flattens every gradient (``p.grad.view(-1)``) and concatenates them: FSDP2 refuses to
    flatten a parameter whose rows do not divide evenly over the ranks ("Cannot flatten unevenly
    sharded tensor"); mfsdp2's flattened rows keep their split, the concatenation is gathered, and
    each rank updates its rows from the replicated direction (so LBFGS's history vectors are
    whole on every rank: not sharded). Driven by a closure that returns the loss averaged over the
    ranks (every rank must take the same line-search decisions).
(4) 2-D parameters only (torch's own rule); see above for its bfloat16 iteration.
(5) Rprop writes through a boolean mask (``sign[sign.gt(0)] = etaplus``: ``index_put_``) and
    copies with ``_foreach_copy_``; DTensor refuses the first in place and has no rule for the
    second. mfsdp2 runs both on each rank's rows when the mask / source holds the same rows.
(6) SparseAdam takes sparse gradients only; no FSDP produces them (the unsharded model raises
    the same "does not support dense gradients").
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Optional

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

from .. import optim_cases as oc
from .._dist import run_ranks
from ..models import F64, REL_F64, build, shard_blocks

WS = 2
STRATEGIES = {
    "zero3": {},
    "zero2": {"sharding_strategy": "optim_grads"},
    "zero1": {"sharding_strategy": "optim"},
    "no_shard": {"sharding_strategy": "no_shard"},
    "hsdp": {"mesh_shape": (2, 1)},
    "offload": {"offload_policy": "cpu"},
}
FSDP2_STRATEGIES = ("zero3",)


def cases() -> list[tuple[str, str]]:
    return [(name, impl) for name, cls in oc.optimizer_classes().items() for impl in oc.impls(cls)]


# Expected refusals: (optimizer, strategy or None for all) -> regex of the error (mfsdp2's, or the
# unsharded run's for an optimizer that cannot run at all).
SPARSE = "SparseAdam does not support dense gradients"
OURS_RAISES = {
    ("SparseAdam", None): SPARSE,
    **{
        ("Adafactor", s): r"UnsupportedOptimizerError: mfsdp2 E60: torch\.optim\.Adafactor cannot step sharded "
        r"parameter 'inp\.weight' of unit 'root': it factors the second moment"
        for s in STRATEGIES
        if s != "no_shard"
    },
}
# torch FSDP2's refusals, worded as torch 2.13 words them or (second alternative) as torch 2.11 does.
FSDP2_RAISES = {
    "SparseAdam": SPARSE,
    "Adafactor": "in-place operations that require placement changes are not supported",
    ("Adafactor", "foreach"): "in-place operations that require placement changes are not supported|"
    r"aten\._foreach_lerp_\.ScalarList does not have a sharding strategy",
    "LBFGS": "Cannot flatten unevenly sharded tensor|Attempted to flatten unevenly sharded dimension",
    ("Rprop", "for-loop"): r"aten\.index_put_\.default(: in-place operations that require placement changes"
    r"| does not have a sharding strategy)",
    ("Rprop", "foreach"): r"aten\._foreach_copy_\.default does not have a sharding strategy",
    ("SGD", "fused"): r"aten\._fused_sgd_\.default does not have a sharding strategy",
    ("Adagrad", "fused"): r"aten\._fused_adagrad_\.default does not have a sharding strategy",
}


def ours_expected(name: str, strategy: str) -> Optional[str]:
    return OURS_RAISES.get((name, None)) or OURS_RAISES.get((name, strategy))


def fsdp2_expected(name: str, impl: str) -> Optional[str]:
    return FSDP2_RAISES.get((name, impl)) or FSDP2_RAISES.get(name)


def _newton_schulz_in_grad_dtype(grad, ns_coefficients, ns_steps, eps):
    """torch's ``_zeropower_via_newtonschulz`` computing in ``grad``'s dtype instead of bfloat16
    (see the module docstring); the same operations in the same order otherwise."""
    a, b, c = ns_coefficients
    ortho_grad = grad.clone()
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


@contextlib.contextmanager
def _muon_in_float64():
    import torch.optim._muon as muon

    plain = muon._zeropower_via_newtonschulz
    muon._zeropower_via_newtonschulz = _newton_schulz_in_grad_dtype
    try:
        yield
    finally:
        muon._zeropower_via_newtonschulz = plain


@functools.lru_cache(maxsize=None)
def reference(name: str, impl: str):
    """The unsharded float64 run of one case: its snapshots, or the error it raises."""
    torch.set_num_threads(1)
    try:
        with _muon_in_float64():
            return oc.gather_snapshots([oc.run(name, impl, lambda: build("net", dtype=F64))])
    except Exception as e:  # an optimizer that cannot run at all (SparseAdam on dense gradients)
        return f"{type(e).__name__}: {e}"


def _outcome(fn) -> tuple[str, object]:
    try:
        return "ok", fn()
    except Exception as e:
        return "raises", f"{type(e).__name__}: {e}"


def _matrix_rank(rank, ws, strategy, case_list, with_fsdp2):
    from torch.distributed.fsdp import fully_shard as torch_shard

    from mfsdp2 import fully_shard

    cfg = dict(STRATEGIES[strategy])
    shape = cfg.pop("mesh_shape", (ws,))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else None)
    if cfg.get("offload_policy") == "cpu":
        cfg["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    makers = {"mfsdp2": lambda: shard_blocks(build("net", dtype=F64), mesh, fully_shard, **cfg)}
    if with_fsdp2:
        makers["fsdp2"] = lambda: shard_blocks(build("net", dtype=F64), mesh, torch_shard)
    out = {}
    with _muon_in_float64():
        for name, impl in case_list:
            for runtime, make in makers.items():
                out[(runtime, name, impl)] = _outcome(lambda: oc.run(name, impl, make, shard=(rank, ws)))
    return out


def _check(runtime: str, name: str, impl: str, strategy: str, per_rank: list, expected: Optional[str]) -> list[str]:
    """What is wrong with one case (empty: as expected)."""
    where = f"{runtime} {strategy} {name}/{impl}"
    kinds = {r[0] for r in per_rank}
    if len(kinds) > 1:
        return [f"{where}: some ranks raised, others did not: {[r[1] if r[0] == 'raises' else 'ok' for r in per_rank]}"]
    if kinds == {"raises"}:
        msg = per_rank[0][1]
        if expected is None:
            return [f"{where}: raised {msg[:500]}"]
        if not re.search(expected, msg):
            return [f"{where}: raised, but not /{expected}/: {msg[:500]}"]
        return []
    if expected is not None:
        return [f"{where}: worked, expected to raise /{expected}/"]
    ref = reference(name, impl)
    if isinstance(ref, str):
        return [f"{where}: worked, but the unsharded run raised {ref[:300]}"]
    got = oc.gather_snapshots([r[1] for r in per_rank])
    diffs = oc.differences(got, ref, REL_F64) + oc.resume_differences(name, got)
    return [f"{where}: {d}" for d in diffs[:6]] + ([f"{where}: ... {len(diffs) - 6} more"] if len(diffs) > 6 else [])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_optimizer_matches_unsharded(strategy):
    case_list = cases()
    with_fsdp2 = strategy in FSDP2_STRATEGIES
    results = run_ranks(_matrix_rank, WS, strategy, case_list, with_fsdp2, timeout=300)
    failures = []
    for name, impl in case_list:
        expected = {"mfsdp2": ours_expected(name, strategy), "fsdp2": fsdp2_expected(name, impl)}
        for runtime in ("mfsdp2", "fsdp2") if with_fsdp2 else ("mfsdp2",):
            per_rank = [r[(runtime, name, impl)] for r in results]
            failures += _check(runtime, name, impl, strategy, per_rank, expected[runtime])
    assert not failures, f"{len(failures)} problems:\n" + "\n".join(failures)


def test_every_optimizer_has_a_case():
    """A new ``torch.optim`` optimizer must be given hyperparameters here (and so enter the matrix)."""
    missing = sorted(set(oc.optimizer_classes()) - set(oc.HPARAMS))
    assert not missing, f"add hyperparameters for {missing} to tests/optim_cases.py HPARAMS"
    unsharded_raises = {name for name, impl in cases() if isinstance(reference(name, impl), str)}
    assert unsharded_raises == {"SparseAdam"}, {n: reference(n, i) for n, i in cases() if n in unsharded_raises}
