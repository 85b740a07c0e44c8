"""Meta-device initialisation: build a model under ``torch.device("meta")``, ``fully_shard`` it,
then :func:`materialize` it -- no rank ever holds the full model.

Why this shape: ``fully_shard`` only needs parameter *shapes* to plan the layout, so it accepts a
meta model and, as torch FSDP2 does, leaves its sharded parameters (and every per-rank buffer
behind them) on the meta device: no bytes until the model is initialised. :func:`materialize`
allocates this rank's shards on the mesh's device, then walks the modules in registration order
(which is construction order for ordinary models) and, for
one module at a time, gives its own parameters real full-size tensors, runs its
``reset_parameters()`` (or the user's ``init_fn(module)``), copies this rank's rows into the main
weights and drops the full tensors. At most one module's parameters exist in full at any moment.

Every rank draws the same values when every rank runs the same RNG stream: seed all ranks alike
(``torch.manual_seed``) before building. Because modules are initialised in construction order
with the same calls their constructors make (``nn.Linear.__init__`` calls ``reset_parameters``),
the result equals the model built normally from the same seed, bit for bit (tested at world sizes
1, 2 and 4). Not equal: modules whose constructor draws random numbers other than through
``reset_parameters``, and tied weights (a tie made after construction discards one draw that
materialize does not make) -- pass ``init_fn`` for those.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..memory.offload import settle_host_reads
from ..runtime.param_adoption import adopt_replaced, settle_all
from ..dtensors.shard_dim import rows_along

__all__ = ["materialize"]

logger = logging.getLogger(__name__)


def _units(model: nn.Module) -> list:
    """Every unit under ``model`` once (a unit of several modules is met once per module)."""
    out: list = []
    for m in model.modules():
        st = m.__dict__.get("_mfsdp2_state")
        if st is not None and all(st is not o for o in out):
            out.append(st)
    return out


def _owned(states: list) -> dict[int, list]:
    """id(module) -> [(group, index, attr)] for every parameter slot a module registers directly
    and whose value is still to come (on the meta device, not pending: a parameter converted or
    replaced on its own already holds its value)."""
    out: dict[int, list] = {}
    for st in states:
        for g in st.groups:
            if not g.needs_init:
                continue
            for i, owners in enumerate(g.infos):
                if i in g.pending:
                    continue
                first = owners[0]  # a tied parameter is initialised by its first owner only
                out.setdefault(id(first.owner), []).append((g, i, first.attr))
    return out


@torch.no_grad()
def materialize(model: nn.Module, init_fn: Optional[Callable[[nn.Module], None]] = None) -> None:
    """Fill the shards of a model that was built on the meta device and passed to ``fully_shard``.

    ``init_fn(module)`` (default: ``module.reset_parameters()``) must initialise the module's own
    parameters (and buffers), which are real full-size tensors while it runs. Parameters that
    already hold values (a module converted by ``to_empty`` on its own, a parameter replaced
    before the first forward) keep them. Not collective, unless a replaced parameter's rows must
    be redistributed (every rank calls it anyway)."""
    settle_host_reads()  # CPU offload: the main weights are written next
    states = _units(model)
    for st in states:
        if st.ctx is None:
            adopt_replaced(st)
        settle_all(st)
    owned = _owned(states)
    if not owned:
        return
    device = next(g for slots in owned.values() for g, _, _ in slots).device
    for g in {id(g): g for slots in owned.values() for g, _, _ in slots}.values():
        g.allocate()  # this rank's shards: on the meta device until now
    done = []
    for name, m in model.named_modules():
        # Buffers built on the meta device get real memory (init_fn / reset_parameters fill them).
        for bname, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[bname] = torch.empty_like(b, device=device)
        slots = owned.get(id(m))
        if not slots:
            continue
        saved = {}
        for g, i, attr in slots:
            saved[attr] = m._parameters[attr]
            m._parameters[attr] = nn.Parameter(
                torch.empty(g.layout.slots[i].shape, dtype=g.orig_dtype, device=g.device), requires_grad=g.requires_grad
            )
        try:
            if init_fn is not None:
                init_fn(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
            else:
                raise RuntimeError(
                    f"mfsdp2 E31: module {name or 'root'!r} ({type(m).__name__}) has parameters on the meta "
                    f"device ({sorted(saved)}) but no reset_parameters(); pass materialize(model, init_fn=...)"
                )
            for g, i, attr in slots:
                full = m._parameters[attr].detach()
                lo = g.layout.piece(i, g.rank)
                g.weights.piece_view(g.main_weight, i).copy_(
                    rows_along(full, g.layout.slots[i].shard_dim, lo.row_start, lo.row_end))
        finally:
            for attr, dp in saved.items():
                m._parameters[attr] = dp
        done.extend(slots)
    groups = {id(g): g for g, _, _ in done}
    for g in groups.values():
        g.needs_init = False
        g.mark_changed()
    for st in states:  # values held apart (pending) now fit their allocated groups
        settle_all(st)
    logger.debug("mfsdp2: materialised %d parameters in %d groups", len(done), len(groups))
