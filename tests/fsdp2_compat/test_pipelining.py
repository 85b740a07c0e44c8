"""``torch.distributed.pipelining`` schedules over mfsdp2 stages, against the same schedules over
torch FSDP2 stages in the same process and against the unsharded model (float64, same split,
same micro-batches, three AdamW steps; the first one runs torch's metadata inference, a real
forward and input-gradient backward before the step).

The model (``tests.models.Net``: input layer, three blocks, head) is cut into 2 stages (one per
pipeline rank) or 4 (two per rank, interleaved or V-shaped); each block is a unit and each stage
module the root of its stage. World size 4 is a (pp=2, dp=2) mesh, world size 2 a (pp=2, dp=1)
one. With a mean loss per micro-batch and the schedule's scaling by the number of micro-batches,
the step's gradient is the unsharded model's gradient of the mean loss over the global batch.

Stages: mfsdp2 units are instances of torch's ``FSDPModule``, so torch's own ``PipelineStage``
drives an mfsdp2 stage as it drives an FSDP2 one (sync off per micro-batch, one reduction at
REDUCE_GRAD through the units' ``post_backward()`` and the root's final callback);
``mfsdp2.integrations.pipelining.PipelineStage`` adds a loop without REDUCE_GRAD and the E52 check.
The test counts the collectives: FSDP2's all-gathers, reduce-scatters and all-reduces with
either stage class.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as FSDP2Module
from torch.distributed.pipelining import PipelineStage as TorchStage

from mfsdp2.comm.communicator import comm_stats

from . import full, runtimes
from .._dist import run_ranks
from .._pipeline_stages import without_self_links
from ..models import F64, REL_F64, assert_close_rel, batch, build, loss_fn, make_opt
from .test_comm_counts import _counting

PP, N_MB, PER_MB, STEPS = 2, 4, 2, 3

# torch 2.13's metadata inference runs a real forward and input-gradient backward, then cleans
# up after it (FSDP2 stages resharded, their gradients cleared: ``_post_metadata_inference_cleanup``,
# which mfsdp2's stage extends). torch 2.11 infers shapes by a no-grad forward and clears
# nothing: gradients left over from before the first step accumulate there under FSDP2 and under
# mfsdp2 alike, so the test leaves none there.
_CLEANS_UP_AFTER_INFERENCE = hasattr(TorchStage, "_post_metadata_inference_cleanup")


def _pieces(net, n_stages: int) -> list:
    """The stage modules: consecutive top-level modules of ``Net``, each cut an ``nn.Sequential``."""
    mods = [net.inp, *net.blocks, net.head]
    cuts = {2: [mods[:3], mods[3:]], 4: [mods[:2], mods[2:3], mods[3:4], mods[4:]]}[n_stages]
    return [nn.Sequential(*c) for c in cuts]


def _schedule_class(name: str):
    """torch's schedule class of that name; ``MultiLoop``: interleaved 1F1B run by
    ``PipelineScheduleMulti``'s own loop, which has no REDUCE_GRAD action (it scales the gradients
    after each stage's last backward)."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    if name == "MultiLoop":
        loop = {"_step_microbatches": PipelineScheduleMulti._step_microbatches}
        return type("MultiLoop", (pipelining.ScheduleInterleaved1F1B,), loop)
    return getattr(pipelining, name)


def _stage_ids(schedule: str, pp_rank: int) -> tuple[int, list[int]]:
    """``(number of stages, this pipeline rank's stages)``: one per rank for single-stage
    schedules, looped (r, r + PP) or V-shaped (r, 2 PP - 1 - r) for the others."""
    if schedule in ("ScheduleGPipe", "Schedule1F1B"):
        return PP, [pp_rank]
    if schedule in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        return 2 * PP, [pp_rank, 2 * PP - 1 - pp_rank]
    return 2 * PP, [pp_rank, pp_rank + PP]


def _train(rank, mesh, runtime, schedule, stage_cls, raf, reshard_after_backward=True):
    """STEPS steps of ``schedule`` over ``runtime``'s stages; per step: this rank's losses,
    ``{name: (full param, full grad)}`` before the optimizer step, and collective counts."""
    import torch.distributed.pipelining as pipelining

    from mfsdp2.integrations.pipelining import PipelineStage as Mfsdp2Stage

    shard = runtimes()[runtime]
    dp_mesh = mesh["dp"]
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    n_stages, mine = _stage_ids(schedule, mesh.get_local_rank("pp"))
    net = build("net", dtype=F64)
    pieces = _pieces(net, n_stages)
    kw = {} if raf is None else {"reshard_after_forward": raf}
    cls = without_self_links(Mfsdp2Stage if stage_cls == "mfsdp2" else pipelining.PipelineStage)
    stages = []
    for i in mine:
        for m in pieces[i]:
            if m in net.blocks:
                shard(m, mesh=dp_mesh, **kw)
        shard(pieces[i], mesh=dp_mesh, **kw)
        # The decision the counts rest on: torch's stage takes its FSDP path for both runtimes.
        assert isinstance(pieces[i], FSDP2Module)
        if not reshard_after_backward:
            pieces[i].set_reshard_after_backward(False)
        stages.append(cls(pieces[i], i, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    ids = {id(p) for i in mine for p in pieces[i].parameters()}
    named = [(k, p) for k, p in net.named_parameters() if id(p) in ids]  # the DTensors, by global name
    opt = make_opt("adamw", [p for _, p in named])
    if _CLEANS_UP_AFTER_INFERENCE:
        # Gradients left over from before the first step: torch's stage clears a unit stage's
        # after its metadata inference (FSDP2's and mfsdp2's alike).
        for _, p in named:
            p.grad = p.detach().clone()
    sched_cls = _schedule_class(schedule)
    sched = sched_cls(stages if len(stages) > 1 else stages[0], N_MB, loss_fn=loss_fn)
    per_rank = N_MB * PER_MB
    out = []
    for step in range(STEPS):
        x, y = batch(step, dp * per_rank, net.inp.in_features, dtype=F64)
        x, y = x[dp_rank * per_rank : (dp_rank + 1) * per_rank], y[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        losses = []
        args = (x,) if 0 in mine else ()
        kwargs = {"target": y, "losses": losses} if n_stages - 1 in mine else {}
        comm_stats.reset()
        with _counting() as counted:
            sched.step(*args, **kwargs)
        if runtime == "fsdp2":
            counts = tuple(counted[n] for n in _counting.NAMES)
        else:
            # A unit's reduction shared a bucketed all-reduce (small units, two ranks, gloo): counted
            # as the reduce-scatter it replaces, and that bucket's all-reduce not at all.
            counts = (comm_stats.all_gather_calls,
                      comm_stats.reduce_scatter_calls + comm_stats.reduce_scatters_in_buckets,
                      comm_stats.all_reduce_calls - comm_stats.all_reduce_buckets)
        out.append(([t.item() for t in losses], {k: (full(p), full(p.grad)) for k, p in named}, counts))
        opt.step()
        opt.zero_grad()
    # Units with weights of their own that a no-grad forward leaves gathered under FSDP2: the
    # stage roots (reshard_after_forward None: off for a root) or, with it False, every unit.
    # mfsdp2 reshards after any no-grad pass.
    kept = 0
    for i in mine:
        blocks = [m for m in pieces[i] if m in net.blocks]
        root_owns = any(next(m.parameters(), None) is not None for m in pieces[i] if m not in blocks)
        kept += int(root_owns) + (len(blocks) if raf is False else 0)
    return out, {k: full(p) for k, p in named}, kept


def _run(rank, ws, cases):
    mesh = init_device_mesh("cpu", (PP, ws // PP), mesh_dim_names=("pp", "dp"))
    results = {}
    for case in cases:
        schedule, stage_cls, raf = case
        results[case] = {"mfsdp2": _train(rank, mesh, "mfsdp2", schedule, stage_cls, raf)}
        if schedule != "MultiLoop":  # FSDP2 stages reduce only at REDUCE_GRAD, which that loop lacks
            results[case]["fsdp2"] = _train(rank, mesh, "fsdp2", schedule, "torch", raf)
    return mesh.get_local_rank("dp"), results


def _reference(dp: int):
    """The unsharded model on the whole global batch: per step the micro-batch losses (in the
    order the ranks see them: data-parallel rank, then micro-batch), gradients of their mean,
    and the weights after the step."""
    torch.set_num_threads(1)
    net = build("net", dtype=F64)
    opt = make_opt("adamw", net.parameters())
    steps = []
    for step in range(STEPS):
        x, y = batch(step, dp * N_MB * PER_MB, net.inp.in_features, dtype=F64)
        per_mb = [loss_fn(net(x[i : i + PER_MB]), y[i : i + PER_MB]) for i in range(0, len(x), PER_MB)]
        torch.stack(per_mb).mean().backward()
        grads = {k: p.grad.clone() for k, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
        steps.append(([t.item() for t in per_mb], grads, {k: p.detach().clone() for k, p in net.named_parameters()}))
    return steps


def _check(outs, ws):
    """Every rank, case and step: losses, gradients and updated weights equal the unsharded
    model's and FSDP2's (REL_F64); collective counts after the first step (whose metadata
    inference adds work) as documented in docs/design.md."""
    dp = ws // PP
    ref = _reference(dp)
    for dp_rank, results in outs:
        for case, by_runtime in results.items():
            schedule, stage_cls, _ = case
            for runtime, (steps, final, _) in by_runtime.items():
                for step, (losses, snap, _) in enumerate(steps):
                    where = f"{case} {runtime} step {step}"
                    ref_losses, ref_grads, ref_params = ref[step]
                    if losses:
                        mine = ref_losses[dp_rank * N_MB : (dp_rank + 1) * N_MB]
                        assert all(abs(a - b) <= REL_F64 * abs(b) for a, b in zip(losses, mine)), (where, losses, mine)
                    after = final if step == STEPS - 1 else {k: v[0] for k, v in steps[step + 1][1].items()}
                    for k, (_, g) in snap.items():
                        assert g is not None, f"{where}: {k} has no gradient"
                        assert_close_rel(g, ref_grads[k], f"{where} grad {k}", REL_F64)
                        assert_close_rel(after[k], ref_params[k], f"{where} param {k}", REL_F64)
            if "fsdp2" not in by_runtime:
                continue
            theirs, ours = by_runtime["fsdp2"][0], by_runtime["mfsdp2"][0]
            for step in range(STEPS):
                assert theirs[step][0] == ours[step][0] or all(
                    abs(a - b) <= REL_F64 * abs(b) for a, b in zip(ours[step][0], theirs[step][0])
                ), (case, step)
                for k, (p, g) in theirs[step][1].items():
                    assert_close_rel(ours[step][1][k][1], g, f"{case} step {step} grad {k} vs FSDP2", REL_F64)
            for step in range(STEPS if dp == 1 else 0, STEPS):  # dp = 1: FSDP2 issues none, nothing to compare
                # FSDP2's protocol with either stage class: its all-gathers, reduce-scatters and
                # all-reduces. Step 0 too: after metadata inference torch's stage reshards the
                # units of both runtimes (kept gathered: fewer gathers). torch 2.11 infers by a
                # no-grad forward and reshards nothing after it: FSDP2's first forward finds the
                # units that pass left gathered (``kept``) and gathers them once fewer than mfsdp2.
                (ag1, rs1, ar1), (ag2, rs2, ar2) = theirs[step][2], ours[step][2]
                extra = 0 if step or _CLEANS_UP_AFTER_INFERENCE else by_runtime["fsdp2"][2]
                assert (ag2, rs2, ar2) == (ag1 + extra, rs1, ar1), (case, stage_cls, step, extra, theirs[step][2],
                                                                     ours[step][2])


@pytest.mark.slow
def test_schedules_match_fsdp2_and_unsharded_ws4():
    """(pp=2, dp=2): torch's stage with GPipe, 1F1B, interleaved 1F1B and a zero-bubble schedule;
    mfsdp2's stage with 1F1B, interleaved 1F1B, both zero-bubble schedules
    (reshard_after_forward=False, as they need) and a loop without REDUCE_GRAD."""
    cases = [
        ("ScheduleGPipe", "torch", None),
        ("Schedule1F1B", "torch", None),
        ("ScheduleInterleaved1F1B", "torch", None),
        ("ScheduleInterleavedZeroBubble", "torch", False),
        ("Schedule1F1B", "mfsdp2", None),
        ("ScheduleInterleaved1F1B", "mfsdp2", None),
        ("ScheduleInterleavedZeroBubble", "mfsdp2", False),
        ("ScheduleZBVZeroBubble", "mfsdp2", False),
        ("MultiLoop", "mfsdp2", None),
    ]
    _check(run_ranks(_run, 4, cases, timeout=600), 4)


@pytest.mark.slow
def test_schedules_match_fsdp2_and_unsharded_ws2():
    """(pp=2, dp=1): data parallelism of one rank per stage."""
    cases = [
        ("ScheduleGPipe", "torch", None),
        ("ScheduleLoopedBFS", "torch", None),
        ("ScheduleDualPipeV", "mfsdp2", False),
    ]
    _check(run_ranks(_run, 2, cases, timeout=600), 2)


def _cause(e: BaseException) -> tuple:
    """``(type name, message)`` of the innermost exception (torch's stage wraps a backward's
    error in a RuntimeError)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return type(e).__name__, str(e)


def _refusal(rank, ws, stage_cls):
    """Zero bubble over blocks that reshard after forward, on ``stage_cls``'s stage: torch's own
    stage (the runtime refuses the first input-only pass through such a unit; FSDP2 trains on
    with wrong gradients) or mfsdp2's (refused before the first input pass). A rank that reaches
    one refuses it; its peer may then lose the connection instead."""
    mesh = init_device_mesh("cpu", (PP, ws // PP), mesh_dim_names=("pp", "dp"))
    try:
        _train(rank, mesh, "mfsdp2", "ScheduleZBVZeroBubble", stage_cls, None)
    except Exception as e:  # noqa: BLE001 (the type is what the test checks)
        return _cause(e)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("stage_cls", ["torch", "mfsdp2"])
def test_what_pipelining_cannot_do_is_refused(stage_cls):
    outs = run_ranks(_refusal, 2, stage_cls, timeout=300)
    assert all(out is not None for out in outs), outs
    refused = [out for out in outs if out[0] == "ValueError"]
    assert refused and all("reshard_after_forward=False" in msg for _, msg in refused), outs


def _checkpointed(net, reentrant: bool):
    """``net.forward`` with each block under activation checkpointing."""
    from torch.utils.checkpoint import checkpoint

    def forward(x):
        h = net.inp(x)
        for b in net.blocks:
            h = checkpoint(b, h, use_reentrant=reentrant)
        return net.head(h)

    return forward


def _input_only_backward(rank, ws):
    """The runtime's E52 check outside a schedule, with the flags torch's stage sets for each
    micro-batch (sync off, kept gathered after backward): an optimizer step after an input-only
    backward through a trainable unit that reshards after forward, with no backward computing its
    weight gradients since, is refused; an input-only ``autograd.grad`` followed by a full
    backward is not (nothing was lost), nor one through a frozen unit (LoRA's base blocks) or a
    kept-gathered one, nor input gradients with ``create_graph`` (a gradient penalty, whose full
    backward follows), nor a full backward with activation checkpointing (a reentrant recompute
    runs inside the outer backward, whose graph lacks the parameters)."""
    from mfsdp2 import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    cases = (("trainable", True, False, None), ("then_full", True, False, None), ("frozen", True, True, None),
             ("kept", False, False, None), ("penalty", True, False, None), ("reentrant", True, False, True),
             ("non_reentrant", True, False, False))
    for case, raf, frozen, reentrant in cases:
        net = build("net", dtype=F64)
        if frozen:
            for p in net.blocks.parameters():
                p.requires_grad_(False)
        for b in net.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=raf)
        fully_shard(net, mesh=mesh)
        if reentrant is not None:
            net.forward = _checkpointed(net, reentrant)
        net.set_requires_gradient_sync(False)
        net.set_reshard_after_backward(False)
        net.set_is_last_backward(False)
        x, y = batch(0, 4, net.inp.in_features, dtype=F64)
        x.requires_grad_(True)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        try:
            loss = loss_fn(net(x), y)
            if case == "penalty":  # input gradients with create_graph, then the full backward
                (gx,) = torch.autograd.grad(loss, [x], create_graph=True)
                (loss + gx.square().sum()).backward()
            elif case == "then_full":  # input gradients, then the full backward of the same graph
                torch.autograd.grad(loss, [x], retain_graph=True)
                loss.backward()
            elif reentrant is None:
                torch.autograd.grad(loss, [x])
                opt.step()  # no backward computed the weight gradients: refused
            else:
                loss.backward()
            net.set_requires_gradient_sync(True)
            net.set_is_last_backward(True)
            loss_fn(net(x), y).backward()  # the accumulation's synced micro-batch
            opt.step()
            out[case] = None
        except ValueError as e:
            out[case] = str(e)
    return out


def test_input_only_backward_through_resharding_trainable_units_is_refused():
    out = run_ranks(_input_only_backward, 1)[0]
    assert out["trainable"] is not None and "reshard_after_forward=False" in out["trainable"], out
    assert all(out[c] is None for c in ("then_full", "frozen", "kept", "penalty", "reentrant", "non_reentrant")), out
