"""A step whose backward runs in several ``backward()`` calls.

Large-vocabulary trainers back-propagate a chunked cross-entropy chunk by chunk through the output
head, then the rest of the model with ``h.backward(h_det.grad)``; others call
``loss1.backward(retain_graph=True); loss2.backward()`` or back-propagate two forwards' losses
separately. Each ``backward()`` runs its own final callback. It used to end the whole step: the
root unit (owning the embedding, whose inputs are token ids, so no post-backward hook of its own)
lost its reduction in the later calls and its gradient stayed 0 (FSDP2: 5.8e-2).

Float64 at world size 2. References: the unsharded model doing the same calls on the whole batch,
and torch FSDP2 doing them in its own rank processes (compared through saved full tensors: in one
process, once FSDP2 built its ``Shard(0)`` parameters, DTensor hands our ``from_local(...,
[RowShard])`` an equal plain ``Shard(0)`` -- see test_meta_init.py -- so same-process comparison
is unreliable).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks
from ..models import Block, assert_close_rel

WS, STEPS, B, T, V = 2, 3, 4, 6, 32
REL = 1e-10
SCENARIOS = ("chunked", "retain_graph", "two_forwards")


class LM(nn.Module):
    """Root-owned embedding and final norm, one unit per block, the output head its own unit."""

    def __init__(self, d: int = 16, hidden: int = 24, n: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, d)
        self.layers = nn.ModuleList(Block(d, hidden) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, V, bias=False)

    def forward(self, tokens, hidden_only: bool = False):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return h if hidden_only else self.output(h)


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (2, B, T), generator=g), torch.randint(0, V, (2, B, T), generator=g)


def _one_step(model, kind: str, tokens, targets, n_total: int):
    """The same calls for every implementation; losses are sums over tokens / global count."""

    def ce(logits, tgt):
        return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), reduction="sum") / n_total

    if kind == "chunked":
        h = model(tokens[0], hidden_only=True)
        h_det = h.detach().requires_grad_()
        flat, tgt = h_det.reshape(-1, h.shape[-1]), targets[0].reshape(-1)
        for c in torch.arange(flat.shape[0]).chunk(3):
            ce(model.output(flat[c]), tgt[c]).backward()
        h.backward(h_det.grad)
    elif kind == "retain_graph":
        out = model(tokens[0])
        ce(out, targets[0]).backward(retain_graph=True)
        (0.1 * out.pow(2).sum() / n_total).backward()
    else:  # two forwards, two backward() calls
        l1 = ce(model(tokens[0]), targets[0])
        l2 = ce(model(tokens[1]), targets[1])
        l1.backward()
        l2.backward()


def _run(model, kind, rank, ws, grad_of, value_of):
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    grads = None
    for step in range(STEPS):
        tokens, targets = _data(step)
        n = B // ws
        sl = slice(rank * n, (rank + 1) * n)
        # Per-rank sums over the global token count, averaged over ranks by the runtime: x ws.
        _one_step(model, kind, tokens[:, sl], targets[:, sl], B * T // ws)
        if step == 0:
            grads = {k: grad_of(p) for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return grads, {k: value_of(p) for k, p in model.named_parameters()}


def _reference(kind: str):
    torch.manual_seed(0)
    model = LM().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    grads = None
    for step in range(STEPS):
        tokens, targets = _data(step)
        _one_step(model, kind, tokens, targets, B * T)
        if step == 0:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return grads, {k: p.detach().clone() for k, p in model.named_parameters()}


def _rowshard_full(t, like):
    """Full value of an mfsdp2 parameter (or its grad's rows) with plain collectives."""
    (pl,) = like.placements
    local = (t._local_tensor.detach() if t is not None
             else like._local_tensor.detach().new_zeros(like._local_tensor.shape))
    return pl._to_replicate_tensor(local, like.device_mesh, 0, like.shape).clone()


def _rank(rank, ws, lib):
    if lib == "torch":
        from torch.distributed.fsdp import fully_shard

        grad_of = lambda p: p.grad.full_tensor().clone()  # noqa: E731
        value_of = lambda p: p.full_tensor().detach().clone()  # noqa: E731
    else:
        from mfsdp2 import fully_shard

        grad_of = lambda p: _rowshard_full(p.grad, p)  # noqa: E731
        value_of = lambda p: _rowshard_full(p, p)  # noqa: E731
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    base = LM().double()
    out = {}
    for kind in SCENARIOS:
        model = copy.deepcopy(base)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model.output, mesh=mesh)
        fully_shard(model, mesh=mesh)
        out[kind] = _run(model, kind, rank, ws, grad_of, value_of)
    return out


@functools.lru_cache(maxsize=None)
def _results(lib: str):
    return run_ranks(_rank, WS, lib)


@pytest.mark.parametrize("kind", SCENARIOS)
def test_every_backward_call_reduces_like_unsharded_and_fsdp2(kind):
    ref_grads, ref_params = _reference(kind)
    assert ref_grads["tok_embeddings.weight"].abs().max() > 1e-3  # the root's gradient is not tiny
    for lib in ("mfsdp2", "torch"):
        for rank, res in enumerate(_results(lib)):
            grads, params = res[kind]
            for k in ref_grads:
                assert_close_rel(grads[k], ref_grads[k], f"{lib} rank {rank} grad {k}", rel=REL)
                assert_close_rel(params[k], ref_params[k], f"{lib} rank {rank} param {k}", rel=REL)
    for ours, theirs in zip(_results("mfsdp2"), _results("torch")):  # and directly against FSDP2
        for a, b in zip(ours[kind], theirs[kind]):
            for k in b:
                assert_close_rel(a[k], b[k], f"mfsdp2 vs FSDP2 {k}", rel=REL)
