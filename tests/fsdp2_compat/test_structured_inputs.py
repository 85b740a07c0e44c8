"""Units called with structured inputs -- a dataclass record, a namedtuple inside a dict -- under
a mixed-precision policy: their floating tensors are cast to the compute dtype like any other
input (FSDP2 does), they get their post-backward hook, and a dataclass output gets its
``output_dtype``. Compared with the unsharded model computing in float32 (the casts written out
for its structures), and with torch FSDP2 on the same model and data in the same process where
its hooks reach tensors inside dataclasses (torch 2.13; see ``FSDP2_HOOKS_DATACLASSES``).

Before: pytree treats a dataclass as a leaf, so the fp32 tensors inside reached a unit computing
in a lower dtype uncast and the forward failed on the dtype mismatch.

Tolerance: float64 model computing in float32 on both sides: the same float32 ops give the same
local gradients; only the reduce-scatter's rounding differs (FSDP2 divides around a SUM on gloo,
we average): a few float32 roundings, <= 1e-6 relative; 1e-5 is the bound. The same holds for
the unsharded reference, which runs each rank's half of the batch with the same float32 ops and
averages the two float32 gradients.
"""

from __future__ import annotations

import copy
import functools
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
import torch.distributed.fsdp._common_utils as fsdp_common_utils
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import MixedPrecisionPolicy
from mfsdp2 import fully_shard as mfsdp2_shard

from .._dist import run_ranks
from ..models import batch, loss_fn

WS, GB, REL = 2, 8, 1e-5

# torch 2.11's FSDP2 finds the tensors to hook in a unit's inputs and outputs with pytree, which
# treats a dataclass as a leaf: a block's ``Outputs`` get no pre-backward hook, so its backward
# runs on resharded weights and fails ("setStorage: ... out of bounds for storage of size 0").
# torch 2.13's FSDP2 walks dataclasses there (``_common_utils.collect_grad_tensors``).
FSDP2_HOOKS_DATACLASSES = hasattr(fsdp_common_utils, "collect_grad_tensors")

Pair = namedtuple("Pair", "a b")


@dataclass
class Inputs:
    x: torch.Tensor
    scale: torch.Tensor
    note: str = "inputs"


@dataclass
class Outputs:
    h: torch.Tensor
    aux: torch.Tensor


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)

    def forward(self, inputs: Inputs, extra: dict) -> Outputs:
        assert inputs.x.dtype == self.lin.weight.dtype, f"input not cast: {inputs.x.dtype}"
        h = torch.tanh(self.lin(inputs.x)) * inputs.scale + self.gate(extra["pair"].a)
        return Outputs(h=h, aux=extra["pair"].b.sum(-1, keepdim=True))


class Model(nn.Module):
    def __init__(self, d_in: int = 12, d: int = 16, n: int = 2):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            scale = torch.full((1,), 0.5, dtype=torch.float64)  # a float64 input, cast by the unit
            out = b(Inputs(x=h.double(), scale=scale), {"pair": Pair(a=h.double(), b=0.1 * h.double())})
            assert out.h.dtype == torch.float64, f"output_dtype not applied to a dataclass: {out.h.dtype}"
            h = out.h + out.aux
        return self.head(h.to(self.head.weight.dtype))  # the root computes in its own dtype


def _run(rank, ws):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_shard

    mesh = init_device_mesh("cpu", (ws,))
    runs = [("mfsdp2", mfsdp2_shard, MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.float64))]
    if FSDP2_HOOKS_DATACLASSES:
        runs.append(("fsdp2", torch_shard, TorchMP(param_dtype=torch.float32, output_dtype=torch.float64)))
    results = {}
    for name, shard, mp in runs:
        torch.manual_seed(0)
        model = Model().double()
        for b in model.blocks:
            shard(b, mesh=mesh, mp_policy=mp)
        shard(model, mesh=mesh, mp_policy=mp)
        x, y = batch(0, GB, 12, dtype=torch.float64)
        n = GB // ws
        loss = loss_fn(model(x[rank * n : (rank + 1) * n]).double(), y[rank * n : (rank + 1) * n])
        loss.backward()
        results[name] = (loss.detach(), {k: p.grad.full_tensor() for k, p in model.named_parameters()})
    return results


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(_run, WS)


def _reference(ws: int):
    """The unsharded model computing in float32, each rank's half of the batch on its own: the
    float64 inputs and outputs of each block and of the model cast as the policy says, by hand for
    these structures. Returns ``([loss of each half], {name: mean of the halves' float32 grads})``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    work = copy.deepcopy(Model().double()).float()

    def cast_in(module, args, kwargs):
        inputs, extra = args
        pair = extra["pair"]
        inputs = Inputs(x=inputs.x.float(), scale=inputs.scale.float(), note=inputs.note)
        return (inputs, {"pair": Pair(a=pair.a.float(), b=pair.b.float())}), kwargs

    def cast_out(module, args, out):
        return Outputs(h=out.h.double(), aux=out.aux.double())

    for b in work.blocks:
        b.register_forward_pre_hook(cast_in, with_kwargs=True)
        b.register_forward_hook(cast_out)
    x, y = batch(0, GB, 12, dtype=torch.float64)
    n = GB // ws
    losses, grads = [], {k: torch.zeros_like(p) for k, p in work.named_parameters()}
    for r in range(ws):
        work.zero_grad()
        loss = loss_fn(work(x[r * n : (r + 1) * n].float()).double(), y[r * n : (r + 1) * n])
        loss.backward()
        losses.append(loss.detach())
        for k, p in work.named_parameters():
            grads[k] += p.grad
    return losses, {k: g / ws for k, g in grads.items()}


def _assert_close(ours, theirs, what):
    (l1, g1), (l2, g2) = theirs, ours
    assert abs(float(l2 - l1)) <= REL * abs(float(l1)), (what, float(l1), float(l2))
    for k, g in g1.items():
        assert g2[k].dtype == torch.float64, (what, k, g2[k].dtype)  # the reduced grads, upcast to the params'
        err = float((g2[k] - g.double()).norm() / g.double().norm().clamp_min(1e-30))
        assert err <= REL, f"{what}: {k}: relative difference {err:.2e}"


def test_dataclass_and_namedtuple_inputs_cast_and_reduce_like_the_unsharded_model():
    ref_losses, ref_grads = _reference(WS)
    for rank, res in enumerate(_results()):
        _assert_close(res["mfsdp2"], (ref_losses[rank], ref_grads), f"rank {rank} vs unsharded")


@pytest.mark.skipif(
    not FSDP2_HOOKS_DATACLASSES,
    reason="this torch's FSDP2 hooks no tensor inside a dataclass output (pytree leaf): its backward fails on "
    "resharded weights; mfsdp2 is checked against the unsharded model",
)
def test_dataclass_and_namedtuple_inputs_cast_and_reduce_like_fsdp2():
    for rank, res in enumerate(_results()):
        _assert_close(res["mfsdp2"], res["fsdp2"], f"rank {rank} vs FSDP2")
