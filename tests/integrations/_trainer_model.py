"""The model, data and helpers the trainer tests share (Lightning, Accelerate): a small MLP
whose every parameter piece is a whole number of CPU vectors under both runtimes, so that
torch's fused AdamW gives FSDP2 and mfsdp2 the same bits (see :class:`Net`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

D = 64
HIDDEN = 256
N_SAMPLES = 32  # world size 2, micro-batches of 4, 2 micro-batches per step: 2 steps per pass
LR = 1e-2


def full(t):
    """A detached full copy of a parameter, gradient or optimizer state (DTensor of either
    runtime, or a plain tensor)."""
    return t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()


def data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, D, generator=g)
    w = torch.randn(D, D, generator=g) / D**0.5
    y = torch.tanh(x @ w) + 0.1 * torch.randn(N_SAMPLES, D, generator=g)
    return TensorDataset(x, y)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Every parameter's piece on every rank is a multiple of 32 elements under both runtimes
    (FSDP2 halves each parameter's rows; mfsdp2 cuts each unit's flat buffer at a row edge):
    torch's CPU fused AdamW computes a tensor's vector body and its scalar tail differently (the
    last bit of ``exp_avg_sq`` differs), so an element's result depends on where its rank's piece
    ends unless every piece is a whole number of vectors (:func:`check_pieces`)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, D)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def check_pieces(module: nn.Module) -> None:
    for n, p in module.named_parameters():
        k = p.to_local().numel()
        assert k % 32 == 0, f"{n}: this rank's piece has {k} elements, not a multiple of 32 (see Net)"




def run_all(rank: int, world_size: int, root: str, runs: list, one, result_cls) -> dict:
    """Every run in turn on this rank through ``one(rank, world_size, root, run)``: ``{name:
    result}`` (a failed run records its traceback as ``result_cls(error=...)`` and the next one
    still runs, so one launch serves every case)."""
    import traceback

    torch.use_deterministic_algorithms(True)
    out = {}
    for run in runs:
        try:
            out[run.name] = one(rank, world_size, root, run)
        except Exception:
            out[run.name] = result_cls(error=traceback.format_exc())
    return out


def equal_dicts(a: dict, b: dict, what: str) -> None:
    """The same keys in the same order, and equal tensors under each (bit for bit)."""
    assert list(a) == list(b), what
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what} differ from FSDP2's for {differ}"


def same_training(ours, ref, first_step: int = 0) -> None:
    """Two runs' records (``losses``, per-step ``grads`` and ``clipped`` gradients, final
    ``params``, ``optim`` states) bit for bit equal."""
    assert ours.losses == ref.losses
    assert len(ours.grads) == len(ref.grads) > 0
    for step, (a, b) in enumerate(zip(ours.grads, ref.grads), first_step):
        equal_dicts(a, b, f"step {step}: gradients")
    for step, (a, b) in enumerate(zip(ours.clipped, ref.clipped), first_step):
        equal_dicts(a, b, f"step {step}: clipped gradients")
    equal_dicts(ours.params, ref.params, "final parameters")
    assert list(ours.optim) == list(ref.optim)
    for name in ref.optim:
        equal_dicts(ours.optim[name], ref.optim[name], f"AdamW state of {name}")


def after_two_steps(record, **more):
    """The part of a training record (a dataclass: ``losses``, ``grads``, ``clipped``, ``norms``
    per step, the rest final) after its first two optimizer steps: what a run resumed from a
    checkpoint taken there must reproduce."""
    return dataclasses.replace(record, losses=record.losses[len(record.losses) // 2:], grads=record.grads[2:],
                               clipped=record.clipped[2:], norms=record.norms[2:], **more)
