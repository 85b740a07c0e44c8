"""Lightning Fabric with ``ModelParallelStrategy`` driving mfsdp2 or torch FSDP2, inside the test's
ranks.

What is Fabric's and what is ours:

* Fabric's code runs unchanged: ``setup_module`` (its ``parallelize_fn`` on the device mesh),
  ``setup_optimizers``, ``no_backward_sync`` (which calls ``set_requires_gradient_sync`` on every
  module that is a torch ``FSDPModule``), ``backward``, ``clip_gradients``, and full (not
  distributed) checkpoints: ``save`` gathers the model and optimizer state dicts with torch's DSD
  (``full_state_dict=True, cpu_offload=True``) into one ``torch.save`` file, ``load`` puts them
  back (``broadcast_from_rank0=True``).
* The ``parallelize_fn`` shards each block and the root with the ``fully_shard`` of the runtime
  under test: the one name a user changes.
* Each optimizer step accumulates two micro-batches, the first under ``no_backward_sync`` (no
  reduction), as Fabric's docs teach.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ._trainer_model import LR, Net, check_pieces, data, full, run_all

MICRO = 4
ACCUM = 2


@dataclass
class Run:
    name: str
    impl: str  # "mfsdp2" or "fsdp2"
    epochs: int = 2
    save: bool = False  # a full checkpoint after epoch 1
    resume_from: Optional[str] = None  # start epoch 2 from that run's full checkpoint


@dataclass
class Result:
    losses: list = field(default_factory=list)
    grads: list = field(default_factory=list)  # per step, before clipping
    clipped: list = field(default_factory=list)  # per step, after clipping
    norms: list = field(default_factory=list)
    params: dict = field(default_factory=dict)
    optim: dict = field(default_factory=dict)
    reductions: list = field(default_factory=list)  # per micro-batch: did its backward reduce?
    steps: int = 0
    error: Optional[str] = None


def _parallelize(impl: str):
    def fn(model, device_mesh):
        if impl == "mfsdp2":
            from mfsdp2 import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        mesh = device_mesh["data_parallel"]
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        check_pieces(model)
        return model

    return fn


def _grads_present(model) -> bool:
    """Whether the sharded parameters hold reduced gradients (a synced backward has run)."""
    return any(p.grad is not None for p in model.parameters())


def train(rank: int, world_size: int, root: str, run: Run) -> Result:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    res = Result()
    strategy = ModelParallelStrategy(parallelize_fn=_parallelize(run.impl), data_parallel_size=world_size,
                                     tensor_parallel_size=1, save_distributed_checkpoint=False)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Net())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True))
    ds = data()
    per_rank = [ds[i] for i in range(rank, len(ds), world_size)]
    first_epoch = 0
    if run.resume_from:
        state = {"model": model, "optimizer": opt, "epoch": 0}
        fabric.load(os.path.join(root, run.resume_from + ".ckpt"), state)
        first_epoch = state["epoch"]
    for epoch in range(first_epoch, run.epochs):
        for step in range(len(per_rank) // (MICRO * ACCUM)):
            for micro in range(ACCUM):
                chunk = per_rank[(step * ACCUM + micro) * MICRO:(step * ACCUM + micro + 1) * MICRO]
                x = torch.stack([c[0] for c in chunk])
                y = torch.stack([c[1] for c in chunk])
                last = micro == ACCUM - 1
                with fabric.no_backward_sync(model, enabled=not last):
                    loss = F.mse_loss(model(x), y)
                    fabric.backward(loss)
                res.losses.append(loss.item())
                res.reductions.append(_grads_present(model))
            res.grads.append({n: full(p.grad) for n, p in model.named_parameters()})
            norm = fabric.clip_gradients(model, opt, max_norm=1e3)
            res.norms.append(full(norm).item())
            res.clipped.append({n: full(p.grad) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
            res.steps += 1
        if run.save and epoch == 0:
            fabric.save(os.path.join(root, run.name + ".ckpt"), {"model": model, "optimizer": opt, "epoch": 1})
    res.params = {n: full(p) for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    res.optim = {names[p]: {k: full(v) for k, v in s.items()} for p, s in opt.state.items()}
    return res


def worker(rank: int, world_size: int, root: str, runs: list) -> dict:
    return run_all(rank, world_size, root, runs, train, Result)
