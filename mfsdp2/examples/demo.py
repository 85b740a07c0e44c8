"""Train the small Llama-style decoder with per-module sharding on CPU ranks.

Run with::

    torchrun --nproc-per-node 2 -m mfsdp2.examples.demo [--steps N] [--batch B] [--seq S] [--fsdp2]

Every rank builds the same model (``torch.manual_seed(0)``), shards each
``TransformerBlock`` and then the root with ``mfsdp2.fully_shard`` (or, with
``--fsdp2``, with ``torch.distributed.fsdp.fully_shard`` for comparison) and
trains it with ``torch.optim.AdamW``.  Each step, every rank builds the same
global batch from ``SyntheticTokens`` and trains on its own slice of it; the
loss that is printed is the mean over ranks.  Rank 0 prints one line per step
and a summary table at the end.

Run without ``torchrun`` it trains as a single rank (world size 1).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mfsdp2.models.llama import LlamaConfig, SyntheticTokens, Transformer, count_params, rank_slice


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mfsdp2.examples.demo",
        description="Train a small Llama-style model sharded with mfsdp2 (or torch FSDP2) on CPU/gloo.",
    )
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--batch", type=int, default=8, help="global batch size, split over ranks (default 8)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="model init seed (default 0)")
    p.add_argument("--data-seed", type=int, default=1234, help="synthetic data seed (default 1234)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads per rank; 0 = 1 when world size >= 2, else unchanged",
    )
    p.add_argument(
        "--fsdp2",
        action="store_true",
        help="shard with torch.distributed.fsdp.fully_shard instead of mfsdp2 (for comparison)",
    )
    p.add_argument(
        "--profile",
        metavar="PATH",
        default=None,
        help="record the last step with torch.profiler and write rank 0's Chrome trace to PATH",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.batch < 1 or args.seq < 1:
        p.error("--batch and --seq must be >= 1")
    return args


def _init_process_group() -> None:
    if "RANK" not in os.environ:  # not under torchrun: a world of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        os.environ["RANK"] = "0"
        os.environ["WORLD_SIZE"] = "1"
        os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("gloo")


def _sharder(use_fsdp2: bool) -> tuple[Callable[..., Any], Any]:
    """The ``fully_shard`` to use, and mfsdp2's ``comm_stats`` (None for torch FSDP2)."""
    if use_fsdp2:
        from torch.distributed.fsdp import fully_shard

        return fully_shard, None
    from mfsdp2 import fully_shard
    from mfsdp2.comm.communicator import comm_stats

    return fully_shard, comm_stats


def _runtime_peak_bytes(model: Any, use_fsdp2: bool) -> int | None:
    """mfsdp2's own accounting: persistent shards + peak of the transient (unsharded) buffers."""
    if use_fsdp2:
        return None
    m = model.memory_stats()
    return m["persistent_bytes"] + m["transient_peak_bytes"]


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024.0 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024.0
    return f"{n:.1f} GiB"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _init_process_group()
    try:
        rc = _train(args)
    finally:
        # Drop the model, optimizer and DeviceMesh (all locals of _train) before
        # tearing down gloo: with a DeviceMesh still alive at interpreter exit,
        # torch 2.13 + gloo aborts now and then ("terminate called without an
        # active exception", SIGABRT) after destroy_process_group().
        gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return rc


def _train(args: argparse.Namespace) -> int:
    rank = dist.get_rank()
    world = dist.get_world_size()
    is_main = rank == 0

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    elif world >= 2:
        torch.set_num_threads(1)

    if args.batch % world != 0:
        if is_main:
            print(f"--batch {args.batch} is not divisible by world size {world}", file=sys.stderr)
        return 2

    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, comm_stats = _sharder(args.fsdp2)
    mesh = init_device_mesh("cpu", (world,))

    cfg = LlamaConfig.demo()
    if args.seq > cfg.max_seq_len:
        cfg.max_seq_len = args.seq
    torch.manual_seed(args.seed)
    model = Transformer(cfg)
    n_params = count_params(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    data = SyntheticTokens(cfg.vocab_size, seed=args.data_seed)
    global_tokens = args.batch * args.seq
    mode = "torch FSDP2 (torch.distributed.fsdp.fully_shard)" if args.fsdp2 else "mfsdp2.fully_shard"
    if is_main:
        print(
            f"mode: {mode} | world {world} | threads/rank {torch.get_num_threads()} | "
            f"params {n_params / 1e6:.2f}M | global batch {args.batch} x {args.seq} "
            f"({global_tokens} tokens/step) | steps {args.steps}",
            flush=True,
        )

    losses: list[float] = []
    times: list[float] = []
    counted_steps = 0
    for step in range(args.steps):
        inputs, targets = data.batch(step, args.batch, args.seq)
        inputs = rank_slice(inputs, rank, world)
        targets = rank_slice(targets, rank, world)

        prof = None
        if args.profile and step == args.steps - 1:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        t0 = time.perf_counter()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        local_time = time.perf_counter() - t0
        if prof is not None:
            prof.__exit__(None, None, None)
            if is_main:
                prof.export_chrome_trace(args.profile)
                print(f"wrote a torch.profiler trace of step {step + 1} to {args.profile}", flush=True)

        stats = torch.tensor([loss.detach().item(), local_time], dtype=torch.float64)
        loss_sum = stats[:1].clone()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        step_time = stats[1:].clone()
        dist.all_reduce(step_time, op=dist.ReduceOp.MAX)
        mean_loss = loss_sum.item() / world
        dt = step_time.item()
        losses.append(mean_loss)
        times.append(dt)

        if comm_stats is not None:
            if step == 0:
                comm_stats.reset()
            else:
                counted_steps += 1

        if is_main:
            print(
                f"step {step + 1:4d}/{args.steps} | loss {mean_loss:8.4f} | "
                f"step {dt * 1e3:8.1f} ms | {global_tokens / dt:10.0f} tokens/s",
                flush=True,
            )

    # Summary -------------------------------------------------------------
    warmup = 2 if args.steps > 3 else (1 if args.steps > 1 else 0)
    steady = times[warmup:]
    median_dt = statistics.median(steady)
    tokens_per_s = global_tokens / median_dt

    mem = {
        "rank": rank,
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        "alloc_peak_bytes": _runtime_peak_bytes(model, args.fsdp2),
    }
    all_mem: list[Any] = [None] * world
    dist.all_gather_object(all_mem, mem)

    comm = comm_stats.as_dict() if comm_stats is not None else None

    if is_main:
        rows: list[tuple[str, str]] = [
            ("mode", mode),
            ("world size", str(world)),
            ("parameters", f"{n_params:,}"),
            ("loss first / last", f"{losses[0]:.4f} / {losses[-1]:.4f}"),
            (
                f"tokens/s (median, steps {warmup + 1}..{args.steps}, global)",
                f"{tokens_per_s:,.0f}",
            ),
            ("step time (median)", f"{median_dt * 1e3:.1f} ms"),
        ]
        for m in sorted(all_mem, key=lambda d: d["rank"]):
            rows.append((f"peak RSS rank {m['rank']}", _fmt_bytes(m["maxrss_bytes"])))
            rows.append(
                (
                    f"mfsdp2 runtime peak (shards + transient) rank {m['rank']}",
                    _fmt_bytes(m["alloc_peak_bytes"]),
                )
            )
        if comm is not None and counted_steps > 0:
            per = float(counted_steps)
            ag_b = comm.get("all_gather_bytes", 0) / per
            rs_b = comm.get("reduce_scatter_bytes", 0) / per
            ag_c = comm.get("all_gather_calls", 0) / per
            rs_c = comm.get("reduce_scatter_calls", 0) / per
            rows += [
                (f"all-gathered / step (steps 2..{args.steps})", _fmt_bytes(ag_b)),
                (f"reduce-scattered / step (steps 2..{args.steps})", _fmt_bytes(rs_b)),
                ("collectives / step", f"{ag_c + rs_c:g} ({ag_c:g} all-gather, {rs_c:g} reduce-scatter)"),
            ]
        else:
            rows += [
                ("all-gathered / step", "n/a"),
                ("reduce-scattered / step", "n/a"),
                ("collectives / step", "n/a"),
            ]
        width = max(len(k) for k, _ in rows)
        line = "-" * (width + 3 + max(len(v) for _, v in rows))
        print(line)
        for k, v in rows:
            print(f"{k:<{width}} | {v}")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
