"""DataParallelBuffer: a planned flat buffer's shard and its unsharded (gathered) storage.

Zero-copy gather: the unsharded buffer is one persistent tensor whose *storage object* lives as
long as the buffer; an unshard points that storage at a block from the runtime's allocator and a
reshard points it at nothing (0 bytes) and hands the block back. Every parameter is a fixed view
into it (:meth:`param_views`), so

* the all-gather writes the parameters in place: its input is this rank's slice of its output;
* views saved by autograd in forward stay valid for backward after a reshard/unshard cycle, because
  they share the storage object, not just its old address;
* the gathered bytes come from the allocator (a cached block or a slot in the planned pool), not
  from a fresh ``malloc``/``mmap`` per unshard: torch FSDP2's ``storage.resize_`` costs a page fault
  per 4 KiB on every unshard of a buffer above glibc's mmap threshold.

The storage is re-pointed with ``UntypedStorage._swap_data_ptr_`` and a non-owning storage made by
``torch._C._construct_storage_from_data_pointer`` (what torch's CUDA-graph trees use to place
tensors in their pool): the block tensor is kept in ``_block`` so its memory outlives the views.

Torch without ``_swap_data_ptr_`` (before 2.13; or ``MFSDP2_NO_STORAGE_SWAP=1``, see
``compat.py``) gets torch FSDP2's approach instead: an unshard is ``storage.resize_(nbytes)`` and a
reshard ``storage.resize_(0)``, so the bytes come from torch's own allocator (on CUDA its caching
allocator; on CPU a fresh allocation each time) and the runtime's allocator does not serve gathered
weights (it still serves gradients and reduce-scatter buffers); it still counts them in its
statistics (``account``), so live/peak bytes and ``memory_stats()`` mean the same on every torch.
``resize_`` keeps the storage object, so the zero-copy views and the views autograd saved in
forward stay valid all the same.

Reduce-scatter reads a full-size gradient buffer and writes a *separate* shard-size output: a
reduce-scatter whose output aliases its input overwrites data it has not yet read.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ..base import compat
from ..comm.communicator import CommHandle, Communicator
from .layout import BufferLayout
from .offload import copy_from_main, wait_copy
from ..dtensors.shard_dim import from_storage

__all__ = ["DataParallelBuffer"]

logger = logging.getLogger(__name__)

# Blocks taken without an allocator (before the root's first forward) whose gather did not
# provably end: referenced for the process's life (see DataParallelBuffer.abandon_unsharded).
leaked_blocks: list = []


class DataParallelBuffer:
    """One dtype's copy of a unit's flat buffer: ``shard`` (persistent) + ``unsharded`` (transient)."""

    def __init__(
        self,
        layout: BufferLayout,
        dtype: torch.dtype,
        device: torch.device,
        comm: Communicator,
        shard: Optional[torch.Tensor] = None,
        persistent: bool = False,
    ):
        if layout.world_size != comm.world_size:
            raise ValueError(f"layout planned for {layout.world_size} ranks, group has {comm.world_size}")
        if persistent and shard is not None:
            raise ValueError("a persistent buffer's shard is its own slice of the unsharded storage")
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.comm = comm
        self.rank = comm.rank
        # persistent (strategies that keep full model weights): the unsharded storage keeps its
        # own memory for the buffer's life and the shard is this rank's slice of it, so holding
        # the full weights costs P elements, not P + P/N.
        self.persistent = persistent
        S = layout.shard_numel
        self.unsharded = (torch.zeros if persistent else torch.empty)(layout.total_numel, dtype=dtype, device=device)
        self._storage = self.unsharded.untyped_storage()
        self._nbytes = self._storage.nbytes()
        # Re-point the storage at allocator blocks (else resize_ it); fixed for the buffer's life.
        self._swap = compat.HAS_STORAGE_SWAP
        # Where the gathered bytes come from while unsharded: (block tensor, allocator, key);
        # the block is None for the storage's own initial memory, which the first free releases.
        self._block: Optional[torch.Tensor] = None
        self._alloc = None
        self._key = None
        # Set when a gather into the storage's own bytes did not provably end: never freed again.
        self._pinned = False
        # Views are made while the storage has its full size (views of an empty storage fail the
        # bounds check); the owner frees it once it has wrapped them (see ParameterGroup).
        self._views = [self.param_view(self.unsharded, i) for i in range(len(layout.slots))]
        # Collectives write through a second alias of the storage with its own version counter:
        # refilling the buffer for backward must not bump the version of the parameter views that
        # autograd saved in forward (it would report them as modified in place). The bytes written
        # are the same weights, so the saved values stay valid.
        self._writer = torch.empty(0, dtype=dtype, device=device).set_(
            self._storage, 0, (layout.total_numel,), (1,)
        )
        # This rank's slice of the writer: the gather's input. A fixed view like ``_views``: it
        # shares the storage object, so it follows every re-pointing of the storage.
        self._mine = self.local_slice(self._writer)
        # Per parameter: where this rank's rows sit in a shard and their view's shape
        # (:meth:`piece_view`, several calls per parameter per step); built from ``_pieces_of``.
        self._pieces: list = []
        self._pieces_of: Optional[BufferLayout] = None
        if persistent:
            # A third alias with its own version counter: the optimizer's in-place updates of
            # the shard (step detection reads them) must not be confused with the gathers.
            owner = torch.empty(0, dtype=dtype, device=device).set_(self._storage, 0, (layout.total_numel,), (1,))
            shard = self.local_slice(owner)
        self.shard = shard if shard is not None else torch.zeros(S, dtype=dtype, device=device)
        # A shard of another dtype (the fp32 main weights of a bf16 buffer) is cast while it is
        # copied into the gather's input: no model-dtype copy is kept between gathers (FSDP2's
        # memory), at the price of one cast per gather instead of one per optimizer step.
        if self.shard.numel() != S:
            raise ValueError(f"shard must have {S} elements, got {self.shard.numel()}")
        # CPU offload on CUDA: the event after the copy-in that refreshed a persistent ``shard``
        # from the main weights on the copy stream; its next reader waits on it (:meth:`take_shard`).
        self.shard_copy = None

    # -- geometry -----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the unsharded buffer when materialised."""
        return self._nbytes

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        lo, hi = self.layout.shard_range(self.rank)
        return full[lo:hi]

    def param_view(self, full: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index`` as a view of a full-size flat tensor, in its original shape (a
        strided view for one sharded on another dim than 0: :mod:`mfsdp2.dtensors.shard_dim`)."""
        slot = self.layout.slots[index]
        return from_storage(full[slot.offset : slot.offset + slot.numel].view(slot.storage_shape), slot.shard_dim)

    def piece_view(self, shard: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's rows of parameter ``index`` as a view of a shard-size flat tensor (its
        slices along the parameter's shard dim, in the parameter's dimension order)."""
        if self._pieces_of is not self.layout:  # the layout (frozen) is what the geometry derives from
            self._pieces = [self._piece_geometry(i) for i in range(len(self.layout.slots))]
            self._pieces_of = self.layout
        start, end, shape, dim = self._pieces[index]
        flat = shard[start:end].view(shape)
        return flat if dim == 0 else from_storage(flat, dim)

    def _piece_geometry(self, index: int) -> tuple:
        """``(start, end, view shape, shard dim)`` of this rank's rows of parameter ``index`` in a
        shard: pure functions of the frozen layout and the rank, so computed once per layout."""
        slot = self.layout.slots[index]
        piece = self.layout.piece(index, self.rank)
        shape = () if len(slot.shape) == 0 else (piece.num_rows,) + slot.storage_shape[1:]
        dim = 0 if len(slot.shape) == 0 else slot.shard_dim
        return piece.shard_offset, piece.shard_offset + piece.numel, shape, dim

    def param_views(self) -> list[torch.Tensor]:
        """Fixed views of every parameter into the unsharded buffer (valid while unsharded)."""
        return self._views

    # -- unsharded storage --------------------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self._storage.nbytes() > 0

    def _point_storage_at(self, ptr: int, nbytes: int) -> None:
        # The old data pointer moves into the temporary storage and is dropped with it (freeing
        # the storage's own initial allocation; blocks from an allocator are not owned by it).
        self._storage._swap_data_ptr_(torch._C._construct_storage_from_data_pointer(ptr, self.device, nbytes))

    def materialize(self, allocator=None, key=None) -> None:
        """Give the unsharded storage its bytes: a block from ``allocator`` under ``key`` (or a
        plain ``torch.empty`` when there is no allocator yet, e.g. before the root's first forward).
        Without storage swapping: ``resize_`` from torch's allocator; ``allocator`` only counts
        the bytes in its statistics (:meth:`~mfsdp2.memory.allocator.BucketAllocator.account`)."""
        if self._storage.nbytes() > 0:  # unsharded already
            return
        if not self._swap:
            self._storage.resize_(self._nbytes)
            if allocator is not None:
                allocator.account(key, self._nbytes)
            self._alloc, self._key = allocator, key
            return
        n = self.layout.total_numel
        if allocator is not None:
            block = allocator.allocate(key, n, self.dtype, self.device)
        else:
            block = torch.empty(n, dtype=self.dtype, device=self.device)
        self._block, self._alloc, self._key = block, allocator, key
        self._point_storage_at(block.data_ptr(), self._nbytes)

    def free_unsharded(self) -> None:
        if self.persistent or self._pinned or self._storage.nbytes() == 0:  # nothing gathered to free
            return
        if self._swap:
            self._point_storage_at(0, 0)
        else:
            self._storage.resize_(0)
        alloc, key = self._alloc, self._key
        self._block, self._alloc, self._key = None, None, None
        if alloc is not None:
            alloc.free(key)

    def abandon_unsharded(self, why: str) -> None:
        """Like :meth:`free_unsharded`, for a gather that did not provably end (it failed and may
        still write the block from gloo's thread): the block is leaked, never reused
        (:meth:`~mfsdp2.memory.allocator.BucketAllocator.leak`). Without storage swapping the storage
        cannot be detached from its bytes, so it keeps them (``resize_(0)`` would free them
        under the collective) and the next gather refills the same memory."""
        if self.persistent or not self.is_unsharded:
            return
        if not self._swap or self._block is None:  # bytes owned by the storage itself: keep them
            self._pinned = True
            alloc, key = self._alloc, self._key
            self._alloc = self._key = None
            if alloc is not None:  # accounted bytes (no storage swap): counted as leaked
                alloc.leak(key, f"the unsharded storage keeps its {self._nbytes} bytes for good: {why}")
            else:
                logger.warning("mfsdp2: %s: the unsharded storage keeps its %d bytes for good: %s", key, self._nbytes,
                               why)
            return
        self._point_storage_at(0, 0)
        block, alloc, key = self._block, self._alloc, self._key
        self._block, self._alloc, self._key = None, None, None
        if alloc is not None:
            alloc.leak(key, why)
        elif block is not None:
            leaked_blocks.append(block)

    # -- collectives --------------------------------------------------------------------------
    def all_gather(self, allocator=None, key=None, label: str = "") -> CommHandle:
        """Fill the unsharded buffer from every rank's shard (in place: no copy-out).

        Under CPU offload on CUDA the gather's input comes from a copy on the copy-in stream
        (this copy of the main shard, or a persistent shard's refresh): the collective's side
        stream waits on its event, so neither the host nor the compute stream does (one rank:
        no collective, the current stream reads the buffer next)."""
        self.materialize(allocator, key)
        mine = self._mine
        if mine.data_ptr() != self.shard.data_ptr():  # a persistent buffer's shard is ``mine``
            self.shard_copy = copy_from_main(mine, self.shard)  # offloaded: on the copy-in stream
        stream = getattr(self.comm, "ag_stream", None) if self.comm.world_size > 1 else None
        self.take_shard(stream)
        return self.comm.all_gather(self._writer, mine, label)

    def take_shard(self, stream=None) -> None:
        """Order the next reader of the shard -- ``stream``, else the current stream (the host
        where the device has none) -- after the copy-in that wrote it, if one is pending."""
        event = self.shard_copy
        if event is None:  # nothing pending (always, without CPU offload on CUDA)
            return
        self.shard_copy = None
        wait_copy(event, self.device, stream)

    def place_rows(self, rows: torch.Tensor) -> None:
        """Fill the unsharded buffer from ``rows`` (``(world size, shard numel)``, row ``q`` =
        rank ``q``'s shard): a gather shared with other groups (:mod:`mfsdp2.groups.gather_buckets`)
        delivers this buffer's shards as one strided block of its output."""
        self.rows_view().copy_(rows)

    def rows_view(self) -> torch.Tensor:
        """The unsharded buffer as ``(world size, shard numel)``: where :meth:`place_rows` writes
        (a caller filling many buffers at once copies into these in one batch)."""
        return self._writer.view(self.layout.world_size, self.layout.shard_numel)

    # -- partial reshard (reshard_after_forward=<int>) -------------------------------------------
    # With groups of ``k`` consecutive ranks, rank ``r`` (local index ``l = r % k``) keeps the
    # ``l``-th of ``k`` contiguous pieces of the gathered buffer (shards ``l N/k .. (l+1) N/k - 1``),
    # as FSDP2 re-shards a parameter over the ``k`` ranks: the ranks of its group then hold every
    # shard between them, in the group's rank order, so the backward unshard is one gather inside
    # the group straight into the buffer -- no staging copy of the full size beside it (the unit's
    # memory in flight is the buffer plus the kept piece, as for an ordinary gather plus 1/k).
    def keep_for_group(self, k: int) -> torch.Tensor:
        """Copy out this rank's piece (``N/k`` shards) of the gathered buffer, then free the full storage."""
        N, S = self.layout.world_size, self.layout.shard_numel
        kept = self._writer.view(k, (N // k) * S)[self.rank % k].clone()
        self.free_unsharded()
        return kept

    def all_gather_in_group(
        self, kept: torch.Tensor, sub: Communicator, allocator=None, key=None, label: str = ""
    ) -> CommHandle:
        """Rebuild the full buffer from the group's kept pieces: the gather's output is the buffer."""
        k = sub.world_size
        if sub.rank != self.rank % k:
            raise RuntimeError(
                f"mfsdp2: {label or 'in-group gather'}: rank {self.rank} of the shard group is rank {sub.rank} of "
                f"its block of {k}, expected {self.rank % k}: the shard group's ranks must be in increasing order"
            )
        self.materialize(allocator, key)
        h = sub.all_gather(self._writer, kept.reshape(-1), label)
        # ``kept`` is referenced by nothing else once the caller dropped it: without ``keep`` its
        # memory could be reused (on CUDA by the current stream) while the side stream reads it.
        return CommHandle(inner=h, keep=(kept,), label=label)

    def reduce_scatter(
        self, full: torch.Tensor, out: torch.Tensor, op, scratch: Optional[torch.Tensor] = None, label: str = ""
    ) -> CommHandle:
        """Reduce a full-size flat tensor into ``out`` (shard size, must not alias ``full``).
        ``full`` is scratch: the communicator may overwrite it (see ``Communicator.reduce_scatter``)."""
        return self.comm.reduce_scatter(out, full, op, scratch, label)
