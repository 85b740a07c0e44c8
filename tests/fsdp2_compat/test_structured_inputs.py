"""Units called with structured inputs -- a dataclass record, a namedtuple inside a dict -- under
a mixed-precision policy: their floating tensors are cast to the compute dtype like any other
input (FSDP2 does), they get their post-backward hook, and a dataclass output gets its
``output_dtype``. Compared with torch FSDP2 on the same model and data in the same process.

Before: pytree treats a dataclass as a leaf, so the fp32 tensors inside reached a unit computing
in a lower dtype uncast and the forward failed on the dtype mismatch.

Tolerance: float64 model computing in float32 on both sides: the same float32 ops give the same
local gradients; only the reduce-scatter's rounding differs (FSDP2 divides around a SUM on gloo,
we average): a few float32 roundings, <= 1e-6 relative; 1e-5 is the bound.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import MixedPrecisionPolicy
from mfsdp2 import fully_shard as mfsdp2_shard

from .._dist import run_ranks
from ..models import batch, loss_fn

WS, GB, REL = 2, 8, 1e-5

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
    results = {}
    for name, shard, mp in (
        ("fsdp2", torch_shard, TorchMP(param_dtype=torch.float32, output_dtype=torch.float64)),
        ("mfsdp2", mfsdp2_shard, MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.float64)),
    ):
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


def test_dataclass_and_namedtuple_inputs_cast_and_reduce_like_fsdp2():
    for res in run_ranks(_run, WS):
        (l1, g1), (l2, g2) = res["fsdp2"], res["mfsdp2"]
        assert abs(float(l2 - l1)) <= REL * abs(float(l1)), (float(l1), float(l2))
        for k, g in g1.items():
            err = float((g2[k] - g).norm() / g.norm().clamp_min(1e-30))
            assert err <= REL, f"{k}: relative difference {err:.2e} from FSDP2"
