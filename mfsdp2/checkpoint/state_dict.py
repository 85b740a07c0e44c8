"""Checkpoints of mfsdp2 models: model and optimizer state dicts, DCP, fused weights, safetensors.

What a sharded state dict of an mfsdp2 model is
------------------------------------------------
Every original parameter name maps to a DTensor with the original global shape, in the fp32
main-weight precision, placed ``RowShard(0, rows)``: its DCP chunk metadata says exactly which
global rows this rank holds, and a rank holding none writes nothing. ``model.state_dict()`` already
returns that (``fully_shard`` registers the hooks of :mod:`mfsdp2.checkpoint.model`), and
``model.load_state_dict`` writes into the main-weight shards; compute-dtype weights are re-cast
from them at the next unshard.

The functions here, next to torch's DSD functions of the same names
--------------------------------------------------------------------
They call torch's ``torch.distributed.checkpoint.state_dict`` for the FQN bookkeeping and fix what
it gets wrong for uneven row shards (see :mod:`mfsdp2.checkpoint.optim` for the details):

* :func:`get_optimizer_state_dict` relabels every per-row optimizer state with its *parameter's*
  ``RowShard`` (SGD's ``momentum_buffer`` comes out of ``clone`` labelled plain ``Shard(0)``, which
  DCP would write at ``torch.chunk`` offsets), gives ranks with empty pieces placeholder states, and
  orders states identically on every rank.
* ``full_state_dict=True`` gathers in that order (``cpu_offload=True``: rank 0 gets everything,
  the others ``{}``), with plain all-gathers rather than ``full_tensor()`` (see
  :mod:`mfsdp2.checkpoint._common` for the DTensor cache hazard that avoids). Loading a full state
  dict slices it by the parameters' rows (torch would use ``distribute_tensor``, i.e.
  ``torch.chunk``), with ``broadcast_from_rank0=True`` one tensor at a time from rank 0.
* :func:`load` keeps aside the top-level entries the checkpoint has no metadata for (``step``,
  ``args`` of a checkpoint written by someone else) and puts them back after ``dcp.load``.

A fresh optimizer is initialised by the first get/set (one zero-gradient, lr=0 step on non-empty
pieces, as torch does), so its states exist for ``dcp.load`` to fill. Checkpoints move freely
between torch FSDP2 and mfsdp2 and across world sizes. torch's own DSD functions work on mfsdp2
models too (tests/fsdp2_compat/test_dsd.py); these add the placeholder states and rank ordering
above.

Typical use::

    from mfsdp2.checkpoint import state_dict as msd

    model_sd, optim_sd = msd.get_state_dict(model, optim)
    msd.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=path)
    ...  # fresh processes, same or another world size
    model_sd, optim_sd = msd.get_state_dict(model, optim)
    sd = {"model": model_sd, "optim": optim_sd, "step": 0}
    msd.load(sd, checkpoint_id=path)          # reads straight into main weights / optimizer states
    msd.set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

All functions are collective over the model's data-parallel group (call them on every rank).
Also re-exported here: fused-weight helpers (:mod:`mfsdp2.checkpoint.fused`) and Hugging Face
safetensors import/export (:mod:`mfsdp2.checkpoint.hf`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as _dsd
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from ._common import (
    broadcast_tree,
    full_to_rows,
    gather_tree,
    map_tree,
    model_group,
    offload_tree,
    sharded_params,
    walk,
)
from ..memory.offload import settle_host_reads
from .fused import join_fused, join_swiglu, split_fused, split_swiglu
from .hf import HFLoadStats, load_hf_safetensors, save_hf_safetensors
from .model import register_state_dict_hooks
from .optim import fix_optimizer_state_dict, full_optimizer_state_to_rows, prepare_optimizers

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "get_state_dict",
    "set_state_dict",
    "save",
    "load",
    "split_fused",
    "join_fused",
    "split_swiglu",
    "join_swiglu",
    "load_hf_safetensors",
    "save_hf_safetensors",
    "HFLoadStats",
    "register_state_dict_hooks",
]

logger = logging.getLogger(__name__)

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]


def _as_tuple(optimizers: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def _local(options: Optional[StateDictOptions]) -> StateDictOptions:
    """The options torch sees: always sharded, never offloaded (we gather/offload ourselves)."""
    return dataclasses.replace(options or StateDictOptions(), full_state_dict=False, cpu_offload=False,
                               broadcast_from_rank0=False)


def _finish(tree: Any, model: nn.Module, options: StateDictOptions) -> Any:
    if options.full_state_dict:
        return gather_tree(tree, model_group(model), cpu_offload=options.cpu_offload, rank0_only=options.cpu_offload)
    if options.cpu_offload:
        return offload_tree(tree)
    return tree


# -- model ----------------------------------------------------------------------------------------
def get_model_state_dict(model: nn.Module, *, options: Optional[StateDictOptions] = None) -> dict[str, Any]:
    """Sharded (RowShard DTensors over the main weights) or, with ``full_state_dict``, full tensors."""
    options = options or StateDictOptions()
    sd = _dsd.get_model_state_dict(model, options=_local(options))
    return _finish(sd, model, options)


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *,
                         options: Optional[StateDictOptions] = None):
    """Load into the main-weight shards. Accepts sharded DTensors of any layout or full tensors.

    ``full_state_dict=True`` needs the full dict on every rank, or with ``broadcast_from_rank0=True``
    on rank 0 only (others may pass ``{}``).
    """
    options = options or StateDictOptions()
    if options.full_state_dict and options.broadcast_from_rank0:
        sps = sharded_params(model)

        def rows_of(path, full):
            sp = sps.get(path[0]) if len(path) == 1 else None
            return full_to_rows(full, sp) if sp is not None and tuple(full.shape) == tuple(sp.param.shape) else full

        model_state_dict = broadcast_tree(model_state_dict, model_group(model), rows_of)
    # Full tensors on every rank need no conversion: the load pre-hook slices plain tensors.
    return _dsd.set_model_state_dict(model, model_state_dict, options=_local(options))


# -- optimizer ------------------------------------------------------------------------------------
def get_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, *,
                             options: Optional[StateDictOptions] = None) -> dict[str, Any]:
    """DSD's optimizer state dict with states relabelled by their parameter's rows (see module doc)."""
    options = options or StateDictOptions()
    optims = _as_tuple(optimizers)
    sps = prepare_optimizers(model, optims)
    osd = _dsd.get_optimizer_state_dict(model, optims, options=_local(options))
    osd = fix_optimizer_state_dict(osd, sps)
    return _finish(osd, model, options)


def set_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, optim_state_dict: dict[str, Any], *,
                             options: Optional[StateDictOptions] = None) -> None:
    """Load optimizer states; full state dicts are sliced by the parameters' rows."""
    settle_host_reads()  # CPU offload: host memory is written next
    options = options or StateDictOptions()
    optims = _as_tuple(optimizers)
    sps = prepare_optimizers(model, optims)
    if options.full_state_dict:
        convert = lambda path, full: full_optimizer_state_to_rows(path, full, sps)  # noqa: E731
        if options.broadcast_from_rank0:
            optim_state_dict = broadcast_tree(optim_state_dict, model_group(model), convert)
        else:
            optim_state_dict = _map_leaves(optim_state_dict, convert)
    _dsd.set_optimizer_state_dict(model, optims, optim_state_dict, options=_local(options))


def _map_leaves(tree: Any, fn) -> Any:
    return map_tree(tree, lambda p, v: fn(p, v) if isinstance(v, torch.Tensor) else v)


# -- both -----------------------------------------------------------------------------------------
def get_state_dict(model: nn.Module, optimizers: Optimizers, *,
                   options: Optional[StateDictOptions] = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model state dict, optimizer state dict)``, as torch's ``get_state_dict``."""
    return (
        get_model_state_dict(model, options=options),
        get_optimizer_state_dict(model, optimizers, options=options),
    )


def set_state_dict(model: nn.Module, optimizers: Optimizers, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any], options: Optional[StateDictOptions] = None):
    """Load both, model first (as torch's ``set_state_dict``)."""
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys


# -- DCP ------------------------------------------------------------------------------------------
def save(state_dict: dict[str, Any], *, checkpoint_id=None, **kwargs):
    """``dcp.save``; nothing to add (placements and empty pieces are handled by the state dicts)."""
    return dcp.save(state_dict, checkpoint_id=checkpoint_id, **kwargs)


def _present_prefixes(metadata) -> set[str]:
    out = set()
    for key in metadata.state_dict_metadata:
        parts = key.split(".")
        for i in range(1, len(parts) + 1):
            out.add(".".join(parts[:i]))
    return out


def load(state_dict: dict[str, Any], *, checkpoint_id=None, storage_reader=None, **kwargs) -> dict[str, Any]:
    """``dcp.load`` in place, keeping aside top-level entries the checkpoint has no metadata for.

    DCP fails on a key it cannot find; a checkpoint written by another program (torch FSDP2, a
    converter) often lacks the bookkeeping entries (``step``, ``args``) our state dict carries. They
    keep their current values. Returns the entries kept aside (name -> value).
    """
    if storage_reader is None:
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    elif checkpoint_id is not None:
        storage_reader.reset(checkpoint_id)
    present = _present_prefixes(storage_reader.read_metadata())
    order = list(state_dict)
    aside = {k: state_dict.pop(k) for k in order if k not in present}
    if aside:
        logger.info("mfsdp2: the checkpoint has no entries for %s; keeping their current values", sorted(aside))
    try:
        dcp.load(state_dict, storage_reader=storage_reader, **kwargs)
    finally:
        loaded = dict(state_dict)
        state_dict.clear()
        for k in order:
            state_dict[k] = aside[k] if k in aside else loaded[k]
    return aside


def tensors_by_path(tree: Any) -> dict[tuple, torch.Tensor]:
    """Every tensor leaf of a nested state dict by its path (handy in tests and comparisons)."""
    return {p: v for p, v in walk(tree) if isinstance(v, torch.Tensor)}
