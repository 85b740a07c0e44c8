"""The gradient-view cache (mfsdp2/groups/grad_views.py) re-points its cached tensors by a view
geometry (offset from the main gradient's start, size, stride) read once per parameter. These
tests fail if the cache reused anything that a new main gradient changes:

* a re-pointed view must land on the *new* main gradient's memory (a new block, a block at a
  storage offset -- the full-gradient strategies' slice), with its rows' values;
* a main gradient of another length must have its geometry read again, one that is not
  contiguous its rows read afresh;
* a main gradient of another dtype must get new tensors, never old ones re-pointed (a local
  tensor's dtype is fixed: re-pointing it would reinterpret the bytes);
* a view somebody else holds past the release keeps its memory and values.

Run without processes: a plain holder object stands in for the gradient DTensor (the cache only
reads its ``_local_tensor``).
"""

from __future__ import annotations

import torch

from mfsdp2.groups.grad_views import GradViews

# Two "parameters" in a flat main gradient: a 2x3 one after two elements, a 4-element one after it.
SHAPES = [(2, 3), (4,)]


class _Grad:
    """Stands in for a gradient DTensor: the cache reads and re-points ``_local_tensor``."""

    def __init__(self, local: torch.Tensor) -> None:
        self._local_tensor = local


def _rows(mg: torch.Tensor, i: int) -> torch.Tensor:
    # The group's view of parameter i's rows: offsets proportional to the main gradient's length,
    # so a main gradient of another length puts them elsewhere.
    start = 2 if i == 0 else mg.numel() // 2
    n = 6 if i == 0 else 4
    return mg[start : start + n].view(SHAPES[i])


def _make(local: torch.Tensor, i: int) -> _Grad:
    return _Grad(local)


def _expose(views: GradViews, mg: torch.Tensor) -> list:
    views.follow(mg)
    return [views.get(i, mg, _make, _rows) for i in range(len(SHAPES))]


def _check(grads: list, mg: torch.Tensor) -> None:
    for i, g in enumerate(grads):
        want = _rows(mg, i)
        local = g._local_tensor
        assert local.data_ptr() == want.data_ptr()
        assert local.untyped_storage()._cdata == mg.untyped_storage()._cdata
        assert local.shape == want.shape and local.stride() == want.stride()
        torch.testing.assert_close(local, want, rtol=0, atol=0)


def test_repointed_views_follow_a_new_block_and_its_storage_offset():
    views = GradViews(len(SHAPES))
    mg1 = torch.arange(16, dtype=torch.float32)
    first = _expose(views, mg1)
    _check(first, mg1)
    ids = [id(g) for g in first]
    del first  # only the cache holds them: the release empties them
    views.detach()
    assert all(views.cached(i)._local_tensor.numel() == 0 for i in range(len(SHAPES)))  # the block is not held
    # A new block at a storage offset (a slice of a bigger one, as the full-gradient strategies'
    # main gradient is), with other values.
    big = torch.arange(100, 140, dtype=torch.float32)
    mg2 = big[7:23]
    second = _expose(views, mg2)
    assert [id(g) for g in second] == ids  # re-pointed, not made anew
    _check(second, mg2)
    mg2.mul_(-1)  # writes through the main gradient are what the views read
    _check(second, mg2)


def test_a_main_gradient_of_another_length_reads_the_geometry_again():
    views = GradViews(len(SHAPES))
    ids = [id(g) for g in _expose(views, torch.zeros(16))]
    views.detach()
    mg = torch.arange(24, dtype=torch.float32)  # parameter 1 now starts at 12, not 8
    second = _expose(views, mg)
    assert [id(g) for g in second] == ids
    _check(second, mg)


def test_a_main_gradient_of_another_dtype_gets_new_views():
    views = GradViews(len(SHAPES))
    _expose(views, torch.zeros(16, dtype=torch.float32))
    views.detach()
    assert all(views.cached(i)._local_tensor.numel() == 0 for i in range(len(SHAPES)))  # emptied, float32
    mg = torch.arange(16, dtype=torch.float64)
    second = _expose(views, mg)
    assert all(g._local_tensor.dtype == torch.float64 for g in second)
    _check(second, mg)


def test_a_view_held_elsewhere_keeps_its_memory_and_values():
    views = GradViews(len(SHAPES))
    mg1 = torch.arange(16, dtype=torch.float32)
    first = _expose(views, mg1)
    kept = first[0]  # the user keeps p.grad past zero_grad
    del first
    views.detach()
    torch.testing.assert_close(kept._local_tensor, _rows(mg1, 0), rtol=0, atol=0)
    mg2 = torch.full((16,), 5.0)
    second = _expose(views, mg2)
    assert second[0] is not kept
    _check(second, mg2)
    torch.testing.assert_close(kept._local_tensor, _rows(mg1, 0), rtol=0, atol=0)


def test_a_live_main_gradient_replaced_without_release_gets_new_views():
    views = GradViews(len(SHAPES))
    mg1 = torch.arange(16, dtype=torch.float32)
    first = _expose(views, mg1)
    mg2 = torch.arange(16, 32, dtype=torch.float32)
    second = _expose(views, mg2)  # no detach: mg1 may still be in use, its views are left alone
    assert all(a is not b for a, b in zip(first, second))
    _check(first, mg1)
    _check(second, mg2)


def test_a_main_gradient_that_is_not_contiguous_gets_its_rows_read_afresh():
    views = GradViews(len(SHAPES))
    ids = [id(g) for g in _expose(views, torch.zeros(16))]
    views.detach()
    mg = torch.arange(32, dtype=torch.float32)[::2]  # 16 elements, stride 2: the geometry does not apply
    second = _expose(views, mg)
    assert [id(g) for g in second] == ids
    _check(second, mg)
