"""Diagnostics: what the runtime built, whether its buffers are sound, and what the gradients say.

* :func:`describe` -- a readable table of units, parameter groups, buffers, padding and bytes per
  rank (the question every FSDP user asks first: "where did my memory go?").
* :func:`check_buffers` -- the debug check that no two parameter views of any buffer overlap, that
  every view lies inside its buffer and that the DTensor parameters still view the main weights
  (a user who replaced a parameter after ``fully_shard`` is found here).
* :func:`grad_norms` / :func:`weight_norms` -- per-parameter global L2 norms (one all-reduce for
  the whole model: each rank sums the squares of its rows, the sum over ranks is exact).
* :func:`check_finite_grads` -- a NaN/Inf check of the reduced gradients whose error names the
  parameters; every rank learns the same verdict (one all-reduce), so all raise together instead
  of one rank raising and the others hanging in the next collective.

All functions take the root module (or any module containing FSDP units) and are collective when
they communicate: call them on every rank.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["describe", "check_buffers", "grad_norms", "weight_norms", "check_finite_grads"]


def _units(model: nn.Module) -> Iterator[tuple[str, object]]:
    for path, m in model.named_modules():
        st = getattr(m, "_mfsdp2_state", None)
        if st is not None:
            yield (path or "root"), st


def _groups(model: nn.Module):
    for path, st in _units(model):
        for g in st.groups:
            yield path, g


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def describe(model: nn.Module) -> str:
    """Units, groups and bytes on this rank, as a plain-text table (no communication)."""
    headers = ["unit", "group", "mesh", "strategy", "params", "elements", "padding", "shard elems", "main weight",
               "model weight", "main grad", "gathered", "world"]
    rows = []
    tot = dict(main=0, model=0, grad=0, gathered=0, elems=0, padded=0)
    for path, g in _groups(model):
        lay = g.layout
        S = lay.shard_numel
        P = lay.total_numel
        aliased = g.main_weight.data_ptr() == g.weights.shard.data_ptr()
        # Persistent strategies hold the whole buffer (their main weights are its slice when the
        # dtypes match); ZeRO-3 casts the main shard into each gather and keeps no model copy.
        main = 0 if (g.persistent and aliased) else S * g.main_weight.element_size()
        if g.persistent:
            model_shard = g.weights.nbytes
        else:
            model_shard = 0 if aliased else S * g.weights.shard.element_size()
        grad_elems = P if g.full_grads else S
        grad = grad_elems * torch.empty((), dtype=g.grad_dtype).element_size() if g.requires_grad else 0
        gathered = 0 if g.persistent else g.weights.nbytes
        strategy = (g.strategy.value + ("+fp8" if g.fp8 is not None else "")
                    + (" hsdp" if g.replicate_comm is not None and g.config.shard_dim is not None else ""))
        strategy += " cpu-offload" if g.main.offloaded else ""  # main weight / main grad in host memory
        dt = str(g.compute_dtype).replace("torch.", "")
        if g.compute_dtype != g.orig_dtype:
            dt = f"{str(g.orig_dtype).replace('torch.', '')}->{dt}"
        rows.append([path, dt + ("" if g.requires_grad else " frozen"), _mesh_label(g), strategy, str(len(lay.slots)),
                     f"{lay.param_numel:,}",
                     f"{lay.padding_fraction:.2%}", f"{S:,}", _fmt(main), _fmt(model_shard), _fmt(grad),
                     _fmt(gathered), str(lay.world_size)])
        tot["main"] += main
        tot["model"] += model_shard
        tot["grad"] += grad
        tot["gathered"] = max(tot["gathered"], gathered)
        tot["elems"] += lay.param_numel
        tot["padded"] += lay.total_numel
    pad = tot["padded"] / tot["elems"] - 1 if tot["elems"] else 0.0
    rows.append(["total", "", "", "", "", f"{tot['elems']:,}", f"{pad:.2%}", "", _fmt(tot["main"]), _fmt(tot["model"]),
                 _fmt(tot["grad"]), "max " + _fmt(tot["gathered"]), ""])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(headers, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(
        "main weight / model weight / main grad: bytes each rank holds (main grads only from the first "
        "reduction to the next forward after zero_grad; model weight: the full buffer for strategies that keep "
        "it); gathered: one unit's transient unsharded buffer while it runs; mesh: the group's data-parallel "
        "mesh (a unit's parameters may have several: shard_placement_fn), after '/' the tensor- or "
        "expert-parallel mesh its parameters are DTensors on"
    )
    return "\n".join(lines)


def _mesh_label(g) -> str:
    """``fsdp=4``; ``efsdp=2 / ep=2`` for expert-parallel parameters sharded over ``efsdp``."""
    def dims(mesh) -> str:
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        return "x".join(f"{n}={s}" for n, s in zip(names, mesh.shape))

    label = dims(g.mesh)
    model_parallel = {dims(t.mesh) for t in g.tp_specs if t is not None}
    return label + "".join(f" / {m}" for m in sorted(model_parallel))


def check_buffers(model: nn.Module) -> None:
    """Raise ``AssertionError`` naming the parameter when two views of a buffer overlap, a view
    leaves its buffer, or an optimizer-facing parameter no longer views the main weights."""
    for path, g in _groups(model):
        lay = g.layout
        spans = sorted((s.offset, s.offset + s.numel, i) for i, s in enumerate(lay.slots))
        names = [infos[0].fqn for infos in g.infos]
        for (a0, a1, i), (b0, b1, j) in zip(spans, spans[1:]):
            if b0 < a1:
                raise AssertionError(
                    f"mfsdp2 E22: unit {path!r}: parameters {names[i]!r} [{a0}, {a1}) and {names[j]!r} "
                    f"[{b0}, {b1}) overlap in the flat buffer"
                )
        if spans and spans[-1][1] > lay.total_numel:
            raise AssertionError(f"mfsdp2: unit {path!r}: parameter {names[spans[-1][2]]!r} ends past its buffer")
        lo = g.main_weight.data_ptr()
        hi = lo + g.main_weight.numel() * g.main_weight.element_size()
        for i, dp in enumerate(g.dist_params):
            owner = g.infos[i][0]
            current = owner.owner._parameters.get(owner.attr)
            if current is not dp and current is not g.unsharded_params[i]:
                raise AssertionError(
                    f"mfsdp2: parameter {names[i]!r} of unit {path!r} was replaced after fully_shard; "
                    "the runtime no longer trains it. Change values in place (param.data.copy_ / "
                    "load_state_dict) instead of assigning a new Parameter"
                )
            local = dp._local_tensor
            if local.numel() and not (lo <= local.data_ptr() < hi):
                raise AssertionError(f"mfsdp2: parameter {names[i]!r} of unit {path!r} "
                                     "no longer views its main-weight shard")


def _norms(model: nn.Module, which: str) -> dict[str, float]:
    names, sq = [], []
    dev = None
    for path, g in _groups(model):
        for i, dp in enumerate(g.dist_params):
            t = dp.grad if which == "grad" else dp
            local = None if t is None else t._local_tensor
            sq.append(local.detach().double().pow(2).sum() if local is not None and local.numel()
                      else torch.zeros((), dtype=torch.float64))
            names.append(g.infos[i][0].fqn if path == "root" else f"{path}.{g.infos[i][0].fqn}")
            dev = g.device
    if not names:
        return {}
    vec = torch.stack(sq).to(dev)
    if dist.is_initialized():
        dist.all_reduce(vec)  # each row lives on exactly one rank: the sum is the global square norm
    return {n: math.sqrt(v) for n, v in zip(names, vec.tolist())}


def grad_norms(model: nn.Module) -> dict[str, float]:
    """Global L2 norm of every parameter's (reduced) gradient, by name; 0 where there is none."""
    return _norms(model, "grad")


def weight_norms(model: nn.Module) -> dict[str, float]:
    """Global L2 norm of every parameter's main weight (fp32), by name."""
    return _norms(model, "weight")


def check_finite_grads(model: nn.Module) -> None:
    """Raise ``FloatingPointError`` on every rank when any rank's reduced gradient holds NaN/Inf,
    naming the parameters (e.g. after ``loss.backward()``, before ``optimizer.step()``)."""
    names, flags = [], []
    dev = None
    for path, g in _groups(model):
        for i, dp in enumerate(g.dist_params):
            local = None if dp.grad is None else dp.grad._local_tensor
            bad = local is not None and local.numel() > 0 and not bool(torch.isfinite(local).all())
            flags.append(1.0 if bad else 0.0)
            names.append(g.infos[i][0].fqn if path == "root" else f"{path}.{g.infos[i][0].fqn}")
            dev = g.device
    if not names:
        return
    vec = torch.tensor(flags, device=dev)
    if dist.is_initialized():
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    bad = [n for n, f in zip(names, vec.tolist()) if f]
    if bad:
        raise FloatingPointError(
            f"mfsdp2 E21: non-finite gradients (NaN/Inf) in {len(bad)} parameter(s): {bad[:10]}"
            + (" ..." if len(bad) > 10 else "")
            + "; lower the learning rate, check the loss for overflow, or use a loss scaler"
        )
