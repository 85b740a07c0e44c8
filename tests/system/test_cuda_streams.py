"""The CUDA-only stream ordering of ``Communicator._launch`` and ``CommHandle.wait``.

A collective launched on a side stream must first wait on the current stream (which may still be
writing its input), and ``wait()`` must make the current stream -- not the host -- wait on the
collective. Each test runs a control that drops the synchronisation and must see stale data, so
a GPU sleep too short to expose the race fails the test instead of making it vacuous.

Needs a GPU (skipped elsewhere): the streams and the collectives (NCCL, one rank) are CUDA's, run
in a fresh process per test (``tests/system/_cuda_process.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ._cuda_process import SLEEP_CYCLES, _dev, run_cuda

# Needs a CUDA GPU (NCCL, CUDA side streams); the gloo tests cover the CPU.
pytestmark = pytest.mark.cuda


def _launch_without_stream_wait(stream, fn):
    """Communicator._launch minus the side stream's wait on the current stream (the control)."""
    from mfsdp2.comm.communicator import CommHandle

    with torch.cuda.stream(stream):
        fn(False)
        ev = torch.cuda.Event()
        ev.record(stream)
    return CommHandle(event=ev)


def _side_stream_waits(collective: str):
    """The current stream sleeps, then writes the input; the launched fn reads it on the side stream."""
    from mfsdp2.comm.communicator import Communicator

    dev = _dev()
    comm = Communicator(dist.group.WORLD, dev)
    stream = comm.ag_stream if collective in ("copy", "all_gather") else comm.rs_stream
    assert stream is not None and stream != torch.cuda.current_stream(dev)
    n = 1 << 20
    src = torch.empty(n, device=dev)
    dst = torch.empty(n, device=dev)
    streams_seen = []
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def fn(async_op):
        streams_seen.append(torch.cuda.current_stream(dev))
        if collective == "copy":
            dst.copy_(src)
        elif collective == "all_gather":
            return ag(dst, src, group=comm.group, async_op=async_op)
        else:
            return rs(dst, src, op=dist.ReduceOp.AVG, group=comm.group, async_op=async_op)

    def trial(launch):
        src.fill_(1.0)
        dst.fill_(0.0)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # the current stream is busy ...
        src.fill_(7.0)  # ... and then writes what the side stream will read
        h = launch(stream, fn)
        h.wait()
        got = dst.clone()  # on the current stream, after wait()
        torch.cuda.synchronize()
        return got

    control = trial(_launch_without_stream_wait)
    real = trial(lambda s, f: comm._launch(s, f, "test"))
    assert all(s == stream for s in streams_seen), "fn did not run on the side stream"
    return bool((control == 7.0).all()), bool((real == 7.0).all()), bool((real == 1.0).any())


@pytest.mark.parametrize("collective", ["copy", "all_gather", "reduce_scatter"])
def test_cuda_side_stream_waits_on_current_stream(collective):
    control_ok, real_ok, real_stale = run_cuda(_side_stream_waits, collective)
    assert not control_ok, (
        "control without the stream wait saw fresh data: the race is not exposed, so this test "
        "could not catch a missing wait (raise SLEEP_CYCLES)"
    )
    assert real_ok and not real_stale, "the side stream read its input before the current stream wrote it"


def _handle_wait_orders_current_stream():
    """The launched fn writes on the side stream after a sleep; after wait() the current stream
    must see the write, and wait() must not have blocked the host."""
    from mfsdp2.comm.communicator import Communicator

    dev = _dev()
    comm = Communicator(dist.group.WORLD, dev)
    n = 1 << 20
    dst = torch.empty(n, device=dev)

    def fn(async_op):
        torch.cuda._sleep(SLEEP_CYCLES)
        dst.fill_(5.0)

    def trial(wait: bool):
        dst.fill_(0.0)
        torch.cuda.synchronize()
        h = comm._launch(comm.ag_stream, fn, "test")
        assert h.pending
        if wait:
            h.wait()
            assert not h.pending
        side_busy = not comm.ag_stream.query()  # the host returned before the side stream finished
        got = dst.clone()
        torch.cuda.synchronize()
        h.wait()  # idempotent
        return bool((got == 5.0).all()), side_busy

    control_fresh, _ = trial(wait=False)
    real_fresh, host_not_blocked = trial(wait=True)
    return control_fresh, real_fresh, host_not_blocked


def test_cuda_handle_wait_makes_current_stream_wait():
    control_fresh, real_fresh, host_not_blocked = run_cuda(_handle_wait_orders_current_stream)
    assert not control_fresh, "control without wait() saw the side stream's write: the race is not exposed"
    assert real_fresh, "after handle.wait() the current stream read the buffer before the side stream wrote it"
    assert host_not_blocked, "handle.wait() blocked the host: it should only order the current stream"
