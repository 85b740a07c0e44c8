"""The accelerator's dequantise of a gathered float8 block (:mod:`mfsdp2.precision.fp8_tiles`), run here on
CPU tensors: bit for bit the per-rank, per-piece reference on every element of a piece, zeros on
padding, and a number of ops set by the tiles alone -- the same for 2 ranks and 7 pieces as for
16 ranks and 40 -- not by ranks and pieces. The whole FP8 gather with it (``tiled_on_cpu``) gives
the quantise-dequantise of each weight with the global amax, as the host path does."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from mfsdp2 import MixedPrecisionPolicy, fully_shard
from mfsdp2.precision import native
from mfsdp2.precision.fp8_tiles import GatheredDequantise

from .._dist import run_ranks
from .._optional import given, settings, st

E4M3 = torch.float8_e4m3fn


def _layout(draw_sizes, ranks: int, shard: int):
    """Rank r's pieces: consecutive segments with gaps (padding), inside ``shard`` columns."""
    out = []
    for r in range(ranks):
        offs, lens, at = [], [], 0
        for gap, n in draw_sizes[r]:
            if at + gap + n > shard:
                break
            offs.append(at + gap)
            lens.append(n)
            at += gap + n
        out.append(native.Segments(offs, lens))
    return out


def _bytes_and_scales(pieces, ranks, shard, width, n_seg, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.zeros(ranks, width, dtype=torch.uint8)
    for r, segs in enumerate(pieces):
        for o, n in zip(segs.offsets, segs.lengths):
            vals = torch.randn(n, generator=g) * 100
            rows[r, o : o + n] = vals.clamp(-448, 448).to(E4M3).view(torch.uint8)
    rows[:, shard:] = 0xAB  # another group's bytes in the same gathered row: never read
    scales = torch.rand(n_seg, generator=g) * 10 + 0.01
    return rows, scales


def _reference(rows, pieces, shard, scales, out_dtype):
    dst = torch.full((len(pieces) * shard,), float("nan"), dtype=out_dtype)
    with native.reference_only():
        for r, segs in enumerate(pieces):
            native.dequantise_fp8(rows[r, :shard], dst[r * shard : (r + 1) * shard], segs, scales, E4M3)
    return dst


@settings(max_examples=40, deadline=None)
@given(
    ranks=st.integers(1, 5),
    shard=st.integers(1, 60),
    extra=st.integers(0, 16),
    tile=st.sampled_from([7, 50, 1 << 24]),
    sizes=st.lists(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 12)), max_size=6), min_size=5, max_size=5),
    out_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 1000),
)
def test_tiles_equal_the_per_rank_reference(ranks, shard, extra, tile, sizes, out_dtype, seed):
    pieces = _layout(sizes, ranks, shard)
    n_seg = max(len(p) for p in pieces) if pieces else 0
    # Every rank's table has one entry per parameter (empty pieces where a rank holds none).
    pieces = [native.Segments(list(p.offsets) + [shard] * (n_seg - len(p)), list(p.lengths) + [0] * (n_seg - len(p)))
              for p in pieces]
    rows, scales = _bytes_and_scales(pieces, ranks, shard, shard + extra, max(n_seg, 1), seed)
    want = _reference(rows, pieces, shard, scales, out_dtype)
    got = torch.full_like(want, float("nan"))
    GatheredDequantise(pieces, shard, n_seg, tile=tile)(rows, got, scales, E4M3)
    in_piece = ~torch.isnan(want)
    assert torch.equal(got[in_piece], want[in_piece])
    assert torch.all(got[~in_piece] == 0)  # padding: 0 bytes / scale 1


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops(ranks: int, params: int, shard: int) -> int:
    per = shard // params
    pieces = [native.Segments([i * per for i in range(params)], [per - 1] * params) for _ in range(ranks)]
    rows, scales = _bytes_and_scales(pieces, ranks, shard, shard, params, 0)
    dst = torch.empty(ranks * shard, dtype=torch.bfloat16)
    deq = GatheredDequantise(pieces, shard, params)
    deq(rows, dst, scales, E4M3)  # the cover goes to the device once
    with _CountOps() as count:
        deq(rows, dst, scales, E4M3)
    assert len(deq.tiles) == 1
    return count.ops


def test_op_count_does_not_grow_with_ranks_or_pieces():
    few, many = _ops(2, 7, 700), _ops(16, 40, 4000)
    assert few == many, (few, many)
    # The per-piece reference launches three ops per piece of every rank.
    assert few < 3 * 2 * 7


def _exact(rank, ws, tiled):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 6))
    mesh = init_device_mesh("cpu", (ws,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather_dtype=E4M3)
    fully_shard(model[0], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in (model, model[0]):
        for g in m._mfsdp2_state.groups:
            if g.fp8 is not None:
                g.fp8.tiled_on_cpu = tiled
    full = model[0].weight.full_tensor()
    with torch.no_grad():
        model(torch.randn(5, 24))  # the root's forward agrees on the scales
        model[0].unshard()
        gathered = model[0].weight.detach().clone()
        model[0].reshard()
    return full, gathered


@pytest.mark.slow
@pytest.mark.parametrize("ws", [2, 4])
def test_tiled_gather_gives_quantise_dequantise_with_the_global_amax(ws):
    for w, gathered in run_ranks(_exact, ws, True):
        scale = torch.finfo(E4M3).max / w.abs().max()
        expect = ((w * scale).clamp(-448, 448).to(E4M3).float() / scale).to(torch.bfloat16)
        assert torch.equal(gathered, expect)
