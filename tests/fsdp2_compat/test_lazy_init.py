"""What may happen to a sharded model between ``fully_shard`` and its first forward, run by torch
FSDP2 and by mfsdp2 (ZeRO-3, ZeRO-2, and no_shard at world size 2) on the same float64 model and
data in the same process, and by the unsharded model.

The model is torchtitan's shape: an input layer owned by the root, blocks as units of their own,
and the final norm and the output layer together as one unit of two modules
(``fully_shard([model.norm, model.head])``). Each flow ends with three AdamW steps; per step the
mean loss, and at the end every full parameter and the last step's full gradients, must equal
FSDP2's and the unsharded model's (REL_F64: only reduction orders differ).

* Init paths with a unit of several modules: ``model.to_empty(device)`` of a meta build,
  ``to_empty`` module by module in a mixed order (a plain sub-module of the root among them),
  ``model.to(float64)`` of an fp32 model and ``.double()`` module by module, a meta
  ``.to(float64)`` followed by ``mfsdp2.materialize`` (FSDP2: ``to_empty`` and the same init), and
  ``to_empty`` followed by ``load_state_dict`` of ``Shard(0)`` DTensors.
* ``to_empty`` of some modules only: the forward is refused, naming the parameters still on meta
  (FSDP2 refuses it too); the values already initialised survive the later ``to_empty`` of the
  rest, and the model then trains like FSDP2's.
* ``.float()`` of one module of a float64 unit: refused at the forward, naming the dtypes (FSDP2:
  "uniform original parameter dtype"); ``.double()`` back and it trains like FSDP2 after the same
  round trip.
* Replaced parameters: every parameter assigned ``nn.Parameter(distribute_tensor(full, mesh,
  [Shard(0)]))`` before the first forward is taken, as FSDP2 takes it, for a meta model too;
  torch's own case, a meta parameter of the root replaced by a DTensor computed from two other
  units' parameters (other rows than its own; its ``state_dict()`` before the forward too); a
  plain-tensor replacement is refused with a message (FSDP2: AttributeError).
* ``unshard(async_op=True)`` of units below the root before the root's first forward (pipeline
  schedules do it) is accepted and trains like FSDP2.
* Also: a materialize after ``to_empty`` of part of the model initialises only what is still on
  meta; ``.double()`` module by module with gradients present converts them (the first backward
  adds to them); a unit of several modules kept gathered after forward gives the sharded main
  weights in ``state_dict()``; a bf16 meta model computes in bf16 after ``to_empty``, and in
  float32 after ``.float()``, as FSDP2's.

The model, the flows and the rank-side cases are in ``_lazy_init_flows.py``. One spawn of ranks
per world size (``_results``) runs every flow and case, and every test here checks part of what
it returned, so the tests stay in this one file: the spawn runs once per world size per worker.
"""

from __future__ import annotations

import pytest
import torch

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, loss_fn, make_opt
from ._lazy_init_flows import (
    D_IN,
    FLOWS,
    GB,
    STEPS,
    NormNet,
    _initial_grads,
    _norm_net_values,
    _ours,
    _reference_values,
    _run,
    _titan,
)


def _reference_run(values: dict, grads: dict | None = None) -> dict:
    model = _titan()
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(values[k])
            if grads is not None:
                p.grad = grads[k].to(p.dtype)
    opt = make_opt("adamw", model.parameters())
    losses, grads = [], {}
    for s in range(STEPS):
        x, y = batch(s, GB, D_IN, dtype=F64)
        loss = loss_fn(model(x), y)
        loss.backward()
        if s == STEPS - 1:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: p.detach().clone() for k, p in model.named_parameters()}, "grads": grads}


def _weight_norm_reference(ws: int) -> dict:
    vals = _norm_net_values()
    m = NormNet().double()
    with torch.no_grad():
        m.layer1.weight.copy_(vals["layer1.weight"])
        m.layer2.weight.copy_(vals["layer2.weight"])
        m.pad.zero_()
    m.init_weight_norm()
    loss = sum(m(torch.randn(4, 3, generator=torch.Generator().manual_seed(r), dtype=F64)) for r in range(ws)) / ws
    loss.backward()
    return {"loss": loss.item(), "params": {k: p.detach().clone() for k, p in m.named_parameters()},
            "grads": {k: p.grad.clone() for k, p in m.named_parameters()}}


_CACHE: dict = {}


def _results(ws: int) -> dict:
    if ws not in _CACHE:
        outs = run_ranks(_run, ws)
        _CACHE[ws] = outs[0]
    return _CACHE[ws]


def _expected_values(flow: str, ref: dict) -> dict:
    if flow == "float_roundtrip":  # the norm's values went through float32 and back
        return {k: (v.float().double() if k.startswith("norm.") else v) for k, v in ref.items()}
    return ref


def _assert_run(got: dict, want: dict, where: str, rel: float) -> None:
    assert "error" not in got, f"{where}:\n{got.get('error')}"
    for s, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(a - b) <= rel * abs(b), f"{where} step {s}: loss {a} vs {b}"
    assert list(got["params"]) == list(want["params"]), where
    for k in want["params"]:
        assert_close_rel(got["params"][k], want["params"][k], f"{where} param {k}", rel)
        assert_close_rel(got["grads"][k], want["grads"][k], f"{where} grad {k}", rel)


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("flow", list(FLOWS))
def test_flow_trains_like_fsdp2_and_the_unsharded_model(ws, flow):
    res = _results(ws)["flows"]
    grads = _initial_grads() if flow == "double_by_module_with_grads" else None
    reference = _reference_run(_expected_values(flow, _reference_values()), grads)
    rel = REL_F64
    fsdp2 = res[(flow, "fsdp2")]
    _assert_run(fsdp2, reference, f"FSDP2 {flow} (ws {ws})", rel)
    for rt in _ours(ws):
        _assert_run(res[(flow, rt)], fsdp2, f"mfsdp2 {rt} {flow} vs FSDP2 (ws {ws})", REL_F64)
        _assert_run(res[(flow, rt)], reference, f"mfsdp2 {rt} {flow} vs unsharded (ws {ws})", rel)
        if "grads_dtype" in fsdp2:
            assert res[(flow, rt)]["grads_dtype"] == fsdp2["grads_dtype"] == ["torch.float64"], rt


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_forward_with_part_of_a_unit_converted_is_refused_naming_the_parameters(ws):
    res = _results(ws)["flows"]
    theirs = _results(ws)["refusals"]["fsdp2"]["part_on_meta"]
    assert theirs[0] == "RuntimeError" and "still on meta device" in theirs[1], theirs
    for rt in _ours(ws):
        assert _results(ws)["refusals"][rt]["part_on_meta"][0] == "RuntimeError"
        kind, msg = res[("to_empty_in_parts", rt)]["refused"]
        assert kind == "RuntimeError", msg
        assert "['[1].weight', '[1].bias'] of unit 'norm' are still on the meta device" in msg, msg
        kind, msg = res[("float_roundtrip", rt)]["refused"]
        assert kind == "RuntimeError" and "have different dtypes after some of them were converted" in msg, msg
        assert "'[0].weight': 'float32'" in msg and "'[1].weight': 'float64'" in msg, msg


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_meta_parameter_replaced_by_a_dtensor_of_other_rows_is_taken_as_fsdp2_takes_it(ws):
    res = _results(ws)["weight_norm"]
    want = _weight_norm_reference(ws)
    for rt in ("fsdp2",) + _ours(ws):
        got = res[rt]
        assert "error" not in got, f"{rt}:\n{got.get('error')}"
        assert abs(got["loss"] - want["loss"]) <= REL_F64 * abs(want["loss"]), (rt, got["loss"], want["loss"])
        for k in want["params"]:
            assert_close_rel(got["params"][k], want["params"][k], f"{rt} param {k}", REL_F64)
            assert_close_rel(got["grads"][k], want["grads"][k], f"{rt} grad {k}", REL_F64)
            assert_close_rel(got["saved"][k], want["params"][k], f"{rt} state_dict before the forward {k}", REL_F64)


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_what_fsdp2_refuses_before_the_first_forward_is_refused_with_a_message(ws):
    res = _results(ws)["refusals"]
    for rt, got in res.items():
        assert "error" not in got, f"{rt}:\n{got.get('error')}"
    theirs = res["fsdp2"]
    assert theirs["plain_replacement"][0] == "AttributeError"  # FSDP2 reads ._local_tensor of it
    for case in ("two_dtypes", "two_dtypes_after_to_empty"):
        assert theirs[case][0] == "AssertionError" and "uniform original parameter dtype" in theirs[case][1], case
    assert theirs["unshard_meta"][0] == "RuntimeError"
    for rt in _ours(ws):
        ours = res[rt]
        kind, msg = ours["plain_replacement"]
        assert kind == "RuntimeError", msg
        assert "'[1].weight' of unit 'norm' was replaced after fully_shard by a plain Parameter" in msg, msg
        assert "distribute_tensor(value, p.device_mesh, p.placements)" in msg, msg
        for case in ("two_dtypes", "two_dtypes_after_to_empty"):
            kind, msg = ours[case]
            assert kind == "RuntimeError" and "'[0].weight': 'float32'" in msg and "'[1].weight': 'float64'" in msg, msg
        kind, msg = ours["unshard_meta"]
        assert kind == "RuntimeError" and "['norm.weight', 'norm.bias', 'fc1.weight'" in msg, msg
        assert "are still on the meta device" in msg, msg


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_gathered_unit_of_several_modules_saves_its_main_weights_and_bf16_to_empty_stays_bf16(ws):
    """... and ``.float()`` of that bf16 model still makes it a float32 one, as in FSDP2."""
    res = _results(ws)["misc"]
    for rt, got in res.items():
        assert "error" not in got, f"{rt}:\n{got.get('error')}"
    theirs = res["fsdp2"]
    ref = _reference_values()
    for rt in _ours(ws):
        ours = res[rt]
        assert list(ours["gathered_state_dict"]) == list(theirs["gathered_state_dict"])
        for k, (kind, v) in ours["gathered_state_dict"].items():
            assert kind == theirs["gathered_state_dict"][k][0] == "DTensor", (rt, k, kind)
            assert torch.equal(v, ref[k]), (rt, k)
        assert ours["bf16_output"][0] == theirs["bf16_output"][0] == "torch.bfloat16", (rt, ours["bf16_output"][0])
        assert torch.equal(ours["bf16_output"][1], theirs["bf16_output"][1]), rt
        assert ours["bf16_float_output"][0] == theirs["bf16_float_output"][0] == "torch.float32", rt
        assert torch.equal(ours["bf16_float_output"][1], theirs["bf16_float_output"][1]), rt
