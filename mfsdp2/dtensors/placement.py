"""``RowShard``: the DTensor placement of our row-aligned, uneven shards.

Why a placement and not a plain ``Shard(0)``: torch's ``Shard(0)`` means ``torch.chunk`` splits.
Our layout (see :mod:`mfsdp2.memory.layout`) splits every parameter at flat-buffer boundaries, so rank
``r`` may hold 7 rows where ``torch.chunk`` would give it 5. A ``Shard(0)`` DTensor with such a
local tensor lies about its metadata: ``full_tensor()`` pads to chunk sizes and gloo aborts with
"Received data size doesn't match", and DCP writes rows at the wrong global offsets.

``RowShard(0, rows)`` carries the true per-rank row counts and overrides exactly the hooks torch's
DTensor machinery asks a shard placement for:

* ``_local_shard_size_and_offset`` -> DCP chunk metadata and ``compute_local_shape_and_global_offset``;
* ``_to_replicate_tensor`` -> ``full_tensor()`` / ``redistribute(Replicate())``;
* ``_to_new_shard_dim`` and ``_replicate_to_shard`` -> other redistributions, through a full tensor.

It compares equal to ``Shard(dim)`` so DTensor's sharding rules (pointwise ops, foreach optimizer
kernels, norms) treat it as a dim-0 shard without redistributing. Everything that would otherwise
confuse it with a ``torch.chunk`` split is kept apart: it hashes with its row counts, two DTensor
specs differing only in ``RowShard`` vs plain ``Shard`` compare unequal, and results computed from
a ``RowShard`` DTensor are relabelled ``RowShard`` (:mod:`mfsdp2.dtensors.row_propagation`): ``p * 2``,
``p.clone()``, ``p.to(torch.bfloat16)``, ``p.view(...)`` and optimizer states all keep the true row
counts, and a same-shape FSDP2 / ``distribute_tensor`` DTensor in the same process is unaffected.

``redistribute`` to a plain ``Shard(0)`` (or from one to a ``RowShard``) moves the rows the two
splits place differently, through ``Replicate`` (:mod:`mfsdp2.dtensors.row_splits`): the result holds
``torch.chunk``'s rows and says ``Shard(0)``.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence, Union

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.device_mesh import DeviceMesh
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..base import compat
from ..comm.devices import group_backend

__all__ = ["RowShard", "row_sharded_dtensor", "data_parallel_dtensor", "chunk_rows", "wrap_local", "offset_free",
           "communicable", "mark_write_nothing", "write_nothing"]


class RowShard(Shard):
    """Shard along ``dim`` with explicit per-rank row counts (``rows[r]`` rows on mesh rank ``r``)."""

    def __init__(self, dim: int, rows: Sequence[int]):
        super().__init__(dim)
        self.rows = tuple(map(int, rows))  # one entry per rank: built in C (1024 per parameter at 1024 ranks)
        self.starts = (0,) + tuple(itertools.accumulate(self.rows))[:-1] if self.rows else ()
        # Not Shard's hash (the dim alone): process-wide DTensor caches must keep a decision made
        # for a torch.chunk split apart from ours, and ours apart per row split. Computed once:
        # ``rows`` has one entry per rank (1024 at world size 1024) and DTensor hashes specs often.
        self._hash = hash(("RowShard", self.dim, self.rows))

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if isinstance(other, RowShard):
            return self._hash == other._hash and self.dim == other.dim and self.rows == other.rows
        return isinstance(other, Shard) and self.dim == other.dim

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"RowShard(dim={self.dim}, rows={self.rows})"

    # ``Shard`` is a C++ (pybind) class whose pickled state is ``dim`` alone, so a copy made
    # through it loses ``rows`` (dynamo deep-copies the placements it guards on, and the guard
    # then fails on its own frame). RowShard is immutable: copies are the object itself, and
    # pickling rebuilds it from both fields.
    def __reduce__(self):
        return (RowShard, (self.dim, self.rows))

    def __copy__(self) -> "RowShard":
        return self

    def __deepcopy__(self, memo) -> "RowShard":
        return self

    def __str__(self) -> str:
        return f"RS({self.dim})"

    def _check_mesh(self, num_chunks: int) -> None:
        if num_chunks != len(self.rows):
            raise ValueError(
                f"{self!r} describes {len(self.rows)} ranks but the mesh dimension has {num_chunks}"
            )

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank):  # type: ignore[override]
        self._check_mesh(num_chunks)
        return self.rows[rank], self.starts[rank]

    def _to_replicate_tensor(self, local_tensor, mesh: DeviceMesh, mesh_dim: int, current_logical_shape):  # type: ignore[override]
        self._check_mesh(mesh.size(mesh_dim))
        if is_traceable_wrapper_subclass(local_tensor):
            local_tensor, gathered = self._subclass_to_gather(local_tensor, mesh, mesh_dim, current_logical_shape)
            if gathered:  # by torch's own Shard path, the subclass kept
                return local_tensor
        # Pad every piece to the longest, gather once, then drop each piece's padding.
        m = max(self.rows)
        moved = local_tensor.movedim(self.dim, 0)
        padded = moved.new_zeros((m,) + tuple(moved.shape[1:]))
        padded[: moved.shape[0]] = moved
        out = padded.new_empty((m * len(self.rows),) + tuple(moved.shape[1:]))
        compat.all_gather_single(out, padded.contiguous(), group=mesh.get_group(mesh_dim))
        full = torch.cat([out[i * m : i * m + r] for i, r in enumerate(self.rows)])
        return full.movedim(0, self.dim).contiguous()

    def _subclass_to_gather(self, local_tensor, mesh, mesh_dim, current_logical_shape):
        """A wrapper subclass's piece (torchao's low-bit optimizer states: they implement
        ``view``, dim-0 ``slice``, ``copy_`` and the functional all-gather, not ``permute`` or
        ``new_zeros``). Equal dim-0 rows on every rank: torch's own ``Shard`` gather, which calls
        only the functional all-gather the subclass implements, and keeps the subclass (as under
        FSDP2): ``(full tensor, True)``. Otherwise the subclass is asked for its values
        (``dequantize()``), gathered as a plain tensor by the caller: ``(values, False)``, a full
        optimizer state of the same values, in the state's dtype."""
        if self.dim == 0 and len(set(self.rows)) == 1:
            return Shard(0)._to_replicate_tensor(local_tensor, mesh, mesh_dim, current_logical_shape), True
        if type(local_tensor).dequantize is not torch.Tensor.dequantize:  # its own, not torch's (a cast to float32)
            return local_tensor.dequantize(), False
        raise TypeError(
            f"mfsdp2: gathering a {type(local_tensor).__name__} split over the ranks in rows {list(self.rows)}: "
            "uneven row shards are padded to one size, which needs ops this tensor subclass does not implement, "
            "and it has no dequantize() to gather its values instead; give it dequantize(), or shard the "
            "parameter so that every rank holds the same number of rows"
        )

    def _replicate_to_shard(self, local_tensor, mesh: DeviceMesh, mesh_dim: int, shard_index):  # type: ignore[override]
        self._check_mesh(mesh.size(mesh_dim))
        i = int(shard_index)
        if is_traceable_wrapper_subclass(local_tensor) and self.dim == 0:
            # dim-0 slicing is what torchao's low-bit states implement (at block edges); no clone
            # (not implemented either): the slice of a full tensor made for this split is the piece.
            return local_tensor[self.starts[i] : self.starts[i] + self.rows[i]]
        return local_tensor.narrow(self.dim, self.starts[i], self.rows[i]).clone()

    def _to_new_shard_dim(self, local_tensor, mesh, mesh_dim, current_logical_shape, new_shard_dim):  # type: ignore[override]
        full = self._to_replicate_tensor(local_tensor, mesh, mesh_dim, current_logical_shape)
        coord = mesh.get_coordinate()
        if coord is None:
            return local_tensor
        return Shard(new_shard_dim)._replicate_to_shard(full, mesh, mesh_dim, coord[mesh_dim])


def chunk_rows(n: int, k: int) -> tuple[int, ...]:
    """Rows per rank of ``torch.chunk(n rows, k)``: what a plain ``Shard(0)`` means."""
    s = -(-n // k) if n and k else 0
    return tuple(max(0, min(s, n - i * s)) for i in range(k))


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what ``DTensor.from_local`` needs with a
    global shape)."""
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def row_sharded_dtensor(
    local: torch.Tensor, mesh: DeviceMesh, rows: Sequence[int], global_shape: Sequence[int]
) -> DTensor:
    """Wrap ``local`` (this rank's rows; kept as is, no copy) as a row-sharded DTensor on a 1-D mesh."""
    return data_parallel_dtensor(local, mesh, rows, global_shape, 0)


def data_parallel_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    rows: Union[Sequence[int], "RowShard"],
    global_shape: Sequence[int],
    shard_dim: Optional[int],
) -> DTensor:
    """``local`` as a DTensor on a data-parallel mesh: ``RowShard(0, rows)`` on mesh dimension
    ``shard_dim`` and ``Replicate()`` on the others (HSDP's replicate dimension; every dimension
    for ``no_shard``, whose ``local`` is the whole parameter)."""
    shape = torch.Size(global_shape)
    placements = [Replicate()] * mesh.ndim
    if shard_dim is not None:
        placements[shard_dim] = rows if isinstance(rows, RowShard) else RowShard(0, rows)
    return wrap_local(local, mesh, placements, shape, contiguous_stride(shape))


def wrap_local(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence, shape: Sequence[int], stride: Sequence[int]
) -> DTensor:
    """``local`` itself -- not a copy, wherever it lives -- as this rank's piece of a DTensor on
    ``mesh`` with global ``shape`` / ``stride``.

    Why not ``DTensor.from_local``: it moves a local tensor whose device type differs from the
    mesh's (``local.to(mesh.device_type)``). Under CPU offload the main weights and gradients live
    in host memory while the mesh is CUDA's: ``from_local`` made every parameter a CUDA *copy* of
    its host shard, so the optimizer stepped the copy (its states on the GPU too) while gathers
    read the untouched host shard -- a model that never trained. FSDP2 builds its offloaded
    parameters the same way (``_from_local_no_grad``: the ``DTensor`` constructor over the local
    tensor). Differentiable (``from_local``) only where it moves nothing: a local tensor that
    records autograd history and already lives on the mesh's device type; callers here wrap
    parameters, gradients and state-dict entries, which do not."""
    if local.requires_grad and torch.is_grad_enabled() and (local.device.type == mesh.device_type or local.is_meta):
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=tuple(stride))
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=local.requires_grad)


def offset_free(t: DTensor) -> DTensor:
    """``t``, or the same DTensor (the same local tensor and spec, nothing copied) whose wrapper
    has storage offset 0: what a state dict hands out.

    Why: ``DTensor(local, ...)`` gives the wrapper its local tensor's storage offset, and ours are
    views into flat buffers, so all but the first of a group have one. torch code that copies
    tensors generically tells a subclass wrapper from a plain tensor by ``data_ptr() == 0`` (a
    wrapper has no storage, so its data pointer is its offset): DCP's ``async_save`` stager
    (``_offload_tensor``), ``Tensor.__deepcopy__``, ``torch.save``'s pickler. With an offset they take the wrapper for a
    plain tensor and read its absent storage ("invalid python storage"). FSDP2's pieces each own
    their storage, so its wrappers have offset 0. Only state-dict entries get this form: the
    parameters keep torch's own construction, which ``torch.compile`` rebuilds the same way
    (``__tensor_unflatten__``) when it traces them."""
    if t.storage_offset() == 0:
        return t
    out = torch.Tensor._make_wrapper_subclass(
        type(t), t.shape, strides=t.stride(), storage_offset=0, dtype=t.dtype, device=t.device, layout=t.layout,
        requires_grad=t.requires_grad)
    out._spec = t._spec
    out._local_tensor = t._local_tensor
    return out


def communicable(t: DTensor) -> DTensor:
    """``t``, or ``t`` moved to its mesh's device type where the mesh's groups cannot run
    collectives on ``t``'s own device (offloaded host shards on an NCCL-only mesh): what to call
    ``full_tensor()`` / ``redistribute`` on. Torch's state-dict gathering moves the same way
    (``_gather_state_dict``); a group that serves the local device (gloo, ``cpu:gloo,cuda:nccl``)
    communicates the tensor where it is."""
    dev = t._local_tensor.device.type
    if dev == t.device_mesh.device_type or t._local_tensor.is_meta:
        return t
    groups = t.device_mesh.get_all_groups()
    if all(group_backend(g, dev) is not None for g in groups):
        return t
    return t.to(t.device_mesh.device_type)


def write_nothing(fqn: str, obj: Any) -> list:
    """``__create_write_items__`` of an object that must not be written (module level: picklable)."""
    return []


def mark_write_nothing(t: torch.Tensor) -> torch.Tensor:
    """Make DCP write nothing for ``t`` (a DTensor with an empty piece, or a placeholder scalar).

    Why here: an empty piece is a property of a placement (a rank that holds no rows of a
    parameter), so the parameter groups mark their own pieces as they make them, and the
    checkpoint code marks the placeholders it builds."""
    target = t._local_tensor if isinstance(t, DTensor) else t
    target.__create_write_items__ = write_nothing
    return t
