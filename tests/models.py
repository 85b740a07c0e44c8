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


# Parity tests run in float64 so that they do not depend on the machine's GEMM kernels (which
# round fp32 differently per instruction set). Tolerance, from float64 rounding: u = 1.1e-16 per
# op; a sharded run only reorders sums (n <= ~1e3 terms: relative change <= n*u ~ 1e-13 per
# gradient), and AdamW turns an absolute gradient change d into at most lr*d/eps per step (lr/eps
# = 1e6), i.e. <= 1e-13 * 1e6 * 10 steps ~ 1e-6 only in the worst case of a gradient ~ eps; the
# error is linear in u, so fp32's observed worst (~1e-5 relative, u32 = 6e-8) predicts ~2e-14
# here. 1e-10 leaves four orders of slack above that, and a real bug (a lost or doubled
# micro-batch, a wrong divide factor, a stale shard) moves weights by >= 1e-4 relative.
F64 = torch.float64
REL_F64 = 1e-10


def build(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The same initial values for every dtype (built in fp32, then converted)."""
    torch.manual_seed(seed)
    if kind == "net":
        m = Net()
    elif kind == "frozen":  # a frozen block and a unit mixing frozen and trainable params
        m = Net()
        m.blocks[1].requires_grad_(False)
        m.blocks[2].fc1.requires_grad_(False)
    elif kind == "tiny":  # so small that at world size 4 some ranks hold no rows of some params
        m = Net(d_in=3, d=2, hidden=3, d_out=1, n_blocks=2)
    else:
        raise ValueError(kind)
    return m.to(dtype)


def shard_blocks(model: nn.Module, mesh, fully_shard=None, **kwargs) -> nn.Module:
    """``fully_shard`` each of ``model.blocks``, then the root (mfsdp2's unless another is given)."""
    if fully_shard is None:
        from mfsdp2 import fully_shard
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Non-reentrant activation checkpointing inside each of ``model.blocks`` (the unit's own
    forward runs once more in backward, under the state saved with the forward)."""
    from torch.utils.checkpoint import checkpoint

    for b in model.blocks:
        b.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(b.forward)
    return model


def batch(step: int, n: int, d_in: int, seed: int = 1234, dtype: torch.dtype = torch.float32):
    """Inputs and targets of a fixed linear teacher plus noise, so the loss can fall (drawn in
    fp32, then converted: the same data for every dtype)."""
    teacher = torch.randn(d_in, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1 + step)
    x = torch.randn(n, d_in, generator=g)
    y = x @ teacher + 0.1 * torch.randn(n, generator=g)
    return x.to(dtype), y.to(dtype)


def make_opt(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    raise ValueError(kind)


def loss_fn(out, y):
    return ((out.sum(-1) - y) ** 2).mean()


def reference_run(
    kind: str, opt_kind: str, steps: int, global_batch: int, dtype: torch.dtype = torch.float32,
    compile_step: bool = False,
):
    """Single-process, unsharded: the independent reference for the parity tests.
    ``compile_step``: the optimizer step is compiled (aot_eager), as the run it is compared with
    (a compiled step computes bias corrections from a float32 step tensor, eager from a float)."""
    torch.set_num_threads(1)
    model = build(kind, dtype=dtype)
    opt = make_opt(opt_kind, [p for p in model.parameters() if p.requires_grad])
    if compile_step:
        opt.step = torch.compile(opt.step, backend="aot_eager")
    losses = [reference_step(model, opt, step, global_batch, dtype) for step in range(steps)]
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def reference_step(model, opt, step: int, global_batch: int, dtype: torch.dtype = torch.float32) -> float:
    """One unsharded training step on the whole global batch of ``step``; returns its loss."""
    x, y = batch(step, global_batch, model.inp.in_features, dtype=dtype)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def same_cast_reference(
    steps: int,
    ws: int,
    global_batch: int,
    reduce_dtype: torch.dtype = torch.float32,
    compute: torch.dtype = torch.bfloat16,
    *,
    make_model=None,
    data=None,
    loss=None,
    make_optimizer=None,
    cast_weight=None,
):
    """Unsharded, fp32 master weights: each step casts the masters to a ``compute`` copy (through
    ``cast_weight(name, master)`` first, e.g. an FP8 quantise-dequantise), runs each of ``ws``
    micro-batches on it (floating inputs cast to ``compute``, loss in fp32), averages the
    micro-batch grads in ``reduce_dtype`` (the policy's), and steps the fp32 masters. What a
    sharded run with ``param_dtype=compute`` does, in one process. Defaults: ``build("net")``,
    :func:`batch`, :func:`loss_fn`, AdamW as :func:`make_opt`."""
    import copy

    torch.set_num_threads(1)
    master = make_model() if make_model is not None else build("net")
    data = data if data is not None else (lambda step: batch(step, global_batch, master.inp.in_features))
    loss = loss if loss is not None else loss_fn
    opt = (make_optimizer or (lambda ps: make_opt("adamw", ps)))(list(master.parameters()))
    work = copy.deepcopy(master).to(compute)
    n = global_batch // ws
    losses = []
    for step in range(steps):
        with torch.no_grad():
            for (name, pw), pm in zip(work.named_parameters(), master.parameters()):
                pw.copy_(cast_weight(name, pm) if cast_weight is not None else pm)
        x, y = data(step)
        grads = [torch.zeros_like(p, dtype=reduce_dtype) for p in master.parameters()]
        total = 0.0
        for r in range(ws):
            work.zero_grad()
            xr = x[r * n : (r + 1) * n]
            out = work(xr.to(compute) if xr.is_floating_point() else xr)
            loss_r = loss(out.float(), y[r * n : (r + 1) * n])
            loss_r.backward()
            total += loss_r.item()
            for g, pw in zip(grads, work.parameters()):
                g += pw.grad.to(reduce_dtype)
        for pm, g in zip(master.parameters(), grads):
            pm.grad = (g / ws).float()
        opt.step()
        opt.zero_grad()
        losses.append(total / ws)
    return losses, {k: v.detach().clone() for k, v in master.named_parameters()}


def rel_dist(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (a floor of 1e-3 for tiny tensors), as in :func:`assert_close_rel`."""
    return (a.double() - b.double()).abs().max().item() / max(b.abs().max().item(), 1e-3)


def same_cast_tolerances(steps: int, ws: int, global_batch: int, **kw):
    """The same-cast reference with ``ws`` micro-batches, and tolerances taken from the run itself:
    twice the distance to the same computation on one micro-batch of the whole global batch (an
    equally legitimate ordering: the low-precision gradient sums round differently, and AdamW
    amplifies that). Returns ``(losses, params, loss_tol, {name: rel_tol})``."""
    losses, params = same_cast_reference(steps, ws, global_batch, **kw)
    alt_losses, alt_params = same_cast_reference(steps, 1, global_batch, **kw)
    loss_tol = 2 * max(abs(a - b) / abs(b) for a, b in zip(alt_losses, losses))
    tol = {k: 2 * rel_dist(alt_params[k], r) for k, r in params.items()}
    return losses, params, loss_tol, tol


def sharded_train_step(model, opt, step: int, rank: int, ws: int, global_batch: int,
                       dp: tuple[int, int] | None = None) -> float:
    """One step on this rank's slice of the global batch; returns the mean loss over ranks.

    ``dp = (dp_rank, dp_size)`` slices by the data-parallel coordinate instead of the rank (ranks
    of one tensor-parallel group see the same slice). Inputs take the dtype of the (main)
    parameters, so a float64 model trains on float64 data. Low-precision outputs are upcast for
    the loss.
    """
    import torch.distributed as dist

    dp_rank, dp_size = dp if dp is not None else (rank, ws)
    n = global_batch // dp_size
    x, y = batch(step, global_batch, model.inp.in_features, dtype=model.inp.weight.dtype)
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


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, name: str, rel: float) -> None:
    """max |a - b| <= rel * max |b| (a floor of 1e-3 for tiny tensors); shapes and dtypes must
    match (a float64 parity run that silently computed in fp32 would be off by ~1e-7)."""
    assert a.shape == b.shape, (name, a.shape, b.shape)
    assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
    if b.numel() == 0:
        return
    scale = max(b.abs().max().item(), 1e-3)
    err = (a - b).abs().max().item()
    assert err <= rel * scale, f"{name}: max err {err:.3e} > {rel:.0e} * {scale:.3e}"


def assert_losses_close(losses, ref_losses, where: str, rel: float) -> None:
    """Per-step losses within ``rel`` of the reference's (relative), as many steps as it has."""
    assert len(losses) == len(ref_losses), (where, len(losses), len(ref_losses))
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rel * abs(b), f"{where} step {step}: loss {a} vs reference {b}"
