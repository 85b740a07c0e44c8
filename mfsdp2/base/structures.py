"""Walking the inputs and outputs of a module: pytree containers *and* dataclasses.

Why not ``torch.utils._pytree`` alone: it treats a dataclass as a leaf unless someone registered
it, and model code passes dataclasses both ways (a ``BatchInputs`` record into a block, a
``CausalLMOutput``-style record out of it). A tensor missed on the way in is not cast by
``cast_forward_inputs`` (the bf16 unit then fails on an fp32 input, where FSDP2 casts it) and gets
no post-backward hook; missed on the way out it gets no pre-backward hook (the unit's backward
would run on freed weights) and no ``output_dtype`` cast. Both walks here look inside dicts,
lists, tuples (named ones rebuilt with their own type) and dataclass instances (copied, never
mutated in place: the caller may still hold the original).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch

__all__ = ["tensors_in", "map_tensors"]


def tensors_in(obj: Any) -> list:
    """Every tensor in ``obj`` (each occurrence; containers visited once)."""
    out, stack, seen = [], [obj], set()
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif type(x) is tuple or type(x) is list or type(x) is dict:  # common: no dataclass check
            if id(x) not in seen:
                seen.add(id(x))
                stack.extend(x.values() if type(x) is dict else x)
        elif id(x) in seen:
            continue
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            seen.add(id(x))
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
        elif isinstance(x, dict):
            seen.add(id(x))
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            seen.add(id(x))
            stack.extend(x)
    return out


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``; containers that hold no changed
    tensor are returned as they are (no copy)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) is tuple or type(obj) is list:  # the common case: no dataclass check needed
        vals = [map_tensors(fn, v) for v in obj]
        if all(nv is v for nv, v in zip(vals, obj)):
            return obj
        return type(obj)(vals)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            nv = map_tensors(fn, v)
            if nv is not v:
                changed[f.name] = nv
        if not changed:
            return obj
        new = copy.copy(obj)  # no __init__ / __post_init__ re-run; frozen dataclasses too
        for k, v in changed.items():
            object.__setattr__(new, k, v) if _frozen(new) else setattr(new, k, v)
        return new
    if isinstance(obj, dict):
        items = [(k, map_tensors(fn, v)) for k, v in obj.items()]
        if all(nv is obj[k] for k, nv in items):
            return obj
        try:
            return type(obj)(items)
        except TypeError:  # a dict subclass with another constructor: keep its type, fill a copy
            new = copy.copy(obj)
            new.update(items)
            return new
    if isinstance(obj, (list, tuple)):
        vals = [map_tensors(fn, v) for v in obj]
        if all(nv is v for nv, v in zip(vals, obj)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*vals)
        try:
            return type(obj)(vals)
        except TypeError:
            return list(vals) if isinstance(obj, list) else tuple(vals)
    return obj


def _frozen(obj: Any) -> bool:
    params = getattr(type(obj), "__dataclass_params__", None)
    return bool(params is not None and params.frozen)
