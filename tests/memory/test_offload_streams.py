"""CPU offload's copies on their own streams (``mfsdp2.memory.offload``), checked on the CPU.

On CUDA with page-locked host memory, the copy of the main weights into a gather's input
(copy-in) and of a reduced gradient into host memory (copy-out) run on a copy stream, ordered
with events. Here the same code runs on simulated streams (``tests/_offload_streams.SimCopyOps``:
threads whose copies run late) and shows, for each hazard, that the ordering is needed and kept:

* a copy-in is issued on the copy-in stream and its reader's stream waits on its event; a reader
  that does not wait reads the old contents;
* the copy stream waits for what the current stream issued before (the data it copies is written
  there);
* a reduction output read by a copy-out is not handed to its next user before the copy read it
  (``offload.hold``); freed at once, the copy reads what the next user wrote;
* whole offloaded training runs (ZeRO-3, ZeRO-2, ZeRO-1, no_shard, accumulation without gradient
  sync) with every copy late are bit for bit the runs with plain copies (which
  tests/fsdp2_compat/test_offload.py compares with FSDP2), every copy on a copy stream, and the
  same runs whose readers skip the waits are not (persistent strategies: a ZeRO-3 copy nobody
  waited for would write a block already freed).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

from mfsdp2 import fully_shard
from mfsdp2.memory import offload

from .._dist import run_ranks
from .._late_streams import SimStreams
from .._offload_streams import SimCopyOps
from ..models import F64, batch, build, loss_fn, make_opt

CPU = torch.device("cpu")


@pytest.fixture
def sim():
    s = SimStreams()
    ops = SimCopyOps(s, delay=0.05)
    prev = offload.set_stream_ops(ops)
    try:
        yield s, ops
    finally:
        offload.set_stream_ops(prev)
        offload._host_reads.clear()
        offload._held.clear()
        s.close()


def _read_on(sim, stream, t):
    box = []
    with sim.stream(stream):
        sim.run(lambda: box.append(t.clone()))
    return box


@pytest.mark.parametrize("waits", [True, False])
def test_a_copy_in_runs_on_the_copy_stream_and_its_reader_waits(sim, waits):
    s, ops = sim
    side = s.new_stream("all-gather")
    src, dst = torch.arange(8.0), torch.zeros(8)
    event = offload.copy_from_main(dst, src)
    assert event is not None and ops.log[-1] == ("copy", "copy-in")
    if waits:
        offload.wait_copy(event, CPU, side)
        assert ops.log[-1] == ("wait", "all-gather")
    got = _read_on(s, side, dst)
    s.synchronize()
    assert offload._host_reads[CPU] is event  # settled before the host writes the main weights
    if waits:
        assert torch.equal(got[0], src)
    else:  # the reader ran before the late copy: the old contents
        assert torch.equal(got[0], torch.zeros(8)) and torch.equal(dst, src)


def test_the_copy_stream_waits_for_the_current_stream(sim):
    s, _ = sim
    src, dst = torch.full((4,), -1.0), torch.zeros(4)
    s.run(lambda: time.sleep(0.1))  # the producer is busy ...
    s.run(lambda: src.fill_(5.0))  # ... then writes what is copied
    event = offload.copy_to_main(dst, src)
    event.synchronize()
    assert torch.equal(dst, torch.full((4,), 5.0))


@pytest.mark.parametrize("held", [True, False])
def test_a_copy_outs_source_is_not_reused_before_the_copy_read_it(sim, held):
    s, _ = sim
    out, host = torch.full((4,), 3.0), torch.zeros(4)
    event = offload.copy_to_main(host, out)

    def free_and_reuse():  # the allocator hands the block to its next user on the current stream
        s.run(lambda: out.fill_(-7.0))

    owner = object()
    if held:
        offload.hold(owner, event, CPU, free_and_reuse)
        assert len(offload._held) == 1  # not yet: MAX_HELD
        offload.release_held(owner)  # the current stream waits on the copy, then the free
    else:
        free_and_reuse()
    event.synchronize()
    s.synchronize()
    assert torch.equal(host, torch.full((4,), 3.0 if held else -7.0))


def test_holding_is_bounded():
    """A further hold releases the oldest (after the current stream waited on its copy)."""
    released = []

    class _Done:
        def synchronize(self):
            pass

    prev = offload.set_stream_ops(SimCopyOps(None))
    try:
        for i in range(3):
            offload.hold(i, _Done(), CPU, lambda i=i: released.append(i))
        assert released == list(range(3 - offload.MAX_HELD))
        offload.release_held()
        assert released == [0, 1, 2] and not offload._held
    finally:
        offload.set_stream_ops(prev)


# -- whole runs ----------------------------------------------------------------------------------
STRATEGIES = ["optim_grads_params", "optim_grads", "optim", "no_shard"]
STEPS, ACCUM = 3, 2


def _train(rank, ws, strategy, ops):
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=F64)
    pol = CPUOffloadPolicy(pin_memory=False)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, offload_policy=pol, sharding_strategy=strategy)
    fully_shard(model, mesh=mesh, offload_policy=pol, sharding_strategy=strategy)
    opt = make_opt("adamw", model.parameters())
    groups = [g for m in model.modules() if hasattr(m, "_mfsdp2_state") for g in m._mfsdp2_state.groups]
    prev = offload.set_stream_ops(ops)
    losses = []
    try:
        for step in range(STEPS):
            x, y = batch(step, 8, 12, dtype=F64)
            x, y = x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]
            for j, (xm, ym) in enumerate(zip(x.chunk(ACCUM), y.chunk(ACCUM))):
                model.set_requires_gradient_sync(j == ACCUM - 1)
                loss = loss_fn(model(xm), ym)
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            losses.append(model(x).sum().item())  # an eval forward after the last step
        offload.settle_host_reads()
        params = {k: p.full_tensor().clone() for k, p in model.named_parameters()}
    finally:
        offload.set_stream_ops(prev)
        offload._held.clear()
        if ops is not None:
            ops.close()
    return losses, params, sum(g.copy_outs for g in groups)


def _compare(rank, ws):
    out = {}
    for strategy in STRATEGIES:
        ref_losses, ref_params, _ = _train(rank, ws, strategy, None)
        ops = SimCopyOps(None, delay=0.003)
        losses, params, copy_outs = _train(rank, ws, strategy, ops)
        copies_in = ops.log.count(("copy", "copy-in"))
        copies_out = ops.log.count(("copy", "copy-out"))
        stale = None
        if strategy != "optim_grads_params":
            # The control. Not for ZeRO-3: its copy-in writes a gathered block that a reshard
            # detaches from its storage, so a copy that nobody waited for writes freed memory.
            bad = SimCopyOps(None, delay=0.02, skip_waits=True)
            bad_losses, bad_params, _ = _train(rank, ws, strategy, bad)
            stale = bad_losses != ref_losses or any(not torch.equal(bad_params[k], ref_params[k]) for k in params)
        out[strategy] = {
            "same": losses == ref_losses and all(torch.equal(params[k], ref_params[k]) for k in params),
            "copies_in": copies_in,
            "copies_out": copies_out,
            "copy_outs": copy_outs,
            "waits": ops.log.count(("wait", "host")),
            "stale_without_waits": stale,
        }
    return out


def test_late_copies_give_the_same_runs_bit_for_bit():
    for rank, res in enumerate(run_ranks(_compare, 2)):
        for strategy, r in res.items():
            where = f"rank {rank}, {strategy}: {r}"
            assert r["same"], where
            assert r["copies_in"] > 0 and r["copies_out"] > 0, where
            # Every reduction landed by a copy-out: the first one after zero_grad overwrites (on
            # the copy stream), the accumulating ones add through a blocking host copy.
            assert 0 < r["copies_out"] <= r["copy_outs"], where
            assert r["waits"] >= r["copies_in"], where
            assert r["stale_without_waits"] is not False, where
