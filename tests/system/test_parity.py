"""Training parity with a single-process unsharded reference (float64, 10 steps, REL_F64: see
tests/models.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import FSDPModule, fully_shard
from mfsdp2.base import compat

from .._dist import run_ranks
from ..models import (
    F64, REL_F64, assert_close_rel, assert_losses_close, build, make_opt, reference_run, sharded_train_step,
)

STEPS = 10
GLOBAL_BATCH = 8


def _train(rank, ws, kind, opt_kind, wrap):
    mesh = init_device_mesh("cpu", (ws,))
    model = build(kind, dtype=F64)
    if wrap == "blocks+root":
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule)
    opt = make_opt(opt_kind, [p for p in model.parameters() if p.requires_grad])
    losses = [sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH) for step in range(STEPS)]
    full = {k: p.full_tensor() for k, p in model.named_parameters()}
    return losses, full


CASES = [
    # (world size, model, optimizer, wrapping)
    (1, "net", "adamw", "blocks+root"),
    (2, "net", "adamw", "blocks+root"),
    (2, "net", "sgd", "blocks+root"),
    (2, "net", "adamw", "root"),
    (2, "frozen", "adamw", "blocks+root"),
    pytest.param(4, "net", "adamw", "blocks+root", marks=pytest.mark.slow),
    pytest.param(4, "net", "sgd", "blocks+root", marks=pytest.mark.slow),
    pytest.param(4, "frozen", "sgd", "blocks+root", marks=pytest.mark.slow),
    pytest.param(4, "tiny", "adamw", "blocks+root", marks=pytest.mark.slow),
    pytest.param(4, "tiny", "sgd", "blocks+root", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("ws,kind,opt_kind,wrap", CASES)
def test_parity_with_unsharded_reference(ws, kind, opt_kind, wrap):
    ref_losses, ref_params = reference_run(kind, opt_kind, STEPS, GLOBAL_BATCH, dtype=F64)
    results = run_ranks(_train, ws, kind, opt_kind, wrap)
    for rank, (losses, full) in enumerate(results):
        assert_losses_close(losses, ref_losses, f"rank {rank}", REL_F64)
        assert set(full) == set(ref_params)
        for name, ref in ref_params.items():
            assert_close_rel(full[name], ref, f"rank {rank} {name}", REL_F64)
    # The reference must actually have moved, or the comparison proves nothing.
    assert ref_losses[-1] < ref_losses[0]


def _llama_losses(rank, ws, steps):
    import torch.nn.functional as F

    from mfsdp2.models.llama import LlamaConfig, SyntheticTokens, Transformer, rank_slice

    cfg = LlamaConfig.tiny()
    torch.manual_seed(0)
    model = Transformer(cfg).to(F64)
    if ws > 0:
        mesh = init_device_mesh("cpu", (ws,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data = SyntheticTokens(cfg.vocab_size, seed=7)
    losses = []
    for step in range(steps):
        x, y = data.batch(step, 4, cfg.max_seq_len)
        if ws > 0:
            x, y = rank_slice(x, rank, ws), rank_slice(y, rank, ws)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if ws > 0:
            dist.all_reduce(t)
            t /= ws
        losses.append(t.item())
    params = {k: (p.full_tensor() if ws > 0 else p.detach().clone()) for k, p in model.named_parameters()}
    return losses, params


def test_llama_tiny_parity():
    """Embedding + rotary GQA attention + RMSNorm + SwiGLU (the demo's model) at world size 2."""
    torch.set_num_threads(1)
    ref_losses, ref_params = _llama_losses(0, 0, STEPS)
    (losses, full), _ = run_ranks(_llama_losses, 2, STEPS)
    assert_losses_close(losses, ref_losses, "llama", REL_F64)
    for name, ref in ref_params.items():
        assert_close_rel(full[name], ref, name, REL_F64)
    assert ref_losses[-1] < ref_losses[0]


def _int_reshard(rank, ws, k):
    """reshard_after_forward=k: backward gathers only inside blocks of k ranks."""
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=F64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=k)
    fully_shard(model, mesh=mesh)
    opt = make_opt("adamw", model.parameters())
    sizes = []
    name = compat.all_gather_name()  # all_gather_single, or all_gather_into_tensor before torch 2.13
    orig = getattr(dist, name)

    def spy(out, inp, group=None, async_op=False):
        sizes.append(dist.get_world_size(group))
        return orig(out, inp, group=group, async_op=async_op)

    setattr(dist, name, spy)
    losses = []
    try:
        for step in range(STEPS):
            sizes.clear()
            losses.append(sharded_train_step(model, opt, step, rank, ws, GLOBAL_BATCH))
    finally:
        setattr(dist, name, orig)
    full = {k_: p.full_tensor() for k_, p in model.named_parameters()}
    return losses, full, sorted(sizes)


@pytest.mark.slow
def test_reshard_after_forward_int_gathers_inside_rank_blocks():
    ref_losses, ref_params = reference_run("net", "adamw", STEPS, GLOBAL_BATCH, dtype=F64)
    results = run_ranks(_int_reshard, 4, 2)
    n_blocks = 3
    for rank, (losses, full, sizes) in enumerate(results):
        assert_losses_close(losses, ref_losses, f"rank {rank}", REL_F64)
        for name, ref in ref_params.items():
            assert_close_rel(full[name], ref, f"rank {rank} {name}", REL_F64)
        # Last step: root + blocks gathered over all 4 ranks in forward; blocks re-gathered in
        # backward inside their block of 2 ranks only.
        assert sizes == [2] * n_blocks + [4] * (n_blocks + 1), sizes


class _Routed(torch.nn.Module):
    """Mixture-of-experts in miniature: each sample goes to one expert, chosen by its sign, so an
    expert can get no tokens on one rank and some on another (its grad exists on some ranks only)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = self.inp(x)
        route = 2 - (x[:, 0] > 0).long() - (x[:, 1] > 2).long()  # expert 0 (rows on rank 0) is rare
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().flatten()
            if idx.numel():  # like HF MoE blocks: experts without tokens do not run at all
                out = out.index_add(0, idx, expert(h[idx]))
        return self.head(torch.relu(out + h)).squeeze(-1)


def _routed_data(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 4, generator=g)
    x[4:, 1] = 3.0 if step % 2 else -3.0  # rank 1's half: expert 0 only on odd steps
    return x, torch.randn(8, generator=g)


def _routed_train(rank, ws, steps):
    torch.manual_seed(0)
    model = _Routed().to(F64)
    if ws:
        mesh = init_device_mesh("cpu", (ws,))
        # The experts stay inside one unit (as in a decoder layer): a unit that runs on some ranks
        # only would issue its all-gather on those ranks only.
        fully_shard(model, mesh=mesh)
        model.set_reduce_scatter_unused_params(True)  # ranks use different experts (as FSDP2 requires)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        x, y = (t.to(F64) for t in _routed_data(step))
        n = 8 // max(ws, 1)
        if ws:
            x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: (p.full_tensor() if ws else p.detach().clone()) for k, p in model.named_parameters()}


def test_parameters_used_on_some_ranks_only_train_like_the_reference():
    """An expert that gets tokens on rank 1 only has a gradient there; the reduced gradient is
    nonzero on every rank's rows, so every rank must step it (a rank that left its grad None would
    never update its rows of that expert)."""
    torch.set_num_threads(1)
    ref = _routed_train(0, 0, 4)
    for full in run_ranks(_routed_train, 2, 4):
        for k, r in ref.items():
            assert_close_rel(full[k], r, k, REL_F64)
