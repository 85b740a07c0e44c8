"""One spawned process holding a world-size-1 NCCL group on GPU 0, for the CUDA tests.

NCCL refuses two ranks on one device, so one GPU runs every CUDA test as a single rank. Each
:func:`run_cuda` call starts a fresh process, so a CUDA error or a hang fails that test alone; the
result comes back by value (``torch.save`` through a queue). Also here: the current CUDA device,
the small model's batches moved to it, and the GPU sleep with which the race controls make the
device lag the host.
"""

from __future__ import annotations

import io
import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._dist import client_store, held_store
from ..models import batch

# About 0.1 s of GPU time at H100 clocks (torch.cuda._sleep spins for this many cycles): far
# longer than it takes the host to queue the work that races with it.
SLEEP_CYCLES = 200_000_000


def _entry(port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=client_store(port), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        out = fn(*args)
        torch.cuda.synchronize()
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((True, buf.getvalue()))
    except BaseException:
        queue.put((False, traceback.format_exc()))
    finally:
        import gc

        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_cuda(fn, *args, timeout: float = 240.0):
    """``fn(*args)`` in a spawned process with a 1-rank NCCL group on GPU 0; its result by value."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = held_store()  # the parent holds the port until the child is done (no xdist races)
    p = ctx.Process(target=_entry, args=(store.port, fn, args, queue))
    p.start()
    try:
        ok, payload = queue.get(timeout=timeout)
    except Exception as e:  # queue.Empty
        ok, payload = False, f"timed out after {timeout}s ({type(e).__name__})"
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join(5)
    if not ok:
        raise AssertionError(payload)
    return torch.load(io.BytesIO(payload), weights_only=False)


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _net_data(step, dev):
    x, y = batch(step, 8, 12)
    return x.to(dev), y.to(dev)
