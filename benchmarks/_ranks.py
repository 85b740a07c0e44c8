"""Spawned gloo ranks for the CPU benchmarks: ``run_ranks(fn, world_size, *args)`` runs
``fn(rank, world_size, *args)`` on ``world_size`` processes and returns their results by value.

Also where the benchmarks find the checkout (:data:`REPO`, put on ``sys.path``: mfsdp2 need not be
pip-installed). Nothing here imports mfsdp2.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from typing import Any, Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # the benchmarks run from a checkout; mfsdp2 need not be pip-installed
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, threads: int, fn: Callable, args: tuple, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        q.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report any failure to the parent instead of hanging it
        q.put((rank, False, traceback.format_exc()))
    finally:
        # Free models and meshes before tearing gloo down (a live DeviceMesh at interpreter exit
        # makes torch 2.13 + gloo abort now and then).
        gc.collect()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 1800.0, threads: int = 1,
              env: Optional[dict] = None) -> list:
    """``[fn(rank, world_size, *args) for rank]`` on spawned gloo ranks (127.0.0.1, a free port).

    Results come back by value (pickled plain Python objects). Raises on any rank's failure or
    when ``timeout`` seconds pass; a rank that dies without reporting fails the run at once.
    ``env`` is set in this process while the ranks start (spawned children inherit it: glibc reads
    ``MALLOC_*`` variables at start-up only) and restored afterwards.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, threads, fn, args, q), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, ok, payload = q.get(timeout=2.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    # Give a dying rank a moment to flush its traceback onto the queue.
                    try:
                        rank, ok, payload = q.get(timeout=5.0)
                    except queue_mod.Empty:
                        errors.append(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                        break
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout:.0f}s; finished ranks: {sorted(results)}")
                    break
                else:
                    continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
