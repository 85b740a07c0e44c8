"""Model state dicts of mfsdp2 units: the hooks ``fully_shard`` registers.

**Saving.** A unit's sharded parameters already *are* what a sharded checkpoint wants: DTensors
with the original names and global shapes, in fp32 main-weight precision, whose ``RowShard``
placement gives DCP the true rows of every rank. The state-dict post-hook only

* swaps in the sharded DTensors when the unit happens to be gathered (its module then holds the
  unsharded compute-dtype views, which must never reach a checkpoint), and
* rebuilds each entry as a fresh ``RowShard`` DTensor over the same main-weight memory, so that an
  empty piece can be told to write nothing (the tag lives on the entry's own local tensor, not on
  the optimizer-facing parameter).

**Loading** writes straight into the main-weight shards, in full precision: the pre-hook turns
whatever arrives (our DTensors, DTensors of another layout or world size, torch FSDP2's
``Shard(0)`` chunks, ``Replicate`` DTensors, plain full tensors) into this rank's rows, copies them
into the main-weight piece and hands the default loader the parameter itself (a no-op self-copy).
Model weights in a lower compute dtype are *not* copied here: the hook marks the groups changed
(``ParameterGroup.mark_changed``) and the next unshard re-casts main -> model once, like after an
optimizer step. A
checkpoint is never routed through the compute-dtype copy, which would round fp32 main weights to
bf16 (the precision regression the Megatron review warned about).

**Loading into a model built on the meta device** is its initialisation (DSD's
``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``, which ends in
``load_state_dict(sd, assign=True)``; Accelerate's ``cpu_ram_efficient_loading``; a plain load):
the pre-hook gives the unit's meta groups their memory (``ParameterGroup.allocate``: the same
DTensor parameter objects, so ``assign=True`` re-registers them and an optimizer built before or
after steps them) and writes the values as above; a group counts as initialised once each of its
parameters was loaded (loads of some keys with ``strict=False`` add up). A source entry on the meta
device has no values and is refused.

Parameters on other layouts -- ``no_shard`` (``Replicate``), HSDP (``(Replicate, RowShard)``) and
FSDP x TP (``(tp placement, RowShard)`` on a (tp, dp) mesh) -- take one generic path: saving rebuilds
the entry with the parameter's own mesh and placements, loading slices a full tensor at the offsets
``compute_local_shape_and_global_offset`` derives from those placements and the *global* shape.
The same path takes parameters sharded on a dim other than 0 (``RowShard(d)``, :mod:`mfsdp2.dtensors.shard_dim`).
A source DTensor is read locally only when its placements put the same elements on every rank:
``RowShard`` compares equal to a plain ``Shard`` of its dim, but FSDP2's ``torch.chunk`` rows are
ours only by chance.

A plain ``Shard(0)`` label is ambiguous for our uneven layouts: torch puts it on genuine
``torch.chunk`` shards (``distribute_tensor``, FSDP2) and also on results derived from our
parameters by out-of-place ops, whose locals hold *our* rows. When the two layouts differ, one
all-reduce over the ranks' local row counts decides which it is.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..dtensors.placement import RowShard, communicable, offset_free, wrap_local
from ..groups.param_group import mark_empty_pieces
from ..memory.offload import settle_host_reads
from ._common import check_loadable, full_of, global_rows, mark_write_nothing, relabel_rows, row_range

__all__ = ["register_state_dict_hooks"]

logger = logging.getLogger(__name__)


def register_state_dict_hooks(module: nn.Module) -> None:
    """Called at the end of ``fully_shard``: hooks for ``state_dict`` / ``load_state_dict``."""
    module.register_state_dict_post_hook(_state_dict_post_hook)
    module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
    for g in module._mfsdp2_state.groups:
        mark_empty_pieces(g)


def _own_entries(module: nn.Module, prefix: str):
    """``(key, dist_param, rows)`` for every name under ``module`` of every parameter its unit
    owns. The hooks run once per module of a unit of several (``fully_shard([norm, head])``),
    each with its own prefix: its parameters' names are relative to it (``[1].weight`` is the
    second module's ``weight``), and the other modules' parameters are theirs to report."""
    state = module._mfsdp2_state
    tag = ""
    if len(state.modules) > 1:
        tag = f"[{next(j for j, m in enumerate(state.modules) if m is module)}]."
    for g in state.groups:
        for i, owners in enumerate(g.infos):
            dp = g.dist_params[i]
            rows = None
            for info in owners:
                cur = info.owner._parameters.get(info.attr)
                if cur is not dp and cur is not g.unsharded_params[i]:
                    continue  # replaced since fully_shard: the module's own object is the entry
                if info.fqn.startswith(tag):
                    if rows is None:
                        # A pending value (mfsdp2.runtime.param_adoption: a replaced parameter, not yet in
                        # the group's rows) is described by its own placement.
                        pending = i in g.pending and not _generic(dp)
                        rows = dp.placements[0].rows if pending else g.layout.rows_per_rank(i)
                    yield prefix + info.fqn[len(tag):], dp, rows


def _subclass_entries(module: nn.Module, prefix: str):
    """``(key, dist_param)`` of the unit's parameters with FSDP2's all-gather extension
    (:mod:`mfsdp2.groups.subclass_params`): their entries are the ``Shard(0)`` DTensors, as FSDP2's,
    also while the unit is gathered."""
    state = module._mfsdp2_state
    if state.subclass is None:
        return
    tag = ""
    if len(state.modules) > 1:
        tag = f"[{next(j for j, m in enumerate(state.modules) if m is module)}]."
    for p in state.subclass.params:
        for info in p.infos:
            if info.fqn.startswith(tag):
                yield prefix + info.fqn[len(tag):], p.dist_param


def _state_dict_post_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    # The entries are views of the main weights, and DCP's load writes into them in place (no
    # load hook runs): under CPU offload, copies to the device still reading them end first.
    settle_host_reads()
    for key, dp in _subclass_entries(module, prefix):
        if key in state_dict:
            state_dict[key] = dp if isinstance(state_dict[key], nn.Parameter) else offset_free(dp.detach())
    for key, dp, rows in _own_entries(module, prefix):
        if key not in state_dict:
            continue
        if isinstance(state_dict[key], nn.Parameter):  # keep_vars=True: the parameter object itself
            state_dict[key] = dp
        elif _generic(dp):
            local = dp._local_tensor.detach()
            # offloaded: stays on the host
            out = wrap_local(local, dp.device_mesh, dp.placements, dp.shape, dp.stride())
            if local.numel() == 0 and dp.numel() > 0:
                mark_write_nothing(out)
            state_dict[key] = offset_free(out)
        else:
            state_dict[key] = relabel_rows(dp._local_tensor.detach(), dp, rows)


def _generic(dp: DTensor) -> bool:
    """Not a 1-D dim-0 ``RowShard`` parameter (no_shard, HSDP, FSDP x TP, another shard dim)."""
    return dp.device_mesh.ndim != 1 or not isinstance(dp.placements[0], RowShard) or dp.placements[0].dim != 0


def _same_placements(a, b) -> bool:
    """Placements that put the same elements on every rank: ``RowShard`` compares equal to a plain
    ``Shard`` of its dim (for DTensor's rules), but its rows are torch.chunk's only by chance."""
    return len(a) == len(b) and all(
        x == y and isinstance(x, RowShard) == isinstance(y, RowShard)
        and getattr(x, "rows", None) == getattr(y, "rows", None)
        for x, y in zip(a, b)
    )


def _write_generic(key: str, dp: DTensor, src, state_dict: dict) -> None:
    """Load ``src`` into ``dp``'s local piece using only its placements and global shape."""
    if src is dp or not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(dp.shape):
        return  # the default loader reports type / size mismatches
    if isinstance(src, DTensor):
        if src.device_mesh == dp.device_mesh and _same_placements(tuple(src.placements), tuple(dp.placements)):
            if src.to_local().data_ptr() != dp._local_tensor.data_ptr():
                dp._local_tensor.copy_(src.to_local())
            state_dict[key] = dp
            return
        # Same decision on every rank: placements are global metadata. A host-memory source
        # (an offloaded model's state dict) is gathered where its mesh's groups can move it.
        src = communicable(src).full_tensor()
    shape, offset = compute_local_shape_and_global_offset(dp.shape, dp.device_mesh, dp.placements)
    piece = src
    for d, (o, n) in enumerate(zip(offset, shape)):
        piece = piece.narrow(d, o, n)
    dp._local_tensor.copy_(piece)
    state_dict[key] = dp


def _same_memory(src: DTensor, dp: DTensor) -> bool:
    a, b = src.to_local(), dp._local_tensor
    return a.shape == b.shape and (a.numel() == 0 or a.data_ptr() == b.data_ptr())


# Groups built on the meta device that a load has started to fill: the indices of the parameters
# written so far (a load of some keys, ``strict=False``, then of the others).
_filling: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _load_state_dict_pre_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    state = module._mfsdp2_state
    entries = [(k, dp, rows) for k, dp, rows in _own_entries(module, prefix) if k in state_dict]
    if not entries:
        return
    settle_host_reads()  # CPU offload: no copy of the main weights to the device may still read them
    check_loadable(state, meta_ok=True)
    _refuse_meta_sources(state, entries, state_dict)
    # A model built on the meta device (DSD's broadcast_from_rank0 / full_state_dict loads with
    # assign=True, Accelerate's cpu_ram_efficient_loading, plain load_state_dict): the load is
    # its init. Its groups get their memory here -- the same DTensor parameter objects, so an
    # optimizer built before or after steps them -- and the values are written as for any load.
    fresh = [g for g in state.groups if g.needs_init and any(dp is e[1] for e in entries for dp in g.dist_params)]
    for g in fresh:
        g.allocate()
    written = {
        id(dp) for k, dp, _ in entries
        if state_dict[k] is not dp and isinstance(state_dict[k], torch.Tensor)
        and tuple(state_dict[k].shape) == tuple(dp.shape)
    }
    with torch.no_grad():
        _write_main_weights(entries, state_dict)
    _note_filled(state, written)
    for g in state.groups:  # every rank loads: re-cast and re-gather at the next use
        g.mark_changed()


def _refuse_meta_sources(state, entries, state_dict) -> None:
    """An entry on the meta device holds no values (a state dict taken from a meta model, or this
    meta model's own entries): loading it would leave the parameter uninitialised."""
    for key, dp, _ in entries:
        src = state_dict[key]
        if isinstance(src, torch.Tensor) and src.is_meta and src is not dp and tuple(src.shape) == tuple(dp.shape):
            raise RuntimeError(
                f"mfsdp2 E59: cannot load {key!r} into unit {state.name!r}: the state dict's value is on the meta "
                "device (no values; a state dict taken from a model built under torch.device('meta')). "
                "Load a state dict with values (a checkpoint, or a materialised model's)"
            )


def _note_filled(state, loaded: set) -> None:
    """Meta-built groups whose every parameter has been loaded (``loaded``: ids of the DTensor
    parameters this load wrote) are initialised: forward allowed."""
    for g in state.groups:
        if not g.needs_init or not g.allocated:
            continue
        done = _filling.setdefault(g, set())
        done.update(i for i, dp in enumerate(g.dist_params) if id(dp) in loaded)
        if len(done) == len(g.dist_params):
            g.needs_init = False
            del _filling[g]


def _write_main_weights(entries, state_dict) -> None:
    """Copy each entry's rows of this rank into the main-weight piece; same decisions on every rank.

    Every branch depends only on placements and global shapes (identical on all ranks) or on the
    one all-reduce below, so the gathers line up across ranks.
    """
    plans = []  # (key, dp, rows, src, how) with how in {"skip", "local", "slice", "full", "ask"}
    for key, dp, rows in entries:
        src = state_dict[key]
        if _generic(dp):
            _write_generic(key, dp, src, state_dict)
            continue
        if src is dp:
            how = "skip"
        elif not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(dp.shape):
            how = "skip"  # the default loader reports the type or size mismatch
        elif not isinstance(src, DTensor):
            how = "slice"  # a plain tensor is the full value
        elif src.device_mesh.ndim != 1 or src.device_mesh.size(0) != len(rows):
            how = "full"
        elif all(isinstance(p, Replicate) for p in src.placements):
            how = "slice"
        else:
            src_rows = global_rows(src)
            if src_rows is None:
                how = "full"
            elif src_rows == tuple(rows):
                how = "skip" if _same_memory(src, dp) else "local"
            elif isinstance(src.placements[0], RowShard):
                how = "full"
            else:
                how = "ask"  # plain Shard(0): torch.chunk rows, or ours under a lying label?
        plans.append([key, dp, rows, src, how])

    asks = [p for p in plans if p[4] == "ask"]
    if asks:
        rank = asks[0][1].device_mesh.get_local_rank(0)
        ours = torch.tensor([int(p[3].to_local().shape[0] == p[2][rank]) for p in asks], dtype=torch.int32)
        dist.all_reduce(ours, op=dist.ReduceOp.MIN, group=asks[0][1].device_mesh.get_group())
        for p, flag in zip(asks, ours.tolist()):
            p[4] = "local" if flag else "full"
            logger.debug("mfsdp2: %s is labelled Shard(0); read as %s rows", p[0], "our" if flag else "torch.chunk")

    for key, dp, rows, src, how in plans:
        if how == "skip":
            if src is not dp and isinstance(src, DTensor) and tuple(src.shape) == tuple(dp.shape):
                state_dict[key] = dp  # same memory: nothing to copy
            continue
        rank = dp.device_mesh.get_local_rank(0)
        s, e = row_range(rows, rank)
        if how == "local":
            rows_here = src.to_local()
        elif how == "slice":
            rows_here = (src.to_local() if isinstance(src, DTensor) else src)[s:e]
        else:
            rows_here = full_of(src)[s:e]
        dp._local_tensor.copy_(rows_here)
        state_dict[key] = dp  # the default loader's copy is then a self-copy
