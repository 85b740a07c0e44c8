"""The ``FSDPModule`` mixin ``fully_shard`` swaps into a module's class, and FSDP2's module-level
helpers (``register_fsdp_forward_method``, ``share_comm_ctx``).

Every public method of torch 2.13's ``FSDPModule`` exists here. Most do what FSDP2's do; the few
that configure machinery mfsdp2 does not have (symmetric memory, process-group allocators, a
separate reduce-scatter group) do the nearest honest thing, said in their docstrings and in
docs/design.md ("FSDP2's API surface"). ``fully_shard`` itself lives in :mod:`mfsdp2.fully_shard`.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..dtensors import dtensor_ops  # noqa: F401  (copy_ into RowShard parameters)
from ..dtensors import row_propagation  # noqa: F401  (results of ops on RowShard DTensors keep RowShard)
from ..dtensors import random_offsets  # noqa: F401  (random init of RowShard pieces on CUDA: their rows' offsets)
from ..checkpoint import serialization  # noqa: F401  (torch.save of state dicts holding our DTensors)
from ..memory.allocator import BucketAllocator
from ..runtime.hooks import lazy_init, outside_inference_mode, post_forward, pre_forward, reset
from ..runtime.unshard import reshard, unshard_async, wait_unshard
from ..runtime.state import FSDPState
from .torch_identity import check_overrides, torch_bases

__all__ = ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]

logger = logging.getLogger(__name__)

_logged: set = set()


def _log_once(key: str, msg: str, *args) -> None:
    """INFO, once per process: settings mfsdp2 accepts but has no machinery for."""
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard."""

    def __init__(self, state: Optional[FSDPState] = None):
        self._state = state

    def wait(self) -> None:
        if self._state is not None:
            outside_inference_mode(wait_unshard)(self._state)
            self._state = None  # as FSDP2's: keep no reference after the wait


class FSDPModule(*torch_bases()):
    """Mixin added to every module ``fully_shard`` was applied to (FSDP2's method names).

    A subclass of torch's ``FSDPModule``, so code that recognises FSDP2 units by ``isinstance``
    (trainers, torch's pipeline stages) recognises mfsdp2's; every method torch's class defines
    is defined here again (:mod:`mfsdp2.frontend.torch_identity`)."""

    _mfsdp2_state: FSDPState

    def __new__(cls, *args, **kwargs):
        # A new object of a swapped ``FSDP<Cls>`` class is never a unit: ``fully_shard`` swaps the
        # class of an existing module. Containers build new ones of their own class
        # (``nn.Sequential.__getitem__`` makes a slice with ``self.__class__(...)``); such a slice
        # was an ``FSDPSequential`` without unit state. It is a plain ``Cls``, as in FSDP2.
        orig = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule) and c not in torch_bases())
        obj = object.__new__(orig) if orig.__new__ is object.__new__ else orig.__new__(orig, *args, **kwargs)
        obj.__init__(*args, **kwargs)  # not an instance of ``cls``: Python would not call it
        return obj

    def __deepcopy__(self, memo):
        # A copy would share nothing sound: its parameters are views of this unit's flat buffers,
        # its hooks and root context point at this model, and the gathered storage may be freed
        # under it. FSDP2 refuses too (with this error type, which scripts may catch).
        raise AssertionError(
            f"mfsdp2 E92: {type(self).__name__} was sharded by fully_shard and cannot be deep-copied (neither "
            "can FSDP2 modules). For a copy (an EMA model, a frozen teacher), build the model again, "
            "fully_shard it the same way, then load_state_dict(model.state_dict())"
        )

    def _units(self, recurse: bool):
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        units = []
        for m in mods:  # a unit of several modules (fully_shard([a, b])) is met once per module
            if isinstance(m, FSDPModule) and m._mfsdp2_state not in units:
                units.append(m._mfsdp2_state)
        return units

    def _apply(self, fn, recurse: bool = True):
        """``to_empty`` / ``.to()`` / ``.double()`` / ``.cuda()`` ... after ``fully_shard``: convert
        this rank's rows and have the groups adopt them (see :mod:`mfsdp2.frontend.conversion`)."""
        from .conversion import apply_to_unit

        # The module's own class is next after torch's FSDPModule in the MRO: torch's ``_apply``
        # (reshard, then reset FSDP2's sharded parameters) must not run on an mfsdp2 unit.
        return apply_to_unit(self, fn, recurse, super(_LAST_MIXIN, self)._apply)

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this unit's parameters now (e.g. to overlap with work before forward)."""
        state = self._mfsdp2_state
        outside_inference_mode(unshard_async)(state)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered parameters and put the sharded ones back on the module."""
        reshard(self._mfsdp2_state)

    def reset(self) -> None:
        """After an exception in forward or backward: wait for in-flight collectives, drop this
        step's partial gradients and reshard every unit under the root, so training can go on."""
        state = self._mfsdp2_state
        if state.ctx is not None:
            reset(state.ctx)

    def mark_weights_changed(self, *, recurse: bool = True) -> None:
        """Announce a write to the weights made outside the optimizer (``p.data.copy_(ema)``,
        ``torch.nn.init.*_(p.data)``, a custom loader): the next forward re-casts and re-gathers
        them. Optional -- such writes are also seen by a forward without this signal (a content
        fingerprint where reading it is free, a re-gather on accelerators and under offload; see
        ``mfsdp2.groups.weight_watch``) -- but it makes the next gather certain and skips that
        work. Required after :meth:`set_detect_data_writes` ``(False)``. Call it on every rank
        (like the write itself)."""
        for s in self._units(recurse):
            for g in s.groups:
                g.mark_changed()

    def set_detect_data_writes(self, enabled: bool, *, recurse: bool = True) -> None:
        """Persistent weights (ZeRO-1/2, no_shard) see a write through ``.data`` (which bumps no
        version counter) at the next forward: a forward after an optimizer step or an announced
        write re-gathers anyway; any other forward (accumulation micro-batches, an eval pass)
        compares the main shard's content on a CPU mesh (one host read of the agreed flags, a
        plain read there) and re-gathers on accelerators and under offload, where that read
        would synchronise (``mfsdp2.groups.weight_watch``). ``False`` trusts the host facts
        instead: optimizer steps, in-place writes through the parameters (which every rank makes)
        and ``load_state_dict`` are still seen, nothing is compared or re-gathered otherwise, and
        a write through ``.data`` must then be announced with :meth:`mark_weights_changed`. Every
        rank must pass the same value."""
        for s in self._units(recurse):
            for g in s.groups:
                g.content_check = bool(enabled)
                g.changed = True  # start from a known-good gather under the new rule

    def reset_iter_state(self) -> None:
        """FSDP2's name for :meth:`reset`: call it on the root after ``forward()`` or ``backward()``
        raised; the failed iteration's gradients (no-sync accumulation, HSDP partial sums
        included) are dropped. On a unit that is not the root it raises, as FSDP2's does."""
        state = self._mfsdp2_state
        if state.ctx is not None and not state.is_root:
            raise RuntimeError(
                f"mfsdp2 E93: reset_iter_state() called on {state.name!r}, which is not the root; call it on "
                f"the root module ({state.ctx.root.name!r}), whose reset covers every unit under it"
            )
        self.reset()

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next root forward orders its all-gathers after ``event`` (recorded after the
        optimizer step), then drops it: pass a new event each iteration. On CUDA the current
        stream waits on it; mfsdp2's gather streams still wait on the current stream as well (its
        buffer reuse relies on that), so the event adds an ordering but removes none. On CPU the
        step already precedes the gathers in program order and the event is dropped."""
        state = self._mfsdp2_state
        lazy_init(state)
        state.ctx.post_optim_event = event

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this unit's backward needs none of its weights (an embedding reads only the
        indices), so its pre-backward all-gather is skipped; gradients are still reduced. Wrong
        for a module whose backward reads the weights (autograd would read freed memory: an
        error or garbage), exactly as in FSDP2. Not recursive."""
        self._mfsdp2_state.unshard_in_backward = bool(unshard_in_backward)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """Call ``hook(reduced)`` on each reduction's result, in place, before it is divided
        (``set_force_sum_reduction_for_comms``) and added to the gradients: the reduce-scatter
        output (this rank's flat shard, padding included) with plain FSDP, the all-reduce output
        with HSDP, the all-reduced full gradient with ``optim`` / ``no_shard`` -- FSDP2's place
        (e.g. a custom all-reduce across replicas). Every (dtype, requires_grad) group of the unit
        calls it with its own buffer. ``stream``: the hook runs on the current stream after the
        reduction was waited; a given stream is made to wait on it and the hook runs there."""
        if stream is not None and any(g.config.replicate_comm is not None for g in self._mfsdp2_state.groups):
            raise ValueError("mfsdp2 E94: set_all_reduce_hook(stream=...) cannot be used with HSDP (as in FSDP2); "
                             "register the hook without a stream")
        run = hook
        if stream is not None:
            def run(t: torch.Tensor) -> None:
                dev = torch.get_device_module(t.device)  # torch.cuda, or torch.cpu's no-op streams
                stream.wait_stream(dev.current_stream(t.device))
                with dev.stream(stream):
                    hook(t)
                dev.current_stream(t.device).wait_stream(stream)
        for g in self._mfsdp2_state.groups:
            g.all_reduce_hook = run

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's deprecated name of :meth:`set_gradient_divide_factor` (this unit only, as FSDP2's)."""
        self.set_gradient_divide_factor(factor, recurse=False)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """True: every collective of this unit's gradient reduction sums (``ReduceOp.SUM``), and
        the result is divided afterwards by the divide factor (default: every data-parallel rank)
        -- no AVG or PREMUL_SUM on the wire, as NCCL's zero-copy paths need. Not recursive."""
        for g in self._mfsdp2_state.groups:
            g.set_force_sum(enable)

    def _customise_comm(self, what: str, obj) -> None:
        state = self._mfsdp2_state
        for g in state.groups:
            if g.fp8 is not None:
                raise ValueError(
                    f"mfsdp2 E95: set_custom_{what} on {state.name!r}, which gathers in float8 "
                    "(all_gather_dtype): its float8 bytes use mfsdp2's own collectives; drop one of the two"
                )
            if what == "reduce_scatter" and g.full_grads:
                raise ValueError(
                    f"mfsdp2 E96: set_custom_reduce_scatter on {state.name!r}: sharding_strategy="
                    f"{g.strategy.value!r} keeps full gradients (all-reduced, or reduce-scattered into its "
                    "full-size main gradient): a custom reduce-scatter is supported with the sharded-gradient "
                    "strategies only"
                )
        for g in state.groups:
            g.set_custom_comm(what, obj)

    def set_custom_all_gather(self, comm) -> None:
        """Issue this unit's all-gathers through ``comm`` (torch's ``AllGather`` interface):
        ``comm(output, input, group, async_op)`` with mfsdp2's buffers -- the output is the
        unit's gathered storage (its parameters are views of it) and the input this rank's slice
        of it; ``comm.allocate`` is not called (the buffers come from mfsdp2's allocator). The
        in-block regather of ``reshard_after_forward=<int>`` stays mfsdp2's."""
        self._customise_comm("all_gather", comm)

    def set_custom_reduce_scatter(self, comm) -> None:
        """Issue this unit's reduce-scatters through ``comm`` (torch's ``ReduceScatter``
        interface): ``comm(output, input, group, op, async_op)`` with mfsdp2's flat gradient buffer
        and shard-size output. ``op`` is always ``ReduceOp.SUM`` and mfsdp2 divides afterwards (AVG
        and PREMUL_SUM exist on NCCL only); ``comm.allocate`` is not called."""
        self._customise_comm("reduce_scatter", comm)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Whether ranks may use different parameters (FSDP2's meaning: an expert without tokens on
        some ranks, a branch taken on some ranks only). A parameter without a local gradient always
        contributes zeros in mfsdp2, so every rank issues the same reduction either way; what True
        adds is the ranks' agreement, at the end of each synced backward (one small all-reduce of
        host flags), on which parameters had a gradient on *any* rank: each rank then gives them a
        ``.grad`` (so every rank steps its rows), and a parameter no rank used keeps ``grad=None``.
        False (default, as in FSDP2): no collective; a parameter used on other ranks only is
        detected and raises :class:`mfsdp2.runtime.grad_presence.GradientPresenceError` (see
        :mod:`mfsdp2.runtime.grad_presence`). Every rank must pass the same value."""
        for s in self._units(recurse):
            s.reduce_unused_params = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduction inputs may be alive at once, this unit's included (FSDP2's meaning;
        default 1: the previous unit's reduction is finished before this unit packs its
        gradients, and its own overlaps the next unit's backward). Each holds a flat gradient
        buffer from the allocator, so a larger value trades memory for more overlap."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"mfsdp2 E97: max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"mfsdp2 E98: max_input_buffers must be >= 1, got {max_input_buffers}")
        for s in self._units(recurse):
            s.max_reduce_in_flight = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Accepted; mfsdp2 keeps one process group per mesh dimension. Its reduce-scatters already
        run on their own CUDA stream (and on gloo as point-to-point exchanges on gloo's threads);
        on NCCL they share the all-gathers' communicator, which serialises the two on the wire."""
        if enable:
            _log_once("separate_rs", "mfsdp2: set_separate_reduce_scatter_group: reduce-scatters share the "
                      "all-gathers' process group in mfsdp2 (own stream, same communicator)")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted; mfsdp2 takes every communication buffer from its own allocator
        (``fully_shard(root, allocator=...)``), never from the process group's."""
        if enable:
            _log_once("pg_alloc", "mfsdp2: communication buffers come from mfsdp2's allocator, not the process group's")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted; mfsdp2 does not allocate symmetric memory: its gathers write into the
        allocator's blocks (zero copy into the parameters), so NCCL uses its regular all-gather."""
        if backend != "NCCL":
            raise ValueError(f"mfsdp2 E99: set_symm_mem_for_comm backend must be 'NCCL' (as in FSDP2), got {backend!r}")
        _log_once("symm_mem", "mfsdp2: set_symm_mem_for_comm: communication buffers come from mfsdp2's "
                  "allocator (no symmetric memory)")

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: accumulate unsharded gradients locally (no reduce-scatter) until set back to True."""
        for s in self._units(recurse):
            s.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False skips the all-reduce across replicas (gradient accumulation with only the
        reduce-scatter); the shard-group results are summed and all-reduced at the next backward
        with it True. No effect without a replicate dimension."""
        for s in self._units(recurse):
            for g in s.groups:
                g.requires_all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: Optional[float], *, recurse: bool = False) -> None:
        """Divide the summed gradients by ``factor`` instead of averaging over the data-parallel
        ranks: ``1.0`` sums (per-token-loss training, where the loss is already normalised by the
        global token count), ``None`` restores the mean. NCCL applies it inside the reduction
        (PREMUL_SUM); other backends pre-scale while packing the gradients.

        Like FSDP2's, it applies to this unit only (a script that calls it on each block and the
        root must get FSDP2's gradients); ``recurse=True`` sets every unit under this one."""
        if factor is not None and not factor > 0:
            raise ValueError(f"mfsdp2 E39: gradient divide factor must be > 0 or None, got {factor!r}")
        for s in self._units(recurse):
            for g in s.groups:
                g.divide_factor = None if factor is None else float(factor)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for s in self._units(recurse):
            s.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        for s in self._units(recurse):
            s.reshard_after_forward = reshard_after_forward
            s.reshard_after_forward_given = True

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step (FSDP2's meaning).
        False: the final callback leaves the last reductions in flight -- they overlap the next
        micro-batch's forward and finish at its backward -- and skips the end-of-backward
        gradient-presence step (:mod:`mfsdp2.runtime.grad_presence`), so ``.grad`` is not complete yet.
        True (default): every
        reduction is finished and every gradient exposed. Like FSDP2's flag it is model-wide:
        every rank must pass the same value."""
        state = self._mfsdp2_state
        for s in state.ctx.states if state.ctx is not None else self._units(True):
            s.is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        self._mfsdp2_state.forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        self._mfsdp2_state.backward_prefetch = [_state_of(m) for m in modules]

    def set_prefetch_depth(self, depth: int) -> None:
        """How many units ahead the recorded-order prefetch gathers (root only; default 1)."""
        state = self._mfsdp2_state
        lazy_init(state)
        if depth < 0:
            raise ValueError(f"mfsdp2 E10: prefetch depth must be >= 0, got {depth}")
        state.ctx.schedule.prefetch_depth = depth

    def set_all_reduce_bucket_cap_mb(self, mb: float) -> None:
        """Bucket size, in MiB, of the gradient all-reduces of ``no_shard`` and of small ZeRO-1/2/3
        units on gloo (whose reduce-scatter is an all-reduce of the whole gradient there):
        consecutive units' gradients, in backward order, are all-reduced together up to this size
        (root only; default 25, torch DDP's ``bucket_cap_mb``). 0 turns bucketing off: every unit
        reduces its own gradients as soon as they are packed (FSDP2's one reduce-scatter per
        unit). Takes effect from the second backward after the call (the first records the order
        the buckets are planned from). See :mod:`mfsdp2.groups.grad_buckets`.

        The same cap bounds the buckets in which the persistent weights of ``optim`` /
        ``optim_grads`` units are re-gathered across units after a step (from the next forward;
        0: one all-gather per unit). See :mod:`mfsdp2.groups.gather_buckets`."""
        state = self._mfsdp2_state
        lazy_init(state)
        state.ctx.buckets.set_cap_mb(mb)

    def set_all_gather_bucket_cap_mb(self, mb: float) -> None:
        """Bucket size, in MiB, in which small ZeRO-3 units gather together (root only; default
        0: each unit gathers alone, as in FSDP2). Above 0, the sharded groups under 1 MiB of
        consecutive units share all-gathers of up to this size: in the recorded forward order at
        the root's forward, in its reverse at the start of backward. Each collective pays the
        backend's fixed latency once for many units -- the cost that dominates a model of many
        small units (about 0.6 ms per all-gather on gloo; on NCCL it grows with the number of
        ranks) -- for gathered rows held up to two buckets ahead of their units (at most twice
        the cap, plus a copy of each unit's rows into its own buffer). Takes effect from the next
        forward; units with FP8 or subclass parameters, CPU offload, a rank-block reshard or an
        optimizer stepping in backward keep gathering alone. See
        :mod:`mfsdp2.groups.gather_buckets`."""
        if not mb >= 0:
            raise ValueError(f"mfsdp2 E100: all-gather bucket size must be >= 0 MiB, got {mb!r}")
        state = self._mfsdp2_state
        lazy_init(state)
        state.ctx.gathers.transient_cap_bytes = int(mb * 2**20)

    def memory_stats(self) -> dict[str, int]:
        """Bytes the runtime owns on this rank for the units under this root.

        Persistent memory by kind, each byte counted once (the main weights of ``optim`` /
        ``optim_grads`` / ``no_shard`` in the model dtype are a slice of the model weights and
        count there): ``model_weight_bytes`` (model-dtype shards, or the full weights the
        strategy keeps), ``main_weight_bytes``, ``main_grad_bytes`` (while they exist: from the
        first reduction to the forward after ``zero_grad(set_to_none=True)``), ``fp8_bytes``
        (0: FP8 keeps no quantised shard, each gather quantises into its allocator block) and
        ``partial_grad_bytes`` (HSDP sums waiting for an all-reduce);
        ``persistent_bytes`` = model + main + fp8; ``host_bytes``: how much of it is host memory
        (``CPUOffloadPolicy``: main weights and main grads). ``transient_peak_bytes`` /
        ``transient_live_bytes``: what the shared allocator serves -- unsharded weights,
        gradient buffers and main grads -- peak since the last ``stats.reset_peak()``;
        ``cached_bytes``: memory the allocator holds for reuse while no buffer uses it.
        """
        seen: list[tuple[int, int]] = []

        def distinct(t: Optional[torch.Tensor]) -> int:
            if t is None or t.numel() == 0:
                return 0
            lo = t.data_ptr()
            hi = lo + t.numel() * t.element_size()
            if any(a <= lo and hi <= b for a, b in seen):
                return 0
            seen.append((lo, hi))
            return hi - lo

        out = dict.fromkeys(
            ("model_weight_bytes", "main_weight_bytes", "main_grad_bytes", "fp8_bytes", "partial_grad_bytes"), 0)
        groups = [g for s in self._units(True) for g in s.groups]
        for g in groups:
            shard = g.weights.shard if g.weights.shard.dtype == g.compute_dtype else None  # else: cast per gather
            out["model_weight_bytes"] += distinct(g.weights.unsharded if g.persistent else shard)
        for g in groups:
            out["main_weight_bytes"] += distinct(g.main_weight)
            out["main_grad_bytes"] += distinct(g.main_grad_full if g.main_grad_full is not None else g.main_grad)
            out["partial_grad_bytes"] += distinct(g.partial)
        out["persistent_bytes"] = out["model_weight_bytes"] + out["main_weight_bytes"] + out["fp8_bytes"]
        # CPU offload: the part of the above in host memory (main weights, and the main grads'
        # host blocks, which are kept for reuse once allocated)
        out["host_bytes"] = sum(t.numel() * t.element_size() for g in groups if g.main.offloaded
                                for t in (g.main_weight, g._main_grad_host) if t is not None)
        stats = self.allocator.stats
        out.update(
            transient_peak_bytes=stats.peak_bytes,
            transient_live_bytes=stats.live_bytes,
            cached_bytes=self.allocator.cached_bytes() if hasattr(self.allocator, "cached_bytes") else 0,
        )
        return out

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted (FSDP2: issue the unshard's all-gather with ``async_op=True`` on the current
        stream). mfsdp2 issues every all-gather asynchronously already: on its side stream on
        accelerators, as an async collective handle on the CPU; the wait is at first use."""
        if not isinstance(async_op, bool):
            raise TypeError(f"mfsdp2 E79: _set_unshard_async_op takes a bool, got {type(async_op).__name__}")

    def _get_fsdp_state(self) -> FSDPState:
        """FSDP2's accessor of the unit state (``fully_shard.state(self)``)."""
        return self._mfsdp2_state

    @property
    def allocator(self) -> BucketAllocator:
        """The allocator shared by every unit under this unit's root (after the first forward)."""
        state = self._mfsdp2_state
        lazy_init(state)
        return state.ctx.allocator


check_overrides(FSDPModule)  # no call on a unit reaches torch FSDP2's own implementation
# The last FSDP class in a unit's MRO: ``super(_LAST_MIXIN, self)`` is the module's own class.
_LAST_MIXIN = (torch_bases() or (FSDPModule,))[-1]

_EAGER_PRE_FORWARD = torch._dynamo.disable(pre_forward, recursive=True)
_EAGER_POST_FORWARD = torch._dynamo.disable(post_forward, recursive=True)


class NotAnFSDPModuleError(TypeError, ValueError):
    """A module that ``fully_shard`` did not wrap, passed where a unit is needed. A ``TypeError``
    (mfsdp2's type) and a ``ValueError`` (what FSDP2 raises for it), so either ``except`` catches it."""


def _state_of(m) -> FSDPState:
    if not isinstance(m, FSDPModule):
        raise NotAnFSDPModuleError(f"mfsdp2 E11: {type(m).__name__} is not an FSDP module: "
                                   "call fully_shard on it first")
    return m._mfsdp2_state




def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` gather and reshard like ``forward`` (e.g. ``generate`` or an
    ``encode`` called instead of ``forward``): the method runs between the unit's pre- and
    post-forward hooks. A no-op for a module that is not an :class:`FSDPModule` (as in FSDP2), so
    the same code runs with and without sharding."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"mfsdp2 E77: {type(module).__name__} has no method {method_name!r} to register; "
                         "define it on the module before register_fsdp_forward_method")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(*args, **kwargs):
        args, kwargs = _EAGER_PRE_FORWARD(module, args, kwargs)
        out = orig(*args, **kwargs)
        return _EAGER_POST_FORWARD(module, args, kwargs, out)

    setattr(module, method_name, wrapped)  # an instance attribute, like FSDP2's bound wrapper


def share_comm_ctx(modules: list) -> None:
    """Share one set of communication side streams among several roots (FSDP2: pipeline stages
    that are separate FSDP roots). mfsdp2 already keeps one communicator -- and so one all-gather,
    reduce-scatter and all-reduce stream -- per (process group, device) for every root; this
    also points the communicators of the other roots' process groups at the first root's
    streams. On CPU there are no streams and it only validates its argument."""
    if not modules:
        return
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"mfsdp2 E78: share_comm_ctx expects FSDP modules (call fully_shard on each first), "
                             f"got {type(m).__name__}")
    first = modules[0]._mfsdp2_state._comm_ctx
    for m in modules[1:]:
        m._mfsdp2_state._comm_ctx = first
