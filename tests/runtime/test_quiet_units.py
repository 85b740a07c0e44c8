"""Quiet passes (:mod:`mfsdp2.runtime.quiet_units`): units that gather nothing run their training
forward with no forward hooks, and their accumulator hooks run the post-backward.

Each graph trains a small model of one-module units three ways in one launch: with quiet passes (the
default), with them off (the hooked pass), and unsharded in float64. The quiet run must equal the
hooked run to the bit (same post-backwards, same buckets, same order), both must match the float64
reference, and the steady steps must really be quiet (the units' forward hooks detached while the
root's forward runs; ``ctx.quiet``). Graphs: a chain of blocks; a block run twice in one forward; a
block skipped in some steps; a unit one of whose parameters gets no gradient in some steps (its
countdown stays open: the final callback reduces it); non-reentrant and reentrant activation
checkpoints (recomputes run the attached hooks, which do nothing); a loss back-propagated in two
``backward()`` calls; gradient accumulation under ``no_sync``; a unit called on its own after the
root's backward (the hooks' full work, once its quiet pass ended); an exception inside a quiet
forward (hooks attached again, training goes on). The misuse checks of a registration still run: a
parameter replaced after the first forward is refused in a quiet pass too, and a user's forward hook
on a unit keeps the pass hooked, so the hook sees every call.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from .._dist import run_ranks

WIDTH = 8
STEPS = 4
GRAPHS = ("chain", "twice", "skip", "partial", "checkpoint", "reentrant", "two_backwards", "no_sync", "direct",
          "raises")


class _Pair(nn.Module):
    """Two Linears; ``b`` takes part only when ``use_b``: otherwise its parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.use_b = True

    def forward(self, x):
        return self.a(x) + self.b(x) if self.use_b else self.a(x)


class _Model(nn.Module):
    def __init__(self, graph: str):
        super().__init__()
        self.graph = graph
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH), _Pair(), nn.Linear(WIDTH, WIDTH)])
        self.head = nn.Linear(WIDTH, 1)  # the root's own parameters
        self.step = 0
        self.hooks_seen: list = []  # forward-hook counts of the units while the root's forward runs
        self.raise_now = False

    def forward(self, x):
        self.hooks_seen.append([len(b._forward_pre_hooks) + len(b._forward_hooks) for b in self.blocks])
        for i, b in enumerate(self.blocks):
            if self.graph == "skip" and i == 2 and self.step % 2:
                continue
            if self.graph in ("checkpoint", "reentrant") and i == 1:
                x = checkpoint(b, x, use_reentrant=self.graph == "reentrant")
            else:
                x = b(x)
            if self.graph == "twice" and i == 0:  # one unit run twice in a forward (weights reused)
                x = b(torch.tanh(x))
            x = torch.tanh(x)
            if self.raise_now and i == 1:
                raise RuntimeError("raised inside the forward")
        return self.head(x).square()


def _batch(step: int, rank: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, WIDTH, generator=g, dtype=torch.float64).to(dtype)
    return x.requires_grad_(True)  # the blocks' inputs need grad: the hooked pass threads them


def _step(model, graph: str, step: int, batches: list, set_sync=None) -> None:
    """One training step's forwards and backwards on ``batches`` (one per data-parallel rank
    the caller stands for); the losses are means over ranks, as the reduction averages."""
    n = len(batches)
    model.step = step
    if graph == "partial":
        model.blocks[1].use_b = step % 2 == 0
    micro = 2 if graph == "no_sync" else 1
    for m in range(micro):
        if set_sync is not None:
            set_sync(m == micro - 1)
        outs = [model(b if m == 0 else b * 0.5) for b in batches]
        if graph == "two_backwards":
            for o in outs:
                o[:2].mean().div(n).backward(retain_graph=True)
            for o in outs:
                o[2:].mean().div(n).backward()
        else:
            sum(o.mean() for o in outs).div(n).backward()
    if graph == "direct":  # a unit called on its own after the root's backward
        sum(model.blocks[2](b).square().mean() for b in batches).div(n).backward()


def _reference(graph: str, ws: int) -> dict:
    torch.manual_seed(0)
    model = _Model(graph).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        if graph == "raises" and step == 2:
            continue  # the sharded run's step 2 raised before any backward
        _step(model, graph, step, [_batch(step, r, torch.float64) for r in range(ws)])
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank: int, ws: int, graph: str, strategy: str, cap_mb=None) -> dict:
    from mfsdp2 import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for quiet in (True, False):
        torch.manual_seed(0)
        model = _Model(graph)
        for b in model.blocks:
            fully_shard(b, mesh=mesh, sharding_strategy=strategy)
        fully_shard(model, mesh=mesh, sharding_strategy=strategy)
        if cap_mb is not None:
            model.set_all_reduce_bucket_cap_mb(cap_mb)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        quiet_steps, done = [], []
        for step in range(STEPS):
            if step == 1:
                model._mfsdp2_state.ctx.quiet_allowed = quiet
            if graph == "raises" and step == 2:
                model.raise_now = True
                try:
                    model(_batch(step, rank, torch.float32))
                except RuntimeError:
                    pass
                model.raise_now = False
                for b in model.blocks:  # the detached hooks are attached again
                    assert len(b._forward_pre_hooks) == 1 and len(b._forward_hooks) == 1
                model.reset()
                for b in model.blocks:
                    assert len(b._forward_pre_hooks) == 1 and len(b._forward_hooks) == 1
                continue
            x = _batch(step, rank, torch.float32)
            # When backward reaches the batch, every unit's post-backward ran already (not the
            # final callback's catch-all, which comes after).
            x.register_hook(lambda g: done.append([b._mfsdp2_state.post_backward_done for b in model.blocks]))
            _step(model, graph, step, [x], model.set_requires_gradient_sync)
            quiet_steps.append(model._mfsdp2_state.ctx.quiet)
            opt.step()
            opt.zero_grad()
        out["quiet" if quiet else "hooked"] = {
            "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
            "quiet_steps": quiet_steps,
            "hooks_seen": model.hooks_seen,
            "done_at_input": done,
        }
    return out


@functools.lru_cache(maxsize=None)
def _reference_cached(graph: str, ws: int) -> dict:
    return _reference(graph, ws)


def _matches_reference(quiet: dict, hooked: dict, graph: str, ws: int) -> None:
    ref = _reference_cached(graph, ws)
    for n, r in ref.items():
        assert torch.equal(quiet["params"][n], hooked["params"][n]), n
        # float32 training of width-8 blocks for a few SGD steps: a few float32 ulps of the
        # weights per step; 1e-5 absolute is ~100x that and far below any step's change.
        assert torch.allclose(quiet["params"][n].double(), r, rtol=0, atol=1e-5), (n, quiet["params"][n], r)


def _check(graph: str, ws: int, strategy: str) -> None:
    out = run_ranks(_train, ws, graph, strategy)[0]
    quiet, hooked = out["quiet"], out["hooked"]
    _matches_reference(quiet, hooked, graph, ws)
    # Quiet from the second step on (the first backward records; under no_sync the first step's
    # second micro-batch already follows one, in both runs); the hooked run never after that.
    assert graph == "no_sync" or quiet["quiet_steps"][0] is False, quiet["quiet_steps"]
    assert all(quiet["quiet_steps"][1:]), quiet["quiet_steps"]
    assert not any(hooked["quiet_steps"][1:]), hooked["quiet_steps"]
    quiet_forwards = [h for h in quiet["hooks_seen"] if h == [0, 0, 0]]
    assert len(quiet_forwards) >= len(quiet["quiet_steps"]) - 1, quiet["hooks_seen"]
    assert all(h == [2, 2, 2] for h in hooked["hooks_seen"][2:]), hooked["hooks_seen"]
    if graph == "chain":
        assert quiet["done_at_input"] == [[True] * 3] * STEPS, quiet["done_at_input"]
        assert hooked["done_at_input"] == [[True] * 3] * STEPS, hooked["done_at_input"]


@pytest.mark.parametrize("graph", GRAPHS)
def test_quiet_pass_equals_hooked_pass_no_shard_two_ranks(graph):
    _check(graph, 2, "no_shard")


@pytest.mark.parametrize("graph", ["chain", "partial", "two_backwards"])
def test_quiet_pass_equals_hooked_pass_one_rank_zero3(graph):
    """ZeRO-3 on one rank keeps persistent weights: its units qualify too."""
    _check(graph, 1, "optim_grads_params")


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
@pytest.mark.parametrize("graph", ["chain", "skip", "two_backwards", "no_sync"])
def test_quiet_pass_equals_hooked_pass_zero1_zero2_two_ranks(graph, strategy):
    """ZeRO-1/2 re-gather their persistent weights after each step in the root's one gather
    bucket: the quiet pass takes the bucket's rows at the root's pre-forward."""
    _check(graph, 2, strategy)


def test_several_gather_buckets_keep_the_pass_hooked():
    """With the persistent weights' gathers cut into several buckets, the units' own waits let
    compute overlap the later buckets: no quiet pass, and the same training."""
    out = run_ranks(_train, 2, "chain", "optim", 920 / 2**20)[0]  # [root, blocks.0], [blocks.1, blocks.2]
    quiet, hooked = out["quiet"], out["hooked"]
    assert not any(quiet["quiet_steps"]) and not any(hooked["quiet_steps"]), out
    _matches_reference(quiet, hooked, "chain", 2)


def _misuse(rank: int, ws: int) -> dict:
    from mfsdp2 import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = _Model("chain")
    for b in model.blocks:
        fully_shard(b, mesh=mesh, sharding_strategy="no_shard")
    fully_shard(model, mesh=mesh, sharding_strategy="no_shard")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        _step(model, "chain", step, [_batch(step, rank, torch.float32)])
        opt.step()
        opt.zero_grad()
    out = {"quiet_before": model._mfsdp2_state.ctx.quiet}
    seen = []
    handle = model.blocks[0].register_forward_hook(lambda m, a, o: seen.append(1))
    _step(model, "chain", 2, [_batch(2, rank, torch.float32)])
    out["hooked_with_user_hook"] = not model._mfsdp2_state.ctx.quiet
    out["user_hook_calls"] = len(seen)
    handle.remove()
    opt.zero_grad()
    _step(model, "chain", 3, [_batch(3, rank, torch.float32)])
    out["quiet_again"] = model._mfsdp2_state.ctx.quiet
    opt.zero_grad()
    model.blocks[2].weight = nn.Parameter(torch.zeros(WIDTH, WIDTH))
    try:
        _step(model, "chain", 4, [_batch(4, rank, torch.float32)])
        out["replaced"] = "accepted"
    except RuntimeError as e:
        out["replaced"] = str(e)
    out["hooks_after_error"] = [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in model.blocks]
    return out


def test_quiet_pass_keeps_the_misuse_checks():
    out = run_ranks(_misuse, 1)[0]
    assert out["quiet_before"] and out["quiet_again"], out
    assert out["hooked_with_user_hook"] and out["user_hook_calls"] == 1, out
    assert "E14" in out["replaced"] and "'blocks.2'" in out["replaced"], out
    assert out["hooks_after_error"] == [2, 2, 2], out  # no unit lost its hooks to the refused pass
