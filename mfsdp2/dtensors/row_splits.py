"""Which rows a row placement means, and moving a DTensor from one row split to another.

Why: ``RowShard`` equals ``Shard(d)`` (that is how DTensor's sharding rules accept our parameters
as plain shards, see :mod:`mfsdp2.dtensors.row_propagation`), so wherever DTensor compares
placements to decide what to move it cannot see that our rows and ``torch.chunk``'s differ. The
helpers here compare the splits themselves (:func:`_split`: the rows per rank a placement means;
:func:`_same_slices`, :func:`_moves`, :func:`_rows_move`), and the wrappers below move rows where
the splits differ, through ``Replicate``.

``distribute_tensor(full, mesh, placements)`` with our parameter's placements (what torch's
``set_optimizer_state_dict(full_state_dict=True)`` does with every full optimizer state, and what
user init code does) split by ``torch.chunk`` whatever the placement said, and labelled the result
plain ``Shard(0)``: the optimizer then held states of other sizes than its parameters' shards.
It now gives each rank the rows its ``RowShard`` names (the data still comes from
``src_data_rank``, as torch's does).

``redistribute`` decides what to move by comparing placements, and ``RowShard`` equals
``Shard(0)``: ``p.redistribute(mesh, [Shard(0)])`` moved nothing and returned our rows where the
caller asked for ``torch.chunk``'s (and a chunk-split DTensor redistributed to our ``RowShard``
kept the chunk rows). Where the two splits differ, the mesh dimension now goes through
``Replicate`` (one gather) and then to the requested split, so the result holds the rows its
placement names; where they coincide nothing moves.

The op dispatcher brings an argument to the spec a sharding decision asks for through
``redistribute_local_tensor``; with mixed splits (:mod:`mfsdp2.dtensors.row_propagation`, "Mixed
splits") that is a change of rows DTensor cannot see, so it goes through ``Replicate`` too, and a
``Partial`` is reduced into our rows the same way (DTensor's reduce-scatter splits by
``torch.chunk``).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch.distributed.tensor as _dtensor_pkg
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .placement import RowShard, chunk_rows, wrap_local

__all__ = ["install"]


def _shard_dim(pl) -> Optional[int]:
    """The tensor dim a placement splits into plain slices: ``Shard(t)`` (torch.chunk) or ours
    (``RowShard(t)``: dim 0 on a parameter, another dim on a transpose of one). None: not one."""
    return pl.dim if type(pl) is Shard or isinstance(pl, RowShard) else None


def _size(spec, t: Optional[int]) -> Optional[int]:
    """``spec``'s size along tensor dim ``t`` (None: no such dim, or a symbolic size)."""
    meta = spec.tensor_meta
    if t is None or meta is None or not 0 <= t < len(meta.shape) or type(meta.shape[t]) is not int:
        return None  # symbolic sizes (dynamic-shape tracing): no guard is added for us
    return meta.shape[t]


def _split(pl, n: int, k: int) -> Optional[tuple[int, ...]]:
    """The rows per rank a row placement means for ``n`` rows (slices along its dim) over ``k``
    ranks (None: not one)."""
    if isinstance(pl, RowShard):
        return tuple(pl.rows)
    if type(pl) is Shard:
        return chunk_rows(n, k)
    return None


def _same_slices(spec: DTensorSpec, c, t, k: int) -> bool:
    """Whether placements ``c`` and ``t`` of one mesh dimension (``k`` ranks) leave every rank the
    same piece of ``spec``'s tensor."""
    if c == t and not _mixes_row_and_chunk((c,), (t,)):
        return True
    dim = _shard_dim(c)
    n = _size(spec, dim)
    return n is not None and dim == _shard_dim(t) and _split(c, n, k) == _split(t, n, k)


def _mixes_row_and_chunk(a, b) -> bool:
    if a is b:
        return False
    for x, y in zip(a, b):
        # Same type (the common case) or not both shards: nothing to tell apart.
        if type(x) is not type(y) and isinstance(x, Shard) and isinstance(y, Shard):
            if isinstance(x, RowShard) != isinstance(y, RowShard):
                return True
    return False


def _moves(cur: DTensorSpec, tgt: DTensorSpec) -> bool:
    """Whether going from ``cur`` to ``tgt`` changes the local tensor (DTensor redistributes)."""
    if cur.mesh != tgt.mesh or len(cur.placements) != len(tgt.placements):
        return True
    for d, (c, t) in enumerate(zip(cur.placements, tgt.placements)):
        if c != t or _mixes_row_and_chunk((c,), (t,)):
            return True
        n = _size(cur, _shard_dim(c))
        if n is not None and _split(c, n, cur.mesh.size(d)) != _split(t, n, cur.mesh.size(d)):
            return True
    return False


def _rows_move(cur, tgt, k: int) -> bool:
    """Whether going from placement ``cur`` to ``tgt`` on one mesh dimension (``k`` ranks) must go
    through ``Replicate`` because one of them is ours: the same tensor dim split differently
    (DTensor sees two equal ``Shard(t)`` and would move nothing), or another tensor dim (DTensor
    would re-split by ``torch.chunk`` whatever split the target names)."""
    if not (isinstance(cur, RowShard) or isinstance(tgt, RowShard)):
        return False
    if not (isinstance(cur, Shard) and isinstance(tgt, Shard)):
        return False
    if cur.dim != tgt.dim:
        return True
    n = sum(cur.rows) if isinstance(cur, RowShard) else sum(tgt.rows)
    return _split(cur, n, k) != _split(tgt, n, k)


def _via_replicate(cur, tgt, k: int) -> bool:
    """Whether ``cur -> tgt`` on one mesh dimension must go through ``Replicate``: a change of
    split DTensor cannot see (:func:`_rows_move`), or a ``Partial`` reduced into our rows
    (DTensor's reduce-scatter splits by ``torch.chunk``)."""
    if _rows_move(cur, tgt, k):
        return True
    # Into our rows from a sum, or from torch.chunk slices of another dim (DTensor's own
    # shard-dim change, an all-to-all, splits the new dim by torch.chunk too).
    return isinstance(tgt, RowShard) and (cur.is_partial() or (type(cur) is Shard and cur.dim != tgt.dim))


def _row_shard_distributable(placements) -> bool:
    """RowShard on some mesh dims, Replicate on the others (what our parameters carry)."""
    if placements is None:
        return False
    placements = tuple(placements)
    return any(isinstance(p, RowShard) for p in placements) and all(
        isinstance(p, (RowShard, Replicate)) for p in placements
    )


def _wrap_distribute_tensor(plain_distribute):
    def distribute_tensor(tensor, device_mesh=None, placements=None, **kwargs):
        # kwargs (``src_data_rank`` on the torch versions that have it) pass through untouched.
        if isinstance(tensor, DTensor) or device_mesh is None or not _row_shard_distributable(placements):
            return plain_distribute(tensor, device_mesh, placements, **kwargs)
        placements = tuple(placements)
        # Replicate first (torch moves the data from src_data_rank, or not at all for None),
        # then keep this rank's rows of every RowShard dimension.
        replicated = plain_distribute(tensor, device_mesh, [Replicate()] * len(placements), **kwargs)
        local = replicated.to_local()
        coord = device_mesh.get_coordinate()
        for d, p in enumerate(placements):
            if isinstance(p, RowShard) and coord is not None:
                local = p._replicate_to_shard(local, device_mesh, d, coord[d])
        out = wrap_local(local.detach(), device_mesh, placements, tensor.shape, tensor.stride())
        return out.requires_grad_(tensor.requires_grad)

    distribute_tensor.__doc__ = plain_distribute.__doc__
    distribute_tensor._mfsdp2_plain = plain_distribute
    return distribute_tensor


def _replace_everywhere(attr: str, plain, wrapped) -> None:
    """Modules that imported a function by name (torch's state-dict utilities, DTensor's op
    dispatcher) hold their own reference: replace it wherever torch.distributed has one."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(mod, attr, None) is plain:
            setattr(mod, attr, wrapped)


def _install_distribute_tensor() -> None:
    plain = _dtensor_pkg.distribute_tensor
    if getattr(plain, "_mfsdp2_plain", None) is not None:
        return
    _replace_everywhere("distribute_tensor", plain, _wrap_distribute_tensor(plain))


def _wrap_redistribute(plain_redistribute):
    def redistribute(self, device_mesh=None, placements=None, **kwargs):
        # DTensor compares placements to decide what to move, and RowShard equals Shard(0): asked
        # for a torch.chunk Shard(0), it kept our rows (or, from a chunk split to our RowShard,
        # the chunk rows) -- a DTensor whose rows are not the split the caller asked for. Those
        # mesh dimensions go through Replicate first (a gather), then to the requested split.
        if placements is not None and (device_mesh is None or device_mesh == self.device_mesh):
            mesh = self.device_mesh
            cur, tgt = tuple(self.placements), tuple(placements)
            if len(cur) == len(tgt):
                move = {d for d, (c, t) in enumerate(zip(cur, tgt)) if _rows_move(c, t, mesh.size(d))}
                if move:
                    mid = [Replicate() if d in move else c for d, c in enumerate(cur)]
                    via = plain_redistribute(self, mesh, mid, **kwargs)
                    return plain_redistribute(via, mesh, tgt, **kwargs)
        return plain_redistribute(self, device_mesh, placements, **kwargs)

    redistribute.__doc__ = plain_redistribute.__doc__
    redistribute._mfsdp2_plain = plain_redistribute
    return redistribute


def _install_redistribute() -> None:
    plain = DTensor.redistribute
    if getattr(plain, "_mfsdp2_plain", None) is None:
        DTensor.redistribute = _wrap_redistribute(plain)


def _wrap_redistribute_local_tensor(plain):
    def redistribute_local_tensor(local_tensor, current_spec, target_spec, **kwargs):
        # The op dispatcher calls this to bring an argument to the spec a sharding decision asks
        # for; with mixed splits (see _align) that is a change of rows DTensor cannot see.
        mesh = current_spec.mesh
        cur, tgt = current_spec.placements, target_spec.placements
        move = [d for d, (c, t) in enumerate(zip(cur, tgt)) if _via_replicate(c, t, mesh.size(d))]
        if move and mesh == target_spec.mesh:
            mid = tuple(Replicate() if d in move else c for d, c in enumerate(cur))
            mid = DTensorSpec(mesh, mid, tensor_meta=current_spec.tensor_meta)
            local_tensor = plain(local_tensor, current_spec, mid, **kwargs)
            current_spec = mid
        return plain(local_tensor, current_spec, target_spec, **kwargs)

    redistribute_local_tensor.__doc__ = plain.__doc__
    redistribute_local_tensor._mfsdp2_plain = plain
    return redistribute_local_tensor


def _install_redistribute_local_tensor() -> None:
    from torch.distributed.tensor import _redistribute

    plain = _redistribute.redistribute_local_tensor
    if getattr(plain, "_mfsdp2_plain", None) is None:
        _replace_everywhere("redistribute_local_tensor", plain, _wrap_redistribute_local_tensor(plain))


def install() -> None:
    """Wrap ``distribute_tensor``, ``DTensor.redistribute`` and the dispatcher's
    ``redistribute_local_tensor`` once per process (idempotent; called by
    :func:`mfsdp2.dtensors.row_propagation.install`)."""
    _install_distribute_tensor()
    _install_redistribute()
    _install_redistribute_local_tensor()
