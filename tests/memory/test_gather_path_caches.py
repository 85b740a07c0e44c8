"""What the gather path keeps between calls is never stale.

A unit's gather, reshard and registration run several times per unit per step, so they keep
what does not change between calls: the buffer's gather input (a fixed view of its storage),
each parameter's piece geometry (per layout) and a group's flat list of the places its parameters
are registered (per ``infos`` list). Each case here changes what the kept value derives from and
fails if the old value were used:

* the gather input is the *current* block's slice after the storage is re-pointed at another
  block (a view made once follows the storage object, not the first block's address);
* ``piece_view`` matches the layout's own pieces (and refuses what they refuse) for every rank,
  shard dim and 0-d parameter, and follows a buffer given another layout;
* ``register`` writes the places of the group's current ``infos``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard
from mfsdp2.comm.communicator import CommHandle
from mfsdp2.dtensors.shard_dim import from_storage
from mfsdp2.groups.param_group import ParamInfo
from mfsdp2.memory.allocator import DynamicAllocator
from mfsdp2.memory.buffer import DataParallelBuffer
from mfsdp2.memory.layout import plan_layout

from .._dist import run_ranks


class _NoComm:
    """A two-rank communicator whose all-gather does nothing: the buffer's own copy-in of the shard
    into its slice of the block is what is checked."""

    def __init__(self, world_size: int, rank: int):
        self.world_size, self.rank = world_size, rank

    def all_gather(self, out, inp, label=""):
        return CommHandle(label=label)


def _reference_piece(buf: DataParallelBuffer, shard: torch.Tensor, i: int) -> torch.Tensor:
    slot = buf.layout.slots[i]
    piece = buf.layout.piece(i, buf.rank)
    flat = shard[piece.shard_offset : piece.shard_offset + piece.numel]
    if len(slot.shape) == 0:
        return flat.view(())
    return from_storage(flat.view((piece.num_rows,) + slot.storage_shape[1:]), slot.shard_dim)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())


def test_gather_input_is_the_slice_of_each_new_block():
    layout = plan_layout([(8, 4), (6,)], 2)
    S = layout.shard_numel
    shard = torch.arange(S, dtype=torch.float32) + 1
    buf = DataParallelBuffer(layout, torch.float32, torch.device("cpu"), _NoComm(2, 1), shard=shard)
    buf.free_unsharded()
    alloc = DynamicAllocator()
    held = []  # the earlier blocks stay allocated: every gather gets memory at a new address
    for step in range(4):
        with torch.no_grad():
            shard.add_(10)
        buf.all_gather(alloc, ("weight", "u", step))
        block = buf._block
        assert all(block.data_ptr() != b.data_ptr() for b in held)
        assert torch.equal(block[S : 2 * S], shard), f"gather {step} wrote another block than its own"
        held.append(block)
        buf.free_unsharded()


def test_piece_view_matches_the_layout_for_every_rank_dim_and_0d_param():
    shapes = [(8, 4), (), (6, 3, 2), (5,), (7, 0)]
    for world in (1, 2, 3, 4):
        for dims in ([0] * 5, [1, 0, 2, 0, 1]):
            layout = plan_layout(shapes, world, dims=dims)
            for rank in range(world):
                buf = DataParallelBuffer(layout, torch.float32, torch.device("cpu"), _NoComm(world, rank))
                shard = torch.randn(layout.shard_numel)
                for _ in range(2):  # the second pass is served from the geometry kept by the first
                    for i in range(len(shapes)):
                        try:
                            want = _reference_piece(buf, shard, i)
                        except RuntimeError:  # a 0-d parameter on a rank without it: no view either way
                            with pytest.raises(RuntimeError):
                                buf.piece_view(shard, i)
                            continue
                        got = buf.piece_view(shard, i)
                        assert _same_view(got, want) and torch.equal(got, want), (world, dims, rank, i)


def test_piece_view_follows_a_buffer_given_another_layout():
    a = plan_layout([(8, 4), (6,)], 2)
    b = plan_layout([(6,), (8, 4)], 2)
    buf = DataParallelBuffer(a, torch.float32, torch.device("cpu"), _NoComm(2, 1))
    shard = torch.randn(a.shard_numel)
    assert buf.piece_view(shard, 0).shape == _reference_piece(buf, shard, 0).shape
    buf.layout = b
    for i in range(2):
        assert _same_view(buf.piece_view(shard, i), _reference_piece(buf, shard, i)), i


def _register_follows_new_infos(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    lin = nn.Linear(4, 4)
    fully_shard(lin, mesh=mesh)
    lin(torch.randn(2, 4)).sum().backward()
    g = lin._mfsdp2_state.groups[0]
    g.register(unsharded=True)
    g.register(unsharded=False)  # the flat list of places is built for the first infos
    twin = nn.Linear(4, 4)
    for i, owners in enumerate(g.infos):
        twin._parameters[owners[0].attr] = g.dist_params[i]
    g.infos = [owners + [ParamInfo(twin, owners[0].attr, "twin." + owners[0].attr)] for owners in g.infos]
    g.register(unsharded=True)
    ok = all(twin._parameters[o[0].attr] is g.unsharded_params[i] for i, o in enumerate(g.infos))
    g.register(unsharded=False)
    return ok and all(twin._parameters[o[0].attr] is g.dist_params[i] for i, o in enumerate(g.infos))


def test_register_writes_the_places_of_the_current_infos():
    assert run_ranks(_register_follows_new_infos, 1) == [True]
