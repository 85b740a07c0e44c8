"""Fail-fast: a rank that dies, hangs or issues different collectives makes the waiting ranks
raise a CollectiveError naming the collective, unit and step within the configured timeout."""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import mfsdp2
from mfsdp2 import fully_shard

from .._dist import run_ranks
from ..models import build

TIMEOUT = 3.0


def _scenario(rank, ws, what):
    mfsdp2.set_collective_timeout(TIMEOUT)
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net")
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(2, 12)
    model(x).sum().backward()  # step 0 runs everywhere
    if rank == 1:
        if what == "dies":
            return "left"  # this rank exits: its process group goes away
        time.sleep(3 * TIMEOUT)  # "hangs"
        return "slept"
    t0 = time.monotonic()
    try:
        model(x).sum().backward()
        return ("no error", time.monotonic() - t0)
    except mfsdp2.CollectiveError as e:
        return (str(e), time.monotonic() - t0)
    finally:
        mfsdp2.set_collective_timeout(None)


@pytest.mark.parametrize("what", ["dies", "hangs"])
def test_waiting_ranks_fail_with_the_unit_and_step_named(what):
    res = run_ranks(_scenario, 2, what, timeout=120)
    msg, took = res[0]
    assert "step 1" in msg and "unit" in msg and "did not finish" in msg, msg
    assert took < TIMEOUT + 5, took  # within the timeout (plus scheduling slack)
    assert res[1] == ("left" if what == "dies" else "slept")


# Ranks that issue *different* collectives of different sizes: gloo checks the received size
# inside its own threads and calls std::terminate on a mismatch, which no Python code can catch.
# set_collective_checks(True) compares the collectives first (the test below).


class _Branchy(torch.nn.Module):
    """A rank can skip a block (as when its inputs take another branch through the model)."""

    def __init__(self):
        super().__init__()
        self.model = build("net")
        self.blocks = self.model.blocks
        self.skip = False

    def forward(self, x):
        h = self.model.inp(x)
        for i, b in enumerate(self.blocks):
            if not (self.skip and i == 1):
                h = b(h)
        return self.model.head(h)


def _branch(rank, ws):
    mfsdp2.set_collective_timeout(TIMEOUT)
    mfsdp2.set_collective_checks(True)
    try:
        mesh = init_device_mesh("cpu", (ws,))
        model = _Branchy()
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(2, 12)
        model(x).sum().backward()  # step 0 runs everywhere
        model.skip = rank == 1
        try:
            model(x).sum().backward()
            return "no error"
        except mfsdp2.CollectiveError as e:
            return str(e)
    finally:
        mfsdp2.set_collective_timeout(None)
        mfsdp2.set_collective_checks(False)


def test_collective_checks_name_what_each_rank_was_about_to_issue():
    """With set_collective_checks(True) the ranks compare each collective before issuing it: a rank
    that skipped a unit makes *every* rank raise, naming each rank's collective, instead of gloo
    terminating the process on mismatched sizes."""
    msgs = run_ranks(_branch, 2, timeout=120)
    for m in msgs:
        assert "about to issue different collectives" in m, msgs
        assert "rank 0:" in m and "rank 1:" in m and "blocks.1" in m, msgs
