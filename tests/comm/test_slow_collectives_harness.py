"""The late-collectives harness itself, on the CPU: the logic its CUDA branch runs (staging on the
launching stream, the gate, the worker's delay and order, the copy back, NCCL's work semantics)
with simulated streams (``tests/_late_streams.SimStreams``) standing for CUDA streams, two gloo
ranks doing the real collectives. The GPU run of the same code is in tests/comm/test_slow_collectives.py.

Each hazard the harness exists for is shown to be *caught*: a consumer without the stream wait, a
side stream that does not wait for the producer before the collective reads, and a block handed to
another buffer before the wait all see wrong data every time; the correct sequence sees the right
data. And the host never blocks: a stream-ordered call returns before the data moved.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from .._dist import run_ranks
from .._late_streams import SimStreams
from .._slow_collectives import SlowCollectives

DELAY = 0.05
WS = 2
pytestmark = pytest.mark.xdist_group("harness")  # one launch of ranks serves the module


def _gathered(ws: int) -> torch.Tensor:
    return torch.cat([torch.full((4,), float(r + 1)) for r in range(ws)])


def _scenarios(rank: int, ws: int) -> dict:
    sim = SimStreams()
    side, side2 = sim.new_stream("side"), sim.new_stream("side2")
    res: dict = {}
    mine = torch.full((4,), float(rank + 1))

    def read(t):
        box = []
        sim.run(lambda: box.append(t.clone()))
        return box

    try:
        with SlowCollectives(DELAY, streams=sim, stream_ordered=False) as slow:
            # 1. the NCCL pattern: side stream waits on compute, stream-ordered call, event, wait
            out = torch.zeros(4 * ws)
            sim.wait_stream(side, sim.compute)
            t0 = time.monotonic()
            with sim.stream(side):
                ret = dist.all_gather_into_tensor(out, mine)
                ev = sim.record()
            res["host_s"] = time.monotonic() - t0
            res["returned"] = ret
            sim.stream_wait(ev)
            got = read(out)
            sim.synchronize()
            res["with_wait"] = got[0]

            # 2. control: the consumer does not wait for the event
            out = torch.zeros(4 * ws)
            with sim.stream(side):
                dist.all_gather_into_tensor(out, mine)
            got = read(out)
            sim.synchronize()
            res["without_wait"], res["without_wait_later"] = got[0], out.clone()

            # 3. the side stream must wait for the producer before the collective reads
            for waits in (True, False):
                src = torch.full((4,), -1.0)
                out = torch.zeros(4 * ws)
                sim.run(lambda: time.sleep(2 * DELAY))  # the producer is busy ...
                sim.run(lambda: src.fill_(float(rank + 1)))  # ... then writes the input
                if waits:
                    sim.wait_stream(side, sim.compute)
                with sim.stream(side):
                    dist.all_gather_into_tensor(out, src)
                    ev = sim.record()
                sim.stream_wait(ev)
                got = read(out)
                sim.synchronize()
                res[f"producer_waited_{waits}"] = got[0]

            # 4. a block handed to another buffer: before the wait vs after it
            for after_wait in (True, False):
                out = torch.zeros(4 * ws)
                with sim.stream(side):
                    dist.all_gather_into_tensor(out, mine)
                    ev = sim.record()
                if after_wait:
                    sim.stream_wait(ev)
                sim.run(lambda: out.fill_(9.0))  # the new owner writes its data
                sim.synchronize()
                res[f"reused_after_wait_{after_wait}"] = out.clone()

            # 5. async_op=True: the work's wait() orders the current stream; the host goes on
            t = torch.arange(4, dtype=torch.float64) + rank
            work = dist.all_reduce(t, async_op=True)
            t0 = time.monotonic()
            work.wait()
            res["wait_host_s"] = time.monotonic() - t0
            got = read(t)
            sim.synchronize()
            res["all_reduce"] = got[0]
            res["completed"] = work.is_completed()

            # 6. several streams and kinds in flight: issued in call order, AVG emulated
            ag = torch.zeros(4 * ws)
            rs = torch.zeros(2, dtype=torch.float64)
            ar = torch.full((3,), float(rank + 1), dtype=torch.float64)
            rs_in = torch.arange(2 * ws, dtype=torch.float64) * (rank + 1)
            with sim.stream(side):
                dist.all_gather_into_tensor(ag, mine)
                e1 = sim.record()
            with sim.stream(side2):
                dist.reduce_scatter_tensor(rs, rs_in, op=dist.ReduceOp.AVG)
                e2 = sim.record()
            dist.all_reduce(ar, op=dist.ReduceOp.AVG)  # on the compute stream itself
            sim.stream_wait(e1)
            sim.stream_wait(e2)
            got = [read(ag), read(rs), read(ar)]
            sim.synchronize()
            res["mixed"] = [g[0] for g in got]

            # 7. point-to-point in both directions at once (a send's completion needs the peer's
            # receive, which the worker posts without waiting for the send)
            send = torch.full((3,), float(rank + 10))
            recv = torch.zeros(3)
            peer = 1 - rank
            works = [dist.isend(send, dst=peer), dist.irecv(recv, src=peer)]
            for w in works:
                w.wait()
            got = read(recv)
            sim.synchronize()
            res["p2p"] = got[0]
        res["issued"], res["waited_early"], res["overtaken"] = slow.issued, slow.waited_early, slow.overtaken
    finally:
        sim.close()
    return res


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_scenarios, WS)


@pytest.mark.slow
def test_stream_ordered_call_returns_at_once_and_the_data_arrives_behind_the_gate(runs):
    for r in runs:
        assert r["returned"] is None  # async_op=False on a stream: nothing to wait for, as NCCL
        assert r["host_s"] < DELAY / 2, r["host_s"]  # the host did not block on the data
        assert torch.equal(r["with_wait"], _gathered(WS))


@pytest.mark.slow
def test_a_consumer_without_the_wait_reads_stale_data(runs):
    for r in runs:
        assert torch.equal(r["without_wait"], torch.zeros(4 * WS)), "the missing wait went unseen"
        assert torch.equal(r["without_wait_later"], _gathered(WS))  # the data did arrive, late


@pytest.mark.slow
def test_the_collective_reads_its_input_at_the_launching_streams_position(runs):
    for rank, r in enumerate(runs):
        assert torch.equal(r["producer_waited_True"], _gathered(WS))
        # without the side stream's wait on the producer the collective read the old input
        assert torch.equal(r["producer_waited_False"], torch.full((4 * WS,), -1.0)), r["producer_waited_False"]


@pytest.mark.slow
def test_a_block_reused_before_the_wait_is_overwritten_by_the_late_collective(runs):
    for r in runs:
        assert torch.equal(r["reused_after_wait_True"], torch.full((4 * WS,), 9.0))
        assert torch.equal(r["reused_after_wait_False"], _gathered(WS)), "the early reuse went unseen"


@pytest.mark.slow
def test_work_wait_orders_the_stream_not_the_host(runs):
    for r in runs:
        assert r["wait_host_s"] < DELAY / 2, r["wait_host_s"]
        assert torch.equal(r["all_reduce"], torch.arange(4, dtype=torch.float64) * 2 + 1)
        assert r["completed"]


@pytest.mark.slow
def test_streams_and_kinds_in_flight_together(runs):
    for rank, r in enumerate(runs):
        ag, rs, ar = r["mixed"]
        assert torch.equal(ag, _gathered(WS))
        full = sum(torch.arange(2 * WS, dtype=torch.float64) * (q + 1) for q in range(WS)) / WS
        assert torch.equal(rs, full[2 * rank : 2 * rank + 2]), (rs, full)
        assert torch.equal(ar, torch.full((3,), 1.5, dtype=torch.float64))
        assert torch.equal(r["p2p"], torch.full((3,), float(1 - rank + 10)))


@pytest.mark.slow
def test_the_counters_prove_the_delay_mattered(runs):
    for r in runs:
        assert r["issued"] == 12, r["issued"]
        assert r["waited_early"] >= 1  # scenario 5 waited before the data moved
        assert r["overtaken"] >= 2  # scenarios 6 and 7 issued the next one before the data moved


def test_the_stream_ordered_persona_is_installed_and_removed():
    import mfsdp2.comm.communicator as comm

    real = comm.stream_ordered_backend
    assert not real("gloo", "cuda")
    with SlowCollectives(0.0, streams=SimStreams(), stream_ordered=True):
        assert comm.stream_ordered_backend("gloo", "cuda") and not comm.stream_ordered_backend("gloo", "cpu")
    assert comm.stream_ordered_backend is real
    with SlowCollectives(0.0, streams=SimStreams(), stream_ordered=False):
        assert comm.stream_ordered_backend is real
