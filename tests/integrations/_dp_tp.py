"""Models on a (dp=2, tp=2) mesh for the FSDP x TP tests: each block's ``fc1`` colwise and ``fc2``
rowwise over ``mesh["tp"]``, then every block and the root sharded over ``mesh["dp"]``."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..models import F64, build


class _TPBlock(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class TPStack(nn.Module):
    """Residual MLP blocks whose every parameter is tensor-parallel once sharded by :func:`shard_dp_tp`."""

    def __init__(self, d: int = 12, hidden: int = 24, n_blocks: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_TPBlock(d, hidden) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def model_of(kind: str) -> nn.Module:
    """``"tp_stack"``: every parameter tensor-parallel; otherwise ``build("net")``, whose input,
    norms and head stay on the ``dp`` mesh alone (parameters on two meshes). Float64."""
    return TPStack().to(F64) if kind == "tp_stack" else build("net", dtype=F64)


def input_dim(model: nn.Module) -> int:
    return model.inp.in_features if hasattr(model, "inp") else model.blocks[0].fc1.in_features


def shard_dp_tp(model: nn.Module, mesh, shard, **kw) -> nn.Module:
    """``model`` with each block tensor-parallel over ``mesh["tp"]`` and each block and the root
    sharded over ``mesh["dp"]`` by ``shard`` (either runtime's ``fully_shard``; ``kw`` to every call)."""
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        shard(b, mesh=mesh["dp"], **kw)
    shard(model, mesh=mesh["dp"], **kw)
    return model
