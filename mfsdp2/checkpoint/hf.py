"""Hugging Face safetensors checkpoints: sharded import, gathered export.

**Import** (:func:`load_hf_safetensors`). Each rank reads only its own rows of each tensor:
``safe_open(file).get_slice(name)[r0:r1]`` reads that byte range of the memory-mapped file, and the
rows go straight into the main-weight shard (fp32 main weights keep full precision; a bf16 file is
up-cast, never the reverse). No rank materialises a full tensor or the full model, so an
mfsdp2 model can be built per unit on the meta device (``to_empty`` + ``fully_shard`` one block at
a time) and then filled from the file. Parameters outside mfsdp2 units and persistent buffers are
read whole. The returned :class:`HFLoadStats` counts the bytes this rank read (about ``1/N`` of the
parameters' bytes).

**Export** (:func:`save_hf_safetensors`): every rank takes part in one gather per
tensor, in state-dict order; rank 0 keeps the gathered CPU tensors (optionally cast, e.g. to bf16)
and writes one ``model.safetensors`` file. Export therefore needs the full model in rank 0's host
memory, as any single-file safetensors writer does.

Names: by default the model's state-dict names are the file's names (true for a module tree that
mirrors ``transformers``' own, e.g. ``LlamaForCausalLM`` itself); ``key_map`` translates
(``model name -> file name``, returning None to skip an entry). Sharded files
(``model.safetensors.index.json``) are supported on import.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._common import check_loadable, full_of, global_rows, model_group, row_range, sharded_params, units

__all__ = ["HFLoadStats", "load_hf_safetensors", "save_hf_safetensors"]

logger = logging.getLogger(__name__)

KeyMap = Union[None, dict, Callable[[str], Optional[str]]]


@dataclass
class HFLoadStats:
    """What one rank read: bytes of tensor data (the slices), tensors touched, names not matched."""

    bytes_read: int = 0
    tensors_read: int = 0
    missing: list = field(default_factory=list)  # model names with no tensor in the files
    unexpected: list = field(default_factory=list)  # file names no model entry asked for


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("mfsdp2 safetensors support needs `pip install safetensors`") from e
    return safe_open


def _files(path: str) -> dict[str, str]:
    """File name -> safetensors file holding it (a file, a directory, or a sharded index)."""
    if os.path.isfile(path) and path.endswith(".json"):
        index, base = path, os.path.dirname(path)
    elif os.path.isdir(path) and os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        index, base = os.path.join(path, "model.safetensors.index.json"), path
    else:
        file = os.path.join(path, "model.safetensors") if os.path.isdir(path) else path
        with _safe_open()(file, framework="pt") as f:
            return {k: file for k in f.keys()}
    with open(index) as fh:
        weight_map = json.load(fh)["weight_map"]
    return {k: os.path.join(base, v) for k, v in weight_map.items()}


def _mapper(key_map: KeyMap) -> Callable[[str], Optional[str]]:
    if key_map is None:
        return lambda k: k
    if isinstance(key_map, dict):
        return lambda k: key_map.get(k, k)
    return key_map


@torch.no_grad()
def load_hf_safetensors(model: nn.Module, path: str, *, key_map: KeyMap = None, strict: bool = True) -> HFLoadStats:
    """Fill ``model`` (mfsdp2-sharded or not) from safetensors, reading only this rank's rows.

    Not collective. ``strict``: every model entry must be found (names mapped by ``key_map``).
    Tied names (two state-dict names of one parameter) need only one of them in the file.
    """
    for s in units(model):
        check_loadable(s)
    sd = model.state_dict()  # sharded entries are RowShard DTensors over the main weights
    sps = sharded_params(model)
    where = _files(path)
    name_of = _mapper(key_map)
    stats = HFLoadStats()
    plan: dict[str, list] = {}  # file -> [(model key, file name, target)]
    found: set = set()
    absent = []

    def ident(key, target):  # one identity per parameter, whichever of its (tied) names
        if key in sps:
            return ("param", id(sps[key].param))
        return ("tensor", target.data_ptr(), target.storage_offset(), tuple(target.shape))

    for key, target in sd.items():
        name = name_of(key)
        if name is None:
            continue
        if name not in where:
            absent.append((key, ident(key, target)))
            continue
        found.add(ident(key, target))
        plan.setdefault(where[name], []).append((key, name, target))
    stats.missing = [key for key, i in absent if i not in found]
    wanted = {n for items in plan.values() for _, n, _ in items}
    stats.unexpected = sorted(set(where) - wanted)
    if strict and stats.missing:
        raise KeyError(f"mfsdp2 E26: no tensor in {path} for {stats.missing[:8]} ({len(stats.missing)} in all)")

    safe_open = _safe_open()
    for file, items in plan.items():
        with safe_open(file, framework="pt") as f:
            for key, name, target in items:
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                if shape != tuple(target.shape):
                    raise ValueError(f"mfsdp2: {name} has shape {shape} in {file}, "
                                     f"the model wants {tuple(target.shape)}")
                if isinstance(target, DTensor):
                    rows = global_rows(target)
                    if rows is None:
                        data, dest = sl[:], target.to_local()
                    else:
                        s, e = row_range(rows, int(target.device_mesh.get_local_rank(0)))
                        dest = target.to_local()
                        if e == s:
                            continue
                        data = sl[s:e]
                else:
                    data, dest = (sl[:] if shape else f.get_tensor(name)), target
                dest.copy_(data)
                stats.bytes_read += data.numel() * data.element_size()
                stats.tensors_read += 1
    logger.info("mfsdp2: read %d tensors, %d bytes from %s", stats.tensors_read, stats.bytes_read, path)
    return stats


@torch.no_grad()
def save_hf_safetensors(model: nn.Module, path: str, *, key_map: KeyMap = None,
                        dtype: Optional[torch.dtype] = None, metadata: Optional[dict] = None) -> Optional[str]:
    """Gather every entry (collective) and write ``path`` (a file, or ``dir/model.safetensors``) on rank 0.

    Returns the file written on rank 0, None elsewhere. ``dtype`` casts floating-point tensors.
    """
    from safetensors.torch import save_file

    group = model_group(model)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    name_of = _mapper(key_map)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        name = name_of(key)
        if name is None:
            continue
        full = full_of(value)
        if rank == 0:
            full = full.detach().cpu()
            if dtype is not None and full.is_floating_point():
                full = full.to(dtype)
            out[name] = full.contiguous().clone()
    file = None
    if rank == 0:
        file = os.path.join(path, "model.safetensors") if os.path.isdir(path) else path
        save_file(out, file, metadata={"format": "pt", **(metadata or {})})
        logger.info("mfsdp2: wrote %d tensors to %s", len(out), file)
    if dist.is_initialized():
        dist.barrier(group=group)
    return file
