"""Packing unsharded gradients into a reduction's flat buffer (GradientReduction._pack): the
run-at-a-time path (one ``torch.cat`` per run of adjacent gradients, one ``zero_`` per stretch of
padding or gradient-less parameters) must leave exactly the bytes of the parameter-by-parameter
path, on layouts with padding between and after parameters, parameters without a gradient
(first, last, adjacent, all), empty parameters, gradients sharded on another dim (a strided
storage view), and in a buffer at a storage offset (a bucket's slice). A gradient of another dtype
makes the run path step aside before it writes or clears anything.

Run without processes: a plain object carries the state the two paths read.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mfsdp2.groups.grad_reduction import GradientReduction
from mfsdp2.memory.layout import plan_layout

SHAPES = [(5, 3), (7,), (0, 4), (3, 6), (2,), (4, 5)]
DIMS = [0, 0, 0, 1, 0, 1]


class _Group:
    """The state the packing paths read: layout, unsharded params, TP specs, unsynced state."""

    def __init__(self, world_size: int, dtype=torch.float32) -> None:
        self.layout = plan_layout(SHAPES, world_size, align=4, dims=DIMS)
        self.unsharded_params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES]
        self.tp_specs = [None] * len(SHAPES)
        self.unsynced_grad = None
        self.unsynced_flags = []

    def set_grads(self, present, seed: int, dtype=torch.float32) -> None:
        gen = torch.Generator().manual_seed(seed)
        for up, s, d, has in zip(self.unsharded_params, SHAPES, DIMS, present):
            if not has:
                up.grad = None
                continue
            g = torch.randn(s, generator=gen)
            if d != 0:  # autograd's gradient of a dim-d sharded parameter has its strided layout
                g = g.movedim(d, 0).contiguous().movedim(0, d)
            up.grad = g.to(dtype)


def _buffer(n: int, offset: int) -> torch.Tensor:
    # NaN-filled: any element neither path writes shows up as a difference.
    return torch.full((n + offset + 3,), float("nan"))[offset : offset + n]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("offset", [0, 5])
def test_run_packing_writes_the_bytes_of_per_parameter_packing(world_size, offset):
    group = _Group(world_size)
    n = group.layout.total_numel
    assert group.layout.padding_numel > 0 or world_size == 1
    for k, present in enumerate(itertools.product([True, False], repeat=len(SHAPES))):
        group.set_grads(present, seed=k)
        want = _buffer(n, offset)
        flags_want = GradientReduction._pack_each(group, want, False)
        group.set_grads(present, seed=k)
        got = _buffer(n, offset)
        flags_got = GradientReduction._pack_runs(group, got)
        assert flags_got == flags_want == list(present)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), present  # bit for bit
        assert all(up.grad is None for up in group.unsharded_params)


def test_a_gradient_of_another_dtype_leaves_everything_to_the_per_parameter_path():
    group = _Group(2, dtype=torch.float64)  # compute dtype float64, reduce dtype float32
    group.set_grads([True] * len(SHAPES), seed=0, dtype=torch.float64)
    buf = _buffer(group.layout.total_numel, 0)
    assert GradientReduction._pack_runs(group, buf) is None
    assert torch.isnan(buf).all()  # nothing written
    assert all(up.grad is not None for up in group.unsharded_params)  # nothing cleared
