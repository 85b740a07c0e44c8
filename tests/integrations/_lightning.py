"""Lightning's own ``Trainer`` with ``ModelParallelStrategy`` driving mfsdp2 or torch FSDP2,
run inside the test's ranks.

What is Lightning's and what is ours:

* Lightning's code runs unchanged: ``Trainer.fit`` with ``ModelParallelStrategy`` (its device
  mesh, ``configure_model`` / ``configure_optimizers`` order, distributed sampler, gradient
  accumulation, ``gradient_clip_val`` -> ``torch.nn.utils.clip_grad_norm_`` on the DTensor
  parameters, distributed checkpoint save through ``get_model_state_dict`` /
  ``get_optimizer_state_dict`` + DCP, and resume through ``ckpt_path=``).
* The LightningModule's ``configure_model`` shards each block and the root with the
  ``fully_shard`` of the runtime under test: the one name a user changes.
* The ranks come from ``tests/_dist.py`` with the gloo group already initialised. Lightning's
  ``LightningEnvironment`` treats a process with ``LOCAL_RANK`` set as launched externally (no
  subprocesses of its own), and its ``_init_dist_connection`` returns early on an initialised
  group. Its ``teardown`` deletes ``WORLD_SIZE`` from the environment, so every fit sets the
  variables again.
* Observation only: hooks of the LightningModule record each micro-batch's loss, the full
  gradients before clipping (``on_before_optimizer_step``, which Lightning calls right before
  it clips) and after clipping (``optimizer_step``, after Lightning's own step, which runs the
  closure, clips and steps), and the
  norm the clip saw (recomputed by ``torch.nn.utils.get_total_norm`` on the same DTensor
  gradients, the function ``clip_grad_norm_`` calls).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ._trainer_model import LR, Net, check_pieces, data, full, run_all

MICRO = 4  # samples per rank per micro-batch
ACCUM = 2


@dataclass
class Run:
    """One ``Trainer.fit``: which ``fully_shard``, for how many epochs, at what clipping
    threshold, and where it starts (``resume_from``: the checkpoint the run of that name saved
    at the end of epoch 1)."""

    name: str
    impl: str  # "mfsdp2" or "fsdp2"
    optimizer: str = "fused"  # torch AdamW's implementation: "fused" or "foreach"
    epochs: int = 2
    clip: float = 1e3
    save: bool = False
    resume_from: Optional[str] = None


@dataclass
class Result:
    losses: list = field(default_factory=list)  # per micro-batch, this rank's
    grads: list = field(default_factory=list)  # per step, {name: full gradient} before clipping
    clipped: list = field(default_factory=list)  # per step, {name: full gradient} after clipping
    norms: list = field(default_factory=list)  # per step, the total norm the clip used
    params: dict = field(default_factory=dict)  # full parameters after the last step
    optim: dict = field(default_factory=dict)  # {name: {state key: full tensor}} after the last step
    global_step: int = 0
    error: Optional[str] = None


def _module_class():
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self, impl: str, optimizer: str, result: Result):
            super().__init__()
            self.impl = impl
            self.optimizer = optimizer
            self.result = result
            torch.manual_seed(0)
            self.net = Net()
            self.strict_loading = True

        def configure_model(self):
            if self.impl == "mfsdp2":
                from mfsdp2 import fully_shard
            else:
                from torch.distributed.fsdp import fully_shard
            mesh = self.device_mesh["data_parallel"]
            for b in self.net.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(self, mesh=mesh)
            check_pieces(self)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.result.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            kind = {"fused": dict(fused=True), "foreach": dict(foreach=True)}[self.optimizer]
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1, **kind)

        def on_before_optimizer_step(self, optimizer):
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.result.norms.append(full(torch.nn.utils.get_total_norm(grads)).item())
            self.result.grads.append({n: full(p.grad) for n, p in self.named_parameters()})

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
            self.result.clipped.append({n: full(p.grad) for n, p in self.named_parameters()})

    return Module


def _env(rank: int, world_size: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))


def fit(rank: int, world_size: int, root: str, run: Run) -> Result:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    _env(rank, world_size)
    res = Result()
    module = _module_class()(run.impl, run.optimizer, res)
    ckpt_dir = os.path.join(root, run.name)

    class SaveAtEpochOne(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if run.save and trainer.current_epoch == 0:
                trainer.save_checkpoint(ckpt_dir)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1),
        max_epochs=run.epochs,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=run.clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveAtEpochOne()],
        deterministic=True,
    )
    loader = DataLoader(data(), batch_size=MICRO, shuffle=False)
    ckpt = os.path.join(root, run.resume_from) if run.resume_from else None
    trainer.fit(module, loader, ckpt_path=ckpt)
    res.global_step = trainer.global_step
    res.params = {n: full(p) for n, p in module.named_parameters()}
    opt = trainer.optimizers[0]
    names = {p: n for n, p in module.named_parameters()}
    res.optim = {names[p]: {k: full(v) for k, v in s.items()} for p, s in opt.state.items()}
    _env(rank, world_size)  # teardown removed WORLD_SIZE
    return res


def worker(rank: int, world_size: int, root: str, runs: list) -> dict:
    """Every run in turn on this rank: ``{name: Result}``."""
    return run_all(rank, world_size, root, runs, fit, Result)
