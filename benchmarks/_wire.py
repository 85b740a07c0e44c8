"""What the benchmarks put on the wire: a counter of the ``torch.distributed`` collectives a step
issues (kind, bytes, dtype, order), their per-step summaries, the ring estimate of what each rank
sends, and a comm-only replay of a recorded step (the collectives alone, no compute).

Byte counts are the size of each collective's *full* buffer on one rank (see ``_common``).
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist


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
        # before torch 2.13: all_gather_into_tensor / reduce_scatter_tensor (mfsdp2/base/compat.py)
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
