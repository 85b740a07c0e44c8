"""Optimizer state dicts of mfsdp2 models, around ``torch.distributed.checkpoint.state_dict``.

torch's DSD (``get_optimizer_state_dict`` / ``set_optimizer_state_dict``) does the FQN mapping and
the param-group bookkeeping correctly for our DTensor parameters. Four things it cannot know:

1. **Placements of derived states.** SGD creates ``momentum_buffer`` with ``clone``; torch labels
   the result a plain ``Shard(0)`` although its local tensor holds our uneven rows, so DCP would
   write it at ``torch.chunk`` offsets. :func:`fix_optimizer_state_dict` relabels every per-row
   state with the *parameter's* ``RowShard`` (a tensor whose local shape is the parameter's local
   shape), never trusting the state's own label; plain local tensors get the same treatment.
2. **Empty pieces.** A rank holding no rows of a parameter never gives it a gradient, so the
   optimizer never creates its state there. DSD's strict loading then misses that state, and its
   ``_init_optim_state`` would hand every parameter a zero gradient — empty ones included, which
   the runtime avoids everywhere. :func:`prepare_optimizers` creates fresh states with zero
   gradients on non-empty pieces only, then gives empty pieces *placeholder* states whose layout
   (and scalar values such as ``step``) comes from a rank that holds rows, in one
   ``all_gather_object``. Placeholders never write anything: empty tensors are empty and their
   scalars are tagged so that only ranks with real state write ``step``.
3. **Order.** ``optimizer.state`` keeps insertion order, which differs between ranks once
   placeholders exist; gathering a full state dict issues one collective per tensor, so the state
   is re-ordered by parameter order before anything is gathered.
4. **Full state dicts.** torch gathers and scatters full optimizer states with the *states'*
   placements (wrong for the mislabelled ones above) and ``distribute_tensor`` (``torch.chunk``);
   here full tensors are sliced with the parameter's rows instead.

Note (as in torch): taking the state dict of a *fresh* optimizer initialises it with one
zero-gradient, zero-learning-rate step, which sets Adam's ``step`` to 1. That is what a load needs;
a checkpoint taken before the first real step therefore does not resume bit-exactly.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._common import (
    ShardedParam,
    check_loadable,
    full_to_rows,
    mark_write_nothing,
    model_group,
    relabel_rows,
    sharded_params,
    units,
)

__all__ = ["prepare_optimizers", "fix_optimizer_state_dict", "full_optimizer_state_to_rows"]

logger = logging.getLogger(__name__)

_STATE, _PG, _PARAMS = "state", "param_groups", "params"


def _params(optim: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for g in optim.param_groups for p in g[_PARAMS]]


def _per_row_local(v: Any, sp: ShardedParam) -> Optional[torch.Tensor]:
    """The local tensor of ``v`` if it is a per-row state of ``sp`` (local shape == param's local)."""
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return None
    if isinstance(v, DTensor):
        if tuple(v.shape) != tuple(sp.param.shape):
            return None
        local = v.to_local()
    else:
        local = v
    want = (sp.rows[sp.rank],) + tuple(sp.param.shape[1:])
    return local if tuple(local.shape) == want else None


# -- preparing the optimizer ----------------------------------------------------------------------
def _init_fresh(optim: torch.optim.Optimizer, by_param: dict[int, ShardedParam]) -> None:
    """A never-stepped optimizer: one zero-gradient, lr=0 step on the non-empty pieces only."""
    params = _params(optim)
    live = [p for p in params if p.requires_grad and not (id(p) in by_param and by_param[id(p)].empty)]
    if not live or any(optim.state.get(p) for p in live) or any(p.grad is not None for p in params):
        return
    for p in live:
        p.grad = torch.zeros_like(p)
    lrs = []
    for g in optim.param_groups:
        if "lr" in g:
            lrs.append(g["lr"])
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optim.step()
    for g in optim.param_groups:
        if "lr" in g:
            g["lr"] = lrs.pop(0)
    for p in live:
        p.grad = None
    logger.debug("mfsdp2: initialised the states of a fresh %s", type(optim).__name__)


def _describe(v: Any, sp: ShardedParam):
    if _per_row_local(v, sp) is not None:
        return ("rows", v.dtype)
    if isinstance(v, DTensor):
        return ("skip", None)  # not per-row: nothing we know how to mirror
    if isinstance(v, torch.Tensor):
        return ("value", v.detach().cpu().clone())
    return ("value", v)


def _placeholder(desc, sp: ShardedParam, current: Any) -> Any:
    kind, val = desc
    if kind == "rows":
        if _per_row_local(current, sp) is not None and current.dtype == val:
            return current
        empty = torch.empty((0,) + tuple(sp.param.shape[1:]), dtype=val, device=sp.param.to_local().device)
        return relabel_rows(empty, sp.param, sp.rows)
    if isinstance(val, torch.Tensor):
        return val.to(sp.param.to_local().device).clone()
    return val


def prepare_optimizers(model: nn.Module, optims: Sequence[torch.optim.Optimizer]) -> dict[str, ShardedParam]:
    """Make every rank hold a state for every parameter: fresh init + placeholders (collective).

    Returns the DSD-name -> :class:`ShardedParam` map used to fix the state dict afterwards.
    """
    for s in units(model):
        # DSD maps model.named_parameters() to the optimizer's parameters: they must be the DTensors.
        check_loadable(s, "take or load the optimizer state dict of")
    sps = sharded_params(model, clean=True)
    by_param: dict[int, ShardedParam] = {}
    for sp in sps.values():
        by_param.setdefault(id(sp.param), sp)
    for o in optims:
        _init_fresh(o, by_param)
    group = model_group(model)
    if group is None:
        return sps
    schema: dict = {}
    for oi, o in enumerate(optims):
        for p in _params(o):
            sp = by_param.get(id(p))
            st = o.state.get(p) if sp is not None and not sp.empty else None
            if st:
                schema[(oi, sp.name)] = {k: _describe(v, sp) for k, v in st.items()}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, schema, group=group)
    merged: dict = {}
    for s in everyone:
        for k, v in s.items():
            merged.setdefault(k, v)
    added = 0
    for oi, o in enumerate(optims):
        for p in _params(o):
            sp = by_param.get(id(p))
            if sp is None or not sp.empty or (oi, sp.name) not in merged:
                continue
            st = o.state[p]
            for k, desc in merged[(oi, sp.name)].items():
                if desc[0] != "skip":
                    st[k] = _placeholder(desc, sp, st.get(k))
            added += 1
    if added:
        logger.debug("mfsdp2: %d placeholder optimizer states for empty pieces", added)
    return sps


# -- fixing DSD's output ----------------------------------------------------------------------------
def _fix_value(v: Any, sp: Optional[ShardedParam]) -> Any:
    if sp is None or not isinstance(v, torch.Tensor):
        return v
    local = _per_row_local(v, sp)
    if local is not None:
        return relabel_rows(local.detach(), sp.param, sp.rows)
    if v.dim() == 0 and not isinstance(v, DTensor) and sp.empty:
        alias = v.detach()  # shares storage: a load still reaches the live state
        return mark_write_nothing(alias)
    if v.dim() > 0:
        logger.debug("mfsdp2: optimizer state of %s with shape %s is not per-row; saved as is", sp.name, tuple(v.shape))
    return v


def fix_optimizer_state_dict(osd: dict, sps: dict[str, ShardedParam]) -> dict:
    """Relabel per-row states with their parameter's rows; order states by parameter order."""
    if _STATE in osd:  # nested: {"state": {fqn: {k: v}}, "param_groups": [...]}
        order = [fqn for g in osd[_PG] for fqn in g[_PARAMS]]
        pos = {fqn: i for i, fqn in enumerate(order)}
        state = osd[_STATE]
        names = sorted(state, key=lambda f: (pos.get(f, len(pos)), str(f)))
        osd[_STATE] = {
            f: {k: _fix_value(state[f][k], sps.get(f)) for k in sorted(state[f], key=str)} for f in names
        }
        return osd
    # flattened (flatten_optimizer_state_dict=True): "state.<fqn>.<key>", "param_groups.<fqn>.<key>"
    order = {}
    for key in osd:
        if key.startswith(_PG + "."):
            order.setdefault(key[len(_PG) + 1 :].rsplit(".", 1)[0], len(order))
    out, states = {}, []
    for key, v in osd.items():
        if key.startswith(_STATE + "."):
            fqn, k = key[len(_STATE) + 1 :].rsplit(".", 1)
            states.append((order.get(fqn, len(order)), fqn, k, key, _fix_value(v, sps.get(fqn))))
        else:
            out[key] = v
    for _, _, _, key, v in sorted(states, key=lambda t: t[:3]):
        out[key] = v
    return out


def full_optimizer_state_to_rows(path: tuple, full: Any, sps: dict[str, ShardedParam]) -> Any:
    """Convert one leaf of a *full* optimizer state dict to this rank's rows (by parameter rows)."""
    if not isinstance(full, torch.Tensor) or full.dim() == 0:
        return full
    fqn = None
    if len(path) >= 3 and path[0] == _STATE:
        fqn = path[1]
    elif len(path) == 1 and isinstance(path[0], str) and path[0].startswith(_STATE + "."):
        fqn = path[0][len(_STATE) + 1 :].rsplit(".", 1)[0]
    sp = sps.get(fqn) if fqn is not None else None
    if sp is None or tuple(full.shape) != tuple(sp.param.shape):
        return full
    return full_to_rows(full, sp)
