"""CPU offload's host <-> device copies (``mfsdp2.memory.offload``): non-blocking where one side is CUDA and
the other page-locked, each followed by an event the host waits on before it touches the memory.

On this CPU machine the copies themselves are host copies (never non-blocking: no CUDA), so what
is checked here is the bookkeeping around them, with stand-in events: the decision, that a
recorded copy-in is waited before any optimizer step and at the end of backward, and that a
group's copy-out is waited before the host writes its main gradient again and before backward
returns. The copies on a GPU -- gradients complete when ``backward()`` returns although the GPU
runs behind -- are tests/system/test_cuda_parity.py's offload parity cases.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

from mfsdp2 import fully_shard
from mfsdp2.memory import offload

from .._dist import run_ranks
from ..models import F64, batch, build, loss_fn, make_opt


class _Event:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_copies_between_host_memories_block_and_record_nothing():
    src, dst = torch.arange(6.0), torch.zeros(6)
    assert not offload.nonblocking(dst, src)
    offload.copy_from_main(dst, src)
    assert torch.equal(dst, src) and not offload._host_reads
    back = torch.zeros(6)
    assert offload.copy_to_main(back, dst) is None and torch.equal(back, src)


def test_a_copy_in_in_flight_is_waited_before_an_optimizer_step():
    ev = _Event()
    offload._host_reads[torch.device("cuda", 0)] = ev
    offload._install_step_hook()
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    torch.optim.SGD([p], lr=0.1).step()
    assert ev.waited == 1 and not offload._host_reads
    offload.settle_host_reads()  # nothing left: a no-op
    assert ev.waited == 1


def _offloaded(rank, ws):
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=F64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    opt = make_opt("adamw", model.parameters())
    groups = [g for m in model.modules() if hasattr(m, "_mfsdp2_state") for g in m._mfsdp2_state.groups]
    waited = {}
    for step in range(2):
        x, y = batch(step, 8, 12, dtype=F64)
        pending = {}
        if step == 1:  # copies "in flight" from the last step, and one copy-in
            pending = {id(g): g.__setattr__("copy_out_event", _Event()) or g.copy_out_event for g in groups}
            reads = offload._host_reads[torch.device("cuda", 0)] = _Event()
        model.set_requires_gradient_sync(True)
        loss_fn(model(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]).backward()
        if step == 1:
            waited = {"copy_out": [pending[id(g)].waited for g in groups],
                      "left": [g.copy_out_event is not None for g in groups], "copy_in": reads.waited}
        opt.step()
        opt.zero_grad()
    return waited


def test_copy_outs_and_copy_ins_are_waited_by_the_end_of_backward():
    for w in run_ranks(_offloaded, 2):
        assert all(n == 1 for n in w["copy_out"]), w  # waited once: before the host wrote the grad
        assert not any(w["left"]), w
        assert w["copy_in"] == 1, w
