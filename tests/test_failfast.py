"""Fail-fast: a rank that dies, hangs or issues different collectives makes the waiting ranks
raise a CollectiveError naming the collective, unit and step within the configured timeout."""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import mfsdp2
from mfsdp2 import fully_shard

from ._dist import run_ranks
from .models import build

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


# Not covered: ranks that issue *different* collectives of different sizes. gloo checks the
# received size inside its own threads and calls std::terminate on a mismatch ("Received data
# size doesn't match expected size"), which no Python code can catch; run with
# TORCH_DISTRIBUTED_DEBUG=DETAIL to have torch compare collective fingerprints before each one.
