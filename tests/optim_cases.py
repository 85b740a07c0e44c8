"""Every ``torch.optim`` optimizer, as a user would configure it, and a trainer that runs one on a
model of :mod:`tests.models` -- sharded or not -- and snapshots its parameters and optimizer states.

Shared by the optimizer matrix (tests/system/test_optimizer_matrix.py): the unsharded float64 run made
here is its reference, the sharded runs (mfsdp2's, torch FSDP2's) are made by the same code.

Options are chosen so that each optimizer's own options change the result (momentum and Nesterov,
AMSGrad, centred RMSprop, decoupled weight decay, ``maximize``...), and every optimizer gets two
parameter groups with different hyperparameters that cut through every unit: the matrices, and the
norms and biases without weight decay (the usual recipe). Exceptions, forced by the optimizers
themselves: ``Muon`` takes only 2-D parameters (its groups: the blocks' matrices, and the input and
head matrices; the vectors are not stepped), ``LBFGS`` takes one group and a closure.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .models import F64, batch, loss_fn


def optimizer_classes() -> dict[str, type]:
    """Every optimizer class ``torch.optim`` exports (so a new one is not missed)."""
    return {
        name: cls
        for name, cls in sorted(vars(torch.optim).items())
        if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
    }


def impls(cls: type) -> list[str]:
    """The implementations a user may pick: ``"for-loop"`` (``foreach=False``), ``"foreach"``,
    ``"fused"``, where the class takes the flag; ``"default"`` for classes with neither."""
    params = inspect.signature(cls.__init__).parameters
    out = []
    if "foreach" in params:
        out += ["for-loop", "foreach"]
    if "fused" in params:
        out.append("fused")
    return out or ["default"]


# Per optimizer: the options of the matrices' group ("a"), those of the vectors' group ("b", no
# weight decay, and other values of the optimizer's switches), and how many steps before the
# state-dict round trip (RAdam's rectified update starts at its 6th step).
HPARAMS: dict[str, dict] = {
    "ASGD": dict(a=dict(lr=0.05, lambd=1e-2, alpha=0.75, t0=1.0, weight_decay=0.1),
                 b=dict(lr=0.02, t0=0.0, maximize=True)),
    "Adadelta": dict(a=dict(lr=1.0, rho=0.8, eps=1e-5, weight_decay=0.1), b=dict(lr=0.5, rho=0.95, maximize=True)),
    "Adafactor": dict(a=dict(lr=0.02, beta2_decay=-0.6, d=0.8, weight_decay=0.1), b=dict(lr=0.01, maximize=True)),
    "Adagrad": dict(
        a=dict(lr=0.05, lr_decay=0.1, weight_decay=0.1, initial_accumulator_value=0.2, eps=1e-8),
        b=dict(lr=0.02, maximize=True),
    ),
    "Adam": dict(a=dict(lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=True),
                 b=dict(lr=0.01, maximize=True)),
    "AdamW": dict(a=dict(lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=True),
                  b=dict(lr=0.01, maximize=True)),
    "Adamax": dict(a=dict(lr=0.02, betas=(0.8, 0.95), weight_decay=0.1), b=dict(lr=0.01, maximize=True)),
    "LBFGS": dict(a=dict(lr=0.5, max_iter=2, history_size=2, line_search_fn="strong_wolfe"), b=None),
    "Muon": dict(
        a=dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True),
        b=dict(lr=0.01, weight_decay=0.0, momentum=0.8, nesterov=False, adjust_lr_fn="match_rms_adamw"),
    ),
    "NAdam": dict(
        a=dict(lr=0.02, betas=(0.8, 0.95), weight_decay=0.1, momentum_decay=0.01, decoupled_weight_decay=True),
        b=dict(lr=0.01, decoupled_weight_decay=False, maximize=True),
    ),
    "RAdam": dict(
        a=dict(lr=0.02, betas=(0.8, 0.95), weight_decay=0.1, decoupled_weight_decay=True),
        b=dict(lr=0.01, decoupled_weight_decay=False, maximize=True),
        steps=6,
    ),
    "RMSprop": dict(
        a=dict(lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.1, momentum=0.5, centered=True),
        b=dict(lr=0.005, momentum=0.0, centered=False, maximize=True),
    ),
    "Rprop": dict(a=dict(lr=0.02, etas=(0.4, 1.3), step_sizes=(1e-5, 0.5)), b=dict(lr=0.01, maximize=True)),
    "SGD": dict(
        a=dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
        b=dict(lr=0.02, momentum=0.5, dampening=0.2, maximize=True),
    ),
    "SparseAdam": dict(a=dict(lr=0.02, betas=(0.8, 0.95)), b=dict(lr=0.01, maximize=True)),
}

STEPS = 2  # before the state-dict round trip (HPARAMS may ask for more); one step after it
GLOBAL_BATCH = 8


def steps_of(name: str) -> int:
    return HPARAMS[name].get("steps", STEPS)


def param_groups(name: str, model: nn.Module) -> list[dict]:
    """The optimizer's parameter groups over ``model`` (see the module docstring)."""
    hp = HPARAMS[name]
    named = list(model.named_parameters())
    if name == "LBFGS":
        return [dict(params=[p for _, p in named], **hp["a"])]
    if name == "Muon":
        mats = [(n, p) for n, p in named if p.ndim == 2]
        a = [p for n, p in mats if n.startswith("blocks.")]
        b = [p for n, p in mats if not n.startswith("blocks.")]
    else:
        a = [p for _, p in named if p.ndim >= 2]
        b = [p for _, p in named if p.ndim < 2]
    return [dict(params=a, **hp["a"]), dict(params=b, **{"weight_decay": 0.0, **hp["b"]})]


def make_optimizer(name: str, impl: str, model: nn.Module) -> torch.optim.Optimizer:
    cls = optimizer_classes()[name]
    flags = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True),
             "default": {}}[impl]
    return cls(param_groups(name, model), **flags)


def make_scheduler(opt) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def train_step(model, opt, step: int, shard: Optional[tuple[int, int]] = None) -> float:
    """One step on the global batch of ``step`` (its ``shard = (index, count)`` slice on a
    data-parallel rank, the loss then averaged over the ranks). LBFGS is driven by a closure that
    returns the global loss, so that every rank takes the same line-search decisions."""
    x, y = batch(step, GLOBAL_BATCH, model.inp.in_features, dtype=F64)
    if shard is not None:
        i, k = shard
        n = GLOBAL_BATCH // k
        x, y = x[i * n : (i + 1) * n], y[i * n : (i + 1) * n]

    def closure():
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        t = loss.detach().clone()
        if shard is not None:
            dist.all_reduce(t)
            t /= shard[1]
        return t

    if isinstance(opt, torch.optim.LBFGS):
        loss = opt.step(closure)
    else:
        loss = closure()
        opt.step()
    model.zero_grad(set_to_none=True)  # every gradient, also of parameters no group holds (Muon)
    return float(loss)


class Piece:
    """This rank's piece of a (D)Tensor: its local values and where they sit in the global tensor,
    by the offsets its DTensor metadata claims (``compute_local_shape_and_global_offset``: what
    ``full_tensor`` and DCP use). A plain tensor is the whole tensor. ``partial`` names a
    placement whose pieces are summands, not pieces (none of our states should have one)."""

    def __init__(self, t: torch.Tensor):
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if isinstance(t, DTensor):
            local = t.to_local().detach()
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            self.error = None
            if tuple(local.shape) != tuple(shape):
                self.error = f"local shape {tuple(local.shape)} but {tuple(t.placements)} says {tuple(shape)}"
            self.partial = next((str(p) for p in t.placements if p.is_partial()), None)
            self.shape, self.offset, self.local = tuple(t.shape), tuple(offset), local.clone()
        else:
            self.error = self.partial = None
            self.shape, self.offset, self.local = tuple(t.shape), (0,) * t.dim(), t.detach().clone()


def assemble(pieces: list) -> "torch.Tensor | str":
    """The global tensor from every rank's :class:`Piece` of it, or what is wrong: a piece whose
    shape contradicts its placements, an element no rank holds, replicas that disagree."""
    first = pieces[0]
    errors = [p.error for p in pieces if p.error] + [f"placement {p.partial}" for p in pieces if p.partial]
    if errors:
        return "; ".join(sorted(set(errors)))
    out = torch.zeros(first.shape, dtype=first.local.dtype)
    seen = torch.zeros(first.shape, dtype=torch.bool)
    for p in pieces:
        idx = tuple(slice(o, o + n) for o, n in zip(p.offset, p.local.shape))
        held = seen[idx]
        if held.any() and not torch.equal(out[idx][held], p.local[held]):
            return "replicas differ"
        out[idx] = p.local
        seen[idx] = True
    if not bool(seen.all()):
        return f"{int((~seen).sum())} of {seen.numel()} elements held by no rank"
    return out


def snapshot(model, opt) -> dict:
    """``{"params": {name: Piece}, "state": {name: {key: Piece}}, "lr": [per group]}``; list
    states (LBFGS's histories) are lists of pieces, numbers stay numbers. No collective: the
    parent assembles the pieces of every rank (:func:`gather_snapshots`)."""
    names = {id(p): n for n, p in model.named_parameters()}

    def value(v):
        if isinstance(v, torch.Tensor):
            return Piece(v)
        if isinstance(v, (list, tuple)):
            return [value(x) for x in v]
        return v

    return {
        "params": {n: Piece(p) for n, p in model.named_parameters()},
        "state": {names[id(p)]: {k: value(v) for k, v in sorted(st.items())} for p, st in opt.state.items()},
        "lr": [g["lr"] for g in opt.param_groups],
    }


def gather_snapshots(per_rank: list):
    """One run's snapshots (``{phase: snapshot}``) of every rank -> the same with global tensors
    (or error strings) in place of the pieces; numbers from rank 0 (every rank must agree)."""

    def merge(vals):
        v0 = vals[0]
        if isinstance(v0, Piece):
            return assemble(vals)
        if isinstance(v0, dict):
            return {k: merge([v[k] for v in vals]) for k in v0}
        if isinstance(v0, list):
            return [merge([v[i] for v in vals]) for i in range(len(v0))]
        return v0 if all(v == v0 for v in vals) else f"ranks disagree: {vals}"

    return merge(per_rank)


def clone_tree(obj):
    """A deep copy of a state dict's tensors (DTensors stay DTensors with their placements)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def run(
    name: str, impl: str, make_model: Callable[[], nn.Module], shard: Optional[tuple[int, int]] = None
) -> dict:
    """Train ``steps_of(name)`` steps (the LR scheduler stepping after each), snapshot, save the
    model / optimizer / scheduler state dicts, take one more step and snapshot; then build a fresh
    model and optimizer, load the saved state dicts and take that step again. Returns
    ``{"steps": snapshot, "next": snapshot, "resumed": snapshot}``."""
    n = steps_of(name)
    model = make_model()
    opt = make_optimizer(name, impl, model)
    sched = make_scheduler(opt)
    for step in range(n):
        train_step(model, opt, step, shard)
        sched.step()
    out = {"steps": snapshot(model, opt)}
    saved = clone_tree((model.state_dict(), opt.state_dict(), sched.state_dict()))
    train_step(model, opt, n, shard)
    out["next"] = snapshot(model, opt)
    del model, opt, sched
    model = make_model()
    model.load_state_dict(saved[0])
    opt = make_optimizer(name, impl, model)
    opt.load_state_dict(saved[1])
    sched = make_scheduler(opt)
    sched.load_state_dict(saved[2])
    train_step(model, opt, n, shard)
    out["resumed"] = snapshot(model, opt)
    return out


def differences(got: dict, ref: dict, rel: float) -> list[str]:
    """What differs between a run and the reference run (names, keys, shapes, dtypes, values
    beyond ``rel`` relative to the reference's largest magnitude; numbers compared the same way).
    The resumed run is compared with the reference's resumed one: torch's ``load_state_dict``
    casts some scalar states (ASGD's ``eta`` / ``mu``, NAdam's ``mu_product``: float32) to the
    parameter's dtype, so a resumed run differs from an uninterrupted one by that cast (NAdam's
    parameters by ~1e-9 relative: ``mu_product`` then accumulates in float64), sharded or not."""
    out = []

    def cmp(a, b, where):
        if isinstance(b, torch.Tensor):
            if isinstance(a, str):
                out.append(f"{where}: {a}")
            elif not isinstance(a, torch.Tensor):
                out.append(f"{where}: {type(a).__name__}, expected a tensor")
            elif a.shape != b.shape or a.dtype != b.dtype:
                out.append(f"{where}: {tuple(a.shape)} {a.dtype}, expected {tuple(b.shape)} {b.dtype}")
            elif b.numel():
                scale = max(b.double().abs().max().item(), 1e-3)
                err = (a.double() - b.double()).abs().max().item()
                if not err <= rel * scale:
                    out.append(f"{where}: max err {err:.3e} > {rel:.0e} * {scale:.3e}")
        elif isinstance(b, (list, tuple)):
            if not isinstance(a, (list, tuple)) or len(a) != len(b):
                out.append(f"{where}: {a!r:.60}, expected {len(b)} items")
            else:
                for i, (x, y) in enumerate(zip(a, b)):
                    cmp(x, y, f"{where}[{i}]")
        elif isinstance(b, float) and isinstance(a, (int, float)):
            if not abs(a - b) <= rel * max(abs(b), 1e-3):
                out.append(f"{where}: {a!r}, expected {b!r}")
        elif a != b:
            out.append(f"{where}: {a!r:.60}, expected {b!r:.60}")

    for phase in ("steps", "next", "resumed"):
        g, r = got[phase], ref[phase]
        cmp(g["lr"], r["lr"], f"{phase} lr")
        for kind in ("params", "state"):
            if sorted(g[kind]) != sorted(r[kind]):
                out.append(f"{phase} {kind}: names {sorted(g[kind])} != {sorted(r[kind])}")
        for n, b in r["params"].items():
            if n in g["params"]:
                cmp(g["params"][n], b, f"{phase} param {n}")
        for n, st in r["state"].items():
            if n not in g["state"]:
                continue
            if sorted(g["state"][n]) != sorted(st):
                out.append(f"{phase} state {n}: keys {sorted(g['state'][n])} != {sorted(st)}")
                continue
            for k, b in st.items():
                cmp(g["state"][n][k], b, f"{phase} state {n}.{k}")
    return out


# States torch's Optimizer.load_state_dict casts from float32 to the parameters' dtype: a resumed
# run of these optimizers differs from an uninterrupted one by that cast, sharded or not.
CAST_ON_LOAD = {"ASGD": ("eta", "mu"), "NAdam": ("mu_product",)}


def resume_differences(name: str, got: dict) -> list[str]:
    """What differs between a run's resumed step and its uninterrupted one (bit for bit: the same
    operations on the same values), for optimizers whose states load without a cast."""
    if name in CAST_ON_LOAD:
        return []
    uninterrupted = {phase: got["next"] for phase in ("steps", "next", "resumed")}
    diffs = differences({**uninterrupted, "resumed": got["resumed"]}, uninterrupted, 0.0)
    return [d.replace("resumed ", "resumed vs uninterrupted: ", 1) for d in diffs if d.startswith("resumed")]

