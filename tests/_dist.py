"""Run a function on N spawned gloo ranks and collect each rank's result by value.

Facts this relies on (see shared notes): spawn, 127.0.0.1, a free port per run, one thread per
rank on a 2-core box, results sent back as ``torch.save`` bytes (tensors put on a queue live in
the rank's shared memory and can vanish when it exits), and a timeout on every join so a
deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import gc
import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report any failure, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        # gloo on torch 2.13 sometimes aborts at exit when a DeviceMesh is still referenced while
        # the group is destroyed: drop every reference first (the helper's locals are gone by now).
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint", "mfsdp2"]


def _context():
    """Ranks are forked from a forkserver that has imported torch and mfsdp2 once per pytest run.

    Each rank is still a fresh process for the test (nothing has run in the server but imports:
    no process group, no thread pool, no dynamo cache), but it no longer pays the 2-4 s import of
    torch.distributed.tensor and friends: over the suite's hundreds of rank launches on two cores
    that import was most of the wall time. ``MFSDP2_TEST_SPAWN=1`` goes back to plain spawn."""
    if os.environ.get("MFSDP2_TEST_SPAWN") == "1":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """``[fn(rank, world_size, *args) for rank]`` on spawned ranks; raises on any rank's failure."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    except Exception as e:  # queue.Empty on timeout
        errors.append(f"timed out after {timeout}s waiting for ranks ({type(e).__name__}); got {sorted(results)}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
