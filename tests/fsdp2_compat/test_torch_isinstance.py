"""mfsdp2 units pass the ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` checks that code
written for FSDP2 makes, and no call on them reaches torch FSDP2's own implementation.

The bug this guards against is silent. torchtitan divides the loss by the global token count
itself and sets each FSDP unit's gradient divide factor to 1.0, finding the units with
``isinstance`` against torch's class (``disable_fsdp_gradient_division``). A user who swapped
only ``fully_shard`` for mfsdp2's got units that failed the check, so they kept averaging over
the ranks: every gradient was world-size times too small and nothing reported it.

Checked against torch FSDP2 in the same process and against the unsharded float64 model: each
rank's loss is the mean over its slice, so the summing reduction that factor 1.0 asks for gives
``ws * g`` (``g`` the gradient of the mean loss over the global batch; float64 rounding only).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from . import runtimes
from .._dist import run_ranks
from ..models import REL_F64, assert_close_rel, batch, build, loss_fn
from .test_divide_factor import GB, WS, _reference  # the same model, batch and float64 gradients


def _disable_gradient_division(model) -> None:
    """torchtitan 0.3.0's ``disable_fsdp_gradient_division``, written out: torch's class."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)


def _trainer_flow(rank, ws):
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    n = GB // ws
    x, y = batch(0, GB, 12, dtype=torch.float64)
    out = {}
    for name, shard in runtimes().items():
        model = build("net", dtype=torch.float64)
        for b in model.blocks:
            shard(b, mesh=mesh)
        shard(model, mesh=mesh)
        units = [m for m in model.modules() if isinstance(m, TorchFSDPModule)]
        # torch's own accessor finds each unit's state (torch's pipeline stages call it)
        states = [torch_fully_shard.state(m) for m in units]
        _disable_gradient_division(model)
        loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        out[name] = {
            "units": len(units),
            "states": sum(s is not None for s in states),
            "grads": {k: p.grad.full_tensor() for k, p in model.named_parameters()},
        }
    return out


class _Encoder(torch.nn.Module):
    """A module whose training code calls a method other than ``forward``."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(12, 6, dtype=torch.float64)

    def encode(self, x):
        return torch.tanh(self.lin(x)) * 2


def _forward_method(rank, ws):
    """torch's ``register_fsdp_forward_method`` on a unit of each runtime: ``encode`` gathers
    before and reshards after, as ``forward`` does; its output and gradients equal FSDP2's."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    mesh = init_device_mesh("cpu", (ws,))
    x = batch(1, GB, 12, dtype=torch.float64)[0][rank::ws]
    out = {}
    for name, shard in runtimes().items():
        torch.manual_seed(0)
        enc = _Encoder()
        shard(enc, mesh=mesh)
        register_fsdp_forward_method(enc, "encode")
        with torch.no_grad():
            y0 = enc.encode(x)
        y = enc.encode(x)
        y.square().sum().backward()
        out[name] = (y0, y.detach(), {k: p.grad.full_tensor() for k, p in enc.named_parameters()})
    return out


def test_torch_register_fsdp_forward_method_gathers_mfsdp2_units():
    got = run_ranks(_forward_method, WS)
    for rank, out in enumerate(got):
        (y0, y, grads), (t0, t, tgrads) = out["mfsdp2"], out["fsdp2"]
        assert torch.equal(y0, t0) and torch.equal(y, t), rank
        for k, g in tgrads.items():
            assert_close_rel(grads[k], g, f"rank {rank} {k}", rel=REL_F64)


def test_trainer_isinstance_checks_find_mfsdp2_units_and_sum_like_fsdp2():
    """Fails if mfsdp2 units are not torch ``FSDPModule`` instances (their gradients are then
    averaged: half the expected value at world size 2)."""
    ref = _reference()
    got = run_ranks(_trainer_flow, WS)[0]
    assert got["mfsdp2"]["units"] == got["fsdp2"]["units"] == 4, got
    assert got["mfsdp2"]["states"] == got["fsdp2"]["states"] == 4, got
    for k, g in ref.items():
        for name in ("fsdp2", "mfsdp2"):
            assert_close_rel(got[name]["grads"][k], WS * g, f"{name} {k}", rel=REL_F64)
        assert_close_rel(got["mfsdp2"]["grads"][k], got["fsdp2"]["grads"][k], f"mfsdp2 vs FSDP2 {k}", rel=REL_F64)


def test_every_torch_fsdpmodule_function_has_an_mfsdp2_definition():
    """No call on a unit falls through to FSDP2's implementation (which reads FSDP2's state)."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from mfsdp2 import FSDPModule
    from mfsdp2.frontend.torch_identity import _functions

    assert issubclass(FSDPModule, TorchFSDPModule)
    below = FSDPModule.__mro__[: FSDPModule.__mro__.index(TorchFSDPModule)]
    names = _functions(TorchFSDPModule)
    assert "set_gradient_divide_factor" in names and "_get_fsdp_state" in names, names
    for name in names:
        owner = next((c for c in below if name in vars(c)), None)
        assert owner is not None, f"{name} is torch FSDP2's implementation on mfsdp2 units"
        assert getattr(vars(owner)[name], "__qualname__", "").split(".")[0] != "_refusal", (
            f"{name}: this torch's FSDPModule has it and mfsdp2 does not implement it"
        )


def test_mfsdp2_methods_do_not_call_into_torch_fsdp2():
    """``super()`` inside mfsdp2's class would reach torch's FSDPModule next (its ``_apply``
    reshards and resets FSDP2's sharded parameters): the module's own class is reached past it."""
    import inspect

    from mfsdp2 import FSDPModule

    source = inspect.getsource(FSDPModule)
    assert "super()." not in source, "a bare super() call in mfsdp2's FSDPModule reaches torch FSDP2's method"


def test_a_method_mfsdp2_lacks_is_refused_not_inherited():
    """A newer torch's method mfsdp2 has no version of raises, naming it."""
    from mfsdp2.frontend.torch_identity import UnsupportedFSDP2MethodError, check_overrides

    class TorchLike:
        def reshard(self):
            return "torch's"

        def set_new_knob(self, value):
            return "torch's"

    class Ours(TorchLike):
        def reshard(self):
            return "ours"

    assert check_overrides(Ours, base=TorchLike) == ["set_new_knob"]
    assert Ours().reshard() == "ours"
    with pytest.raises(UnsupportedFSDP2MethodError, match="set_new_knob"):
        Ours().set_new_knob(1)


def test_set_unshard_async_op_checks_its_argument():
    import torch.nn as nn

    from mfsdp2 import FSDPModule

    # the method reads nothing of the unit: called unbound on a plain module
    FSDPModule._set_unshard_async_op(nn.Linear(2, 2), True)
    with pytest.raises(TypeError, match="bool"):
        FSDPModule._set_unshard_async_op(nn.Linear(2, 2), "yes")
