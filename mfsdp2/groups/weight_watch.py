"""Noticing that the main weights changed, including writes that bump no version counter.

Strategies that keep full model weights between steps (ZeRO-1/2, no_shard) re-cast main -> model
weights and re-gather only when the weights changed; ZeRO-3 units kept gathered across forwards
(``set_reshard_after_backward(False)``, an in-flight ``unshard(async_op=True)``) re-gather on the
same signal. Version counters alone miss the writes users make through ``.data`` (an EMA copied
in for an eval pass, ``torch.nn.init.*_(p.data)``, loaders): ``p.data`` is a new tensor with its
own counter. What a group knows at the root's forward:

* **common host facts** -- the same on every rank without communication: an optimizer step ran
  (one process-wide ``register_optimizer_step_post_hook`` marks every live group; every rank
  steps), an announced write (``FSDPModule.mark_weights_changed()``, ``load_state_dict``,
  ``mfsdp2.materialize``; every rank calls them), a reset after an error;
* a moved **version counter** of the main weights (in-place ops through the parameters);
* the main shard's **content fingerprint** (:func:`fingerprint`) differs from the one taken at the
  last gather: the catch-all for silent writes. Local: a rank holding no rows sees nothing.

**The policy** (:func:`watch_mode`, decided per group at each root forward, from facts every rank
shares, so every rank issues the same gathers):

1. A common fact says "changed": the group re-gathers. No content check, no read, nothing to
   agree. In the usual loop (one forward per optimizer step) that is every forward, so the steady
   state makes no host read and no blocking collective for any strategy.
2. No such fact (a micro-batch of gradient accumulation, an eval pass without a step): either
   compare the content (a fingerprint on the device, an all-reduce MAX of the flags, and a host
   read of the agreed flags) or simply re-gather (the all-gather FSDP2 pays every forward anyway;
   no read). :attr:`WatchMode.CONTENT` where the read is free -- the compute device's memory is
   host memory (a CPU mesh), where ``tolist`` is a plain read -- and the check saves a collective
   of the full weights; :attr:`WatchMode.REGATHER` where reading the agreed flag synchronises the
   device (:func:`host_read_synchronises`: CUDA and every accelerator). Under CPU offload on an
   accelerator the check would also cost a fingerprint of all main weights on the host and a
   blocking all-reduce over the gloo twin per forward: re-gather there too (the copy-in is the
   cast it needed anyway). On a CPU mesh with offload both memories are host memory: the check
   costs what it costs without offload and stays.
   The content check compares against a fingerprint the last gather took. Taking it costs
   passes over the main shard at every gather, and in the usual loop no forward reads it: from
   the third grad-enabled forward in a row that follows a common fact, a gather takes none (a
   prediction from facts every rank shares), and a forward without a fact that finds none
   re-gathers without an agreement -- and takes one for the forwards after it. Gradient
   accumulation (a forward without a fact after each step's) and evaluation passes (a forward
   under ``no_grad`` takes one) keep their fingerprints.
3. ``set_detect_data_writes(False)`` (:attr:`WatchMode.HOST_FACTS`): trust the host facts; no
   content check and no re-gather without a fact, so a write through ``.data`` must be announced.
   The version counters stay facts: the in-place ops that move them go through the DTensor
   parameters, which every rank runs (SPMD, as FSDP2 assumes), so every rank sees them move --
   the wrapper's counter moves even on a rank whose local piece is empty. No collective agrees on
   them (that would be a blocking gloo all-reduce per forward): a write to the local shards of
   some ranks only must be announced on every rank with ``mark_weights_changed()``. The same mode
   serves ``no_shard`` groups that compute with the main weights' own memory (nothing to
   re-gather).

Writes through ``p.data`` are therefore never used stale silently: CONTENT sees them, REGATHER
re-gathers regardless, HOST_FACTS is the documented opt-out. ``tests/groups/test_weight_writes.py``
runs every kind of write under both defaults (:func:`set_host_read_synchronises` forces the
accelerator's on a CPU); ``tests/runtime/test_host_sync.py`` counts host reads and collectives per
forward under both.
"""

from __future__ import annotations

import enum
import logging
import weakref
from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..base.markers import reads_no_params
from ..comm.communicator import device_ints

__all__ = ["agree_on_gathers", "fingerprint", "fingerprints", "watch", "WatchMode", "watch_mode",
           "host_read_synchronises", "set_host_read_synchronises"]

logger = logging.getLogger(__name__)

_groups: "weakref.WeakSet" = weakref.WeakSet()

# Grad-enabled root forwards in a row with a common fact from which a gather takes no fingerprint.
BASELINE_STREAK = 3
_hook_handle = None

# Columns of the (rows, columns) view the fingerprint weights by position.
_COLS = 1024


def as_words(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` as a flat integer tensor (int32 where the bytes allow, else narrower)."""
    flat = t.detach().reshape(-1)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        try:
            return flat.view(dtype)
        except RuntimeError:  # size or storage offset not a multiple of the wider word
            continue
    raise TypeError(f"mfsdp2: cannot fingerprint a {t.dtype} tensor")


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A device-side digest of ``t``'s bits. Its integer words ``w`` are viewed as a matrix of
    ``_COLS`` columns (the tail words as one more, shorter row); the digest is
    ``[sum w, sum_r (r+1) R_r, sum_c (c+1) C_c]`` with ``R_r`` / ``C_c`` the row / column sums, all in
    int32 arithmetic wrapping modulo 2^32 (what CPU and CUDA integer kernels do; modular sums are
    exact, so the result does not depend on the reduction order).

    Why this and not a float sum: a write of different values changes some word by a nonzero ``d``
    with ``|d| < 2^32``, so a single changed word always changes the first sum; two words swapped
    move between rows or columns and change the weighted sums; several changed words go unseen
    only if all three cancel at once. Why int32 and row / column sums rather than one sum weighted
    by each word's position: an int64 position-weighted sum needs an int64 temporary per element
    and runs at about a hundredth of the speed of an int32 sum on CPU (180 ms vs 1.3 ms for the 8.4M
    words of one mlp unit, measured), and persistent strategies pay it at every gather: it made
    ``no_shard`` slower than DDP. Three reduction passes over the words, no host read: the
    comparison with the previous fingerprint stays on the device until the agreement all-reduce."""
    words = as_words(t)
    n = words.numel()
    rows = n // _COLS
    main = words[: rows * _COLS].view(rows, _COLS)
    tail = words[rows * _COLS :]
    i32 = torch.int32
    row_sums = main.sum(dim=1, dtype=i32)
    col_sums = main.sum(dim=0, dtype=i32)
    tail_sum = tail.sum(dtype=i32)
    row_w = torch.arange(1, rows + 1, dtype=i32, device=t.device)
    col_w = torch.arange(1, _COLS + 1, dtype=i32, device=t.device)
    return torch.stack([
        row_sums.sum(dtype=i32) + tail_sum,
        (row_sums * row_w).sum(dtype=i32) + tail_sum * (rows + 1),
        (col_sums * col_w).sum(dtype=i32) + (tail.to(i32) * col_w[: tail.numel()]).sum(dtype=i32),
    ])


def fingerprints(ts: list) -> list:
    """:func:`fingerprint` of each tensor of ``ts``, the same int32 values, in a handful of
    kernels for the lot instead of about ten per tensor (a bucket of 64 small groups re-gathered
    after a step spent 3 ms on those launches, a fifth of ZeRO-1's forward on the tiny model).

    Why the values are the same: ``sum_r (r+1) R_r`` and ``sum_c (c+1) C_c`` (tail included, as
    :func:`fingerprint` counts it) are ``sum_p (p // COLS + 1) w_p`` and ``sum_p (p % COLS + 1) w_p``
    over each tensor's word positions ``p``: sums and products modulo 2^32 are a ring, so grouping
    the terms differently gives the same int32 result. Tensors whose bytes are not int32 words,
    or that live on different devices, take :func:`fingerprint` one by one.

    How: tensors of one word count (a bucket's members are usually alike: the blocks of a model)
    are stacked as the rows of a matrix and weighted by one position vector, three row sums for
    the lot; the rest are concatenated and summed per segment. The stacked form is the cheap one:
    the segment sums need a segment index and a position per word and ``index_add_``, which ran at
    a tenth of the speed of a row sum on CPU (2 ms for the 64 shards of the tiny model's bucket).

    No host synchronisation on CUDA: the word counts are host facts, sent to the device from
    page-locked memory without waiting (:func:`~mfsdp2.comm.communicator.device_ints`), and
    ``repeat_interleave`` is told its output size (without it, it reads the counts' sum back to
    size its output). So the computation needs no device data on the host: it runs on the meta
    device as well."""
    words = [as_words(t) for t in ts]
    if len(ts) < 2 or any(w.dtype != torch.int32 for w in words) or len({w.device for w in words}) > 1:
        return [fingerprint(t) for t in ts]
    by_size: dict = {}
    for i, w in enumerate(words):
        by_size.setdefault(w.numel(), []).append(i)
    out: list = [None] * len(ts)
    rest = []
    for n, idx in by_size.items():
        if len(idx) < 2 or n == 0:
            rest += idx
            continue
        for i, f in zip(idx, _stacked_fingerprints([words[i] for i in idx])):
            out[i] = f
    if len(rest) == 1:
        out[rest[0]] = fingerprint(ts[rest[0]])
    elif rest:
        for i, f in zip(rest, _segmented_fingerprints([words[i] for i in rest])):
            out[i] = f
    return out


def _stacked_fingerprints(words: list) -> list:
    """Fingerprints of int32 word vectors of one length ``n``: the rows of a ``(k, n)`` matrix,
    weighted by the positions' row (``p // COLS + 1``) and column (``p % COLS + 1``) numbers."""
    i32 = torch.int32
    n, device = words[0].numel(), words[0].device
    w = torch.stack(words)
    pos = torch.arange(n, device=device, dtype=i32)
    row_w = torch.div(pos, _COLS, rounding_mode="floor").add_(1)
    col_w = pos.remainder_(_COLS).add_(1)
    out = torch.stack([w.sum(dim=1, dtype=i32), (w * row_w).sum(dim=1, dtype=i32), (w * col_w).sum(dim=1, dtype=i32)])
    return list(out.t())


def _segmented_fingerprints(words: list) -> list:
    """Fingerprints of int32 word vectors of any lengths: concatenated, summed per segment."""
    device = words[0].device
    i32 = torch.int32
    sizes = [w.numel() for w in words]
    counts = device_ints(sizes, device)
    seg = torch.repeat_interleave(torch.arange(len(words), device=device), counts, output_size=sum(sizes))
    starts = torch.cumsum(counts, 0) - counts
    pos = (torch.arange(seg.numel(), device=device) - starts[seg]).to(i32)
    flat = torch.cat(words)
    out = torch.zeros(3, len(words), dtype=i32, device=device)
    out[0].index_add_(0, seg, flat)
    out[1].index_add_(0, seg, flat * (pos // _COLS + 1))
    out[2].index_add_(0, seg, flat * (pos % _COLS + 1))
    return list(out.t())


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    for g in list(_groups):
        g.mark_changed()


# Reads nothing of the optimizer: it may run while a step's parameters are swapped for their
# local tensors (mfsdp2.runtime.local_step).
reads_no_params(_on_optimizer_step)


def watch(group) -> None:
    """Register a :class:`~mfsdp2.groups.param_group.ParameterGroup` for the optimizer-step signal; the
    hook is installed once per process and holds the groups weakly."""
    global _hook_handle
    _groups.add(group)
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_post_hook(_on_optimizer_step)


class WatchMode(str, enum.Enum):
    """How a persistent group decides, without a common fact, whether to re-gather (see the
    module docstring)."""

    HOST_FACTS = "host facts"  # version counters only (set_detect_data_writes(False); no_shard on main memory)
    CONTENT = "content check"  # fingerprint, agreed flags read on the host (reads are free)
    REGATHER = "re-gather"  # re-gather: no read, no agreement (reads synchronise; offload on an accelerator)


_read_synchronises: Optional[bool] = None


def host_read_synchronises(device: torch.device) -> bool:
    """Whether the host reading data of ``device`` waits for the device: every device but the
    CPU's own memory (and meta, which holds no data)."""
    if _read_synchronises is not None:
        return _read_synchronises
    return device.type not in ("cpu", "meta")


def set_host_read_synchronises(value: Optional[bool]) -> Optional[bool]:
    """Force :func:`host_read_synchronises` for every device (None: per device, the default);
    returns the previous setting. Tests run the accelerator's policy on a CPU with it. Every rank
    must use the same setting."""
    global _read_synchronises
    prev, _read_synchronises = _read_synchronises, value
    return prev


def watch_mode(group) -> WatchMode:
    """The :class:`WatchMode` of a persistent group (see the module docstring)."""
    if not group.fingerprinted:
        return WatchMode.HOST_FACTS
    if host_read_synchronises(group.device):
        return WatchMode.REGATHER
    return WatchMode.CONTENT


def agree_on_gathers(ctx) -> None:
    """At the root's forward (``ctx``: its RootContext): decide which persistent groups re-gather
    (see the module docstring) and agree on the FP8 scales.

    * Persistent weights (``optim``, ``optim_grads``, ``no_shard``): a group with a common fact
      (:attr:`changed`) re-gathers; otherwise its :func:`watch_mode` decides. Only
      :attr:`WatchMode.CONTENT` groups need an agreement: one all-reduce (MAX) of their flags over
      the device group and one host read (``tolist``) of the result, where that read is a plain
      read of host memory.
    * FP8 groups need one scale per parameter that every rank shares: the max of the ranks'
      amax, in the same all-reduce. The scales stay on the device (no host read).
    """
    checked = []
    grad = torch.is_grad_enabled()
    for s in ctx.states:
        for g in s.groups:
            if not g.persistent:
                continue  # ZeRO-3: gathers every time
            # The fingerprint a gather takes serves only a later forward without a common fact:
            # a micro-batch of gradient accumulation (the run of forwards after a fact never
            # passes one) or an evaluation pass (under no_grad). A run of grad-enabled forwards
            # that each followed a fact (one forward per optimizer step) predicts that the next
            # one does too: from the third, the gather this forward plans skips it (the gather
            # consumes the prediction, begin_gather). A forward without a fact that then finds
            # none re-gathers, as FSDP2 does every forward, and its gather takes one for the
            # forwards after it. Facts every rank shares only (the grad mode too, SPMD):
            # every rank predicts alike, so whether a group holds a fingerprint is common.
            g.fact_streak = g.fact_streak + 1 if g.changed else 0
            g.wants_baseline = g.fact_streak < BASELINE_STREAK or not grad
            if g.changed:
                continue  # a common fact: nothing to decide
            mode = watch_mode(g)
            if mode is not WatchMode.CONTENT:
                g.agreed_stale = mode is WatchMode.REGATHER or g.host_changed()
            elif g.has_baseline:
                checked.append(g)
            else:
                g.agreed_stale = True  # nothing to compare with: re-gather, no agreement needed
    fp8 = [g for s in ctx.states for g in s.groups if g.fp8 is not None]
    if not checked and not fp8:
        return
    from ..precision.fp8 import agree_scales

    groups = checked + fp8
    device = groups[0].device
    parts = []
    if checked:
        one = torch.ones((), dtype=torch.float32, device=device)
        parts.append(torch.stack([g.changed_flag(one) for g in checked]))
    amaxes = [g.fp8.local_amax() for g in fp8]
    parts += amaxes
    vec = torch.cat(parts) if len(parts) > 1 else parts[0]
    label = f"gather agreement (changed flags, fp8 amax) at the forward of step {ctx.step}"
    _all_reduce_max_per_mesh(vec, groups, [1] * len(checked) + [a.numel() for a in amaxes], label)
    if checked:
        for g, f in zip(checked, vec[: len(checked)].tolist()):  # host memory: a plain read
            g.agreed_stale = f > 0
    agree_scales(fp8, vec, len(checked))


def _all_reduce_max_per_mesh(vec: torch.Tensor, groups: list, sizes: list[int], label: str) -> None:
    """MAX of ``vec`` (``sizes[i]`` entries for ``groups[i]``) over each group's shard group.

    Usually every group of a model shares one shard group: one collective (groups of one rank,
    e.g. no_shard's, need none: their gathers involve no other rank, and a MAX with the others'
    flags is merely conservative). Groups on per-parameter meshes (experts over their
    expert-data-parallel mesh) agree with the ranks of their own mesh, one collective per mesh:
    the ranks of another block of that mesh hold other experts, whose flags and scales are theirs."""
    by_comm: dict[int, list] = {}
    start = 0
    for g, n in zip(groups, sizes):
        if g.comm.world_size > 1:
            by_comm.setdefault(id(g.comm.group), [g.comm, []])[1].append((start, start + n))
        start += n
    for c, spans in by_comm.values():
        if len(by_comm) == 1 and sum(b - a for a, b in spans) == vec.numel():
            c.all_reduce(vec, op=torch.distributed.ReduceOp.MAX, label=label).wait()
            continue
        idx = torch.cat([torch.arange(a, b, device=vec.device) for a, b in spans])
        sub = vec[idx]
        c.all_reduce(sub, op=torch.distributed.ReduceOp.MAX, label=label).wait()
        vec[idx] = sub
