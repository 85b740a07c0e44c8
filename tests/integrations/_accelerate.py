"""Accelerate's ``Accelerator`` with an FSDP2 plugin driving mfsdp2 or torch FSDP2, run inside
the test's ranks.

What is Accelerate's and what is ours:

* Accelerate's code runs unchanged: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
  fsdp_version=2, ...), gradient_accumulation_steps=2)``, ``prepare(model, optimizer,
  loader)`` (``fsdp2_prepare_model``, which keeps a model that already is an ``FSDPModule``,
  and the optimizer's parameters swapped for the model's by ``data_ptr``), ``accumulate``
  (``set_requires_gradient_sync(False)`` on the model between syncs), ``backward`` (the loss
  divided by the accumulation steps), ``clip_grad_norm_`` (its DTensor-aware path over torch's
  ``clip_grad_norm_``), the prepared optimizer's skipped steps, ``get_state_dict`` (a full state
  dict), ``save_state`` / ``load_state`` (DCP of the model and the optimizer).
* A user of mfsdp2 shards before ``prepare``: ``fully_shard`` on each block and the root
  (``impl="mfsdp2"``). The references are the same calls with torch's ``fully_shard``
  (``"fsdp2"``) and Accelerate sharding the plain model itself with a transformer-based wrap
  policy on the blocks (``"fsdp2_auto"``).
* After ``prepare`` the optimizer's parameter lists are put back (``restore_params``): it maps
  them by ``_local_tensor.data_ptr()``, 0 for every empty piece (docs/errors.md E61); a run
  without that shows mfsdp2's refusal.
* The ranks come from ``tests/_dist.py`` with the gloo group already initialised; Accelerate's
  ``PartialState`` reads ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` and keeps that group. Its
  shared state is reset between runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ._trainer_model import LR, Net, check_pieces, data, full, run_all

MICRO = 4
ACCUM = 2


@dataclass
class Run:
    """One training loop: who shards (``impl``), the AdamW implementation, the clip threshold,
    the number of passes over the data (2 steps each), and the checkpoint it saves after the
    first pass (``save``) or starts from (``resume_from``: the run of that name's)."""

    name: str
    impl: str  # "mfsdp2", "fsdp2" (torch's fully_shard by hand) or "fsdp2_auto" (Accelerate's)
    optimizer: str = "fused"
    epochs: int = 2
    clip: float = 1e3
    save: bool = False
    resume_from: Optional[str] = None
    restore_params: bool = True  # put the optimizer's parameter lists back after prepare()


@dataclass
class Result:
    losses: list = field(default_factory=list)  # per micro-batch, this rank's
    grads: list = field(default_factory=list)  # per step, {name: full gradient} before clipping
    clipped: list = field(default_factory=list)  # per step, after clipping
    norms: list = field(default_factory=list)  # per step, what clip_grad_norm_ returned
    params: dict = field(default_factory=dict)  # full parameters after the last step
    optim: dict = field(default_factory=dict)  # {name: {state key: full tensor}}
    optimizer_params: list = field(default_factory=list)  # names of the optimizer's parameters, in order
    state_dict: dict = field(default_factory=dict)  # accelerator.get_state_dict(model), rank 0
    units: list = field(default_factory=list)  # names of the modules that are FSDPModule
    steps: int = 0
    error: Optional[str] = None


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _fsdp_on_cpu() -> None:
    """Accelerate turns a plugin into ``DistributedType.FSDP`` only for accelerator devices: CPU
    processes (``cpu=True``, else they count as one process) get ``MULTI_CPU`` and the plugin is
    dropped without a word (``prepare`` would wrap the model in DDP). The shared
    ``PartialState`` (the existing process group, device ``cpu``) is told it is ``MULTI_GPU``
    before the ``Accelerator`` reads it, so Accelerate's FSDP2 code paths run on the CPU ranks."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)
    assert state.distributed_type == DistributedType.MULTI_CPU and state.device.type == "cpu", state
    state.distributed_type = DistributedType.MULTI_GPU


def train(rank: int, world_size: int, root: str, run: Run) -> Result:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    _reset_accelerate()
    _fsdp_on_cpu()
    res = Result()
    torch.manual_seed(0)
    model = Net()
    if run.impl == "fsdp2_auto":
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"],
            state_dict_type="SHARDED_STATE_DICT",
        )
    else:
        if run.impl == "mfsdp2":
            from mfsdp2 import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, gradient_accumulation_steps=ACCUM)
    assert acc.is_fsdp2 and acc.device.type == "cpu"
    kind = {"fused": dict(fused=True), "foreach": dict(foreach=True)}[run.optimizer]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, **kind)
    loader = DataLoader(data(), batch_size=MICRO, shuffle=False)
    groups = [list(g["params"]) for g in opt.param_groups]
    model, opt, loader = acc.prepare(model, opt, loader)
    if run.impl != "fsdp2_auto" and run.restore_params:
        # prepare() re-pointed the optimizer at the model's parameters by data_ptr(), which is 0
        # for every empty piece (mfsdp2 docs/errors.md E61); they already were the model's.
        for g, ps in zip(opt.optimizer.param_groups, groups):
            g["params"] = ps
    check_pieces(model)
    res.units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if run.resume_from:
        acc.load_state(os.path.join(root, run.resume_from))
    first = 1 if run.resume_from else 0
    for epoch in range(first, run.epochs):
        for x, y in loader:
            with acc.accumulate(model):
                loss = F.mse_loss(model(x), y)
                res.losses.append(loss.item())
                acc.backward(loss)
                if acc.sync_gradients:
                    res.grads.append({n: full(p.grad) for n, p in model.named_parameters()})
                    res.norms.append(full(acc.clip_grad_norm_(model.parameters(), run.clip)).item())
                    res.clipped.append({n: full(p.grad) for n, p in model.named_parameters()})
                    res.steps += 1
                opt.step()
                opt.zero_grad()
        if run.save and epoch == 0:
            acc.save_state(os.path.join(root, run.name))
    res.params = {n: full(p) for n, p in model.named_parameters()}
    res.optim = _full_optimizer_states(model, opt.optimizer)
    res.optimizer_params = _optimizer_param_names(model, opt.optimizer)
    sd = acc.get_state_dict(model)
    res.state_dict = {k: v.detach().clone() for k, v in sd.items()} if rank == 0 else {}
    acc.wait_for_everyone()
    return res


def _optimizer_param_names(model, opt) -> list:
    """The model's names of the parameters the optimizer holds, in its order (``"?"``: not one of
    the model's)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names.get(id(p), "?") for g in opt.param_groups for p in g["params"]]


def _full_optimizer_states(model, opt) -> dict:
    """``{name: {state key: full tensor}}`` from each rank's local pieces (every rank's rows of a
    parameter follow the previous rank's under both runtimes), gathered by name so that a rank
    whose optimizer lacks a parameter cannot desynchronise the collectives."""
    import torch.distributed as dist

    local = {}
    for n, p in model.named_parameters():
        s = opt.state.get(p, {})
        local[n] = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in s.items()}
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, local)
    out = {}
    for n, _ in model.named_parameters():
        keys = [k for r in pieces for k in r[n]]
        out[n] = {}
        for k in dict.fromkeys(keys):
            parts = [r[n][k] for r in pieces if k in r[n]]
            out[n][k] = parts[0] if parts[0].dim() == 0 else torch.cat(parts)
    return out


def worker(rank: int, world_size: int, root: str, runs: list) -> dict:
    """Every run in turn on this rank: ``{name: Result}``."""
    return run_all(rank, world_size, root, runs, train, Result)
