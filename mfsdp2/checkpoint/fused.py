"""Split and join fused parameters in state dicts, sharded or not, in global coordinates.

A fused parameter stacks several logical ones along dim 0 (SwiGLU's ``fc1 = [gate; up]``, a QKV
projection). Checkpoints written by a model with separate parameters must load into a model with
fused ones and back, without gathering anything.

**Split** works on what the rank holds: the fused DTensor's placement says which global rows
``[a, b)`` this rank owns; each part ``i`` covers fused rows ``[o_i, o_i + n_i)``, so this rank's
rows of part ``i`` are the intersection, a *view* of its local tensor (possibly empty), and every
rank's row counts of part ``i`` follow from the fused placement alone. The parts are ``RowShard``
DTensors, so ``dcp.load`` into a split state dict writes straight into the fused tensor's memory.
Offsets come from the placement and the given sizes, never from a local tensor's shape: a plain
local tensor says nothing about where it sits (the Megatron SwiGLU-split bug).

**Join** concatenates each rank's local parts when, in fused coordinates, every rank's rows stay
one contiguous range in rank order — true after a split, and for parameters stored consecutively
in one mfsdp2 flat buffer (each rank holds the tail of one and the head of the next). Otherwise
(e.g. torch FSDP2, which chunks every parameter separately) it gathers the parts and re-shards the
fused tensor, by ``rows`` if given, else as ``torch.chunk`` would.

Both accept flat model state dicts (``{name: tensor}``) and DSD's nested optimizer state dicts
(``{"state": {name: {key: value}}, "param_groups": [...]}``), modify them in place (keeping the
order of entries) and return them. Plain tensors are taken to be *full* (unsharded) values;
non-tensors and 0-d tensors (``step``) are copied to every part and taken from the first on join.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor

from ..dtensors.placement import chunk_rows, offset_free, wrap_local
from ._common import full_of, global_rows, mesh_rank, relabel_rows, row_range

__all__ = ["split_fused", "join_fused", "split_swiglu", "join_swiglu"]

logger = logging.getLogger(__name__)


def _is_optim(sd: dict) -> bool:
    return "state" in sd and "param_groups" in sd


def _replace(d: dict, old: Sequence[str], new: dict) -> None:
    """Replace the entries ``old`` of ``d`` by ``new`` at the position of the first, in place."""
    items = list(d.items())
    d.clear()
    for k, v in items:
        if k == old[0]:
            d.update(new)
        elif k not in old:
            d[k] = v


def _offsets(sizes: Sequence[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


# -- one value ------------------------------------------------------------------------------------
def _split_value(v: Any, sizes: Sequence[int]) -> list[Any]:
    total = sum(sizes)
    if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != total:
        return [v] * len(sizes)
    if not isinstance(v, DTensor):
        return list(torch.split(v, list(sizes), dim=0))
    rows = global_rows(v)
    if rows is None:  # Replicate: the local tensor is the full value
        mesh, pl = v.device_mesh, v.placements
        return [
            offset_free(wrap_local(part, mesh, pl, part.shape, part.stride()))
            for part in torch.split(v.to_local(), list(sizes), dim=0)
        ]
    rank = mesh_rank(v)
    a, b = row_range(rows, rank)
    local = v.to_local()
    out = []
    for o, n in zip(_offsets(sizes), sizes):
        lo, hi = max(a, o), min(b, o + n)
        piece = local[lo - a : hi - a] if hi > lo else local[0:0]
        part_rows = []
        for q in range(len(rows)):
            qa, qb = row_range(rows, q)
            part_rows.append(max(0, min(qb, o + n) - max(qa, o)))
        out.append(relabel_rows(piece, v, part_rows))
    return out


def _compatible_rows(parts: Sequence[DTensor]) -> Optional[tuple[int, ...]]:
    """Per-rank rows of the fused tensor if concatenating locals yields a valid row shard."""
    all_rows = [global_rows(p) for p in parts]
    if any(r is None for r in all_rows) or len({len(r) for r in all_rows}) != 1:
        return None
    n = len(all_rows[0])
    offs = _offsets([p.shape[0] for p in parts])
    cursor = 0
    for q in range(n):
        for o, rows in zip(offs, all_rows):
            qa, qb = row_range(rows, q)
            if qb == qa:
                continue
            if o + qa != cursor:
                return None
            cursor = o + qb
    return tuple(sum(r[q] for r in all_rows) for q in range(n))


def _join_value(vs: Sequence[Any], rows: Optional[Sequence[int]]) -> Any:
    if not all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in vs):
        return vs[0]
    if not any(isinstance(v, DTensor) for v in vs):
        return torch.cat(list(vs), dim=0)
    if not all(isinstance(v, DTensor) for v in vs):
        raise TypeError("join_fused: cannot mix DTensor and plain tensor parts")
    if all(global_rows(v) is None for v in vs):  # all Replicate
        mesh, pl = vs[0].device_mesh, vs[0].placements
        joined = torch.cat([v.to_local() for v in vs])
        return wrap_local(joined, mesh, pl, joined.shape, joined.stride())
    fused_rows = _compatible_rows(vs)
    if fused_rows is not None and (rows is None or tuple(rows) == fused_rows):
        return relabel_rows(torch.cat([v.to_local() for v in vs]), vs[0], fused_rows)
    # Not a contiguous row range per rank: gather the parts and re-shard the fused tensor.
    full = torch.cat([full_of(v) for v in vs])
    n = vs[0].device_mesh.size(0)
    rows = tuple(rows) if rows is not None else chunk_rows(full.shape[0], n)
    s, e = row_range(rows, mesh_rank(vs[0]))
    logger.info("mfsdp2: join_fused gathered %d parts (their shards are not contiguous when fused)", len(vs))
    return relabel_rows(full[s:e].clone(), vs[0], rows)


# -- state dicts ----------------------------------------------------------------------------------
def split_fused(state_dict: dict, key: str, into: Sequence[str], sizes: Optional[Sequence[int]] = None) -> dict:
    """Replace ``state_dict[key]`` (fused along dim 0) by ``into[i]`` with ``sizes[i]`` rows each.

    ``sizes=None`` splits into equal parts. Sharded parts are views of the fused local tensor.
    """
    into = list(into)
    if _is_optim(state_dict):
        states = state_dict["state"]
        if key in states:
            st = states[key]
            sz = _sizes_for(st.values(), sizes, len(into))
            per_key = {k: _split_value(v, sz) for k, v in st.items()}
            _replace(states, [key], {name: {k: per_key[k][i] for k in st} for i, name in enumerate(into)})
        for g in state_dict["param_groups"]:
            g["params"] = [x for p in g["params"] for x in (into if p == key else [p])]
        return state_dict
    if key not in state_dict:
        raise KeyError(f"mfsdp2 E23: split_fused: {key!r} is not in the state dict")
    v = state_dict[key]
    sz = _sizes_for([v], sizes, len(into))
    _replace(state_dict, [key], dict(zip(into, _split_value(v, sz))))
    return state_dict


def _sizes_for(values, sizes: Optional[Sequence[int]], n: int) -> list[int]:
    if sizes is not None:
        if len(sizes) != n:
            raise ValueError(f"mfsdp2 E24: split_fused: {n} names but {len(sizes)} sizes")
        return list(sizes)
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            if v.shape[0] % n:
                raise ValueError(f"split_fused: {v.shape[0]} rows do not split into {n} equal parts")
            return [v.shape[0] // n] * n
    raise ValueError("split_fused: no tensor to infer sizes from; pass sizes")


def join_fused(state_dict: dict, keys: Sequence[str], into: str, rows: Optional[Sequence[int]] = None) -> dict:
    """Replace ``state_dict[keys[i]]`` by one entry ``into`` stacking them along dim 0.

    ``rows``: per-rank rows wanted for the fused result when the parts must be re-sharded (for
    example the target parameter's ``RowShard.rows``); ignored when locals simply concatenate.
    """
    keys = list(keys)
    if _is_optim(state_dict):
        states = state_dict["state"]
        if all(k in states for k in keys):
            first = states[keys[0]]
            joined = {k: _join_value([states[p][k] for p in keys], rows) for k in first}
            _replace(states, keys, {into: joined})
        for g in state_dict["param_groups"]:
            out = []
            for p in g["params"]:
                if p == keys[0]:
                    out.append(into)
                elif p not in keys:
                    out.append(p)
            g["params"] = out
        return state_dict
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise KeyError(f"mfsdp2 E25: join_fused: {missing} not in the state dict")
    _replace(state_dict, keys, {into: _join_value([state_dict[k] for k in keys], rows)})
    return state_dict


def split_swiglu(state_dict: dict, key: str, gate_key: str, up_key: str) -> dict:
    """SwiGLU ``fc1 = [gate; up]`` (first half gate, second half up) -> separate entries."""
    return split_fused(state_dict, key, [gate_key, up_key])


def join_swiglu(state_dict: dict, gate_key: str, up_key: str, key: str, rows: Optional[Sequence[int]] = None) -> dict:
    """Separate gate and up entries -> SwiGLU ``fc1 = [gate; up]``."""
    return join_fused(state_dict, [gate_key, up_key], key, rows=rows)
