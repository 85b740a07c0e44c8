"""The test ranks' ports cannot collide under ``pytest -n`` (tests/_dist.py): the parent holds
the rendezvous store on a port the OS picked, and ``free_port`` (for launchers that bind the port
themselves) draws from a range of its own per xdist worker."""

from __future__ import annotations

import socket

import pytest

from .._dist import held_store, port_range, worker_index


def test_worker_ranges_are_disjoint_and_below_the_ephemeral_range():
    assert worker_index({"PYTEST_XDIST_WORKER": "gw0"}) == 0
    assert worker_index({"PYTEST_XDIST_WORKER": "gw13"}) == 13
    assert worker_index({}) == -1
    ranges = [set(port_range(i)) for i in range(-1, 29)]
    assert all(a.isdisjoint(b) for i, a in enumerate(ranges) for b in ranges[i + 1 :])
    assert max(max(r) for r in ranges) < 32768  # Linux hands out ephemeral ports from 32768


def test_a_held_store_keeps_its_port():
    store = held_store(timeout_s=10)
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))  # nobody else can take it while the store lives
    del store


def _rank1_dies(rank, ws):
    import os
    import time

    if rank == 1:
        os._exit(3)  # no exception, no report: as a C++ crash or glibc's abort leaves it
    time.sleep(60)  # rank 0 would wait on rank 1 in a collective
    return rank


def test_a_rank_that_dies_without_a_result_fails_the_launch_at_once():
    """run_ranks notices a rank process that exited without reporting instead of waiting out its
    timeout (a crashed rank otherwise costs the whole timeout, 600 s for the slow tests)."""
    import time

    import pytest

    from .._dist import run_ranks

    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 exited with code 3 without a result"):
        run_ranks(_rank1_dies, 2, timeout=120)
    assert time.monotonic() - t0 < 45


def _crash_at_teardown(rank, ws):
    """A rank whose work finished and whose process then aborts while tearing the group down
    (as gloo sometimes does at exit), with a result large enough that the queue's feeder thread
    is still writing it when ``put`` returns."""
    import os

    import torch
    import torch.distributed as dist

    dist.destroy_process_group = os.abort  # what the rank's teardown calls next
    return torch.full((4 << 20,), float(rank))


def test_a_rank_that_crashes_after_its_result_still_delivers_it():
    """The ranks flush their result into the pipe before the teardown, so a crash there keeps the
    result the test checks; the launch reports the crash as a warning naming the ranks."""
    import torch

    from .._dist import run_ranks

    with pytest.warns(RuntimeWarning, match=r"exited abnormally after reporting their results .*\(0, -6\), \(1, -6\)"):
        out = run_ranks(_crash_at_teardown, 2, timeout=120)
    assert [bool(torch.all(t == r)) for r, t in enumerate(out)] == [True, True]
