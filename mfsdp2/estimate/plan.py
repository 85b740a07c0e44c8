"""The static half of a memory estimate: which unit owns which parameters, the groups and flat
layouts ``fully_shard`` would build, and the per-rank bytes that follow from them exactly.

Nothing here needs a process group or real memory: a unit's parameters are found the way
``fully_shard`` finds them (its own modules' parameters in registration order, nested units
skipped, a parameter used by several units owned by their lowest common unit), grouped by
``(dtype, requires_grad, fp8)`` as ``fully_shard`` groups them, and each group's layout is
:func:`mfsdp2.memory.layout.plan_layout` called with the arguments :class:`~mfsdp2.groups.param_group.ParameterGroup`
passes (the shard-group size, 16 bytes of the narrower of the compute and main dtypes). So the
shard size ``S``, the padding and every rank's rows are the runtime's, and the bytes of main
weights, main gradients, persistent weights and optimizer states are exact per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.nn as nn

from ..memory.layout import BufferLayout, plan_layout
from ..precision.mixed_precision import MixedPrecisionPolicy
from ..base.strategy import ShardingStrategy

__all__ = ["GroupPlan", "UnitPlan", "plan_units", "resolve_units", "OptimizerSpec", "OPTIMIZERS"]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True)
class OptimizerSpec:
    """What an optimizer keeps per parameter and what its step allocates.

    ``states``: state tensors the size of the parameter's local rows, in the main dtype;
    ``step_tensor``: a 4-byte ``step`` tensor per parameter (on the host for CUDA parameters
    unless fused / capturable, as torch keeps it); ``temps``: parameter-sized temporaries alive at
    once inside the step -- per parameter for the single-tensor loop (plus the previous
    parameter's last one, still held by its local variable: :func:`optimizer_temp_bytes`),
    over all of a device's parameters for ``foreach`` (torch's ``_foreach_sqrt`` of the second
    moments, ...), none for ``fused``. ``flat``: the states are flat tensors over the span of the
    shard holding the rank's pieces, padding between pieces included (``mfsdp2.optim.AdamW``:
    in-place steps, no temporaries); ``state_dtype``: the states' dtype where it is not the
    main weights' (bfloat16 moments, whose step counters stay on the host)."""

    states: int
    step_tensor: bool
    temps_single: int
    temps_foreach: int
    flat: bool = False
    state_dtype: Optional[torch.dtype] = None


OPTIMIZERS = {
    # AdamW / Adam: exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad); the single-tensor step makes
    # sqrt(exp_avg_sq) and its quotient (two temporaries), foreach one list of sqrt.
    "adamw": OptimizerSpec(2, True, 2, 1),
    "adam": OptimizerSpec(2, True, 2, 1),
    "adamw_amsgrad": OptimizerSpec(3, True, 2, 1),
    "adam_amsgrad": OptimizerSpec(3, True, 2, 1),
    "sgd": OptimizerSpec(0, False, 0, 0),
    "sgd_momentum": OptimizerSpec(1, False, 0, 0),
    "adagrad": OptimizerSpec(1, True, 1, 1),
    "rmsprop": OptimizerSpec(1, True, 1, 1),
    "rmsprop_momentum": OptimizerSpec(2, True, 1, 1),
    "rmsprop_centered": OptimizerSpec(2, True, 2, 1),
    # mfsdp2.optim.AdamW: flat states, stepped in place (native kernel / one fused launch per group)
    "mfsdp2_adamw": OptimizerSpec(2, True, 0, 0, flat=True),
    "mfsdp2_adamw_amsgrad": OptimizerSpec(3, True, 0, 0, flat=True),
    "mfsdp2_adamw_bf16": OptimizerSpec(2, True, 0, 0, flat=True, state_dtype=torch.bfloat16),
    "mfsdp2_adamw_bf16_amsgrad": OptimizerSpec(3, True, 0, 0, flat=True, state_dtype=torch.bfloat16),
}


@dataclass
class GroupPlan:
    """One :class:`~mfsdp2.groups.param_group.ParameterGroup` as ``fully_shard`` would build it."""

    unit: str
    index: int
    shapes: list[tuple[int, ...]]
    param_ids: list[int]
    orig_dtype: torch.dtype
    requires_grad: bool
    fp8: Optional[torch.dtype]
    compute_dtype: torch.dtype
    main_dtype: torch.dtype
    grad_dtype: torch.dtype
    reduce_dtype: torch.dtype
    layout: BufferLayout
    # Per-parameter meshes (expert parallelism): ``mesh`` names the group's data-parallel mesh
    # ("" for the unit's), ``world`` its shard-group size, and a rank of the unit's shard group
    # is rank ``r // rank_div`` of this one (torchtitan's (efsdp, ep) order: ep innermost).
    mesh: str = ""
    world: int = 1
    rank_div: int = 1

    @property
    def S(self) -> int:
        return self.layout.shard_numel

    @property
    def total(self) -> int:
        return self.layout.total_numel

    def local_numel(self, rank: int) -> int:
        """Elements of this rank's rows (the optimizer's states follow these, not the padding)."""
        lo, hi = self.layout.shard_range(rank // self.rank_div)
        return sum(max(0, min(hi, s.offset + s.numel) - max(lo, s.offset)) for s in self.layout.slots)

    def local_span(self, rank: int) -> int:
        """Elements from this rank's first piece to its last, padding between them included (the
        span ``mfsdp2.optim.AdamW``'s flat states cover)."""
        lo, hi = self.layout.shard_range(rank // self.rank_div)
        ends = [(max(lo, s.offset), min(hi, s.offset + s.numel)) for s in self.layout.slots
                if min(hi, s.offset + s.numel) > max(lo, s.offset)]
        return max(e for _, e in ends) - min(b for b, _ in ends) if ends else 0

    def local_pieces(self, rank: int) -> list[int]:
        lo, hi = self.layout.shard_range(rank // self.rank_div)
        return [max(0, min(hi, s.offset + s.numel) - max(lo, s.offset)) for s in self.layout.slots]


@dataclass
class UnitPlan:
    name: str
    modules: list[nn.Module]
    groups: list[GroupPlan] = field(default_factory=list)
    is_root: bool = False

    def gathered_bytes(self) -> int:
        """The unit's gathered weights (every group's full buffer in its compute dtype)."""
        return sum(g.total * _itemsize(g.compute_dtype) for g in self.groups)

    def flat_grad_bytes(self) -> int:
        """The flat gradients its reduction reads (reduce dtype, every trainable group)."""
        return sum(g.total * _itemsize(g.reduce_dtype) for g in self.groups if g.requires_grad)


UnitsArg = Union[None, Sequence[nn.Module], type, tuple, Callable[[str, nn.Module], bool]]


def resolve_units(model: nn.Module, units: UnitsArg) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every unit, the root (``model``) last. ``units``: a list of modules of
    ``model``, a module class (or tuple of classes: every module of that type), or a predicate
    ``(path, module) -> bool``; None: the root alone."""
    named = list(model.named_modules())
    if units is None:
        chosen: list[tuple[str, nn.Module]] = []
    elif isinstance(units, type) or (isinstance(units, tuple) and units and all(isinstance(u, type) for u in units)):
        chosen = [(n, m) for n, m in named if isinstance(m, units) and m is not model]
    elif callable(units) and not isinstance(units, nn.Module):
        chosen = [(n, m) for n, m in named if m is not model and units(n, m)]
    else:
        ids = {id(m) for m in units}
        chosen = [(n, m) for n, m in named if id(m) in ids and m is not model]
        paths = {id(m) for _, m in chosen}
        missing = [type(m).__name__ for m in units if id(m) not in paths and m is not model]
        if missing:
            raise ValueError(f"mfsdp2.estimate_memory: units {missing} are not sub-modules of the model")
    return chosen + [("", model)]


def _owned_params(units: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Parameter]]]:
    """Per unit: its own parameters as ``fully_shard`` collects them (registration order, nested
    units skipped, deduplicated); a parameter several units use goes to their lowest common unit
    (``shared_params.adopt_shared``)."""
    unit_ids = {id(m): i for i, (_, m) in enumerate(units)}
    parent: dict[int, Optional[int]] = {}
    uses: dict[int, list[int]] = {}
    params: dict[int, tuple[str, nn.Parameter]] = {}
    per_unit: list[list[int]] = [[] for _ in units]

    def visit(i: int, m: nn.Module, prefix: str) -> None:
        for attr, p in m._parameters.items():
            if p is None:
                continue
            if id(p) not in params:
                params[id(p)] = (prefix + attr, p)
            if i not in uses.setdefault(id(p), []):
                uses[id(p)].append(i)
                per_unit[i].append(id(p))
        for name, child in m._modules.items():
            if child is None:
                continue
            if id(child) in unit_ids:
                parent.setdefault(unit_ids[id(child)], i)
                continue
            visit(i, child, prefix + name + ".")

    # Children first, as fully_shard is applied; parents are found while walking the root down.
    for i, (path, m) in reversed(list(enumerate(units))):
        visit(i, m, path + "." if path else "")

    def ancestors(i: int) -> list[int]:
        out = [i]
        while parent.get(out[-1]) is not None:
            out.append(parent[out[-1]])
        return out

    owner: dict[int, int] = {}
    for pid, us in uses.items():
        # Used by several units: the one above all the others takes it (a tied embedding and
        # output layer: the root); units that are not nested in each other cannot share one.
        owner[pid] = next((u for u in us if all(u in ancestors(v) for v in us)), us[0])
    return [[params[pid] for pid in per_unit[i] if owner[pid] == i] for i in range(len(units))]


def plan_units(
    units: list[tuple[str, nn.Module]],
    shard_world: int,
    mp: MixedPrecisionPolicy,
    shard_dims: Optional[Callable[[str, nn.Parameter], int]] = None,
    experts: Optional[Callable[[str, nn.Parameter], bool]] = None,
    expert_parallel: int = 1,
) -> list[UnitPlan]:
    """Groups and layouts of every unit (``shard_world``: the shard-group size; 1 for no_shard).

    ``experts`` / ``expert_parallel`` (torchtitan's MoE sharding): with ``expert_parallel > 1``
    the parameters ``experts(fqn, p)`` picks are DTensors ``Shard(0)`` over that many ranks, and
    each rank's local experts are sharded over the expert-data-parallel group of
    ``shard_world // expert_parallel`` ranks: their own group (``fully_shard`` keys groups by
    mesh, :mod:`mfsdp2.frontend.param_grouping`), planned from the local shape."""
    owned = _owned_params(units)
    plans = []
    for (path, module), params in zip(units, owned):
        unit = UnitPlan(path or "root", [module], is_root=path == "")
        by_key: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
        seen: set[int] = set()
        for fqn, p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            fp8 = mp.all_gather_dtype if p.dim() >= 2 and p.dtype.is_floating_point else None
            expert = expert_parallel > 1 and experts is not None and experts(fqn, p)
            by_key.setdefault((expert, p.dtype, p.requires_grad, fp8), []).append((fqn, p))
        for gi, ((expert, dtype, rg, fp8), ps) in enumerate(by_key.items()):
            compute = mp.compute_dtype(dtype)
            main = mp.main_dtype(dtype, rg)
            itemsize = min(torch.finfo(d).bits if d.is_floating_point else torch.iinfo(d).bits
                           for d in (compute, main)) // 8
            shapes = [tuple(int(s) for s in p.shape) for _, p in ps]
            world, div = shard_world, 1
            if expert:  # the local experts, over the expert-data-parallel group
                shapes = [(s[0] // expert_parallel,) + s[1:] for s in shapes]
                world, div = max(shard_world // expert_parallel, 1), expert_parallel
            dims = [int(shard_dims(f, p)) if shard_dims else 0 for f, p in ps]
            layout = plan_layout(shapes, world, align=max(16 // itemsize, 1), dims=dims)
            unit.groups.append(GroupPlan(unit.name, gi, shapes, [id(p) for _, p in ps], dtype, rg, fp8, compute, main,
                                         mp.grad_dtype(dtype, rg), mp.wire_reduce_dtype(compute), layout,
                                         mesh="experts" if expert else "", world=world, rank_div=div))
        plans.append(unit)
    return plans


def keeps_full_weights(g: GroupPlan, strategy: ShardingStrategy, offloaded: bool) -> bool:
    """Whether group ``g`` keeps its full weights for the whole run instead of gathering them,
    as the runtime's group decides (:meth:`ShardingStrategy.keeps_full_weights`)."""
    return strategy.keeps_full_weights(g.world, g.main_dtype == g.compute_dtype and not offloaded, g.fp8 is not None)


def persistent_bytes(plans: Iterable[UnitPlan], strategy: ShardingStrategy, offloaded: bool, rank: int,
                     optimizer: OptimizerSpec, step_on_device: bool) -> dict[str, int]:
    """Exact per-rank bytes of what lives for the whole run, by kind, split device / host.

    ``model_weights``: the full weights persistent groups keep (ZeRO-1/2, no_shard; see
    :func:`keeps_full_weights`), in the compute dtype; ``main_weights``: the shard the
    optimizer updates (none extra where it is the persistent buffer's own slice);
    ``main_grads``: each group's main gradient (shard-size, or full-size for ZeRO-1 /
    no_shard) -- live from the first reduction to the next root forward;
    ``optimizer_states``: the states over this rank's rows (plus 4-byte step tensors)."""
    out = dict.fromkeys(("model_weights", "main_weights", "main_grads", "optimizer_states",
                         "host_main_weights", "host_main_grads", "host_optimizer_states"), 0)
    for u in plans:
        for g in u.groups:
            shares = g.main_dtype == g.compute_dtype and not offloaded
            persistent = keeps_full_weights(g, strategy, offloaded)
            if persistent:
                out["model_weights"] += g.total * _itemsize(g.compute_dtype)
            if not (persistent and shares):
                out["host_main_weights" if offloaded else "main_weights"] += g.S * _itemsize(g.main_dtype)
            if g.requires_grad:
                n = g.S if strategy.shards_grads else g.total
                out["host_main_grads" if offloaded else "main_grads"] += n * _itemsize(g.grad_dtype)
                rows = g.local_span(rank) if optimizer.flat else g.local_numel(rank)
                states = optimizer.states * rows * _itemsize(optimizer.state_dtype or g.main_dtype)
                steps = 4 * len(g.shapes) if optimizer.step_tensor else 0
                out["host_optimizer_states" if offloaded else "optimizer_states"] += states
                out["optimizer_states" if step_on_device and not offloaded else "host_optimizer_states"] += steps
    return out


def optimizer_temp_bytes(plans: Iterable[UnitPlan], rank: int, optimizer: OptimizerSpec, impl: str,
                         order: Optional[Sequence[int]] = None) -> int:
    """Bytes of the optimizer step's temporaries on ``rank`` (see :class:`OptimizerSpec`).

    The single-tensor loop keeps its last temporary in a local variable (AdamW's ``denom``) until
    the next parameter's step assigns it again, after making that parameter's own: the most at
    once is the previous parameter's piece plus ``temps_single`` of the current one, in the order
    the optimizer walks them (``order``: parameter ids as ``model.parameters()`` gives them;
    default: the plans' order)."""
    trainable = [g for u in plans for g in u.groups if g.requires_grad]
    if impl == "fused" or not trainable:
        return 0
    if impl == "foreach":
        by_dtype: dict[torch.dtype, int] = {}
        for g in trainable:
            by_dtype[g.main_dtype] = by_dtype.get(g.main_dtype, 0) + g.local_numel(rank)
        return optimizer.temps_foreach * max(n * _itemsize(d) for d, n in by_dtype.items())
    if optimizer.temps_single == 0:
        return 0
    piece: dict[int, int] = {}
    for g in trainable:
        for pid, n in zip(g.param_ids, g.local_pieces(rank)):
            piece[pid] = n * _itemsize(g.main_dtype)
    walk = [pid for pid in (order if order is not None else piece) if pid in piece]
    most, prev = 0, 0
    for pid in walk:
        most = max(most, prev + optimizer.temps_single * piece[pid])
        prev = piece[pid]
    return most
