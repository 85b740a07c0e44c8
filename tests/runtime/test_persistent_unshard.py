"""Units whose weights are persistent and current (``no_shard``, ZeRO-1, ZeRO-2 between optimizer
steps) unshard without the gather machinery (``mfsdp2.runtime.unshard.nothing_to_gather``).

* Counted at two ranks on a stack of small units: a steady-state step (forward, backward,
  optimizer step) calls ``ParameterGroup.unshard`` only for the ZeRO-1/2 units that ask before
  the forward's re-gather after the step (one bucket for all) is first waited -- every member is
  placed then -- and never for a ``no_shard`` group, whose module computes with the
  main weights' own memory (the step wrote what it reads); a micro-batch without a step (nothing
  changed: the CPU's content check agrees nothing is stale) calls it never; no ``ag_issue`` event
  is recorded in either backward. The general path asks every group again in each forward.
* Such units stay gathered from a grad-enabled forward to their backward (a reshard would free
  nothing): two registrations per group and step instead of four, the sharded parameters back
  on the module after backward and after a grad-disabled forward, ``state_dict()`` in between
  unchanged, training bit-identical to resharding after forward.
* ZeRO-3 units keep the general path: each gathers in forward and in backward -- except on a
  shard group of one rank in the compute dtype, where the one shard is the whole parameter and
  the unit computes with it (as FSDP2 trains, bit for bit).
* The losses and parameters equal those of the same model trained with the fast path turned
  off, bit for bit (the fast path skips work that issues nothing).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard
from mfsdp2.base.profiling import event_log
from mfsdp2.groups.param_group import ParameterGroup

from .._dist import run_ranks

UNITS = 6


def _build(strategy: str, mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(UNITS)])
    for layer in model:
        fully_shard(layer, mesh=mesh, sharding_strategy=strategy)
    return fully_shard(model, mesh=mesh, sharding_strategy=strategy)


def _count_calls(cls, name: str) -> tuple:
    """Count calls of ``cls.name`` in ``calls[0]``; returns ``(calls, original)`` to put back."""
    calls = [0]
    orig = getattr(cls, name)

    def counting(self, *a, **k):
        calls[0] += 1
        return orig(self, *a, **k)

    setattr(cls, name, counting)
    return calls, orig


def _run(rank: int, ws: int, strategy: str, fast: bool) -> dict:
    import mfsdp2.runtime.unshard as unshard_mod

    if not fast:
        unshard_mod.nothing_to_gather = lambda state: False
    mesh = init_device_mesh("cpu", (ws,))
    model = _build(strategy, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls, orig = _count_calls(ParameterGroup, "unshard")
    torch.manual_seed(1 + rank)
    xs = [torch.randn(4, 16) for _ in range(6)]
    out = {"losses": [], "step_calls": [], "micro_calls": [], "bwd_ag_issue": []}
    event_log.enabled = True
    try:
        for i, x in enumerate(xs):
            micro = i % 2 == 1  # every other pass: a micro-batch without an optimizer step after it
            calls[0] = 0
            loss = model(x).square().mean()
            event_log.clear()
            loss.backward()
            out["bwd_ag_issue"].append(sum(1 for kind, _ in event_log.events if kind == "ag_issue"))
            if not micro:
                opt.step()
                opt.zero_grad(set_to_none=True)
            out["losses"].append(loss.item())
            if i >= 2:  # steady state: the recorded order exists, the previous pass stepped or not
                out["micro_calls" if i % 2 == 0 else "step_calls"].append(calls[0])
    finally:
        event_log.enabled = False
        ParameterGroup.unshard = orig
    out["params"] = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_persistent_units_skip_the_gather_path(strategy):
    fast = run_ranks(_run, 2, strategy, True)
    slow = run_ranks(_run, 2, strategy, False)
    # The root holds no parameters of its own; no_shard groups re-gather nothing after a step.
    groups = 0 if strategy == "no_shard" else UNITS
    for r, (f, s) in enumerate(zip(fast, slow)):
        # Pass i runs after pass i-1: even passes follow a micro-batch (no step), odd ones a step.
        assert f["micro_calls"] == [0] * len(f["micro_calls"]), (strategy, r, f["micro_calls"])
        # After a step the groups re-gather in one shared bucket (six small units, default cap),
        # whose first wait places every member: only the units that ask before it -- the first and
        # the one it prefetches -- call unshard; the rest take the fast path.
        assert all(c == min(groups, 2) for c in f["step_calls"]), (strategy, r, f["step_calls"])
        assert f["bwd_ag_issue"] == [0] * len(f["bwd_ag_issue"]), (strategy, r, f["bwd_ag_issue"])
        # The general path asks every group again in each forward (the units stay gathered to
        # their backward, so backward asks none on either path): strictly more calls.
        assert sum(s["micro_calls"]) > 0 and sum(s["step_calls"]) >= sum(f["step_calls"]), (strategy, r, s)
        assert f["losses"] == s["losses"], (strategy, r)
        for n, v in f["params"].items():
            assert torch.equal(v, s["params"][n]), (strategy, r, n)


def test_zero3_units_gather_in_forward_and_backward():
    (f, _) = run_ranks(_run, 2, "optim_grads_params", True)
    assert all(n > 0 for n in f["bwd_ag_issue"]), f["bwd_ag_issue"]
    assert all(n >= 2 * (UNITS - 1) for n in f["micro_calls"]), f["micro_calls"]


# -- staying gathered from forward to backward ------------------------------------------------
def _registrations(rank: int, ws: int, strategy: str, keep: bool) -> dict:
    """Per steady-state step: registrations per group, what the layers' weights are between forward
    and backward, after backward and after a grad-disabled forward, and ``state_dict()`` between
    forward and backward against the one taken after the step."""
    from torch.distributed.tensor import DTensor

    import mfsdp2.runtime.step_plan as step_plan_mod

    if not keep:
        step_plan_mod._reshard_frees_nothing = lambda state: False
    mesh = init_device_mesh("cpu", (ws,))
    model = _build(strategy, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls, orig = _count_calls(ParameterGroup, "register")
    torch.manual_seed(1 + rank)
    out = {"losses": [], "registers": [], "between": set(), "after_backward": set(), "after_eval": set(),
           "state_dict_ok": []}
    try:
        for i in range(5):
            x = torch.randn(4, 16)
            calls[0] = 0
            loss = model(x).square().mean()
            out["between"] |= {type(layer.weight) is DTensor for layer in model}
            between_sd = model.state_dict()
            loss.backward()
            out["after_backward"] |= {type(p) is DTensor for p in model.parameters()}
            after_sd = model.state_dict()
            out["state_dict_ok"].append(all(
                type(v) is DTensor and torch.equal(v.full_tensor(), after_sd[k].full_tensor())
                for k, v in between_sd.items()))
            opt.step()
            opt.zero_grad(set_to_none=True)
            out["losses"].append(loss.item())
            with torch.no_grad():
                model(x)
            out["after_eval"] |= {type(p) is DTensor for p in model.parameters()}
            if i >= 2:
                out["registers"].append(calls[0])
    finally:
        ParameterGroup.register = orig
    out["params"] = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_persistent_units_stay_gathered_from_forward_to_backward(strategy):
    """A reshard after forward frees nothing for persistent weights: each group registers its
    gathered parameters once in forward and its sharded ones once after backward (four times if
    it resharded after forward and re-registered in backward: the control). Between forward and
    backward the layers hold their gathered tensors, as FSDP2's units with
    ``reshard_after_forward=False``; ``state_dict()`` there still reports the sharded
    parameters, and after backward and after a grad-disabled forward every parameter is the
    DTensor again. Training is bit-identical to the control's."""
    kept = run_ranks(_registrations, 2, strategy, True)
    control = run_ranks(_registrations, 2, strategy, False)
    for r, (k, c) in enumerate(zip(kept, control)):
        # The forward and the post-backward: a group's two registrations; the grad-disabled
        # forward after the step registers the gathered and then the sharded ones (two more).
        assert k["registers"] == [4 * UNITS] * 3, (strategy, r, k["registers"])
        assert c["registers"] == [6 * UNITS] * 3, (strategy, r, c["registers"])
        assert k["between"] == {False} and c["between"] == {True}, (strategy, r)
        assert k["after_backward"] == k["after_eval"] == {True}, (strategy, r)
        assert all(k["state_dict_ok"]), (strategy, r)
        assert k["losses"] == c["losses"], (strategy, r)
        for n, v in k["params"].items():
            assert torch.equal(v, c["params"][n]), (strategy, r, n)


def test_zero3_units_reshard_after_forward():
    (k, _) = run_ranks(_registrations, 2, "optim_grads_params", True)
    # The layers are resharded after forward; only the root keeps its gathered (empty) state.
    assert k["between"] == {True}, k["between"]


# -- a shard group of one rank ------------------------------------------------------------------
def _one_rank(rank: int, ws: int, param_dtype) -> dict:
    """ZeRO-3 at world size 1 next to torch FSDP2's, same model and data: losses and parameters,
    and how often the units gather."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from mfsdp2 import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for impl in ("mfsdp2", "fsdp2"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(UNITS)])
        if impl == "mfsdp2":
            shard, mp = fully_shard, MixedPrecisionPolicy(param_dtype=param_dtype)
        else:
            shard, mp = torch_fully_shard, TorchMP(param_dtype=param_dtype)
        for layer in model:
            shard(layer, mesh=mesh, mp_policy=mp)
        shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        calls, orig = _count_calls(ParameterGroup, "unshard")
        losses = []
        try:
            for i in range(4):
                loss = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(i))).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        finally:
            ParameterGroup.unshard = orig
        out[impl] = {"losses": losses, "gathers": calls[0],
                     "params": {n: p.full_tensor() for n, p in model.named_parameters()}}
        if impl == "mfsdp2":  # flat gradient buffers ever taken (a one-rank reduce-scatter needs none)
            out[impl]["grad_buffers_peak"] = model.allocator.stats.peak_by_role.get("grad", 0)
    return out


def test_zero3_at_one_rank_computes_with_the_main_weights():
    """At world size 1 a ZeRO-3 unit's only shard is its whole parameter: in the compute dtype
    (no mixed precision, no offload) the module computes with the main weights and gathers
    nothing -- no second full-size copy, as no_shard --, packs its gradients straight into the
    main gradient, and trains bit for bit as FSDP2, whose units copy their shard into an
    all-gather buffer in forward and again in backward, and their gradients out of a
    reduce-scatter buffer. With
    bfloat16 compute the units still gather (cast) their weights."""
    out = run_ranks(_one_rank, 1, torch.float32)[0]
    assert out["mfsdp2"]["gathers"] == 0, out["mfsdp2"]["gathers"]
    # Its reduce-scatter over one rank is the identity: the gradients are packed straight into
    # the main gradient, with no flat buffer to copy them out of.
    assert out["mfsdp2"]["grad_buffers_peak"] == 0, out["mfsdp2"]["grad_buffers_peak"]
    assert out["mfsdp2"]["losses"] == out["fsdp2"]["losses"]
    for n, v in out["fsdp2"]["params"].items():
        assert torch.equal(out["mfsdp2"]["params"][n], v), n
    bf16 = run_ranks(_one_rank, 1, torch.bfloat16)[0]
    assert bf16["mfsdp2"]["gathers"] >= 4 * 2 * UNITS, bf16["mfsdp2"]["gathers"]
    assert bf16["mfsdp2"]["losses"] == bf16["fsdp2"]["losses"]
