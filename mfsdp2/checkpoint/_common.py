"""Global-coordinate helpers shared by the checkpoint code.

Everything here answers one question the same way: *which global rows of a parameter does rank
``r`` hold?* The answer always comes from the parameter's placement (``RowShard.rows``, or
``torch.chunk`` sizes for a plain ``Shard(0)`` of another runtime), never from the shape of a
tensor derived from it: a state tensor may come from a checkpoint of another runtime or have been
relabelled by user code, and a plain local tensor carries no offsets at all.

Also here:

* :func:`mark_write_nothing` — DCP asks every state-dict object for its write items through
  ``__create_write_items__``; an empty piece answering ``[]`` writes nothing (torch would otherwise
  write one zero-size chunk per key, ~1.5 KB of pickle each, and list it in the metadata).
* :func:`sharded_params` — the map from state-dict names to the optimizer-facing DTensor params of
  every mfsdp2 unit, built from the units themselves (``named_parameters`` returns the *unsharded*
  views while a unit is gathered).
* tree walks that gather or broadcast nested state dicts in one order that is the same on every
  rank, after checking that every rank has the same structure (a mismatch would otherwise
  deadlock inside a collective).

**Why gathers here use plain collectives rather than ``DTensor.full_tensor()``.** They gather
from the rows the placement states with one ``all_gather_single`` (:func:`full_of`), independent of
DTensor's process-wide caches. Those caches used to mix ``RowShard`` with a same-shape
``torch.chunk`` ``Shard(0)`` (a wrong-sized gather, or silently wrong rows); since
:mod:`mfsdp2.dtensors.row_propagation` they keep the two apart, and gathering outside them stays the
defensive choice for checkpoint code, where a wrong row is the most expensive kind of bug.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..base import compat
from ..dtensors.placement import (
    RowShard, communicable, mark_write_nothing, offset_free, row_sharded_dtensor, wrap_local, write_nothing,
)
from ..runtime.state import unit_state

__all__ = [
    "ShardedParam",
    "sharded_params",
    "global_rows",
    "row_range",
    "relabel_rows",
    "mark_write_nothing",
    "check_loadable",
    "model_group",
    "gather_tree",
    "broadcast_tree",
    "walk",
    "map_tree",
    "full_of",
    "gather_rows",
]

logger = logging.getLogger(__name__)


# -- which rows where ---------------------------------------------------------------------------
def global_rows(t: DTensor) -> Optional[tuple[int, ...]]:
    """Per-rank dim-0 row counts of a DTensor on a 1-D mesh, from its placement; None if unsharded.

    ``RowShard`` states them; a plain ``Shard(0)`` means ``torch.chunk`` sizes (what torch FSDP2
    writes). Any other placement (``Replicate``, sharding on another dim) returns None.
    """
    if t.device_mesh.ndim != 1:
        raise ValueError(f"mfsdp2 checkpoints support 1-D meshes only, got placements {t.placements}")
    (pl,) = t.placements
    if isinstance(pl, RowShard) and pl.dim == 0:
        return pl.rows
    if isinstance(pl, Shard) and pl.dim == 0:
        n = t.device_mesh.size(0)
        return tuple(int(pl._local_shard_size_and_offset(t.shape[0], n, r)[0]) for r in range(n))
    return None


def gather_rows(local: torch.Tensor, rows: Sequence[int], group) -> torch.Tensor:
    """The full tensor from every rank's dim-0 piece (``rows[r]`` rows on rank ``r``); collective."""
    rank = dist.get_rank(group)
    if local.shape[0] != rows[rank]:
        raise ValueError(f"mfsdp2: local tensor has {local.shape[0]} rows, its placement says {rows[rank]}")
    m, n = max(rows), len(rows)
    padded = local.new_zeros((m,) + tuple(local.shape[1:]))
    padded[: local.shape[0]] = local
    out = local.new_empty((n * m,) + tuple(local.shape[1:]))
    compat.all_gather_single(out, padded, group=group)
    return torch.cat([out[i * m : i * m + r] for i, r in enumerate(rows)])


def full_of(t: Any) -> Any:
    """The full value of a DTensor (any other value is returned as is); collective for shards."""
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.ndim == 1:
        if isinstance(t.placements[0], Replicate):
            return t.to_local()
        rows = global_rows(t)
        if rows is not None:
            return gather_rows(communicable(t).to_local(), rows, t.device_mesh.get_group())
    return communicable(t).full_tensor()


def row_range(rows: Sequence[int], rank: int) -> tuple[int, int]:
    start = sum(rows[:rank])
    return start, start + rows[rank]


def mesh_rank(t: DTensor) -> int:
    return int(t.device_mesh.get_local_rank(0))


# The function DCP finds on a write-nothing tensor is pickled by name with it (torch.save keeps a
# tensor's attributes): checkpoints written before it moved name it here.
_write_nothing = write_nothing


def relabel_rows(local: torch.Tensor, like: DTensor, rows: Sequence[int]) -> DTensor:
    """``local`` (this rank's rows, shared not copied) as a ``RowShard`` DTensor shaped like ``like``.

    An empty piece writes nothing, unless the whole tensor is empty (then some rank must write it
    for the key to exist in the checkpoint: rank 0 does).
    """
    shape = (sum(rows),) + tuple(local.shape[1:])
    out = offset_free(row_sharded_dtensor(local, like.device_mesh, rows, shape))  # ``local`` itself, never moved
    if local.shape[0] == 0 and (out.numel() > 0 or mesh_rank(like) != 0):
        mark_write_nothing(out)
    return out


# -- the units' parameters ----------------------------------------------------------------------
@dataclass
class ShardedParam:
    """One state-dict name of an mfsdp2 parameter: the optimizer-facing DTensor and its rows."""

    name: str
    param: nn.Parameter  # the DTensor parameter (RowShard placement)
    rows: tuple[int, ...]
    state: Any  # the owning unit's FSDPState

    @property
    def rank(self) -> int:
        return mesh_rank(self.param)

    @property
    def start_end(self) -> tuple[int, int]:
        return row_range(self.rows, self.rank)

    @property
    def empty(self) -> bool:
        return self.rows[self.rank] == 0


def _clean_name(model: nn.Module, name: str) -> str:
    """The name DSD uses (it drops wrapper prefixes such as ``_checkpoint_wrapped_module``)."""
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns

        fqns = _get_fqns(model, name)
        if len(fqns) == 1:
            return next(iter(fqns))
    except Exception:  # private helper: fall back to the module path
        logger.debug("mfsdp2: could not canonicalise %s", name, exc_info=True)
    return name


def sharded_params(model: nn.Module, clean: bool = False) -> dict[str, ShardedParam]:
    """Every state-dict name of every mfsdp2 unit's own parameters (tied names included).

    ``clean=True`` uses DSD's canonical names (what ``get_optimizer_state_dict`` keys by).
    """
    units(model)  # refuses layouts these helpers do not handle, with what to use instead
    out: dict[str, ShardedParam] = {}
    for path, m in model.named_modules():
        state = unit_state(m)
        if state is None:
            continue
        for g in state.groups:
            for i, owners in enumerate(g.infos):
                dp = g.dist_params[i]
                rows = g.layout.rows_per_rank(i)
                for info in owners:
                    name = f"{path}.{info.fqn}" if path else info.fqn
                    if clean:
                        name = _clean_name(model, name)
                    out[name] = ShardedParam(name, dp, rows, state)
    return out


def units(model: nn.Module) -> list:
    states = [s for s in map(unit_state, model.modules()) if s is not None]
    for s in states:
        for g in s.groups:
            other_dim = any(slot.shard_dim for slot in g.layout.slots)
            if g.config.shard_dim is None or g.mesh.ndim != 1 or any(t is not None for t in g.tp_specs) or other_dim:
                kind = "no_shard" if g.config.shard_dim is None else (
                    "HSDP" if g.mesh.ndim != 1 else "FSDP x TP" if not other_dim
                    else "sharded on dim != 0 for some parameters (shard_placement_fn)"
                )
                raise ValueError(
                    f"mfsdp2 E43: mfsdp2.checkpoint.state_dict helpers handle row-sharded 1-D layouts "
                    "(ZeRO-1/2/3 on a 1-D mesh); "
                    f"unit {s.name!r} is {kind}. Save and load its model state with model.state_dict() / "
                    "model.load_state_dict() and torch.distributed.checkpoint (dcp.save / dcp.load), which "
                    "handle these placements"
                )
    return states


def model_group(model: nn.Module) -> Optional[dist.ProcessGroup]:
    """The process group of the model's (single, 1-D) data-parallel mesh; None without units."""
    states = units(model)
    if not states:
        return None
    meshes = {id(s.mesh): s.mesh for s in states}
    if len(meshes) > 1:
        raise ValueError("mfsdp2 checkpoints expect every unit of a model on the same mesh")
    return next(iter(meshes.values())).get_group()


def check_loadable(state, what: str = "load a state dict into", meta_ok: bool = False) -> None:
    """Refuse to write main weights while the unit's gathered weights are in use.

    Mid-forward/backward the gathered copy feeds autograd; writing the main shard then would mix
    old and new weights in one step. A unit gathered outside a step (``unshard()``, the root after a
    forward whose backward has not run) registers its *unsharded* compute tensors on the module, so
    the default loader would write those instead of the main weights. ``meta_ok``: the caller
    gives groups still on the meta device their memory first (a model state dict load is their
    init); other writers refuse them.
    """
    from ..runtime.state import ShardState, TrainingState

    meta = [g.name for g in state.groups if not g.allocated]
    if meta and not meta_ok:  # writing into meta shards would drop the values without a word
        raise RuntimeError(
            f"mfsdp2 E50: cannot {what} unit {state.name!r}: the parameters of {meta} are still on the "
            "meta device (the model was built under torch.device('meta')); give them memory first "
            "with model.to_empty(device=...) (or mfsdp2.materialize(model)), then load"
        )
    if state.training_state is not TrainingState.IDLE:
        raise RuntimeError(
            f"mfsdp2 E17: cannot {what} unit {state.name!r} mid-forward/backward (its state is "
            f"{state.training_state.value!r}): its gathered weights are in use. Load before the "
            "forward or after optimizer.step()."
        )
    if state.shard_state is not ShardState.SHARDED or any(getattr(g, "kept", None) is not None for g in state.groups):
        raise RuntimeError(
            f"mfsdp2 E18: cannot {what} unit {state.name!r} while it is unsharded (after unshard(), or a "
            "forward whose backward has not run); call reshard() on it (or on the root) first"
        )


# -- nested state dicts -------------------------------------------------------------------------
def walk(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Leaves of nested dicts/lists/tuples with their paths, in insertion order."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from walk(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from walk(v, path + (i,))
    else:
        yield path, tree


def map_tree(tree: Any, fn: Callable[[tuple, Any], Any], path: tuple = ()) -> Any:
    """A copy of nested dicts/lists/tuples with every leaf replaced by ``fn(path, leaf)``."""
    if isinstance(tree, dict):
        return {k: map_tree(v, fn, path + (k,)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        out = [map_tree(v, fn, path + (i,)) for i, v in enumerate(tree)]
        return type(tree)(out) if isinstance(tree, tuple) else out
    return fn(path, tree)


def _check_same_structure(tree: Any, group) -> None:
    sig = [(p, isinstance(v, DTensor)) for p, v in walk(tree) if isinstance(v, DTensor)]
    if group is None or dist.get_world_size(group) == 1:
        return
    sigs: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(sigs, sig, group=group)
    for r, s in enumerate(sigs):
        if s != sigs[0]:
            diff = set(map(str, s)) ^ set(map(str, sigs[0]))
            raise RuntimeError(
                f"mfsdp2: ranks 0 and {r} hold state dicts of different structure; gathering would "
                f"deadlock. Differences: {sorted(diff)[:8]}"
            )


def gather_tree(tree: Any, group, *, cpu_offload: bool, rank0_only: bool) -> Any:
    """Replace every DTensor by its full tensor (collectives in the same order on every rank).

    ``rank0_only``: other ranks still take part in every gather but return ``{}``, as torch's
    ``full_state_dict=True, cpu_offload=True`` does.
    """
    _check_same_structure(tree, group)

    def full(path, v):
        v = full_of(v)
        if isinstance(v, torch.Tensor):
            # A snapshot (plain values such as ``step`` would alias live state), made on the host
            # directly under cpu_offload.
            v = v.detach().to("cpu", copy=True) if cpu_offload else v.detach().clone()
        return v

    out = map_tree(tree, full)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    return out if (rank == 0 or not rank0_only) else {}


def offload_tree(tree: Any) -> Any:
    """``cpu_offload`` without gathering: DTensors keep their placement, locals move to CPU."""

    def move(path, v):
        if isinstance(v, DTensor):
            if v.to_local().device.type == "cpu":
                return v
            # The host copy wrapped as is (from_local would move it back to the mesh's device:
            # a second device copy of the whole state dict, and no offload).
            moved = wrap_local(v.to_local().cpu(), v.device_mesh, v.placements, v.shape, v.stride())
            if hasattr(v._local_tensor, "__create_write_items__"):
                mark_write_nothing(moved)
            return moved
        if isinstance(v, torch.Tensor):
            return v.cpu()
        return v

    return map_tree(tree, move)


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple
    dtype: torch.dtype


def broadcast_tree(tree: Any, group, convert: Callable[[tuple, torch.Tensor], Any]) -> Any:
    """Send rank 0's nested state dict (full tensors) to every rank, one tensor at a time.

    Rank 0's structure travels first (tensors replaced by shape/dtype); then each tensor is
    broadcast and immediately handed to ``convert(path, full)``, which keeps only what this rank
    needs (its rows), so no rank holds more than one full tensor at a time beyond rank 0's input.
    """
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0)
    skeleton = [None]
    if rank == 0:
        skeleton[0] = map_tree(
            tree, lambda p, v: _TensorMeta(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v)
    dist.broadcast_object_list(skeleton, src=src, group=group)
    flat = dict(walk(tree)) if rank == 0 else {}

    def recv(path, v):
        if not isinstance(v, _TensorMeta):
            return v
        if rank == 0:
            t = flat[path].detach()
            if isinstance(t, DTensor):
                raise ValueError(f"mfsdp2 E28: broadcast_from_rank0 expects full tensors; {path} is a DTensor")
            t = t.contiguous()
        else:
            t = torch.empty(v.shape, dtype=v.dtype)
        dist.broadcast(t, src=src, group=group)
        return convert(path, t)

    return map_tree(skeleton[0], recv)


def full_to_rows(full: torch.Tensor, sp: ShardedParam, dtype: Optional[torch.dtype] = None) -> DTensor:
    """This rank's rows of a full tensor shaped like ``sp``'s parameter, as an owned RowShard DTensor."""
    s, e = sp.start_end
    # Beside the parameter's own rows: the compute device, or host memory under CPU offload.
    home = sp.param._local_tensor.device
    local = full[s:e].to(device=full.device if home.type == "meta" else home, dtype=dtype or full.dtype, copy=True)
    return relabel_rows(local, sp.param, sp.rows)

