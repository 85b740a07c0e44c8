"""Parameters shared across units (tied embeddings): owned by the lowest common FSDP ancestor.

Why: ``fully_shard`` runs children first. When a child unit (say ``model.embed_tokens``) has
already sharded a parameter that a module outside it also uses (``lm_head.weight`` tied to the
embedding), the child cannot see that second user. The parent's ``fully_shard`` does: its own
modules still reference the *original* parameter object, which the child marked as taken. The
parent then takes the parameter over: the child's parameter group is rebuilt without it (one
``full_tensor`` gather per remaining parameter, at wrap time), and the parent registers it on every
module that uses it, inside the child too. The parent is unsharded whenever the child runs (the
root for the whole step; an intermediate unit from its pre-forward/pre-backward on, which encloses
its children's), so every user sees the gathered weight and its gradient is reduced once.

Torch FSDP2 (2.13) raises on such parameters; here the only refused case is a parameter shared by
two units neither of which contains the other, wrapped before their common ancestor is seen: the
error says which units and how to wrap instead.
"""

from __future__ import annotations

import weakref
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate

from ..base.markers import ORIGINAL_PARAM
from ..base import plan_epoch
from ..groups.param_group import ParamInfo, ParameterGroup, mark_empty_pieces
from .state import FSDPState

__all__ = ["mark_owned", "adopt_shared"]

OWNER_ATTR = "_mfsdp2_owned_by"  # attribute on the user's original Parameter: (state, group)


def mark_owned(state: "FSDPState", originals: list[list[nn.Parameter]]) -> None:
    """Remember, on each original parameter object, which unit and group shard it (and on each
    DTensor parameter, weakly, its original)."""
    for g, params in zip(state.groups, originals):
        for p, dp in zip(params, g.dist_params):
            setattr(p, OWNER_ATTR, (state, g))
            setattr(dp, ORIGINAL_PARAM, weakref.ref(p))


def _path_in(parent: nn.Module, child: nn.Module):
    for path, m in parent.named_modules():
        if m is child:
            return path
    return None


def original_of(dp):
    ref = getattr(dp, ORIGINAL_PARAM, None)  # a weakref: never keeps a full-size original alive
    return ref() if ref is not None else None


def adopt_shared(module: nn.Module, infos: list[list["ParamInfo"]], params: list[nn.Parameter]) -> None:
    """Take over, from already wrapped units inside ``module``, the parameters that ``module``'s own
    submodules use too (``infos[i]`` gains the owners inside the child unit)."""
    for i, p in enumerate(params):
        owner = getattr(p, OWNER_ATTR, None)
        if owner is None:
            continue
        state, g = owner
        path = _path_in(module, state.module)
        if path is None or g not in state.groups:
            raise ValueError(
                f"mfsdp2 E32: parameter {infos[i][0].fqn!r} of {type(module).__name__} is also used by the unit "
                f"{type(state.module).__name__}, which is not inside it and was wrapped first; a shared parameter "
                "belongs to the lowest common ancestor of its users: leave all but one of those modules "
                "unwrapped (e.g. fully_shard the decoder layers and the root, not the embedding and the head)"
            )
        idx = next(j for j, dp in enumerate(g.dist_params) if original_of(dp) is p)
        infos[i] = infos[i] + [ParamInfo(o.owner, o.attr, f"{path}.{o.fqn}" if path else o.fqn) for o in g.infos[idx]]
        _rebuild_without(state, g, idx)


def _rebuild_without(state: "FSDPState", g: "ParameterGroup", idx: int) -> None:
    """Replace ``g`` in ``state.groups`` by a group of the same parameters minus ``idx`` (or drop it).
    Collective: every rank gathers the values that stay (all ranks run fully_shard together)."""
    keep = [j for j in range(len(g.infos)) if j != idx]
    gi = state.groups.index(g)
    if not keep:
        del state.groups[gi]
        return
    params = []
    for j in keep:
        dp, spec = g.dist_params[j], g.tp_specs[j]
        # The group shards TP-local tensors: a tensor-parallel parameter is gathered over the
        # data-parallel dimension only (its layout slot has the local shape), keeping its TP spec.
        if g.needs_init:
            value = torch.empty(g.layout.slots[j].shape, dtype=g.orig_dtype, device="meta")
        else:
            # Gathered on the compute device: CPU-offloaded shards live in host memory, which the
            # mesh's device group (NCCL) cannot gather. A no-op without offload.
            src = dp.detach().to(g.device)
            if spec is not None:
                value = src.redistribute(dp.device_mesh, spec.placements + (Replicate(),)).to_local().to(g.orig_dtype)
            else:
                value = src.full_tensor().to(g.orig_dtype)
        p = nn.Parameter(value, requires_grad=g.requires_grad)
        for k, v in dp.__dict__.items():
            if not k.startswith("_mfsdp2"):
                setattr(p, k, v)
        params.append(p)
    new = ParameterGroup(
        g.unit_name, [g.infos[j] for j in keep], params, g.mesh, g.comm, g.device, state.mp, g.config,
        tp_specs=[g.tp_specs[j] for j in keep], shard_dims=[g.layout.slots[j].shard_dim for j in keep],
    )
    for j, dp in zip(keep, new.dist_params):
        setattr(dp, ORIGINAL_PARAM, getattr(g.dist_params[j], ORIGINAL_PARAM, None))
        orig = original_of(dp)
        if orig is not None:
            setattr(orig, OWNER_ATTR, (state, new))
    new.register(unsharded=False, check=False)
    state.groups[gi] = new
    plan_epoch.bump(plan_epoch.PlanChange.PARAMETERS)
    mark_empty_pieces(new)
