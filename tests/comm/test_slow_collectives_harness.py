"""The late-collectives harness itself, on the CPU: the logic its CUDA branch runs (staging on the
launching stream, the gate, the worker's delay and order, the copy back, NCCL's work semantics)
with simulated streams (``tests/_late_streams.SimStreams``) standing for CUDA streams, two gloo
ranks doing the real collectives. The GPU run of the same code is in tests/comm/test_slow_collectives.py.

Each hazard the harness exists for is shown to be *caught*: a consumer without the stream wait, a
side stream that does not wait for the producer before the collective reads, a block handed to
another buffer before the wait, an input overwritten (by another stream or the host) before the
collective's late turn, and an allocator block freed before the wait (poisoned) all see wrong data
every time -- on simulated streams and on gloo's own path for CPU tensors; the correct sequence,
and a write ordered after the collective on its own stream, see the right data. And the host
never blocks: a stream-ordered call returns before the data moved. PREMUL_SUM, which gloo lacks,
is emulated exactly.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from .._dist import run_ranks
from mfsdp2.memory.allocator import DynamicAllocator

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
                sim.run(lambda: time.sleep(4 * DELAY))  # the producer is busy ...
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

            # 8. an input overwritten after the call: by another stream that did not wait for the
            # collective, by the host, by another stream after the wait, by the launching stream
            # itself (ordered after the collective, as a kernel behind it)
            for who in ("other_stream", "host", "other_stream_after_wait", "same_stream"):
                src = mine.clone()
                out = torch.zeros(4 * ws)
                with sim.stream(side):
                    dist.all_gather_into_tensor(out, src)
                    if who == "same_stream":
                        sim.run(lambda: src.fill_(9.0))
                    ev = sim.record()
                if who == "other_stream":
                    sim.run(lambda: src.fill_(9.0))
                elif who == "host":
                    src.fill_(9.0)
                elif who == "other_stream_after_wait":
                    sim.stream_wait(ev)
                    sim.run(lambda: src.fill_(9.0))
                sim.stream_wait(ev)
                got = read(out)
                sim.synchronize()
                res[f"overwritten_{who}"] = got[0]

            # 9. a reduce-scatter input from the runtime's allocator, freed before / after the wait
            alloc = DynamicAllocator()
            for after_wait in (True, False):
                key = ("grad", "unit", after_wait)
                grad = alloc.allocate(key, 2 * ws, torch.float64, torch.device("cpu"))
                shard = torch.zeros(2, dtype=torch.float64)
                sim.run(lambda g=grad: g.copy_(torch.arange(2 * ws, dtype=torch.float64) + rank))
                sim.wait_stream(side, sim.compute)
                with sim.stream(side):
                    dist.reduce_scatter_tensor(shard, grad)
                    ev = sim.record()
                if after_wait:
                    sim.stream_wait(ev)
                alloc.free(key)  # poisoned on the compute stream, where the free happens
                sim.stream_wait(ev)
                got = read(shard)
                sim.synchronize()
                res[f"freed_after_wait_{after_wait}"] = got[0]

            # 10. PREMUL_SUM, emulated: the inputs times the factor, then SUM
            rs = torch.zeros(2, dtype=torch.float64)
            rs_in = torch.arange(2 * ws, dtype=torch.float64) * (rank + 1)
            with sim.stream(side):
                dist.reduce_scatter_tensor(rs, rs_in, op=dist._make_nccl_premul_sum(0.25))
                ev = sim.record()
            sim.stream_wait(ev)
            got = read(rs)
            sim.synchronize()
            res["premul_stream"] = got[0]
        res["issued"], res["waited_early"], res["overtaken"] = slow.issued, slow.waited_early, slow.overtaken
        res["poisoned"] = slow.poisoned
        res.update(_cpu_scenarios(rank, ws))
    finally:
        sim.close()
    return res


def _cpu_scenarios(rank: int, ws: int) -> dict:
    """CPU tensors without streams (the path every CPU training test takes): the worker issues
    the collective late, and gloo reads the inputs then."""
    res: dict = {}
    with SlowCollectives(DELAY) as slow:
        mine = torch.full((4,), float(rank + 1))
        for overwrite in (False, True):  # the input overwritten by the host before the wait
            src, out = mine.clone(), torch.zeros(4 * ws)
            work = dist.all_gather_into_tensor(out, src, async_op=True)
            if overwrite:
                src.fill_(9.0)
            work.wait()
            res[f"cpu_overwritten_{overwrite}"] = out.clone()
        alloc = DynamicAllocator()
        for after_wait in (True, False):  # an allocator block freed before / after the wait
            key = ("grad", "unit", after_wait)
            grad = alloc.allocate(key, 2 * ws, torch.float64, torch.device("cpu"))
            grad.copy_(torch.arange(2 * ws, dtype=torch.float64) + rank)
            shard = torch.zeros(2, dtype=torch.float64)
            work = dist.reduce_scatter_tensor(shard, grad, async_op=True)
            if after_wait:
                work.wait()
            alloc.free(key)
            work.wait()
            res[f"cpu_freed_after_wait_{after_wait}"] = shard.clone()
        rs = torch.zeros(2, dtype=torch.float64)
        dist.reduce_scatter_tensor(rs, torch.arange(2 * ws, dtype=torch.float64) * (rank + 1),
                                   op=dist._make_nccl_premul_sum(0.25))
        res["premul_cpu"] = rs
        res["cpu_poisoned"] = slow.poisoned
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
def test_the_collective_reads_its_input_only_after_its_stream_reached_it(runs):
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


def _rs_expected(rank: int, scale: float = 1.0) -> torch.Tensor:
    full = sum(torch.arange(2 * WS, dtype=torch.float64) + q for q in range(WS)) * scale
    return full[2 * rank : 2 * rank + 2]


@pytest.mark.slow
def test_an_input_overwritten_before_the_collectives_turn_is_read_overwritten(runs):
    """The collective reads its input at its (late) turn, not at the call: a write from another
    stream that did not wait, or from the host, lands first every time; a write ordered after
    the collective -- behind the wait, or behind the collective on its own stream -- does not."""
    for r in runs:
        assert torch.equal(r["overwritten_other_stream"], torch.full((4 * WS,), 9.0)), r["overwritten_other_stream"]
        assert torch.equal(r["overwritten_host"], torch.full((4 * WS,), 9.0)), r["overwritten_host"]
        assert torch.equal(r["overwritten_other_stream_after_wait"], _gathered(WS))
        assert torch.equal(r["overwritten_same_stream"], _gathered(WS))
        assert torch.equal(r["cpu_overwritten_True"], torch.full((4 * WS,), 9.0))
        assert torch.equal(r["cpu_overwritten_False"], _gathered(WS))


@pytest.mark.slow
def test_an_input_freed_before_the_wait_is_read_poisoned(runs):
    """A block the runtime's allocator takes back before the collective read it: the harness
    poisons it where it is freed, so the late collective reduces NaN, on streams and on gloo's
    path; freed after the wait, the result is right."""
    for rank, r in enumerate(runs):
        for path in ("", "cpu_"):
            assert torch.equal(r[f"{path}freed_after_wait_True"], _rs_expected(rank)), r[f"{path}freed_after_wait_True"]
            assert torch.isnan(r[f"{path}freed_after_wait_False"]).all(), r[f"{path}freed_after_wait_False"]
        assert r["poisoned"] == 2 and r["cpu_poisoned"] == 2


@pytest.mark.slow
def test_premul_sum_is_emulated_as_gloo_can_run_it(runs):
    for rank, r in enumerate(runs):
        full = sum(torch.arange(2 * WS, dtype=torch.float64) * (q + 1) * 0.25 for q in range(WS))
        for path in ("stream", "cpu"):
            assert torch.equal(r[f"premul_{path}"], full[2 * rank : 2 * rank + 2]), (path, r[f"premul_{path}"])


@pytest.mark.slow
def test_the_counters_prove_the_delay_mattered(runs):
    for r in runs:
        assert r["issued"] == 19, r["issued"]
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
