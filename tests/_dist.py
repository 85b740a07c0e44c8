"""Run a function on N spawned gloo ranks and collect each rank's result by value.

Facts this relies on (see shared notes): spawn, 127.0.0.1, one thread per rank on a 2-core box,
results sent back as ``torch.save`` bytes (tensors put on a queue live in the rank's shared memory
and can vanish when it exits), and a timeout on every join so a deadlock fails the test instead of
hanging it.

Ports cannot collide, also under ``pytest -n`` (xdist): the parent process creates the
rendezvous store itself, listening on a port the OS picks (:func:`held_store`), and keeps it
open until the ranks are done; the ranks connect to it as clients. Picking a "free" port and
letting a child bind it later raced other test processes (``EADDRINUSE``, "Connection reset by
peer" under xdist). Where a launcher must bind the port itself (``torchrun``), :func:`free_port`
picks one from a range of its own per xdist worker.
"""

from __future__ import annotations

import datetime
import gc
import io
import os
import random
import socket
import sys
import time
import traceback
import warnings
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


HOST = "127.0.0.1"
# Ports below Linux's ephemeral range (32768-60999), where the OS never hands out a port of its own.
_PORT_BASE, _PORTS_PER_WORKER, _WORKERS = 20000, 400, 30


def worker_index(env=None) -> int:
    """The xdist worker's number (``PYTEST_XDIST_WORKER=gw3`` -> 3); -1 outside xdist."""
    name = (os.environ if env is None else env).get("PYTEST_XDIST_WORKER", "")
    digits = name[2:] if name.startswith("gw") else ""
    return int(digits) if digits.isdigit() else -1


def port_range(index: int) -> range:
    """The ports :func:`free_port` may return in xdist worker ``index`` (-1: not under xdist).
    Disjoint between workers, so two workers never pick the same port."""
    slot = (index + 1) % _WORKERS
    start = _PORT_BASE + slot * _PORTS_PER_WORKER
    return range(start, start + _PORTS_PER_WORKER)


def free_port() -> int:
    """A port nobody listens on now, for launchers that bind it themselves (``torchrun
    --master-port``). Taken from this xdist worker's own range (:func:`port_range`), in random
    order, checked by binding it: another worker of the same run cannot pick it; only an
    unrelated process binding that port in between can still collide. Prefer
    :func:`held_store`, which cannot collide at all."""
    ports = list(port_range(worker_index()))
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports[0]}..{ports[-1]}")


def held_store(timeout_s: float = 300.0) -> dist.TCPStore:
    """A rendezvous store served by this process on a port the OS picked (``store.port``): it
    stays bound while the store object lives, so no other process can take the port."""
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))


def client_store(port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """A rank's connection to a :func:`held_store` of its parent."""
    return dist.TCPStore(HOST, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _entry(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", store=client_store(port), rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report any failure, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        # ``put`` hands the bytes to a feeder thread: wait until they are in the pipe, so a crash
        # in the teardown below cannot take a finished rank's result with it.
        queue.close()
        queue.join_thread()
        # gloo on torch 2.13 sometimes aborts at exit when a DeviceMesh is still referenced while
        # the group is destroyed: drop every reference first (the helper's locals are gone by now;
        # mfsdp2's cached communicators hold their groups until the next default group).
        registry = sys.modules.get("mfsdp2.comm.registry")
        if registry is not None:
            registry.clear_communicators()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint", "mfsdp2"]


def process_context():
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
    ctx = process_context()
    queue = ctx.Queue()
    store = held_store()  # referenced until the ranks are done: the port stays ours
    port = store.port
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    deadline = time.monotonic() + timeout
    dead_since: dict[int, float] = {}
    try:
        while len(results) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=1.0)
            except Empty:
                now = time.monotonic()
                if now > deadline:
                    errors.append(f"timed out after {timeout}s waiting for ranks; got {sorted(results)}")
                    break
                # A rank that died without reporting (a crash in C++, glibc's abort, the OOM killer)
                # fails the launch now instead of at the timeout; the grace lets a result its
                # exiting process already queued arrive first.
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode is not None:
                        dead_since.setdefault(r, now)
                gone = [r for r, t in dead_since.items() if now - t > 3.0 and r not in results]
                if gone:
                    errors.append("; ".join(f"rank {r} exited with code {procs[r].exitcode} without a result"
                                            for r in gone)
                                  + f" (got {sorted(results)})")
                    break
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    del store
    if errors:
        raise AssertionError("\n".join(errors))
    crashed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, None)]
    if crashed:
        # Every rank delivered its whole result first (the ranks flush it before tearing down), so
        # what the test checks is complete: a crash in gloo's process-group teardown is reported
        # as a warning, not as a failure of the test.
        warnings.warn(f"{getattr(fn, '__qualname__', fn)}: ranks exited abnormally after reporting their results "
                      f"(rank, exit code): {crashed}", RuntimeWarning, stacklevel=2)
    return [results[r] for r in range(world_size)]


def world_mesh(device_type: str, expect_backend: str = "gloo"):
    """A 1-D mesh over the whole default group, built *from* that group, with the backend its
    ``device_type`` collectives go to checked.

    Why: ``init_device_mesh`` may make a fresh group, and on torch versions that make it as
    ``cpu:gloo,cuda:nccl`` a CUDA mesh over a gloo default group would send its collectives to
    NCCL -- which refuses two ranks on one GPU, or, worse, a test written for gloo's path would
    silently run the NCCL one. Raises when the backend is not ``expect_backend``."""
    from torch.distributed.device_mesh import DeviceMesh

    from mfsdp2.comm.devices import group_backend

    group = dist.group.WORLD
    backend = group_backend(group, device_type)
    if backend != expect_backend:
        raise RuntimeError(
            f"the default group runs its {device_type} collectives on {backend!r}, not {expect_backend!r}: "
            f"several ranks on one GPU need gloo (NCCL refuses them); initialise with init_process_group('gloo')")
    mesh = DeviceMesh.from_group(group, device_type)
    mesh_backend = group_backend(mesh.get_group(), device_type)
    if mesh.get_group() is not group and mesh_backend != expect_backend:
        raise RuntimeError(f"the {device_type} mesh's group runs on {mesh_backend!r}, not {expect_backend!r}")
    return mesh
