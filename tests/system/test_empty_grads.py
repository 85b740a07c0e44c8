"""Every rank has a gradient for every parameter that got one on any rank, even where it holds
no rows of it (an empty DTensor local tensor), as torch FSDP2 does.

Why it matters: user code that walks the gradients issues collectives per gradient
(``torch.nn.utils.clip_grad_norm_`` reduces a norm over the DTensor grads), so ranks that skip a
``None`` grad issue different collectives than the others (gloo aborts: "Received data size
doesn't match"); ``GradScaler`` unscaling and loops over ``p.grad.to_local()`` crash on ``None``.

Checked against an unsharded float64 reference clipped the same way (relative 1e-10: float64
rounding of sums over a few dozen terms, nothing else differs), against torch FSDP2 on the same
model and data in the same rank process, and -- for the claim that once justified ``None`` --
torch's multi-tensor optimizers stepped with and without empty parameters, bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from mfsdp2 import fully_shard

from .._dist import run_ranks
from ..models import assert_close_rel, batch, build, local_grad_rows, loss_fn

WS = 4
GLOBAL_BATCH = 8


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _clip_run(rank, ws, strategy):
    torch.manual_seed(0)
    template = build("tiny").double()
    mesh = init_device_mesh("cpu", (ws,))
    x, y = batch(0, GLOBAL_BATCH, 3)
    x, y = x.double(), y.double()
    n = GLOBAL_BATCH // ws
    mine = slice(rank * n, (rank + 1) * n)

    # Unsharded reference: the global batch's mean loss, clipped.
    ref = copy.deepcopy(template)
    loss_fn(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_grads = {k: p.grad.clone() for k, p in ref.named_parameters()}

    model = copy.deepcopy(template)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, sharding_strategy=strategy)
    fully_shard(model, mesh=mesh, sharding_strategy=strategy)
    loss_fn(model(x[mine]), y[mine]).backward()
    empty, missing = [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            missing.append(name)
        elif p.to_local().numel() == 0:
            empty.append(name)
            assert p.grad.to_local().shape == p.to_local().shape, name
    assert not missing, f"rank {rank}: parameters without a gradient: {missing}"
    # Every rank issues the same collectives now; before, ranks without rows skipped grads.
    norm = _full(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    assert_close_rel(norm.reshape(()), ref_norm.reshape(()), "total norm", rel=1e-10)
    for name, p in model.named_parameters():
        start, rows = local_grad_rows(p)
        want = ref_grads[name][start : start + rows.shape[0]]
        assert_close_rel(rows, want, f"clipped grad of {name}", rel=1e-10)
    # An optimizer step with a multi-tensor implementation over empty and non-empty params.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    opt.step()
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_rel(p.full_tensor(), q.detach(), f"stepped {name}", rel=1e-10)

    # torch FSDP2 on the same model and data: it too gives every rank a (possibly empty) grad.
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    theirs = copy.deepcopy(template)
    for b in theirs.blocks:
        torch_fully_shard(b, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    loss_fn(theirs(x[mine]), y[mine]).backward()
    assert all(p.grad is not None for p in theirs.parameters()), "torch FSDP2 gives every rank a grad"
    their_norm = _full(torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0))
    assert_close_rel(norm.reshape(()), their_norm.reshape(()), "total norm vs torch FSDP2", rel=1e-10)
    for (name, q) in theirs.named_parameters():  # torch.chunk rows: rank r's start is the sum before it
        sizes = [len(c) for c in torch.arange(q.shape[0]).chunk(ws)] + [0] * ws
        start = sum(sizes[:rank])
        local = q.grad.to_local()
        assert local.shape[0] == sizes[rank], (name, local.shape, sizes)
        assert_close_rel(local, ref_grads[name][start : start + local.shape[0]], f"FSDP2's clipped grad of {name}",
                         rel=1e-10)
    return empty


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_every_rank_gets_a_grad_and_clip_grad_norm_matches(strategy):
    empties = run_ranks(_clip_run, WS, strategy)
    assert any(empties), "the tiny model should leave some rank without rows of some parameter"


@pytest.mark.parametrize(
    "kind, flags",
    [("adamw", {"foreach": True}), ("adamw", {"fused": True}), ("sgd", {"foreach": True}), ("sgd", {"fused": True})],
)
def test_multi_tensor_optimizers_are_not_disturbed_by_empty_params(kind, flags):
    """The reason once given for ``grad = None`` on empty pieces ("fused multi-tensor optimizers
    handed empty tensors corrupt their neighbours' updates") does not hold on this torch: the
    same optimizer with and without empty parameters updates the others bitwise alike."""
    shapes = [(4, 3), (0, 3), (5,), (0,), (2, 2)]

    def run(with_empty):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        grads = [torch.randn(s, generator=gen) for s in shapes]
        used = [p for p in params if with_empty or p.numel()]
        make = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
        extra = {"weight_decay": 0.1} if kind == "adamw" else {"momentum": 0.9}
        opt = make(used, lr=0.1, **extra, **flags)
        for step in range(3):
            for p, g in zip(params, grads):
                if any(p is u for u in used):
                    p.grad = g * (step + 1)
            opt.step()
        return [p.detach() for p in params if p.numel()]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
