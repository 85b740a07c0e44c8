"""Training patterns torch FSDP2's own suite checks, run by FSDP2 and by mfsdp2 on the same float64
model and data in the same process, compared step by step: losses, every full parameter and every
full gradient (present on both sides or on neither).

Patterns: a different ``reshard_after_forward`` per unit; a unit called twice in one forward;
several forwards before one backward with nested units; a forward output left out of the loss;
a unit that never runs; unused parameters inside a unit, and a grouped unit whose first module
never runs; activations wrapped in list / namedtuple / tuple / dict between units;
tied parameters inside one unit (uneven vocabulary); buffers (BatchNorm running statistics,
persistent and non-persistent); a forward and backward through a non-root unit after the root's;
explicit forward / backward prefetching; per-parameter optimizers stepped from
``register_post_accumulate_grad_hook`` (each hook runs once per parameter per backward);
``zero_grad(set_to_none=False)`` alternating with ``True``; a root whose forward takes no tensor.

Tolerance: float64 throughout. The runtimes sum the same per-rank gradients in a different order
(FSDP2 divides around a SUM on gloo, mfsdp2 averages), i.e. a few float64 roundings per gradient,
amplified by at most lr/eps of AdamW over a handful of steps: REL_F64 (tests/models.py) bounds it
with orders of margin, and any real difference (a dropped micro-batch, a stale gather, a doubled
gradient) moves values by >= 1e-4.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from . import assert_same_snapshots, mean_loss, runtimes, snapshot
from .._dist import run_ranks
from ..models import REL_F64, assert_close_rel

WS, STEPS, D = 2, 3, 8


def _x(step: int, rank: int, n: int = 2, d: int = D, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + 10 * step + rank)
    return torch.randn(n, d, generator=g, dtype=torch.float64)


class MLP(nn.Module):
    def __init__(self, d: int = D, hidden: int = 3 * D):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _seq(n: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[MLP() for _ in range(n)]).double()


def _train(model, steps, loss_of, opt=None, set_to_none_alternating=True):
    """``steps`` steps of ``loss_of(model, step)``; returns per-step losses and the snapshot after
    the last backward (before its optimizer step) and after the last step."""
    opt = opt if opt is not None else torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=(step % 2 == 0) if set_to_none_alternating else True)
        loss = loss_of(model, step)
        loss.backward()
        losses.append(mean_loss(loss))
        if step == steps - 1:
            grads = snapshot(model)
        opt.step()
    return {"losses": losses, "grads": grads, "final": snapshot(model)}


# -- scenarios: (build and wrap with `shard`, mesh) -> result ------------------------------------
def per_unit_reshard(shard, mesh, rank):
    model = _seq()
    for block, raf in zip(model, (True, False, 1)):
        shard(block, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=True)
    return _train(model, STEPS, lambda m, s: m(_x(s, rank)).pow(2).sum())


class MultiForward(nn.Module):
    """A unit (``inner``) called twice in one forward."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(D, D)
        self.outer = nn.Linear(D, 5)

    def forward(self, x):
        return self.outer(self.inner(x) + self.inner(x * 2))


def multi_forward_module(shard, mesh, rank):
    out = {}
    for raf in (True, False):
        torch.manual_seed(0)
        model = MultiForward().double()
        shard(model.inner, mesh=mesh, reshard_after_forward=raf)
        shard(model, mesh=mesh, reshard_after_forward=raf)
        out[raf] = _train(model, STEPS, lambda m, s: m(_x(s, rank)).pow(2).sum())
    return out


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(D, D)
        self.ffn = MLP()

    def forward(self, x):
        h = x + self.attn(x)
        return h + self.ffn(h)


def _nested(shard, mesh, raf):
    torch.manual_seed(0)
    model = nn.Sequential(Layer(), Layer(), nn.Linear(D, 3)).double()
    for layer in model[:2]:
        shard(layer.attn, mesh=mesh, reshard_after_forward=raf)
        shard(layer.ffn, mesh=mesh, reshard_after_forward=raf)
        shard(layer, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    return model


def double_forward_nested(shard, mesh, rank):
    """Two forwards, one backward of a loss combining both (DPO-style), nested units."""
    out = {}
    for raf in (True, False):
        model = _nested(shard, mesh, raf)
        out[raf] = _train(
            model, STEPS, lambda m, s: (m(_x(s, rank)).sum() - m(_x(s, rank, seed=1)).sum()).pow(2)
        )
    return out


class TwoOut(nn.Module):
    def __init__(self, second: bool):
        super().__init__()
        self.lin1 = nn.Linear(D, D)
        self.lin2 = nn.Linear(D, D)
        self.second = second

    def forward(self, x):
        y = self.lin1(x)
        return (y, self.lin2(F.relu(y))) if self.second else y


def unused_forward_output(shard, mesh, rank):
    """The second output is in the loss for the first steps only (its unit's gradients vanish)."""
    out = {}
    for raf in (True, False):
        torch.manual_seed(0)
        model = TwoOut(second=True).double()
        shard(model.lin1, mesh=mesh, reshard_after_forward=raf)
        shard(model, mesh=mesh, reshard_after_forward=raf)

        def loss_of(m, s):
            a, b = m(_x(s, rank))
            return (a * b).sum() if s < 2 else a.pow(2).sum()

        out[raf] = _train(model, STEPS + 1, loss_of)
    return out


def unused_forward_module(shard, mesh, rank):
    """``lin2`` is its own unit and never runs: no gradient on either runtime."""
    torch.manual_seed(0)
    model = TwoOut(second=False).double()
    shard(model.lin1, mesh=mesh)
    shard(model.lin2, mesh=mesh)
    shard(model, mesh=mesh)
    return _train(model, STEPS, lambda m, s: m(_x(s, rank)).pow(2).sum())


_NT = collections.namedtuple("_NT", "x y")


class Wrap(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return {"list": lambda: [x], "namedtuple": lambda: _NT(x, torch.ones_like(x)), "tuple": lambda: (x,),
                "dict": lambda: {"x": x}}[self.kind]()


class OnContainer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, inp):
        if isinstance(inp, list):
            return [self.mlp(inp[0])]
        if isinstance(inp, _NT):
            return _NT(self.mlp(inp.x), inp.y)
        if isinstance(inp, tuple):
            return (self.mlp(inp[0]),)
        return {"x": self.mlp(inp["x"])}


class Unwrap(nn.Module):
    def forward(self, inp):
        return inp["x"] if isinstance(inp, dict) else inp[0]


def container_activations(shard, mesh, rank):
    out = {}
    for kind in ("list", "namedtuple", "tuple", "dict"):
        torch.manual_seed(0)
        model = nn.Sequential(Wrap(kind), OnContainer(), OnContainer(), OnContainer(), Unwrap()).double()
        for m in model:
            shard(m, mesh=mesh)
        shard(model, mesh=mesh)
        out[kind] = _train(model, STEPS, lambda m, s: m(_x(s, rank)).pow(2).sum())
    return out


V = WS * 4 + 1  # uneven vocabulary


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.body = MLP()
        self.out = nn.Linear(D, V, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, ids):
        return self.out(self.body(self.tok(ids)))


def _ids(step, rank):
    return torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(7 * step + rank))


def tied_parameters(shard, mesh, rank):
    """Tied embedding / output weight: in the root, and in one grouped unit ``[tok, out]``."""
    out = {}
    for grouping in ("root", "grouped"):
        torch.manual_seed(0)
        model = Tied().double()
        shard(model.body, mesh=mesh)
        if grouping == "grouped":
            shard([model.tok, model.out], mesh=mesh)
        shard(model, mesh=mesh)
        out[grouping] = _train(model, STEPS,
                               lambda m, s: F.cross_entropy(m(_ids(s, rank)).view(-1, V), _ids(s + 1, rank).view(-1)))
    return out


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.register_buffer("scale", torch.full((D,), 0.5))
        self.register_buffer("shift", torch.linspace(-1, 1, D), persistent=False)

    def forward(self, x):
        return self.bn(self.lin(x)) * self.scale + self.shift


def buffers(shard, mesh, rank):
    """BatchNorm running statistics update in forward; state-dict keys (non-persistent left out)."""
    torch.manual_seed(0)
    model = nn.Sequential(WithBuffers(), WithBuffers()).double()
    shard(model[0], mesh=mesh)
    shard(model, mesh=mesh)
    res = _train(model, STEPS, lambda m, s: m(_x(s, rank, n=4)).pow(2).sum())
    res["buffers"] = {k: b.detach().clone() for k, b in model.named_buffers()}
    res["keys"] = list(model.state_dict())
    return res


def non_root_after_root(shard, mesh, rank):
    """Root forward/backward/step, then a forward/backward/step through a non-root unit alone."""
    model = _seq()
    for m in model:
        shard(m, mesh=mesh)
    shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_x(0, rank)).sum().backward()
    opt.step()
    opt.zero_grad()
    loss = model[0](_x(1, rank)).sum()
    loss.backward()
    grads = snapshot(model)
    opt.step()
    return {"losses": [mean_loss(loss), mean_loss(model(_x(2, rank)).sum())], "grads": grads, "final": snapshot(model)}


def explicit_prefetch(shard, mesh, rank):
    torch.manual_seed(0)
    model = _seq(5)
    for m in model:
        shard(m, mesh=mesh)
    shard(model, mesh=mesh)
    for i, m in enumerate(model):
        m.set_modules_to_forward_prefetch([model[j] for j in (i + 1, i + 2) if j < len(model)])
        m.set_modules_to_backward_prefetch([model[j] for j in (i - 1, i - 2) if j >= 0])
    return _train(model, STEPS, lambda m, s: m(_x(s, rank)).pow(2).sum())


def optimizer_in_backward(shard, mesh, rank):
    """One AdamW per parameter stepped (and zeroed) from its post-accumulate-grad hook."""
    model = _seq()
    for m in model:
        shard(m, mesh=mesh)
    shard(model, mesh=mesh)
    names = {p: k for k, p in model.named_parameters()}
    calls = collections.Counter()
    opts = {p: torch.optim.AdamW([p], lr=1e-2, foreach=False) for p in model.parameters()}

    def hook(p):
        calls[names[p]] += 1
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    losses = []
    for step in range(STEPS):
        loss = model(_x(step, rank)).pow(2).sum()
        loss.backward()
        losses.append(mean_loss(loss))
    return {"losses": losses, "final": snapshot(model), "calls": dict(calls)}


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(1, 1)
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return F.relu(self.lin(x))


def unused_parameters(shard, mesh, rank):
    """A grouped unit ``[unused, lin]`` whose first module never runs (its pass stays partial
    until the root's forward ends), and one whose parameters include an unused one."""
    out = {}
    for grouped in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(WithUnused(), WithUnused(), nn.Linear(D, D)).double()
        for m in model[:2]:
            if grouped:
                shard([m.unused, m.lin], mesh=mesh)
            else:
                shard(m, mesh=mesh)
        shard(model, mesh=mesh)
        out[grouped] = _train(model, STEPS, lambda m, s: m(_x(s, rank)).pow(2).sum())
    return out


class NoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 16).view(4, 4))

    def forward(self):
        return self.weight @ self.weight


class Paramless(nn.Module):
    def forward(self, x, ys):
        return x + ys[0] * ys[1] + 1


def unusual_roots(shard, mesh, rank):
    """A root whose forward takes no input, and a root without parameters taking a tuple."""
    model = NoInputs().double()
    shard(model, mesh=mesh)
    res = _train(model, STEPS, lambda m, s: m().pow(2).sum())
    pl = shard(Paramless(), mesh=mesh)
    x = _x(0, rank)
    res["paramless"] = pl(x, (x * 2, x + 1))
    return res


SCENARIOS = {
    f.__name__: f
    for f in (
        per_unit_reshard,
        multi_forward_module,
        double_forward_nested,
        unused_forward_output,
        unused_forward_module,
        unused_parameters,
        container_activations,
        tied_parameters,
        buffers,
        non_root_after_root,
        explicit_prefetch,
        optimizer_in_backward,
        unusual_roots,
    )
}


def _rank(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, fn in SCENARIOS.items():
        for lib, shard in runtimes().items():
            out[(name, lib)] = fn(shard, mesh, rank)
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(_rank, WS, timeout=300)


def _compare(ours, theirs, where):
    if isinstance(theirs, dict) and "final" not in theirs:
        assert set(ours) == set(theirs), where
        for k in theirs:
            _compare(ours[k], theirs[k], f"{where}[{k}]")
        return
    for i, (a, b) in enumerate(zip(ours["losses"], theirs["losses"])):
        assert abs(a - b) <= REL_F64 * abs(b), f"{where} loss {i}: mfsdp2 {a}, FSDP2 {b}"
    assert len(ours["losses"]) == len(theirs["losses"])
    if "grads" in theirs:
        assert_same_snapshots(ours["grads"], theirs["grads"], f"{where} last backward", REL_F64)
    assert_same_snapshots(ours["final"], theirs["final"], f"{where} after the steps", REL_F64)
    for key in ("buffers",):
        if key in theirs:
            assert list(ours[key]) == list(theirs[key]), where
            for k, t in theirs[key].items():
                assert_close_rel(ours[key][k], t, f"{where} buffer {k}", REL_F64)
    for key in ("keys", "calls"):
        if key in theirs:
            assert ours[key] == theirs[key], (where, key, ours[key], theirs[key])
    if "paramless" in theirs:
        assert_close_rel(ours["paramless"], theirs["paramless"], f"{where} paramless root", REL_F64)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_training_pattern_matches_fsdp2(scenario):
    for rank, res in enumerate(_results()):
        _compare(res[(scenario, "mfsdp2")], res[(scenario, "fsdp2")], f"{scenario} rank {rank}")
    if scenario == "optimizer_in_backward":
        calls = _results()[0][(scenario, "mfsdp2")]["calls"]
        assert set(calls.values()) == {STEPS}, calls  # once per parameter per backward
