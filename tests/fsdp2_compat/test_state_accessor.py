"""``fully_shard.state(module)``, side by side with torch FSDP2 in the same process.

The same float64 model is sharded by each runtime (two nested units, a two-module unit
``fully_shard([a, b])`` and the root) and the facts code written for FSDP2 reads from the state
are compared: ``None`` for modules that are not units, one state per call (shared by the modules
of a list unit), ``_is_root`` before and after ``_lazy_init()``, ``_state_ctx.all_states`` in
order, the parameter group's ``_module_fqn``, each parameter's ``_param_fqn`` / ``_orig_size``
and that ``sharded_param`` is the model's parameter object, ``_training_state`` during a forward
and after backward (FSDP2's enum), the forward-hook handles, ``_mp_policy``, ``_device``,
``mesh_info``, that the gathered outputs hold no bytes once resharded, and
``module._get_fsdp_state()``. Training through the state's parameters equals FSDP2's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from . import full, runtimes
from .._dist import run_ranks
from ..models import REL_F64, assert_close_rel


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(8, 12)
        self.out_proj = nn.Linear(12, 8)

    def forward(self, x):
        return self.out_proj(F.relu(self.in_proj(x)))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(MLP(), MLP(), MLP()).double()


def _facts(shard, mesh, rank):
    from torch.autograd.graph import _MultiHandle
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.utils.hooks import RemovableHandle

    model = _model()
    shard(model[0].in_proj, mesh=mesh)
    shard(model[0].out_proj, mesh=mesh)
    shard([model[2].in_proj, model[2].out_proj], mesh=mesh)
    shard(model, mesh=mesh)
    st = shard.state
    names = {id(m): n or "root" for n, m in model.named_modules()}
    units = {"root": model, "0.in_proj": model[0].in_proj, "0.out_proj": model[0].out_proj,
             "2.in_proj": model[2].in_proj}
    states = {k: st(m) for k, m in units.items()}
    out = {
        "not_units": [st(m) is None for m in (model[1], model[1].in_proj, model[0])],
        "distinct": len({id(s) for s in states.values()}),
        "list_unit_shared": st(model[2].out_proj) is st(model[2].in_proj),
        "list_unit_modules": [names[id(m)] for m in st(model[2].in_proj)._modules],
        "is_root_before": [s._is_root for s in states.values()],
        "all_states_before": len(states["root"]._state_ctx.all_states),
        "get_fsdp_state": all(m._get_fsdp_state() is st(m) for m in units.values()),
        "mp_param_dtype": states["root"]._mp_policy.param_dtype,
        "device": states["root"]._device.type,
        "handles": {
            k: (type(s._pre_forward_hook_handle).__name__, isinstance(s._post_forward_hook_handle, RemovableHandle))
            for k, s in states.items()
        },
        "list_handle_multi": isinstance(states["2.in_proj"]._pre_forward_hook_handle, _MultiHandle),
    }
    states["root"]._lazy_init()
    out["is_root_after"] = [s._is_root for s in states.values()]
    out["all_states"] = [names[id(s._modules[0])] for s in states["root"]._state_ctx.all_states]
    groups = {k: s._fsdp_param_group for k, s in states.items()}
    out["module_fqn"] = {k: g._module_fqn for k, g in groups.items()}
    params = dict(model.named_parameters())
    out["params"] = {
        k: sorted((fp._param_fqn, tuple(fp._orig_size), fp.sharded_param is params[fp._param_fqn])
                  for fp in g.fsdp_params)
        for k, g in groups.items()
    }
    # torch 2.11's FSDP2 state has only ``_fsdp_param_group`` (one group per unit, or None); its
    # group count is read from that there, and mfsdp2's list still has to agree with it.
    out["n_groups"] = {
        k: len(s._fsdp_param_groups) if hasattr(s, "_fsdp_param_groups") else int(s._fsdp_param_group is not None)
        for k, s in states.items()
    }
    mi = groups["root"].mesh_info
    out["mesh_info"] = (mi.mesh == mesh, mi.shard_mesh_size, mi.shard_mesh_rank == rank)
    seen = []
    model[0].in_proj.register_forward_pre_hook(lambda m, a: seen.append(st(m)._training_state))
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        loss = model(x).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    out["state_in_forward"] = [s == TrainingState.FORWARD for s in seen]
    out["idle_after"] = [s._training_state == TrainingState.IDLE for s in states.values()]
    out["group_state_after"] = [g._training_state == TrainingState.IDLE for g in groups.values()]
    out["resharded_outputs_empty"] = {
        k: all(t.untyped_storage().size() == 0 for fp in g.fsdp_params for t in fp.all_gather_outputs)
        for k, g in groups.items() if k != "root"
    }
    out["sharded_sizes"] = {fp._param_fqn: tuple(fp.sharded_size) for g in groups.values() for fp in g.fsdp_params}
    out["losses"] = losses
    out["weights"] = {k: full(p) for k, p in model.named_parameters()}
    return out


def _rank(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    return {lib: _facts(shard, mesh, rank) for lib, shard in runtimes().items()}


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(_rank, 2)


def test_state_accessor_answers_like_fsdp2():
    for r in _results():
        ours, theirs = r["mfsdp2"], r["fsdp2"]
        for key in theirs:
            if key in ("losses", "weights", "sharded_sizes"):
                continue
            if key == "all_states":
                # torch 2.11's FSDP2 lists a unit of several modules once per module (torch 2.13
                # lists each state once): compared as the states in order, each once.
                assert ours[key] == list(dict.fromkeys(theirs[key])), (key, ours[key], theirs[key])
                continue
            assert ours[key] == theirs[key], (key, ours[key], theirs[key])
        assert theirs["not_units"] == [True, True, True] and theirs["distinct"] == 4
        assert theirs["is_root_after"] == [True, False, False, False]
        assert set(ours["sharded_sizes"]) == set(theirs["sharded_sizes"])


def test_training_through_the_state_equals_fsdp2():
    for r in _results():
        for a, b in zip(r["mfsdp2"]["losses"], r["fsdp2"]["losses"]):
            assert_close_rel(a, b, "loss", REL_F64)
        for k, w in r["fsdp2"]["weights"].items():
            assert_close_rel(r["mfsdp2"]["weights"][k], w, k, REL_F64)
