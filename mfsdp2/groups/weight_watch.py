"""Noticing that the main weights changed, including writes that bump no version counter.

Strategies that keep full model weights between steps (ZeRO-1/2, no_shard) re-cast main -> model
weights and re-gather only when the weights changed; ZeRO-3 units kept gathered across forwards
(``set_reshard_after_backward(False)``, an in-flight ``unshard(async_op=True)``) re-gather on the
same signal. Version counters alone miss the writes users make through ``.data`` (an EMA copied
in for an eval pass, ``torch.nn.init.*_(p.data)``, loaders): ``p.data`` is a new tensor with its
own counter. So a group counts as changed when any of these says so:

* **an optimizer step** ran: one process-wide ``register_optimizer_step_post_hook`` marks every
  live group (every rank steps, so every rank marks: no agreement needed for this signal);
* **an announced write**: ``FSDPModule.mark_weights_changed()``, ``load_state_dict``,
  ``mfsdp2.materialize``;
* a **version counter** of the main weights moved (in-place ops on the parameters);
* the main shard's **content fingerprint** (:func:`fingerprint`) differs from the one taken at the
  last gather: the catch-all for silent writes.

The last two are local facts -- a rank holding no rows of a parameter sees nothing -- so the
root's forward agrees on them with the existing per-forward all-reduce (:func:`agree_on_gathers`).
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..comm.communicator import device_ints, host_tensor

__all__ = ["agree_on_gathers", "fingerprint", "fingerprints", "watch"]

logger = logging.getLogger(__name__)

_groups: "weakref.WeakSet" = weakref.WeakSet()
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

    No host synchronisation on CUDA: the word counts are host facts, sent to the device from
    page-locked memory without waiting (:func:`~mfsdp2.comm.communicator.device_ints`), and
    ``repeat_interleave`` is told its output size (without it, it reads the counts' sum back to
    size its output). So the computation needs no device data on the host: it runs on the meta
    device as well."""
    words = [as_words(t) for t in ts]
    if len(ts) < 2 or any(w.dtype != torch.int32 for w in words) or len({w.device for w in words}) > 1:
        return [fingerprint(t) for t in ts]
    device = words[0].device
    i32 = torch.int32
    sizes = [w.numel() for w in words]
    counts = device_ints(sizes, device)
    seg = torch.repeat_interleave(torch.arange(len(ts), device=device), counts, output_size=sum(sizes))
    starts = torch.cumsum(counts, 0) - counts
    pos = (torch.arange(seg.numel(), device=device) - starts[seg]).to(i32)
    flat = torch.cat(words)
    out = torch.zeros(3, len(ts), dtype=i32, device=device)
    out[0].index_add_(0, seg, flat)
    out[1].index_add_(0, seg, flat * (pos // _COLS + 1))
    out[2].index_add_(0, seg, flat * (pos % _COLS + 1))
    return list(out.t())


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    for g in list(_groups):
        g.mark_changed()


def watch(group) -> None:
    """Register a :class:`~mfsdp2.groups.param_group.ParameterGroup` for the optimizer-step signal; the
    hook is installed once per process and holds the groups weakly."""
    global _hook_handle
    _groups.add(group)
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_post_hook(_on_optimizer_step)


def agree_on_gathers(ctx) -> None:
    """At the root's forward (``ctx``: its RootContext): one small all-reduce (MAX) for every
    unit at once, when some groups keep persistent weights or gather in FP8.

    * Persistent weights (``optim``, ``optim_grads``, ``no_shard``) are re-gathered only when
      they changed (see the module docstring). Version counters and the content fingerprint
      are local: a rank holding no rows of a group sees no write while the others do, and
      deciding locally would make the ranks issue different collectives. The agreed flags need
      **one host read per root forward** (``tolist``) when the content is compared: the one
      documented exception to "no host synchronisation in steady state", for these strategies
      only. With ``set_detect_data_writes(False)`` only host facts are agreed, over the CPU twin
      group (no device read); a write through ``.data`` must then be announced.
    * FP8 groups need one scale per parameter that every rank shares: the max of the ranks'
      amax. The scales stay on the device (no host read).
    """
    persistent = [g for s in ctx.states for g in s.groups if g.persistent]
    checked = [g for g in persistent if g.compares_on_device]
    _agree_on_host_facts(ctx, [g for g in persistent if not g.compares_on_device])
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
    _all_reduce_max_per_mesh(vec, groups, [1] * len(checked) + [a.numel() for a in amaxes], label, host=False)
    if checked:
        for g, f in zip(checked, vec[: len(checked)].tolist()):
            g.agreed_stale = f > 0
    agree_scales(fp8, vec, len(checked))


def _agree_on_host_facts(ctx, groups: list) -> None:
    """Persistent groups without the content check, or whose main weights live in host memory
    (CPU offload): agree on what the hosts know (a step, an announced write, a moved version
    counter; offloaded: the content fingerprint too) over the CPU twin group -- no device read."""
    if not groups:
        return
    flags = host_tensor([1.0 if g.host_flag() else 0.0 for g in groups], torch.float32)
    label = f"gather agreement (changed flags, host) at the forward of step {ctx.step}"
    _all_reduce_max_per_mesh(flags, groups, [1] * len(groups), label, host=True)
    for g, f in zip(groups, flags.tolist()):  # a CPU tensor: no device synchronisation
        g.agreed_stale = f > 0


def _all_reduce_max_per_mesh(vec: torch.Tensor, groups: list, sizes: list[int], label: str, host: bool) -> None:
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
    for comm, spans in by_comm.values():
        c = comm.host() if host else comm
        if len(by_comm) == 1 and sum(b - a for a, b in spans) == vec.numel():
            c.all_reduce(vec, op=torch.distributed.ReduceOp.MAX, label=label).wait()
            continue
        idx = torch.cat([torch.arange(a, b, device=vec.device) for a, b in spans])
        sub = vec[idx]
        c.all_reduce(sub, op=torch.distributed.ReduceOp.MAX, label=label).wait()
        vec[idx] = sub
