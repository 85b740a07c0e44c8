"""Which parameters get a ``.grad`` at the end of a synced backward, decided without a per-step
host collective.

Each reduction exposes the gradients of the parameters that had one *on this rank*
(``GradientReduction.expose_grads``). That is the whole answer when every rank used the same
parameters -- torch FSDP2's contract: its reduce-scatters only match when they do -- and then
nothing needs agreeing. FSDP2 issues no collective for it, and neither do we by default: an
all-reduce of presence flags at the end of every backward was a host-blocking gloo/TCP round trip
per step (over the CPU twin of the device group on GPUs), whose latency grows with the rank count.

Ranks that use *different* parameters (a mixture-of-experts whose expert got no tokens on some
ranks, a branch taken on some ranks only) ask for it as they do in FSDP2, with
``set_reduce_scatter_unused_params(True)``: the ranks then agree on which parameters had a gradient
anywhere (one small all-reduce of host flags per backward, :func:`agree`), and each rank exposes
those -- every rank steps a parameter used on any rank, and one no rank used keeps ``grad=None``
as it would unsharded.

Without it the mistake is caught rather than trained through (:func:`check`): a parameter this
rank had no gradient for, whose reduced gradient in this rank's rows is nonzero, was used on
another rank; leaving it ``None`` here would freeze this rank's rows of it. The check reads
memory the reduction wrote: on the CPU at once, on CUDA through a non-blocking copy whose event
is looked at (never waited for) at the next backward's end, so it raises one step later there.
It costs nothing when this rank had a gradient for every parameter it reduced (the usual dense
model). What it cannot see: a rank holding no rows of such a parameter, or rows the others'
gradients left exactly zero; the ranks that hold nonzero rows raise.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..comm.communicator import host_tensor

if TYPE_CHECKING:
    from .state import RootContext

__all__ = ["finish", "agree", "check", "agreement_wanted", "GradientPresenceError"]

logger = logging.getLogger(__name__)

# CUDA checks still in flight that may stay so; an older one is waited for (the GPU is then
# more than this many backwards behind the host, which a training loop never is).
MAX_PENDING_CHECKS = 4


class GradientPresenceError(RuntimeError):
    """Ranks used different parameters without ``set_reduce_scatter_unused_params(True)``."""


def agreement_wanted(ctx: "RootContext") -> bool:
    """Whether some unit under this root asked for the presence agreement
    (``set_reduce_scatter_unused_params(True)``; every rank must ask the same)."""
    return any(getattr(s, "reduce_unused_params", False) for s in ctx.states)


def finish(ctx: "RootContext") -> None:
    """End of a synced backward (the last before the optimizer step): agree on gradient presence
    where asked, else check that no parameter was used on other ranks only; then start the next
    step's flags afresh."""
    groups = [g for s in ctx.states for g in s.groups if g.requires_grad and g.grads_reduced_this_step]
    _poll(ctx, block=False)
    if groups:
        if agreement_wanted(ctx):
            agree(ctx, groups)
        else:
            check(ctx, groups)
    for g in groups:
        g.local_grad_flags = [False] * len(g.local_grad_flags)
        g.grads_reduced_this_step = False


def agree(ctx: "RootContext", groups: list) -> None:
    """One small all-reduce (MAX) of which parameters had a gradient on *any* rank, then expose
    those used on other ranks alone (and run their post-accumulate-grad hooks).

    The flags are host facts (which unsharded parameters had ``.grad``), so they are agreed over
    the group's gloo twin on the CPU (``Communicator.host``): no device copy and no
    device-to-host read. Every rank reduced the same groups (their reductions matched), so every
    rank builds the same vector. Groups sharded over different meshes (per-parameter meshes:
    experts over their expert-data-parallel mesh) agree over their own mesh's groups, one
    all-reduce per mesh: the ranks of another mesh block hold other experts."""
    by_mesh: dict[tuple, list] = {}
    for g in groups:
        key = (id(g.comm.group), id(g.replicate_comm.group) if g.replicate_comm is not None else None)
        by_mesh.setdefault(key, []).append(g)
    label = f"gradient-presence all-reduce (end of backward, step {ctx.step})"
    for members in by_mesh.values():
        comms = [c.host() for c in (members[0].comm, members[0].replicate_comm) if c is not None and c.world_size > 1]
        flags = host_tensor([f for g in members for f in g.local_grad_flags], torch.uint8)
        for c in comms:  # over the shard group, then across replicas (HSDP; no_shard's only group)
            c.all_reduce(flags, op=dist.ReduceOp.MAX, label=label).wait()
        flat = flags.tolist()  # a CPU tensor: no device synchronisation
        k = 0
        for g in members:
            n = len(g.local_grad_flags)
            # Only the parameters used on other ranks alone: those with a local gradient were exposed
            # (and hooked) at their reduction, and a post-accumulate-grad hook may have cleared them
            # since (optimizer-in-backward's zero_grad) -- exposing them again would undo that.
            others = [a and not b for a, b in zip(flat[k : k + n], g.local_grad_flags)]
            g.expose_grads(others)
            g.run_post_accumulate_grad_hooks(others)
            k += n


def _missing(groups: list) -> list[tuple[str, torch.Tensor]]:
    """(name, reduced gradient this rank holds) of each parameter with no local gradient and no
    ``.grad`` (a gradient kept or assigned by the user is theirs)."""
    out = []
    for g in groups:
        if g.main_grad is None:
            continue
        for i, had in enumerate(g.local_grad_flags):
            if had or g.dist_params[i].grad is not None:
                continue
            piece = g.weights.piece_view(g.main_grad, i)  # this rank's rows: reduced in every strategy
            if piece.numel():
                out.append((f"{g.unit_name}: {g.infos[i][0].fqn}" if g.infos[i] else f"{g.name}[{i}]", piece))
    return out


def check(ctx: "RootContext", groups: list) -> None:
    """Raise :class:`GradientPresenceError` when a parameter without a local gradient has a
    nonzero reduced gradient here (see the module docstring). CPU pieces are read at once; CUDA
    ones are reduced to one flag on the device and read back later without a synchronisation."""
    missing = _missing(groups)
    if not missing:
        return
    host = [(n, p) for n, p in missing if p.device.type == "cpu"]
    used = [n for n, p in host if bool(p.ne(0).any())]
    if used:
        _raise(used, ctx.step)
    dev = [(n, p) for n, p in missing if p.device.type != "cpu"]
    if not dev:
        return
    names = [n for n, _ in dev]
    flags = torch.stack([p.ne(0).any() for _, p in dev])
    pinned = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
    pinned.copy_(flags, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    pending = ctx.presence_checks
    pending.append((event, pinned, names, ctx.step))
    if len(pending) > MAX_PENDING_CHECKS:
        _poll(ctx, block=True, keep=MAX_PENDING_CHECKS)


def _poll(ctx: "RootContext", block: bool, keep: int = 0) -> None:
    """Read the CUDA checks whose copies have finished (``block``: wait for all but ``keep``)."""
    pending = ctx.presence_checks
    while pending:
        event, pinned, names, step = pending[0]
        if not event.query():
            if not block or len(pending) <= keep:
                return
            event.synchronize()
        pending.pop(0)
        used = [n for n, f in zip(names, pinned.tolist()) if f]
        if used:
            pending.clear()
            _raise(used, step)


def _raise(names: list[str], step: int) -> None:
    raise GradientPresenceError(
        f"mfsdp2: at step {step} this rank had no gradient for {names}, but other ranks had one (their "
        "reduced gradient in this rank's rows is nonzero): the ranks used different parameters (e.g. an "
        "expert without tokens here). Leaving them without .grad here would freeze this rank's rows. Call "
        "model.set_reduce_scatter_unused_params(True) (as torch FSDP2 requires for such models) so that the "
        "ranks agree on which parameters have a gradient"
    )
