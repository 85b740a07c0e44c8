"""``clip_grad_norm_`` over the flat gradient shards: a few tensor ops per parameter group and one
all-reduce for the whole model, instead of per-parameter DTensor dispatch.

Why: ``torch.nn.utils.clip_grad_norm_`` on DTensor gradients pays DTensor's dispatch for every
parameter (a norm, a stack, a ``Partial`` reduction, a multiply), which FSDP2 users measure in
tens of milliseconds of CPU time per step on large models. Our gradients are views of one flat
main-gradient shard per :class:`~mfsdp2.groups.param_group.ParameterGroup`, so the norm is a reduction
over those flat tensors (per-parameter pieces when only some parameters are clipped or their norms
are asked for: one ``segment_reduce``), summed over the data-parallel shard group in one
all-reduce, and the clip is one multiply per flat shard.

What it returns equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model (same total norm,
same clipped gradients; tests/integrations/test_clip_grad.py), as a plain tensor holding the same value on
every rank. Gradients that are not views of our flat shards (a gradient the user assigned, plain
tensors, tensor-parallel parameters) go through torch's own norm, and the two parts combine.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..comm.communicator import device_ints
from ..groups.param_group import live_groups

__all__ = ["clip_grad_norm_"]

logger = logging.getLogger(__name__)


def _locate() -> dict[int, tuple]:
    """``id(DTensor parameter) -> (group, index)`` for every live mfsdp2 parameter."""
    where = {}
    for g in live_groups():
        for i, dp in enumerate(g.dist_params):
            where[id(dp)] = (g, i)
    return where


def _name(where, p, i: int) -> str:
    hit = where.get(id(p))
    if hit is None:
        return f"param{i}"
    g, k = hit
    fqn = g.infos[k][0].fqn
    return fqn if g.unit_name == "root" else f"{g.unit_name}.{fqn}"


def _flat_pieces(params: list[torch.Tensor], where: dict):
    """``{group: [(index, param), ...]}`` for the parameters whose grad is a view of their
    group's flat main gradient, and the list of the others."""
    flat, other = {}, []
    for p in params:
        hit = where.get(id(p))
        g = hit[0] if hit is not None else None
        if g is None or g.main_grad is None or g.tp_specs[hit[1]] is not None or not _views_main_grad(p.grad, g):
            other.append(p)
        else:
            flat.setdefault(g, []).append((hit[1], p))
    return flat, other


def _views_main_grad(grad: torch.Tensor, g) -> bool:
    """Whether ``grad`` is (a view of) the group's flat main gradient: the same storage. Empty
    pieces too (their view shares the storage), so every rank decides alike for a gradient the
    user replaced, whatever its local size."""
    local = grad._local_tensor if isinstance(grad, DTensor) else grad
    mg = g.main_grad
    return local.dtype == mg.dtype and local.untyped_storage().data_ptr() == mg.untyped_storage().data_ptr()


def _segments(g, indices: list[int]):
    """Offsets/lengths of the given parameters' pieces in ``g.main_grad``, with the gaps
    between them as segments of their own (so one ``segment_reduce`` covers the shard)."""
    mg = g.main_grad
    pieces = []
    for i in indices:
        v = g.weights.piece_view(mg, i)
        pieces.append(((v.data_ptr() - mg.data_ptr()) // mg.element_size() if v.numel() else 0, v.numel(), i))
    pieces.sort()
    lengths, which, pos = [], [], 0
    for off, n, i in pieces:
        if n == 0:
            which.append((i, None))
            continue
        if off > pos:
            lengths.append(off - pos)  # a gap: other parameters or padding
        which.append((i, len(lengths)))
        lengths.append(n)
        pos = off + n
    if pos < mg.numel():
        lengths.append(mg.numel() - pos)
    return lengths, which


def _group_powers(g, indices: list[int], norm_type: float, want_each: bool):
    """``(sum of |x|^p, or max |x| for inf, over the given pieces; per-index values or None)``."""
    mg = g.main_grad
    whole = len(indices) == len(g.dist_params) and not want_each
    if norm_type == math.inf:
        if whole:
            return mg.abs().amax() if mg.numel() else mg.new_zeros(()), None
        vals = mg.abs()
        reduce = "max"
    else:
        if whole:
            return (mg.abs().pow(norm_type).sum() if norm_type != 2 else mg.dot(mg)), None
        vals = mg.abs().pow(norm_type) if norm_type != 2 else mg * mg
        reduce = "sum"
    lengths, which = _segments(g, indices)
    if mg.numel() == 0:
        seg = mg.new_zeros((0,))
    else:
        seg = torch.segment_reduce(vals, reduce, lengths=device_ints(lengths, mg.device), unsafe=True)
        if reduce == "max":
            seg = seg.clamp_min(0)  # empty segments give -inf; norms are >= 0
    picked = [seg[k] if k is not None else mg.new_zeros(()) for _, k in which]
    total = torch.stack(picked).amax() if reduce == "max" else torch.stack(picked).sum() if picked else mg.new_zeros(())
    return total, ({i: v for (i, _), v in zip(which, picked)} if want_each else None)


def clip_grad_norm_(
    parameters: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    param_norms: bool = False,
):
    """Clip the gradients of ``parameters`` (a model, or parameters as for torch's function) so
    that their total ``norm_type`` norm is at most ``max_norm``; returns the total norm before
    clipping (a plain tensor, equal on every rank), or ``(total, {name: norm before clipping})``
    with ``param_norms=True`` (model names; for a parameter list the same names for mfsdp2
    parameters, ``"param<i>"`` for others).

    Collective over the data-parallel group: call it on every rank with the same parameters.
    ``error_if_nonfinite=True`` raises (on every rank) naming the parameters whose gradient has a
    non-finite norm; otherwise a non-finite total is returned as torch does (and the gradients are
    scaled by NaN, as torch's do)."""
    norm_type = float(norm_type)
    where = _locate()
    if isinstance(parameters, nn.Module):
        named = [(n, p) for n, p in parameters.named_parameters() if p.grad is not None]
    else:
        plist = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        named = [(_name(where, p, i), p) for i, p in enumerate(plist) if p.grad is not None]
    if not named:
        return (torch.tensor(0.0), {}) if param_norms else torch.tensor(0.0)
    name_of = {id(p): n for n, p in named}
    flat, other = _flat_pieces([p for _, p in named], where)
    for g in flat:  # an optimizer that stepped with these gradients in backward refuses the clip
        for listener in g.grad_listeners:
            listener.before_clip(g)

    # 1. Local powers per communicator (one all-reduce each: normally the model's shard group).
    per_comm: dict[object, list] = {}
    device = None
    for g, items in flat.items():
        total, _ = _group_powers(g, [i for i, _ in items], norm_type, want_each=False)
        device = total.device
        # ZeRO-1/2/3 expose this rank's rows: sum over the shard group (HSDP replicas hold the
        # same rows, so not over them). no_shard exposes the whole gradient on every rank.
        # Offloaded main grads (host memory) are summed over the gloo twin (``main_comm``).
        replicated = g.comm.world_size == 1 or _is_no_shard(g)
        per_comm.setdefault(None if replicated else g.main_comm.group, []).append(total)
    totals = []
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    for group, parts in per_comm.items():
        t = torch.stack(parts).amax() if norm_type == math.inf else torch.stack(parts).sum()
        if group is not None:
            dist.all_reduce(t, op=op, group=group)
        totals.append(t)

    # 2. Gradients outside our flat shards: torch's own norm (DTensors reduce themselves).
    if other:
        grads = [p.grad for p in other]
        if norm_type == math.inf:
            t = _inf_norm(grads)  # torch's refuses empty local pieces (no identity for max)
        else:
            t = torch.nn.utils.get_total_norm(grads, norm_type)
            t = t.full_tensor() if isinstance(t, DTensor) else t
        totals.append(t if norm_type == math.inf else t.pow(norm_type))
        device = device or t.device

    stacked = torch.stack([t.to(device) for t in totals])
    total = stacked.amax() if norm_type == math.inf else stacked.sum().pow(1.0 / norm_type)
    each = _param_norms(flat, other, name_of, norm_type, op) if param_norms else None

    if error_if_nonfinite and not bool(torch.isfinite(total)):  # the same answer on every rank
        each = each if each is not None else _param_norms(flat, other, name_of, norm_type, op)
        bad = sorted(n for n, v in each.items() if not bool(torch.isfinite(v)))
        raise RuntimeError(
            f"mfsdp2.clip_grad_norm_: the total norm of order {norm_type} is non-finite; gradients with "
            f"a non-finite norm: {bad}. Set error_if_nonfinite=False to clip anyway (as torch does)"
        )

    # 3. Clip: one multiply per flat shard (or per piece when only some are clipped).
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g, items in flat.items():
            c = coef.to(device=g.main_grad.device, dtype=g.main_grad.dtype)  # offloaded: host memory
            if len(items) == len(g.dist_params):
                g.main_grad.mul_(c)
            else:
                torch._foreach_mul_([p.grad._local_tensor for _, p in items], c)
        if other:
            torch.nn.utils.clip_grads_with_norm_([p for p in other], max_norm, total.to(other[0].grad.device)
                                                 if not isinstance(other[0].grad, DTensor) else total)
    if param_norms:
        return total, {n: each[n] for n, _ in named}
    return total


def _param_norms(flat, other, name_of, norm_type: float, op) -> dict[str, torch.Tensor]:
    """Every parameter's gradient norm (collective: one all-reduce per shard group)."""
    each: dict[str, torch.Tensor] = {}
    for g, items in flat.items():
        _, per = _group_powers(g, [i for i, _ in items], norm_type, want_each=True)
        for i, p in items:
            each[name_of[id(p)]] = per[i]
    _reduce_each(each, flat, name_of, norm_type, op)
    for p in other:
        n = _inf_norm([p.grad]) if norm_type == math.inf else torch.linalg.vector_norm(p.grad, norm_type)
        each[name_of[id(p)]] = n.full_tensor() if isinstance(n, DTensor) else n
    return each


def _inf_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Max |x| over gradients that may be DTensors with empty local pieces: local maxima (0 for
    an empty piece), then MAX over every dimension of each DTensor's mesh (idempotent over
    replicated dimensions)."""
    out = []
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        local = g._local_tensor if isinstance(g, DTensor) else g
        m = local.abs().amax() if local.numel() else local.new_zeros(())
        if isinstance(g, DTensor):
            by_mesh.setdefault(g.device_mesh, []).append(m)
        else:
            out.append(m)
    for mesh, ms in by_mesh.items():
        t = torch.stack(ms).amax()
        for d in range(mesh.ndim):
            if mesh.size(d) > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
        out.append(t)
    return torch.stack(out).amax()


def _is_no_shard(g) -> bool:
    return not g.config.strategy.shards_optim


def _reduce_each(each, flat, name_of, norm_type: float, op) -> None:
    """Per-parameter norms: the pieces' powers summed over the shard group in one all-reduce."""
    by_group: dict[object, list[str]] = {}
    for g, items in flat.items():
        if g.comm.world_size > 1 and not _is_no_shard(g):
            by_group.setdefault(g.main_comm.group, []).extend(name_of[id(p)] for _, p in items)
    for group, names in by_group.items():
        t = torch.stack([each[n] for n in names])
        dist.all_reduce(t, op=op, group=group)
        for n, v in zip(names, t):
            each[n] = v
    for g, items in flat.items():
        for _, p in items:
            n = name_of[id(p)]
            each[n] = each[n] if norm_type == math.inf else each[n].pow(1.0 / norm_type)
