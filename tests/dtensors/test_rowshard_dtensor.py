"""DTensors derived from our row-sharded parameters stay correct, and torch.chunk-sharded DTensors
of the same shapes in the same process (FSDP2, ``distribute_tensor``) are not disturbed by ours.

Before: DTensor's process-wide caches treated ``RowShard`` as ``Shard(0)``, so whichever kind ran
an op first decided the other's output placement and redistribute plan: ``full_tensor()`` of our
``p * 2`` or of an FSDP2 parameter's clone came back wrong-sized or with rows in the wrong places,
without an error. Every check here compares with the same op applied to the full tensor, exactly
(float64, no arithmetic rounding differs between a shard and the full tensor for these ops)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from mfsdp2 import fully_shard as mfsdp2_shard

from .._dist import run_ranks
from ..models import (
    F64, REL_F64, assert_close_rel, assert_losses_close, build, make_opt, reference_step, sharded_train_step,
)

STEPS, GB = 3, 8

# (op on a DTensor, the same op on the full tensor): pointwise, foreach, factories, dtype casts,
# ops with a shape argument, reductions that keep dim 0.
OPS = {
    "self": (lambda d: d, lambda t: t),
    "detach": (lambda d: d.detach(), lambda t: t),
    "mul": (lambda d: d * 2, lambda t: t * 2),
    "add": (lambda d: d + d, lambda t: t + t),
    "clone": (lambda d: d.clone(), lambda t: t.clone()),
    "clamp": (lambda d: d.clamp(-0.1, 0.1), lambda t: t.clamp(-0.1, 0.1)),
    "lerp": (lambda d: torch.lerp(d, torch.zeros_like(d), 0.5), lambda t: t * 0.5),
    "foreach_mul": (lambda d: torch._foreach_mul([d], 3.0)[0], lambda t: t * 3.0),
    "foreach_add": (lambda d: torch._foreach_add([d], [d])[0], lambda t: t + t),
    "zeros_like": (lambda d: torch.zeros_like(d), torch.zeros_like),
    "empty_like": (lambda d: torch.empty_like(d).fill_(1.0), torch.ones_like),
    "new_empty": (lambda d: d.new_empty(d.shape).fill_(1.0), torch.ones_like),
    "to_f32": (lambda d: d.to(torch.float32), lambda t: t.to(torch.float32)),
    "to_bf16": (lambda d: d.to(torch.bfloat16), lambda t: t.to(torch.bfloat16)),
    "view": (lambda d: d.view(d.shape), lambda t: t),
    "view_rows": (lambda d: d.view(d.shape[0], -1), lambda t: t.view(t.shape[0], -1)),
    "unsqueeze_squeeze": (lambda d: d.unsqueeze(1).squeeze(1), lambda t: t),
    "sum_dim1": (lambda d: d.sum(1), lambda t: t.sum(1)),
    "abs_amax_dim1": (lambda d: d.abs().amax(dim=1), lambda t: t.abs().amax(dim=1)),
    "contiguous": (lambda d: d.contiguous(), lambda t: t),
    # transposes (Muon's Newton-Schulz works on p.T): the split moves to dim 1 and back
    "t": (lambda d: d.T, lambda t: t.T),
    "t_mul_t": (lambda d: (d.T * 2).T, lambda t: t * 2),
    "transpose_contiguous": (lambda d: d.transpose(0, 1).contiguous(), lambda t: t.T.contiguous()),
    "permute_clone": (lambda d: d.permute(1, 0).clone(), lambda t: t.T.clone()),
    "t_copy_into": (lambda d: torch.zeros_like(d.T).copy_(d.T), lambda t: t.T),
    "add_t": (lambda d: d + d.T if d.shape[0] == d.shape[1] else d,
              lambda t: t + t.T if t.shape[0] == t.shape[1] else t),
}


# Ops that DTensor refuses for a torch.chunk split whose rows do not divide evenly ("Cannot flatten
# unevenly sharded tensor", which torch FSDP2 raises too) but that our row blocks allow: merging
# dim 0 with the dims after it (torch.optim.LBFGS flattens every gradient), splitting it back, and
# concatenating flat views of several parameters.
OURS_ONLY = {
    "view_flat": (lambda d: d.view(-1), lambda t: t.view(-1)),
    "flatten": (lambda d: d.flatten(), lambda t: t.flatten()),
    "reshape_flat": (lambda d: d.reshape(-1), lambda t: t.reshape(-1)),
    "flat_and_back": (lambda d: d.view(-1).mul(2).view(d.shape), lambda t: t * 2),
    "cat": (lambda d: torch.cat([d, d * 2]), lambda t: torch.cat([t, t * 2])),
    "cat_flat": (lambda d: torch.cat([d.view(-1), d.view(-1) + 1]), lambda t: torch.cat([t.view(-1), t.view(-1) + 1])),
}


def _model():
    # Five weights, three of the same (3, 3) shape with different row splits at world size 2.
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in [(4, 3), (3, 5), (5, 3), (3, 3), (3, 3)])).double()


def _derived_ops(rank, ws, plain_first):
    model = _model()
    full = {k: p.detach().clone() for k, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (ws,))
    mfsdp2_shard(model, mesh=mesh)
    wrong = []

    def check(kind, name, d, t, ops=OPS):
        for op, (on_dtensor, on_full) in ops.items():
            try:
                got = on_dtensor(d).full_tensor()
            except Exception as e:  # an op that fails is as wrong as a wrong value
                wrong.append((kind, name, op, f"raised {type(e).__name__}: {e}"[:160]))
                continue
            want = on_full(t)
            if got.shape != want.shape or not torch.equal(got, want):
                wrong.append((kind, name, op, "wrong value"))

    def plain():
        for k, t in full.items():
            check("distribute_tensor", k, distribute_tensor(t.clone(), mesh, [Shard(0)]), t)

    def ours():
        for k, p in model.named_parameters():
            check("mfsdp2", k, p, full[k], {**OPS, **OURS_ONLY})
        params = list(model.parameters())
        got = torch.cat([p.detach().view(-1) for p in params]).full_tensor()
        if not torch.equal(got, torch.cat([t.view(-1) for t in full.values()])):
            wrong.append(("mfsdp2", "all", "cat of every flat parameter", "wrong value"))
        # Splitting a flat view into rows of another width: exact where every rank's block is whole
        # rows of the result, refused naming the counts where a block would start inside a row.
        from mfsdp2.dtensors.placement import row_sharded_dtensor

        t = torch.arange(6.0, dtype=torch.float64).view(3, 2)
        d = row_sharded_dtensor(t[:2] if rank == 0 else t[2:], mesh, (2, 1), (3, 2))
        if not torch.equal(d.view(-1).view(3, 2).full_tensor(), t):
            wrong.append(("mfsdp2", "(3, 2) rows (2, 1)", "view(-1).view(3, 2)", "wrong value"))
        try:
            d.view(-1).view(2, 3)
            wrong.append(("mfsdp2", "(3, 2) rows (2, 1)", "view(-1).view(2, 3)", "not refused"))
        except RuntimeError as e:
            if "mfsdp2: cannot view a row-sharded tensor of shape (6,) as (2, 3)" not in str(e):
                wrong.append(("mfsdp2", "(3, 2) rows (2, 1)", "view(-1).view(2, 3)", f"raised {e}"[:160]))

    rows = {k: p.placements[0].rows for k, p in model.named_parameters()}
    if plain_first:
        plain()
        ours()
    else:
        ours()
        plain()
    return wrong, rows


@pytest.mark.parametrize("plain_first", [True, False], ids=["chunk_first", "ours_first"])
def test_derived_dtensors_keep_their_rows(plain_first):
    for wrong, rows in run_ranks(_derived_ops, 2, plain_first):
        assert len({rows[k] for k in ("2.weight", "3.weight", "4.weight")} | {(2, 1)}) > 1, rows
        assert not wrong, f"{len(wrong)} wrong results, first: {wrong[:6]}"


def _spec_equality(rank, ws):
    from mfsdp2.dtensors.placement import RowShard, row_sharded_dtensor

    mesh = init_device_mesh("cpu", (ws,))
    local = torch.zeros(2 if rank == 0 else 1, 3)
    ours_chunk_rows = row_sharded_dtensor(local, mesh, (2, 1), (3, 3))
    ours_other = row_sharded_dtensor(torch.zeros(3 if rank == 0 else 0, 3), mesh, (3, 0), (3, 3))
    plain = distribute_tensor(torch.zeros(3, 3), mesh, [Shard(0)])
    return (
        ours_chunk_rows._spec == plain._spec,
        plain._spec == ours_chunk_rows._spec,
        ours_other._spec == ours_chunk_rows._spec,
        ours_chunk_rows._spec == row_sharded_dtensor(local.clone(), mesh, (2, 1), (3, 3))._spec,
        RowShard(0, (2, 1)) == Shard(0),
        hash(RowShard(0, (2, 1))) != hash(Shard(0)),
    )


def test_spec_equality_keeps_row_and_chunk_splits_apart():
    for r in run_ranks(_spec_equality, 2):
        # A cache that compares keys by equality alone (DTensor's C++ dispatch cache does, within
        # a hash bucket) must never take ours for a torch.chunk spec, nor the reverse.
        assert r == (False, False, False, True, True, True), r


def _fsdp2_and_mfsdp2_in_one_process(rank, ws):
    """A user comparing the two (or a framework holding torch.chunk DTensors of the same shapes
    next to ours) trains both in one process; each must match the unsharded model."""
    from torch.distributed.fsdp import fully_shard as torch_shard

    mesh = init_device_mesh("cpu", (ws,))
    models = [build("net", dtype=F64), build("net", dtype=F64)]
    for m, shard in zip(models, (torch_shard, mfsdp2_shard)):
        for b in m.blocks:
            shard(b, mesh=mesh)
        shard(m, mesh=mesh)
    opts = [make_opt("adamw", m.parameters()) for m in models]
    losses = ([], [])
    for step in range(STEPS):
        for i, (m, opt) in enumerate(zip(models, opts)):
            losses[i].append(sharded_train_step(m, opt, step, rank, ws, GB))
            # the clones a training loop makes (EMA, logging) run between the two models' steps
            _ = [p.detach().clone().mul_(0.5) for p in m.parameters()]
    out = []
    for m, opt in zip(models, opts):
        params = {k: p.full_tensor() for k, p in m.named_parameters()}
        states = {k: opt.state[p]["exp_avg_sq"].full_tensor() for k, p in m.named_parameters()}
        doubled = {k: (p.detach().clone() * 2).full_tensor() for k, p in m.named_parameters()}
        out.append((params, states, doubled))
    return losses, out


def test_fsdp2_and_mfsdp2_share_a_process():
    ref = build("net", dtype=F64)
    opt = make_opt("adamw", ref.parameters())
    ref_losses = [reference_step(ref, opt, s, GB, F64) for s in range(STEPS)]
    for losses, results in run_ranks(_fsdp2_and_mfsdp2_in_one_process, 2):
        for who, l, (params, states, doubled) in zip(("FSDP2", "mfsdp2"), losses, results):
            assert_losses_close(l, ref_losses, f"{who} losses", REL_F64)
            for k, p in ref.named_parameters():
                assert_close_rel(params[k], p.detach(), f"{who} {k}", REL_F64)
                assert_close_rel(states[k], opt.state[p]["exp_avg_sq"], f"{who} exp_avg_sq {k}", REL_F64)
                assert_close_rel(doubled[k], 2 * p.detach(), f"{who} 2 * {k}", REL_F64)
