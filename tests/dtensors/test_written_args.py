"""Ops that update their arguments in place never update a temporary copy.

An in-place op (``p.add_``), an ``out=`` op and a multi-tensor optimizer kernel
(``_foreach_*_``, ``_fused_adam(w)_``, ``_fused_sgd_``, ``_fused_adagrad_``) write into tensors the
caller holds: parameters, gradients, optimizer states. If DTensor's dispatcher were asked to bring
such an argument to another row split, it would do so in a *new* local tensor, the kernel would
update that temporary, and the caller's tensor would keep its old value -- training silently
wrong (torch's fused AdamW on an mfsdp2 model left every parameter of units whose rows differed
from an earlier same-size tensor's unchanged). The rules checked here, each against the same op
on full tensors in float64 (exact: these kernels round the same on a piece as on the whole):

Float64 throughout. The CPU fused kernels round an element differently in their vector body and
their scalar tail (a fused multiply-add in one, not the other): a piece starting at another
offset than the whole tensor may differ by an ulp per operation. They do fewer than ten operations
per element per call, so results are compared to 1e-13 of the tensor's largest magnitude (float64's
u = 1.1e-16: ~1e-15 worst case, 100x slack); an update that went to a temporary leaves a
difference of lr * |grad| >= 1e-3.

* a multi-tensor op lines up the i-th tensors of its lists, not tensors of equal size across
  indices (our parameters of one shape in different units hold different rows);
* a written argument whose rows differ from what the op's other inputs would need is refused,
  naming the op and the argument;
* ``out=`` into one of our parameters with a result of other rows is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from mfsdp2 import fully_shard

from .._dist import run_ranks

_REL = 1e-13

# Same-shape weights in three units: the unit layouts give them different row splits.
_DIMS = [(4, 3), (3, 5), (5, 3), (3, 3), (3, 3), (3, 7), (7, 3), (3, 3)]


def _sharded(ws):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(i, o, bias=True) for i, o in _DIMS)).double()
    full = nn.Sequential(*(nn.Linear(i, o, bias=True) for i, o in _DIMS)).double()
    full.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (ws,))
    fully_shard(model[4], mesh=mesh)
    fully_shard(model[7], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, full, mesh


def _kernels(params, grads, states, full: bool):
    """Each fused / foreach kernel once over the lists (``states``: four per parameter)."""
    steps = [torch.tensor(1.0, dtype=torch.float64) for _ in params]
    m, v, s, mom = (list(x) for x in zip(*states))
    torch._fused_adamw_(params, grads, m, v, [], steps, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.1,
                        eps=1e-8, amsgrad=False, maximize=False)
    torch._fused_adam_(params, grads, m, v, [], steps, lr=0.05, beta1=0.8, beta2=0.9, weight_decay=0.0,
                       eps=1e-8, amsgrad=False, maximize=False)
    torch._fused_sgd_(params, grads, mom, weight_decay=0.01, momentum=0.9, lr=0.1, dampening=0.0,
                      nesterov=True, maximize=False, is_first_step=False)
    torch._fused_adagrad_(params, grads, s, [torch.tensor(1.0, dtype=torch.float64) for _ in params],
                          lr=0.1, lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False)
    torch._foreach_addcmul_(params, grads, m, value=-0.01)
    torch._foreach_lerp_(v, grads, 0.3)


def _multi_tensor_kernels(rank, ws):
    model, full, mesh = _sharded(ws)
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()
    full(x).square().sum().backward()
    params = [p for p in model.parameters()]
    fparams = [p for p in full.parameters()]
    with torch.no_grad():
        # States as optimizers make them: from their parameters (our rows), non-zero.
        states = [tuple(torch.full_like(p, 0.1 * (j + 1)) for j in range(4)) for p in params]
        fstates = [tuple(torch.full_like(p, 0.1 * (j + 1)) for j in range(4)) for p in fparams]
        _kernels(params, [p.grad for p in params], states, full=False)
        _kernels(fparams, [p.grad for p in fparams], fstates, full=True)
    rows = {n: (tuple(p.shape), p.placements[0].rows) for n, p in model.named_parameters()}
    wrong = []
    for (name, p), fp, st, fst in zip(model.named_parameters(), fparams, states, fstates):
        for what, a, b in [(name, p, fp)] + [(f"{name} state {j}", a, b) for j, (a, b) in enumerate(zip(st, fst))]:
            err = (a.full_tensor() - b).abs().max().item()
            if err > _REL * max(b.abs().max().item(), 1.0):
                wrong.append((what, err))
    return rows, wrong


@pytest.mark.slow
@pytest.mark.parametrize("ws", [2, 4])
def test_multi_tensor_kernels_update_every_parameter_and_state(ws):
    for rank, (rows, wrong) in enumerate(run_ranks(_multi_tensor_kernels, ws)):
        assert not wrong, f"rank {rank}: wrong after the kernels: {wrong}"
        # The hazard needs two tensors of one size with different rows.
        splits: dict = {}
        for shape, r in rows.values():
            splits.setdefault(shape, set()).add(r)
        assert any(len(s) > 1 for s in splits.values()), rows


def _written_mismatch(rank, ws):
    model, _, mesh = _sharded(ws)
    p = model[5].weight  # rows (0, 7) where torch.chunk gives (4, 3)
    model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    chunk = distribute_tensor(torch.ones(p.shape, dtype=torch.float64), mesh, [Shard(0)])  # torch.chunk rows
    before = chunk.full_tensor()
    outcomes = {}
    # A fused kernel whose state holds other rows than its parameter: the state is written.
    try:
        torch._fused_adamw_([p.detach()], [p.grad], [chunk], [torch.ones_like(p)], [],
                            [torch.tensor(1.0, dtype=torch.float64)], lr=0.1, beta1=0.9, beta2=0.99,
                            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        outcomes["fused_adamw_"] = "ran"
    except RuntimeError as e:
        outcomes["fused_adamw_"] = str(e)
    # A foreach in-place op whose self (written) holds torch.chunk rows: self's rows are kept, ours
    # are lined up to them (a read), and the result is the full op's.
    torch._foreach_add_([chunk], [p.detach()])
    outcomes["foreach_add_ chunk self"] = torch.equal(chunk.full_tensor(), before + p.full_tensor())
    # out= into our parameter with a result holding torch.chunk's rows.
    try:
        with torch.no_grad():
            torch.add(chunk, chunk, out=p)
        outcomes["add out="] = "ran"
    except RuntimeError as e:
        outcomes["add out="] = str(e)
    # out= into our parameter with a result of the same rows (torch.chunk's split happens to be
    # ours here): the value lands and the parameter keeps its RowShard label.
    q = model[3].weight
    src = distribute_tensor(torch.full(q.shape, 2.0, dtype=torch.float64), mesh, [Shard(0)])
    with torch.no_grad():
        torch.add(src, src, out=q)
    outcomes["add out= same rows"] = (type(q.placements[0]).__name__,
                                      torch.equal(q.full_tensor(), torch.full(q.shape, 4.0, dtype=torch.float64)))
    return outcomes, p.placements[0].rows


@pytest.mark.slow
def test_a_written_argument_with_other_rows_is_refused_not_copied():
    for outcomes, rows in run_ranks(_written_mismatch, 2):
        from mfsdp2.dtensors.placement import chunk_rows

        assert tuple(rows) != chunk_rows(sum(rows), 2), rows  # the case needs differing splits
        msg = outcomes["fused_adamw_"]
        assert "_fused_adamw_" in msg and "exp_avgs[0]" in msg and "temporary" in msg, msg
        assert outcomes["foreach_add_ chunk self"] is True
        msg = outcomes["add out="]
        assert "out=" in msg and "add" in msg, msg
        assert outcomes["add out= same rows"] == ("RowShard", True), outcomes
