"""Shared pieces of the CPU benchmarks: spawned gloo ranks, a collective counter, the benchmark
models, memory probes and small statistics helpers.

Nothing here imports mfsdp2 at module level, so ``benchmarks/gpu.py --help`` works anywhere.

Conventions (see docs/benchmarks.md):

* Byte counts are the size of each collective's *full* buffer on one rank: the output of an
  all-gather, the input of a reduce-scatter, the tensor of an all-reduce / broadcast. That is the
  quantity ``mfsdp2.comm.communicator.comm_stats`` counts too; what a ring moves per rank is ``(N-1)/N`` of it
  (x2 for gloo's reduce-scatter, which gloo runs as an all-reduce).
* Times are per step, the max over ranks of each rank's wall time for the step (every step starts
  after a barrier), and are summarised by the median and p10/p90 over the timed steps.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import gc
import inspect
import os
import pickle
import platform
import queue as queue_mod
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # the benchmarks run from a checkout; mfsdp2 need not be pip-installed
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# --------------------------------------------------------------------------------------------
# spawned ranks
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# collective counter
# --------------------------------------------------------------------------------------------

# name -> (kind, index of the tensor whose bytes count, its parameter name)
_COLLECTIVES = {
    "all_gather_single": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "_all_gather_base": ("all_gather", 0),
    "all_gather": ("all_gather", 0),  # list of outputs
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter": ("reduce_scatter", 1),  # list of inputs
    "all_reduce": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
    "all_to_all_single": ("all_to_all", 1),
    # point-to-point (a runtime may build a collective from them): bytes sent count, receives 0
    "isend": ("p2p", 0),
    "send": ("p2p", 0),
    "irecv": ("p2p_recv", 0),
    "recv": ("p2p_recv", 0),
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CollectiveCounter:
    """Counts the ``torch.distributed`` collectives issued while :attr:`enabled`.

    :meth:`install` replaces the functions in ``torch.distributed`` *and* in
    ``torch.distributed.distributed_c10d`` (the deprecated aliases call the ``*_single`` ones through
    the latter's globals; a thread-local depth makes such a nested call count once). torch FSDP2
    (torch 2.13, ``_fsdp_collectives.py``) issues ``dist.all_gather_single``,
    ``dist.reduce_scatter_single`` and, for HSDP only, ``dist.all_reduce``; mfsdp2's ``comm/communicator.py``
    issues the same two plus ``dist.all_reduce`` (and, on gloo, may build its reduce-scatter from
    ``dist.isend`` / ``dist.irecv``: those count as kind ``p2p`` with the bytes sent, and
    ``p2p_recv`` with 0 bytes). Install before building the models.

    Records are ``(function, kind, bytes, dtype, peer)``; ``peer`` is the p2p destination/source
    group rank (None for collectives).
    """

    def __init__(self) -> None:
        self.enabled = False
        self.records: list[tuple] = []  # (function, kind, bytes, dtype, peer)
        self._tls = threading.local()
        self.originals: dict[str, Callable] = {}

    def install(self) -> "CollectiveCounter":
        import torch.distributed.distributed_c10d as c10d

        for name, (kind, pos) in _COLLECTIVES.items():
            orig = getattr(c10d, name, None) or getattr(dist, name, None)
            if orig is None or getattr(orig, "_bench_wrapped", False):
                continue
            params = list(inspect.signature(orig).parameters)
            pname = params[pos]
            wrapper = self._wrap(name, kind, pos, pname, orig)
            self.originals[name] = orig
            for mod in (dist, c10d):
                if getattr(mod, name, None) is orig:
                    setattr(mod, name, wrapper)
        return self

    def _wrap(self, name: str, kind: str, pos: int, pname: str, orig: Callable) -> Callable:
        tls = self._tls
        counter = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if not counter.enabled:
                return orig(*args, **kwargs)
            depth = getattr(tls, "depth", 0)
            if depth == 0:
                t = args[pos] if len(args) > pos else kwargs.get(pname)
                first = t[0] if isinstance(t, (list, tuple)) and t else t
                dtype = str(first.dtype).replace("torch.", "") if isinstance(first, torch.Tensor) else "?"
                peer = None
                if kind.startswith("p2p"):
                    peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
                    if peer is None:
                        peer = kwargs.get("group_dst", kwargs.get("group_src"))
                nbytes = 0 if kind == "p2p_recv" else _nbytes(t)
                counter.records.append((name, kind, nbytes, dtype, peer))
            tls.depth = depth + 1
            try:
                return orig(*args, **kwargs)
            finally:
                tls.depth = depth

        wrapper._bench_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    def take(self) -> list[tuple]:
        out, self.records = self.records, []
        return out


def summarize_records(records: list, steps: int) -> dict:
    """Per-step bytes and calls, in total and per kind. ``collectives_per_step`` counts collective
    calls only; point-to-point sends/receives are in ``p2p_ops_per_step`` (their sent bytes are in
    ``wire_bytes_per_step``)."""
    steps = max(steps, 1)
    by_kind: dict[str, dict[str, float]] = {}
    by_fn: dict[str, int] = {}
    for fn, kind, nb, *_ in records:
        d = by_kind.setdefault(kind, {"bytes": 0, "calls": 0})
        d["bytes"] += nb
        d["calls"] += 1
        by_fn[fn] = by_fn.get(fn, 0) + 1
    for d in by_kind.values():
        d["bytes"] /= steps
        d["calls"] /= steps
    return {
        "wire_bytes_per_step": sum(d["bytes"] for d in by_kind.values()),
        "collectives_per_step": sum(d["calls"] for k, d in by_kind.items() if not k.startswith("p2p")),
        "p2p_ops_per_step": sum(d["calls"] for k, d in by_kind.items() if k.startswith("p2p")),
        "by_kind": by_kind,
        "functions_called": by_fn,
    }


def wire_summary(coll: dict, ws: int) -> dict:
    """Bytes per step by kind in the full-buffer convention and the ring estimate of bytes sent per
    rank, from :func:`summarize_records`' output. Like with like: mfsdp2's gloo reduce-scatter is
    built from point-to-point sends, which the counter records as bytes *sent*; they are converted
    back to the reduce-scatter buffer they came from (x N/(N-1)), so both frameworks' totals are in
    the buffer convention. At world size 1 nothing crosses the wire (a ring sends (N-1)/N of a
    buffer: 0), and there are no point-to-point bytes to convert."""
    bk = {k: d["bytes"] for k, d in coll["by_kind"].items()}
    calls = {k: d["calls"] for k, d in coll["by_kind"].items()}
    f = (ws - 1) / ws
    buf = {
        "all_gather": bk.get("all_gather", 0.0),
        "reduce_scatter": bk.get("reduce_scatter", 0.0) + (bk.get("p2p", 0.0) / f if f else 0.0),
        "all_reduce": bk.get("all_reduce", 0.0),
        "broadcast": bk.get("broadcast", 0.0),
    }
    sent = (buf["all_gather"] * f + bk.get("reduce_scatter", 0.0) * f + bk.get("p2p", 0.0)
            + buf["all_reduce"] * 2 * f + buf["broadcast"] * f)
    return {"buffer_bytes_by_kind": buf, "buffer_bytes": sum(buf.values()), "ring_sent_bytes": sent,
            "counted": bk, "calls_by_kind": calls}


# --------------------------------------------------------------------------------------------
# comm-only replay
# --------------------------------------------------------------------------------------------


class CommReplay:
    """Re-issues a recorded step's collectives (same kinds, sizes, dtypes, order), blocking, no compute.

    Point-to-point records are re-posted asynchronously to the same peers in the same order; all
    outstanding ones are waited for before the next collective and at the end."""

    def __init__(self, records: list, world_size: int, counter: Optional[CollectiveCounter] = None,
                 device: str = "cpu"):
        fns = counter.originals if counter is not None else {}
        # before torch 2.13: all_gather_into_tensor / reduce_scatter_tensor (mfsdp2/integrations/compat.py)
        ag = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        rs = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        self._ag = fns.get(ag) or getattr(dist, ag)
        self._rs = fns.get(rs) or getattr(dist, rs)
        self._ar = fns.get("all_reduce", dist.all_reduce)
        self._bc = fns.get("broadcast", dist.broadcast)
        self._isend = fns.get("isend", dist.isend)
        self._irecv = fns.get("irecv", dist.irecv)
        self.ops: list[Callable[[], None]] = []
        self._pending: list = []
        rank = dist.get_rank()
        bufs: dict[tuple, torch.Tensor] = {}
        sends: list[tuple] = [r for r in records if r[1] == "p2p"]
        recv_sizes = iter([(r[2], r[3]) for r in sends])  # a receive mirrors a peer's send (same sizes)
        for rec in records:
            _, kind, nb, dtype = rec[:4]
            peer = rec[4] if len(rec) > 4 else None
            if kind == "p2p_recv":
                nb, dtype = next(recv_sizes, (nb, dtype))
            dt = getattr(torch, dtype)
            numel = nb // torch.empty(0, dtype=dt).element_size()
            if kind in ("p2p", "p2p_recv"):
                key = (kind, numel, dt, peer)
                if key not in bufs:
                    bufs[key] = torch.zeros(numel, dtype=dt, device=device)
                fn = self._isend if kind == "p2p" else self._irecv
                self.ops.append(functools.partial(self._post, fn, bufs[key], int(peer)))
                continue
            self.ops.append(self._drain)
            key = (kind, numel, dt)
            if key not in bufs:
                bufs[key] = torch.randn(numel, device=device).to(dt)
            buf = bufs[key]
            if kind == "all_gather":
                s = numel // world_size
                self.ops.append(functools.partial(self._ag, buf, buf[rank * s:(rank + 1) * s]))
            elif kind == "reduce_scatter":
                s = numel // world_size
                okey = ("rs_out", s, dt)
                if okey not in bufs:
                    bufs[okey] = torch.empty(s, dtype=dt, device=device)
                self.ops.append(functools.partial(self._rs, bufs[okey], buf, op=dist.ReduceOp.AVG))
            elif kind == "all_reduce":
                self.ops.append(functools.partial(self._ar, buf))
            elif kind == "broadcast":
                self.ops.append(functools.partial(self._bc, buf, 0))
            else:
                raise ValueError(f"cannot replay {kind}")
        self._bufs = bufs

    def _post(self, fn, buf, peer) -> None:
        self._pending.append(fn(buf, peer))

    def _drain(self) -> None:
        for w in self._pending:
            w.wait()
        self._pending = []

    def __call__(self) -> None:
        for op in self.ops:
            op()
        self._drain()


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


class MLPBlock(nn.Module):
    def __init__(self, d: int = 1024, hidden: int = 4096):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Stack(nn.Module):
    """``blocks`` applied in order; the root owns no parameters."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


MODELS = ("mlp", "llama", "tiny")


def build_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":  # 8 x (Linear(1024,4096)-GELU-Linear(4096,1024)): 67.1M params
        return Stack([MLPBlock(1024, 4096) for _ in range(8)])
    if name == "tiny":  # 64 x Linear(64,64): framework overhead
        return Stack([nn.Linear(64, 64) for _ in range(64)])
    if name == "llama":
        from mfsdp2.examples.llama import LlamaConfig, Transformer

        return Transformer(LlamaConfig.demo())
    raise ValueError(f"unknown model {name!r}")


def units(model: nn.Module) -> list[nn.Module]:
    """The modules wrapped before the root: the blocks / decoder layers."""
    return list(model.layers) if hasattr(model, "layers") else list(model.blocks)


# global batch per model: mlp/tiny rows, llama sequences of LLAMA_SEQ tokens
GLOBAL_BATCH = {"mlp": 16, "tiny": 16, "llama": 8}
LLAMA_SEQ = 128


def make_batch(name: str, step: int, rank: int, world_size: int, global_batch: Optional[int] = None,
               seed: int = 1234):
    """This rank's slice of the global batch of ``step`` (the same on every rank and framework)."""
    gb = global_batch or GLOBAL_BATCH[name]
    per = gb // world_size
    if name == "llama":
        from mfsdp2.examples.llama import LlamaConfig, SyntheticTokens

        data = SyntheticTokens(LlamaConfig.demo().vocab_size, seed=seed)
        x, y = data.batch(step, gb, LLAMA_SEQ)
    else:
        d = 1024 if name == "mlp" else 64
        g = torch.Generator().manual_seed(seed * 1000 + step)
        x = torch.randn(gb, d, generator=g)
        y = torch.randn(gb, d, generator=g)
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def loss_fn(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "llama":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
    return F.mse_loss(out.float(), y)


def items_per_step(name: str, global_batch: Optional[int] = None) -> tuple[int, str]:
    gb = global_batch or GLOBAL_BATCH[name]
    return (gb * LLAMA_SEQ, "tokens") if name == "llama" else (gb, "samples")


CONFIGS = ("fp32", "bf16", "fp32_no_reshard")


def config_options(config: str) -> dict:
    """``param_dtype``, ``reduce_dtype``, ``reshard_after_forward`` of a config name."""
    if config == "fp32":
        return {"param_dtype": None, "reduce_dtype": None, "reshard_after_forward": True}
    if config == "bf16":
        return {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "reshard_after_forward": True}
    if config == "fp32_no_reshard":
        return {"param_dtype": None, "reduce_dtype": None, "reshard_after_forward": False}
    raise ValueError(f"unknown config {config!r}")


# --------------------------------------------------------------------------------------------
# torch FSDP2 at its best
# --------------------------------------------------------------------------------------------

# Candidate FSDP2 configurations (torch 2.13's API; benchmarks/fsdp2_tuning.py times them against
# each other). ``prefetch``: explicit ``set_modules_to_forward_prefetch`` /
# ``set_modules_to_backward_prefetch`` of the next ``k`` units on every unit (the root included);
# ``async``: ``_set_unshard_async_op(True)`` (the pre-forward / pre-backward all-gathers and the
# prefetches issued with ``async_op=True``: on CPU the only way FSDP2's gathers leave the main
# thread, since its CPU "streams" are stubs and ``async_op=False`` blocks).
FSDP2_TUNINGS = {
    "default": {},
    "prefetch1": {"prefetch": 1},
    "async": {"async": True},
    "async_prefetch1": {"async": True, "prefetch": 1},
    "async_prefetch2": {"async": True, "prefetch": 2},
}
# The fastest of the candidates per backend when no tuning run was recorded (CPU: from the runs in
# docs/benchmarks.md "The FSDP2 baseline"). CUDA's collectives already run on side streams with
# ``async_op=False``; there explicit prefetch is the documented overlap knob (not measured here).
FSDP2_TUNED = {"cpu": "async_prefetch1", "cuda": "prefetch1"}  # cpu: fsdp2_tuning.json of 2026-11-24
# A recorded ``benchmarks/fsdp2_tuning.py --json`` run overrides the CPU choice with its measured
# winner (``make bench-record`` records it first), so "tuned" is always the fastest measured here.
TUNING_JSON = os.path.join(REPO, "benchmarks", "results", "fsdp2_tuning.json")
FRAMEWORKS = ("mfsdp2", "fsdp2", "fsdp2_tuned")


def fsdp2_tuned(device_type: str = "cpu") -> str:
    """The tuned FSDP2 configuration for a device type: the recorded tuning run's winner on CPU
    when ``TUNING_JSON`` exists, else :data:`FSDP2_TUNED`."""
    if device_type == "cpu" and os.path.exists(TUNING_JSON):
        import json

        with open(TUNING_JSON) as f:
            winner = json.load(f).get("winner")
        if winner in FSDP2_TUNINGS:
            return winner
    return FSDP2_TUNED[device_type]


def fsdp2_tuning_name(framework: str, device_type: str = "cpu") -> Optional[str]:
    """The FSDP2 configuration a framework name stands for: ``fsdp2`` = "default",
    ``fsdp2_tuned`` = the backend's tuned one, ``fsdp2:<name>`` = a candidate; None for others."""
    if framework == "fsdp2":
        return "default"
    if framework == "fsdp2_tuned":
        return fsdp2_tuned(device_type)
    if framework.startswith("fsdp2:"):
        name = framework.split(":", 1)[1]
        if name not in FSDP2_TUNINGS:
            raise ValueError(f"unknown FSDP2 tuning {name!r}; one of {sorted(FSDP2_TUNINGS)}")
        return name
    return None


def tune_fsdp2(model: nn.Module, tuning: str) -> nn.Module:
    """Apply FSDP2 candidate configuration ``tuning`` (a key of :data:`FSDP2_TUNINGS`) to a model
    sharded by :func:`shard` (every unit, then the root). The root stays unsharded between forward
    and backward (its default, as in every configuration)."""
    opts = FSDP2_TUNINGS[tuning]
    us = units(model)
    k = opts.get("prefetch", 0)
    if k:
        # Forward: the root runs first, then the units in order; backward the reverse.
        order = [model] + us
        for i, m in enumerate(order):
            nxt = [u for u in order[i + 1:i + 1 + k]]
            if nxt:
                m.set_modules_to_forward_prefetch(nxt)
        for i, u in enumerate(us):
            prev = list(reversed(us[max(0, i - k):i]))
            if prev:
                u.set_modules_to_backward_prefetch(prev)
        model.set_modules_to_backward_prefetch(list(reversed(us[-k:])))
    if opts.get("async"):
        model._set_unshard_async_op(True)  # recurses into every FSDPModule
    return model


def set_accumulation_flags(model: nn.Module, framework: str, sync: bool) -> None:
    """Per micro-batch flags of gradient accumulation: every sharded framework skips the gradient
    reduction until the last micro-batch; mfsdp2 and tuned FSDP2 also keep the gathered weights
    after each non-syncing backward (``set_reshard_after_backward(False)``, FSDP2's documented way
    not to re-gather between micro-batches)."""
    model.set_requires_gradient_sync(sync)
    if framework == "mfsdp2" or (framework != "fsdp2" and fsdp2_tuning_name(framework) is not None):
        model.set_reshard_after_backward(sync)


def shard(model: nn.Module, framework: str, config: str, mesh, sharding_strategy: Optional[str] = None,
          all_gather_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """``fully_shard`` every unit, then the root, with ``framework``: "mfsdp2", "fsdp2" (torch's
    defaults), "fsdp2_tuned" (:data:`FSDP2_TUNED` for the mesh's device) or "fsdp2:<tuning>".

    ``sharding_strategy`` / ``all_gather_dtype`` (mfsdp2 only) go to every ``fully_shard`` call and
    into the ``MixedPrecisionPolicy``; None keeps mfsdp2's defaults (ZeRO-3, no FP8)."""
    o = config_options(config)
    extra: dict = {}
    tuning = fsdp2_tuning_name(framework, mesh.device_type)
    if framework == "mfsdp2":
        from mfsdp2 import MixedPrecisionPolicy, fully_shard

        if sharding_strategy is not None:
            extra["sharding_strategy"] = sharding_strategy
    elif tuning is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if sharding_strategy is not None or all_gather_dtype is not None:
            raise ValueError("sharding_strategy / all_gather_dtype are mfsdp2 options")
    else:
        raise ValueError(framework)
    mp_kw = {"all_gather_dtype": all_gather_dtype} if all_gather_dtype is not None else {}
    mp = MixedPrecisionPolicy(param_dtype=o["param_dtype"], reduce_dtype=o["reduce_dtype"], **mp_kw)
    for u in units(model):
        fully_shard(u, mesh=mesh, mp_policy=mp, reshard_after_forward=o["reshard_after_forward"], **extra)
    # The root keeps its parameters from forward to backward in both runtimes when its
    # reshard_after_forward is left at the default (None); an explicit True makes either all-gather
    # the root twice per step.
    root_kw = {} if o["reshard_after_forward"] else {"reshard_after_forward": False}
    fully_shard(model, mesh=mesh, mp_policy=mp, **root_kw, **extra)
    if tuning is not None:
        tune_fsdp2(model, tuning)
    return model


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, name: str, x, y) -> torch.Tensor:
    loss = loss_fn(name, model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class ComputeFloor:
    """The same model unsharded in this process (compute dtype), this rank's batch, no collectives,
    and the optimizer over fp32 tensors of one rank's shard size (what each rank updates)."""

    def __init__(self, ref: nn.Module, name: str, config: str, world_size: int, loss=None):
        import copy

        o = config_options(config)
        self.loss = loss or functools.partial(loss_fn, name)
        self.model = copy.deepcopy(ref)
        if o["param_dtype"] is not None:
            self.model.to(o["param_dtype"])
        self.name = name
        self.dtype = o["param_dtype"]
        self.shards = []
        for p in ref.parameters():
            rows = -(-p.shape[0] // world_size)
            t = torch.zeros((rows,) + tuple(p.shape[1:]), device=p.device, requires_grad=True)
            t.grad = torch.randn_like(t) * 1e-3
            self.shards.append(t)
        self.opt = make_optimizer(self.shards)

    def __call__(self, x, y) -> None:
        if self.dtype is not None and x.is_floating_point():
            x = x.to(self.dtype)
        loss = self.loss(self.model(x), y)
        loss.backward()
        for p in self.model.parameters():
            p.grad = None
        self.opt.step()


# --------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------

_libc = None


def malloc_trim() -> None:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except OSError:
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    gc.collect()
    malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM since the last :func:`reset_peak_rss` (getrusage's ru_maxrss when that is unavailable)."""
    hwm = _status_kib("VmHWM")
    if hwm:
        return hwm * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def mfsdp2_groups(model: nn.Module) -> list:
    gs = []
    for m in model.modules():
        st = getattr(m, "_mfsdp2_state", None)
        if st is not None:
            gs.extend(st.groups)
    return gs


def mfsdp2_persistent_bytes(model: nn.Module) -> dict:
    """Bytes of mfsdp2's persistent shards: main weights, model-weight shards (when a separate
    tensor)."""
    main_w = model_w = 0
    for g in mfsdp2_groups(model):
        main_w += g.main_weight.numel() * g.main_weight.element_size()
        sh = g.weights.shard
        if sh.untyped_storage().data_ptr() != g.main_weight.untyped_storage().data_ptr():
            model_w += sh.numel() * sh.element_size()
    # Main grads are blocks of mfsdp2's allocator (counted in its peak), not persistent.
    return {"main_weight": main_w, "model_weight_shard": model_w, "total": main_w + model_w}


def mfsdp2_padding(model: nn.Module) -> float:
    """Padding fraction of mfsdp2's flat buffers: total / sum(param numel) - 1."""
    tot = used = 0
    for g in mfsdp2_groups(model):
        tot += g.layout.total_numel
        used += sum(s.numel for s in g.layout.slots)
    return tot / used - 1 if used else 0.0


# --------------------------------------------------------------------------------------------
# other load on the machine
# --------------------------------------------------------------------------------------------


def machine_busy_s() -> float:
    """CPU seconds all processes spent in user and system mode since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq = vals[:7]
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")  # irq/softirq: not attributable


def process_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def wait_until_quiet(max_wait_s: float, threshold: float = 0.15, window_s: float = 2.0) -> float:
    """Sleep until the CPU used by processes other than this one over ``window_s`` is below
    ``threshold`` of the machine (or ``max_wait_s`` passed). Returns the last foreign fraction.

    Call on one rank while the others wait in a barrier (a gloo barrier blocks without spinning).
    """
    deadline = time.monotonic() + max_wait_s
    ncpu = os.cpu_count() or 1
    while True:
        b0, c0, t0 = machine_busy_s(), process_cpu_s(), time.monotonic()
        time.sleep(window_s)
        foreign = (machine_busy_s() - b0 - (process_cpu_s() - c0)) / (ncpu * (time.monotonic() - t0))
        if foreign < threshold or time.monotonic() > deadline:
            return foreign
        time.sleep(5.0)



def run_cases(rank: int, ws: int, specs: list[dict], run_case: Callable, label_key: str) -> list[dict]:
    """The rank body of the side-by-side benchmarks: one CollectiveCounter installed before any
    model is built, then ``run_case(rank, ws, spec, counter)`` per spec, each optionally after
    waiting (on rank 0, the others in a barrier) for the machine to be quiet."""
    counter = CollectiveCounter().install()
    out = []
    for spec in specs:
        if spec.get("wait_quiet", 0) > 0:
            if rank == 0:
                f = wait_until_quiet(spec["wait_quiet"])
                if f >= 0.15:
                    print(f"  warning: other processes use {f:.0%} of the CPUs; timings will be noisy", flush=True)
            dist.barrier()
        t0 = time.time()
        out.append(run_case(rank, ws, spec, counter))
        out[-1]["case_wall_s"] = time.time() - t0
        if rank == 0:
            ph = ", ".join(f"{k} {v:.0f}s" for k, v in out[-1]["phase_s"].items())
            print(f"  [{spec['model']}/{spec[label_key]}] done in {out[-1]['case_wall_s']:.0f}s ({ph})", flush=True)
    return out

# --------------------------------------------------------------------------------------------
# statistics and reporting
# --------------------------------------------------------------------------------------------


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize_times(ts: list[float]) -> dict:
    return {
        "median": statistics.median(ts) if ts else float("nan"),
        "p10": quantile(ts, 0.1),
        "p90": quantile(ts, 0.9),
        "n": len(ts),
    }


def max_over_ranks(per_rank: list[list[float]]) -> list[float]:
    return [max(v) for v in zip(*per_rank)]


def fmt_bytes(n: Optional[float]) -> str:
    if n is None or n != n:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "mfsdp2"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except Exception:
        rev, dirty = "?", ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "backend": "gloo",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads_per_rank": 1,
        "mfsdp2_commit": rev + ("+uncommitted changes in mfsdp2/" if dirty else ""),
        "malloc_mmap_max": os.environ.get("MALLOC_MMAP_MAX_"),
        "fsdp2_tuned_cpu": fsdp2_tuned("cpu"),  # what "FSDP2 tuned" meant in this run
        "env": {k: v for k, v in os.environ.items() if k.startswith(("MFSDP2_", "MALLOC_"))},
    }


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    line = " | ".join(str(h).ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))
