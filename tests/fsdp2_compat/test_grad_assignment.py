"""A gradient the user *assigns* between two ``backward()`` calls is what the second one adds to.

torch accumulates into whatever tensor ``p.grad`` holds, and FSDP2 does the same for its sharded
gradients (it adds each reduction into the existing ``.grad``). Trainers assign gradients: a
rescale written as ``p.grad = p.grad * s`` between micro-batches, ``p.grad = torch.zeros_like(p)``
to restart a parameter, a gradient loaded from elsewhere. Before: mfsdp2 folded the assigned
tensor into its main gradient and added the reduction there, but left the user's tensor in
``.grad``, so the optimizer stepped the value from *before* the second backward (1/3 off for a
doubled gradient, the whole reduction lost for a fresh zero tensor) -- silently.

Each scenario: backward, the edit, backward, ``opt.step()``. Float64 at world size 2, every
mfsdp2 strategy (ZeRO-3 also with small units' reductions in a bucket and without, and with CPU
offload: main gradients in host memory), against
torch FSDP2 (ZeRO-3, ZeRO-2) run in its own rank processes and against the unsharded model doing
the same edits on the whole batch: gradients after the second backward and weights after the step
to 1e-10 relative (``tests/models.py``: float64 sums in another order differ by ~1e-14).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, build, loss_fn, shard_blocks
from . import full, runtimes

WS, GB = 2, 8
SCENARIOS = ("scaled_copy", "fresh_zeros", "one_replaced", "replaced_then_zeroed", "in_place", "assigned_first")
# name -> (runtime, fully_shard kwargs, all-reduce bucket cap in MiB or None for the default)
SETUPS = {
    "fsdp2_zero3": ("fsdp2", {}, None),
    "fsdp2_zero2": ("fsdp2", {"reshard_after_forward": False}, None),
    "zero3": ("mfsdp2", {}, None),
    "zero3_unbucketed": ("mfsdp2", {}, 0),
    "zero2": ("mfsdp2", {"sharding_strategy": "optim_grads"}, None),
    "zero1": ("mfsdp2", {"sharding_strategy": "optim"}, None),
    "no_shard": ("mfsdp2", {"sharding_strategy": "no_shard"}, None),
    "zero3_offload": ("mfsdp2", {"offload_policy": "cpu"}, None),  # main grads in host memory
}


def _edit(model, scenario: str) -> None:
    """The user's edit between the two backward() calls (same code for every runtime)."""
    params = dict(model.named_parameters())
    if scenario == "scaled_copy":
        for p in params.values():
            p.grad = p.grad * 2
    elif scenario == "fresh_zeros":
        for p in params.values():
            p.grad = torch.zeros_like(p)
    elif scenario == "one_replaced":  # one assigned gradient among the unit's own views
        p = params["blocks.1.fc1.weight"]
        p.grad = p.grad * -3
    elif scenario == "replaced_then_zeroed":  # then zero_grad(set_to_none=False) zeroes it in place
        for p in params.values():
            p.grad = p.grad * 5
        model.zero_grad(set_to_none=False)
    elif scenario == "assigned_first":  # before the first backward (no gradient yet)
        for p in params.values():
            p.grad = torch.full_like(p, 0.5)
    else:
        for p in params.values():
            p.grad.mul_(2)


def _step(model, scenario: str, halves) -> None:
    if scenario == "assigned_first":
        _edit(model, scenario)
    for i in (0, 1):
        loss_fn(model(halves[i][0]), halves[i][1]).backward()
        if i == 0 and scenario != "assigned_first":
            _edit(model, scenario)


def _run(rank, ws, setups):
    mesh = init_device_mesh("cpu", (ws,))
    x, y = batch(0, GB, 12, dtype=F64)
    n = GB // ws
    mine = (x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
    out = {}
    for name in setups:
        runtime, kwargs, cap = SETUPS[name]
        if kwargs.get("offload_policy") == "cpu":
            from torch.distributed.fsdp import CPUOffloadPolicy  # what mfsdp2 takes too

            kwargs = {**kwargs, "offload_policy": CPUOffloadPolicy(pin_memory=False)}
        for scenario in SCENARIOS:
            model = shard_blocks(build("net", dtype=F64), mesh, runtimes()[runtime], **kwargs)
            if cap is not None:
                model.set_all_reduce_bucket_cap_mb(cap)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            _step(model, scenario, (mine, mine))  # both backward() calls on this rank's half
            grads = {k: full(p.grad) for k, p in model.named_parameters()}
            opt.step()
            out[(name, scenario)] = (grads, {k: full(p) for k, p in model.named_parameters()})
    return out


def _reference(scenario: str):
    """The unsharded model: each backward on the whole batch, the loss the mean of the ranks'
    losses (the sharded runs average their gradients over ranks)."""
    model = build("net", dtype=F64)
    x, y = batch(0, GB, 12, dtype=F64)
    n = GB // WS

    def backward_whole():
        sum(loss_fn(model(x[r * n : (r + 1) * n]), y[r * n : (r + 1) * n]) for r in range(WS)).div(WS).backward()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if scenario == "assigned_first":
        _edit(model, scenario)
    backward_whole()
    if scenario != "assigned_first":
        _edit(model, scenario)
    backward_whole()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    opt.step()
    return grads, {k: p.detach().clone() for k, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results():
    fsdp2 = run_ranks(_run, WS, ["fsdp2_zero3", "fsdp2_zero2"])
    ours = run_ranks(_run, WS, [k for k, v in SETUPS.items() if v[0] == "mfsdp2"])
    return [{**a, **b} for a, b in zip(fsdp2, ours)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_assigned_grad_is_accumulated_into_like_torch_and_fsdp2(results, scenario):
    ref_grads, ref_params = _reference(scenario)
    for rank, res in enumerate(results):
        for setup in SETUPS:
            grads, params = res[(setup, scenario)]
            for k in ref_grads:
                where = f"{setup} {scenario} rank {rank} {k}"
                assert grads[k] is not None, f"{where}: grad is None"
                assert_close_rel(grads[k], ref_grads[k], f"{where} grad", REL_F64)
                assert_close_rel(params[k], ref_params[k], f"{where} weight after step", REL_F64)
        # mfsdp2 against FSDP2 directly (ZeRO-3 and ZeRO-2): the same gradients and weights.
        for ours, theirs in (("zero3", "fsdp2_zero3"), ("zero2", "fsdp2_zero2")):
            for k in ref_grads:
                assert_close_rel(res[(ours, scenario)][0][k], res[(theirs, scenario)][0][k],
                                 f"{ours} vs {theirs} {scenario} rank {rank} {k} grad", REL_F64)
