"""Small models and a reference trainer shared by the tests."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d_in: int = 12, d: int = 16, hidden: int = 40, d_out: int = 5, n_blocks: int = 3):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "net":
        return Net()
    if kind == "frozen":  # a frozen block and a unit mixing frozen and trainable params
        m = Net()
        m.blocks[1].requires_grad_(False)
        m.blocks[2].fc1.requires_grad_(False)
        return m
    if kind == "tiny":  # so small that at world size 4 some ranks hold no rows of some params
        return Net(d_in=3, d=2, hidden=3, d_out=1, n_blocks=2)
    raise ValueError(kind)


def batch(step: int, n: int, d_in: int, seed: int = 1234):
    """Inputs and targets of a fixed linear teacher plus noise, so the loss can fall."""
    teacher = torch.randn(d_in, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1 + step)
    x = torch.randn(n, d_in, generator=g)
    y = x @ teacher + 0.1 * torch.randn(n, generator=g)
    return x, y


def make_opt(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    raise ValueError(kind)


def loss_fn(out, y):
    return ((out.sum(-1) - y) ** 2).mean()


def reference_run(kind: str, opt_kind: str, steps: int, global_batch: int):
    """Single-process, unsharded: the independent reference for the parity tests."""
    torch.set_num_threads(1)
    model = build(kind)
    d_in = model.inp.in_features
    opt = make_opt(opt_kind, [p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(steps):
        x, y = batch(step, global_batch, d_in)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def sharded_train_step(model, opt, step: int, rank: int, ws: int, global_batch: int, dp: tuple[int, int] | None = None) -> float:
    """One step on this rank's slice of the global batch; returns the mean loss over ranks.

    ``dp = (dp_rank, dp_size)`` slices by the data-parallel coordinate instead of the rank (ranks
    of one tensor-parallel group see the same slice). Low-precision outputs are upcast for the loss.
    """
    import torch.distributed as dist

    dp_rank, dp_size = dp if dp is not None else (rank, ws)
    n = global_batch // dp_size
    x, y = batch(step, global_batch, model.inp.in_features)
    out = model(x[dp_rank * n : (dp_rank + 1) * n])
    loss = loss_fn(out if out.dtype == torch.float64 else out.float(), y[dp_rank * n : (dp_rank + 1) * n])
    loss.backward()
    opt.step()
    opt.zero_grad()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / ws


def local_grad_rows(p):
    """``(first global row, this rank's rows of p.grad)`` of an optimizer-facing DTensor parameter;
    every rank has a gradient, an empty one where it holds no rows (as torch FSDP2)."""
    from mfsdp2 import RowShard

    start = 0
    for dim, pl in enumerate(p.placements):
        if isinstance(pl, RowShard):
            start = pl.starts[p.device_mesh.get_local_rank(dim)]
    assert p.grad is not None, "every rank must get a gradient, an empty one where it holds no rows"
    assert p.grad.to_local().shape == p.to_local().shape
    return start, p.grad.to_local().clone()


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, name: str, rel: float = 1e-5) -> None:
    """max |a - b| <= rel * max |b| (a floor of 1e-3 for tiny tensors); shapes must match."""
    assert a.shape == b.shape, (name, a.shape, b.shape)
    if b.numel() == 0:
        return
    scale = max(b.abs().max().item(), 1e-3)
    err = (a - b).abs().max().item()
    assert err <= rel * scale, f"{name}: max err {err:.3e} > {rel:.0e} * {scale:.3e}"
