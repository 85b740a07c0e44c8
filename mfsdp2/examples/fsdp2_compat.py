"""A training loop written for torch FSDP2, run unchanged on mfsdp2: only the import differs.

This is what "drop-in" means for a trainer in the style of torchtitan: per-block ``fully_shard``
then the root, per-block ``torch.compile``, gradient accumulation with
``set_requires_gradient_sync(False)`` on all micro-batches but the last, ``clip_grad_norm_`` on
the sharded gradients, and checkpoints through torch's distributed state-dict API
(``torch.distributed.checkpoint.state_dict``) saved and loaded with DCP. Nothing in
:func:`train` knows which runtime it drives; ``--runtime`` only picks where ``fully_shard``
comes from::

    torchrun --nproc-per-node 2 -m mfsdp2.examples.fsdp2_compat --runtime mfsdp2
    torchrun --nproc-per-node 2 -m mfsdp2.examples.fsdp2_compat --runtime torch

Both print the same losses (to rounding; exactly the same in ``--dtype float64`` up to the
order of floating-point sums). ``tests/fsdp2_compat/test_example.py`` runs both and compares,
and resumes from the checkpoint written half-way.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2.models.llama import LlamaConfig, SyntheticTokens, Transformer, rank_slice


def import_fully_shard(runtime: str) -> Callable:
    """The one line a user changes: where ``fully_shard`` comes from."""
    if runtime == "torch":
        from torch.distributed.fsdp import fully_shard
    elif runtime == "mfsdp2":
        from mfsdp2 import fully_shard
    else:
        raise ValueError(f"--runtime must be 'torch' or 'mfsdp2', got {runtime!r}")
    return fully_shard


def build(cfg: LlamaConfig, fully_shard: Callable, mesh, compile_blocks: bool, dtype: torch.dtype):
    torch.manual_seed(0)
    model = Transformer(cfg).to(dtype)
    for block in model.layers:
        if compile_blocks:
            block.compile(backend="aot_eager")
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt


def train(
    fully_shard: Callable,
    steps: int,
    *,
    micro_batches: int = 2,
    batch: int = 8,
    compile_blocks: bool = True,
    dtype: torch.dtype = torch.float32,
    checkpoint_dir: Optional[str] = None,
    save_at: Optional[int] = None,
    resume: bool = False,
    start: int = 0,
) -> list[float]:
    """Train ``steps`` steps from ``start``; returns the global mean loss of each step.

    ``save_at``: after that step, save model + optimizer with DSD + DCP into ``checkpoint_dir``.
    ``resume``: load that checkpoint into a freshly built model before the first step.
    """
    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig.tiny()
    mesh = init_device_mesh("cpu", (ws,))
    model, opt = build(cfg, fully_shard, mesh, compile_blocks, dtype)
    if resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=checkpoint_dir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    data = SyntheticTokens(cfg.vocab_size, seed=7)
    losses = []
    for step in range(start, start + steps):
        x, y = data.batch(step, batch, cfg.max_seq_len)
        x, y = rank_slice(x, rank, ws), rank_slice(y, rank, ws)
        total = torch.zeros((), dtype=torch.float64)
        for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            model.set_requires_gradient_sync(i == micro_batches - 1)
            loss = F.cross_entropy(model(xm).flatten(0, 1), ym.flatten()) / micro_batches
            loss.backward()
            total += loss.detach().to(torch.float64)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / ws)
        if save_at is not None and step == save_at:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_dir)
    return losses


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m mfsdp2.examples.fsdp2_compat", description=__doc__.split("\n")[0])
    p.add_argument("--runtime", choices=("mfsdp2", "torch"), default="mfsdp2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--no-compile", action="store_true", help="leave the blocks uncompiled")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:  # a plain `python -m` run: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    fully_shard = import_fully_shard(args.runtime)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        half = args.steps // 2
        ckpt_list = [ckpt]
        dist.broadcast_object_list(ckpt_list)  # every rank writes into rank 0's directory
        losses = train(fully_shard, args.steps, compile_blocks=not args.no_compile, dtype=dtype,
                       checkpoint_dir=ckpt_list[0], save_at=half - 1)
        resumed = train(fully_shard, args.steps - half, compile_blocks=not args.no_compile, dtype=dtype,
                        checkpoint_dir=ckpt_list[0], resume=True, start=half)
        if dist.get_rank() == 0:
            for i, loss in enumerate(losses):
                extra = f"   resumed from step {half - 1}: {resumed[i - half]:.6f}" if i >= half else ""
                print(f"[{args.runtime}] step {i:3d}  loss {loss:.6f}{extra}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
