"""The main gradient of a parameter group: where its reductions accumulate, how long it lives, and
how it reaches the optimizer as the DTensor parameters' ``.grad``.

Why a file of its own: the reduction (:mod:`mfsdp2.groups.grad_reduction`) decides *when* a result
arrives; this is *where* it goes. The main gradient (``main_grad``; ``main_grad_full`` for the
full-gradient strategies, whose ``main_grad`` is its slice) lives from the first reduction after a
``zero_grad(set_to_none=True)`` until the next forward that finds every ``.grad`` cleared, in the
allocator's memory, a shared bucket's slice, or (CPU offload) host memory the group keeps. Each
reduced result is added into it (restarting at zero the parameters whose ``.grad`` the user
cleared, folding in a gradient the user assigned), and every flagged parameter's ``.grad`` is a
view of its rows (:mod:`mfsdp2.groups.grad_views` keeps those DTensors across steps).

``MainGradient`` is a mixin over the group's state set up by ``ParameterGroup.__init__``, and the
base of :class:`~mfsdp2.groups.grad_reduction.GradientReduction`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from ..memory.allocator import BucketAllocator, BufferRole
from ..memory.offload import copy_to_main, release_held
from .grad_mode import no_grad

__all__ = ["MainGradient"]


# Set on the gradient DTensors that are views of a main gradient (MainGradient.grad_view).
_GRAD_VIEW = "_mfsdp2_main_grad_view"


class MainGradient:
    """The main gradient's lifetime, accumulation and exposure as ``.grad`` (mixed into
    :class:`~mfsdp2.groups.param_group.ParameterGroup` through
    :class:`~mfsdp2.groups.grad_reduction.GradientReduction`)."""

    # -- main grads ---------------------------------------------------------------------------
    def _main_grad_key(self) -> tuple:
        return (BufferRole.MAIN_GRAD, self.unit_name, self.name)

    def _ensure_main_grad(self, allocator: BucketAllocator, zero: bool) -> None:
        """main_grad lives from the first reduction after a ``zero_grad(set_to_none=True)`` to the
        next forward that finds all its grads cleared (:meth:`release_main_grad`): like FSDP2's
        sharded grads, it takes no memory through forward."""
        if self.main_grad is not None:
            return
        n = self.layout.total_numel if self.full_grads else self.layout.shard_numel
        if self.main.offloaded:
            # Host memory, owned by the group and reused: not the compute device's allocator
            # (whose blocks and plans are device memory), and page-locked memory is costly to
            # allocate every step. Released like the allocator's block, then reused.
            if self._main_grad_host is None:
                self._main_grad_host = self.main.empty(n, self.grad_dtype)
            block = self._main_grad_host
            main = None
        else:
            self._main_grad_alloc = allocator
            refilled = self._refill_main_grad(allocator, n)
            if refilled is not None:
                block, main = refilled
            else:
                block, main = allocator.allocate(self._main_grad_key(), n, self.grad_dtype, self.device), None
        if zero:
            block.zero_()
        if self.full_grads:
            self.main_grad_full = block
            self.main_grad = main if main is not None else self.weights.local_slice(block)
        else:
            self.main_grad = block
        # Views of an earlier main gradient are stale now. A gradient the user assigned (before
        # this step's first reduction, e.g. ``p.grad = torch.full_like(p, g0)``) is not one of
        # them: it stays in ``.grad``, and _accumulate folds it in as torch would add to it.
        for dp in self.dist_params:
            if dp.grad is not None and getattr(dp.grad, _GRAD_VIEW, False):
                dp.grad = None

    def release_main_grad(self) -> None:
        """Give main_grad back to the allocator when no parameter exposes it any more (the
        optimizer's ``zero_grad(set_to_none=True)`` ran); called at the root's next forward."""
        if self.main_grad is None or self._pending_reduce is not None:
            return
        if any(dp.grad is not None for dp in self.dist_params):
            return  # grads kept (zero_grad(set_to_none=False) or accumulation across steps)
        if not self._empty_main_grad():
            self.drop_main_grad()

    def _empty_main_grad(self) -> bool:
        """Give the main gradient's memory back by emptying its storage in place (``resize_(0)``),
        keeping the block, its slice and the gradient DTensors over it for the next backward,
        which refills the same storage (:meth:`_refill_main_grad`). True when it did (or when the
        allocator turned out to keep the block: then it was dropped as :meth:`drop_main_grad`
        drops it); False, with nothing changed, where it may not.

        Why: dropping the block and allocating a new one each step means emptying every cached
        gradient DTensor and re-pointing it at the new block (``set_``), slicing the new block
        and the allocator's bookkeeping: about a quarter of a small unit's host time in the
        steady state. Emptying the storage gives torch the same bytes at the same moment, and the
        refill takes them back where the allocation would have.

        Only where nothing else can see the storage meanwhile: no cached gradient DTensor is held
        by anybody else (the user kept ``p.grad`` past ``zero_grad``), and the allocator empties
        it only where it served the block as a tensor of its own and torch counts no tensor over
        it but ours (:meth:`BucketAllocator.free_in_place
        <mfsdp2.memory.allocator.BucketAllocator.free_in_place>`): not a pool's or a bucket's
        slice, not an offloaded host block, no memory tool observing, no view or ``detach()`` of
        a gradient somebody kept. Elsewhere the block is dropped as before."""
        if self._main_grad_bucket is not None:
            return self._empty_bucket_slice()
        alloc = self._main_grad_alloc
        if alloc is None:
            return False
        held = self._grad_views.held_only_here()
        if held is None:
            return False
        block = self.main_grad_full if self.full_grads else self.main_grad
        # The tensors over its storage are ours: the block, the main gradient's slice of it
        # (full-gradient strategies) and the cached DTensors' local tensors.
        done = alloc.free_in_place(self._main_grad_key(), block, 1 + (self.main_grad is not block) + held)
        if done is None:
            return False
        main = self.main_grad
        self.main_grad = self.main_grad_full = None
        self._main_grad_alloc = None
        if done:
            self._emptied_main_grad = (alloc, block, main)
        else:  # the allocator kept the block: dropped as drop_main_grad drops it
            self._grad_views.detach()
        return True

    def _empty_bucket_slice(self) -> bool:
        """:meth:`_empty_main_grad` for a main gradient that is a slice of a shared all-reduce
        bucket (:mod:`mfsdp2.groups.grad_buckets`): the group lets go of the bucket *in place*,
        keeping its slice and its gradient DTensors, and tells the bucket how many tensors over
        its storage it keeps. The bucket empties its block in place when its last holder lets go
        and every tensor over it is one its members declared -- else it tells the members to
        forget their slices (:meth:`forget_bucket_slice`) and frees the block as before. The next
        backward's bucket of the same plan position and members refills the same block, and
        this group takes its kept slice back (:meth:`_bucket_slice`)."""
        held = self._grad_views.held_only_here()
        if held is None:
            return False
        buckets, bucket = self._main_grad_bucket
        full, main = self.main_grad_full, self.main_grad
        self._emptied_bucket_slice = (bucket.block, full, main)
        self.main_grad = self.main_grad_full = None
        self._main_grad_bucket = None
        buckets.release(bucket, self, in_place=1 + (main is not full) + held)
        return True

    def keeps_bucket_slice(self, block: torch.Tensor) -> bool:
        """Whether this group still keeps the slice of ``block`` it let go of in place (it gave the
        slice up if it reduced into another bucket since)."""
        kept = self._emptied_bucket_slice
        return kept is not None and kept[0] is block

    def forget_bucket_slice(self, block: torch.Tensor) -> None:
        """The bucket whose ``block`` this group let go of in place frees it instead of emptying
        it: the kept slice goes, and the cached gradient DTensors over it are emptied or
        forgotten (:meth:`GradViews.detach <mfsdp2.groups.grad_views.GradViews.detach>`), so none
        keeps the freed block alive."""
        kept = self._emptied_bucket_slice
        if kept is not None and kept[0] is block:
            self._emptied_bucket_slice = None
            self._grad_views.detach()

    def _bucket_slice(self, block: torch.Tensor, full: torch.Tensor) -> tuple:
        """``(main_grad_full, main_grad)`` of a direct reduction into ``full``, this group's slice
        of a bucket's ``block``: the slice kept when the group let go of that very block in place
        (its gradient DTensors view it still), else ``full`` and this rank's slice of it."""
        kept, self._emptied_bucket_slice = self._emptied_bucket_slice, None
        if (kept is not None and kept[0] is block and kept[1].storage_offset() == full.storage_offset()
                and kept[1].numel() == full.numel()):
            return kept[1], kept[2]
        return full, self.weights.local_slice(full)

    def _refill_main_grad(self, allocator: BucketAllocator, n: int) -> Optional[tuple]:
        """``(block, main_grad)`` of the main gradient :meth:`_empty_main_grad` emptied, its
        storage refilled from torch and the block live in ``allocator`` again; None (the emptied
        one forgotten) where it no longer fits: another allocator or size or dtype, a memory tool
        observing, or a storage somebody resized meanwhile."""
        emptied, self._emptied_main_grad = self._emptied_main_grad, None
        if emptied is None:
            return None
        alloc, block, main = emptied
        if (alloc is not allocator or block.numel() != n or block.dtype != self.grad_dtype
                or block.device != self.device or not allocator.refill(self._main_grad_key(), block)):
            return None
        return block, main

    def drop_main_grad(self) -> Optional[BucketAllocator]:
        """Give the main gradient back -- to the allocator, or to the bucket whose slice it is --
        and return the allocator it came from (None: there was none, or it was an offloaded
        group's host block, which the group keeps)."""
        if self.main_grad is None:
            return None
        self.main_grad = None
        self.main_grad_full = None
        if self._grad_views is not None and (self._main_grad_bucket is not None or self._main_grad_alloc is not None):
            self._grad_views.detach()  # the memory goes back: no cached view may keep it
        if self._main_grad_bucket is not None:
            buckets, bucket = self._main_grad_bucket
            self._main_grad_bucket = None
            buckets.release(bucket, self)
            return buckets.allocator
        alloc, self._main_grad_alloc = self._main_grad_alloc, None
        if alloc is not None:  # None: the offloaded host block, the group's own, kept for reuse
            alloc.free(self._main_grad_key())
        return alloc

    def run_post_accumulate_grad_hooks(self, flags) -> None:
        """Call the ``register_post_accumulate_grad_hook`` hooks of the flagged parameters once
        their reduced gradient is in ``.grad``, as FSDP2 does after each reduction: autograd never
        accumulates into our DTensor parameters (we set ``.grad``), so it never calls them, and
        optimizer-in-backward (a per-parameter optimizer stepped from the hook) silently never
        stepped."""
        for dp, flag in zip(self.dist_params, flags):
            if flag:
                hooks = getattr(dp, "_post_accumulate_grad_hooks", None)
                if hooks:  # None unless one was registered
                    for hook in tuple(hooks.values()):
                        hook(dp)

    def _accumulate(self, allocator: BucketAllocator, out: torch.Tensor):
        """main_grad += out, restarting at zero the parameters whose grad the user cleared.
        Returns the event of a copy-out that still reads ``out`` on the copy-out stream (CPU
        offload on CUDA: ``out`` must not be freed before it, :func:`~mfsdp2.memory.offload.hold`),
        else None."""
        self._ensure_main_grad(allocator, zero=True)
        # A full-size result (no_shard; ZeRO-1's share of a bucket) goes into the full main
        # gradient, a shard-size one (ZeRO-1's reduce-scatter; the sharded strategies) into its rows.
        full_out = self.full_grads and out.numel() == self.layout.total_numel
        dst = self.main_grad_full if full_out else self.main_grad
        view = self.weights.param_view if full_out else self.weights.piece_view
        overwrite = [dp.grad is None for dp in self.dist_params]
        if self.main.offloaded:
            self.copy_outs += 1  # the compute device's result into host memory (tests count these)
            self.settle_copy_out()  # the host writes the main grad below
        if all(overwrite):
            # Offloaded: non-blocking into page-locked memory, waited before the host touches it
            # (settle_copy_out; at the latest at the end of backward). Blocking where a
            # post-accumulate-grad hook reads it at once (optimizer-in-backward), as in FSDP2.
            hooked = any(getattr(dp, "_post_accumulate_grad_hooks", None) for dp in self.dist_params)
            self.copy_out_event = copy_to_main(dst, out, blocking=hooked)
            return self.copy_out_event
        # optimizer.zero_grad() (set_to_none) clears some grads: their pieces restart at 0.
        for i, dp in enumerate(self.dist_params):
            if overwrite[i]:
                view(dst, i).zero_()
            elif self._is_foreign_grad(dp.grad, self.main_grad, i):
                # The user assigned a grad of their own: fold it in before accumulating
                # (expose_grads then points .grad at the sum).
                self.weights.piece_view(self.main_grad, i).copy_(dp.grad._local_tensor)
        dst.add_(self.main.fetch(out))  # offloaded: a blocking copy to the host first
        return None

    def settle_copy_out(self) -> None:
        """Wait for this group's non-blocking copy of a reduction into host memory (CPU offload),
        if one is in flight: the host is about to read or write the main gradient."""
        event, self.copy_out_event = self.copy_out_event, None
        if event is not None:
            event.synchronize()
            release_held(self, host_waited=True)  # the reduction output it read may go back

    def expose_grads(self, flags) -> None:
        """Give ``dp.grad`` (a view of main_grad; empty where this rank holds no rows) to every
        flagged parameter.

        Called with this rank's flags after each reduction, then with the flags of *all* ranks
        at the end of backward (:func:`mfsdp2.runtime.grad_presence.finish`): a parameter used on some ranks only
        (an MoE expert that got no tokens here) has a nonzero reduced gradient on every rank's rows,
        so every rank must step it, while a parameter no rank used keeps ``grad = None`` (the
        optimizer skips it, as it would unsharded). Empty pieces get an empty gradient, never
        ``None``: a rank whose list of gradients differs from the others' issues different
        collectives in ``clip_grad_norm_`` (gloo aborts). torch's foreach and fused optimizers
        step empty tensors without touching their neighbours (tests/system/test_empty_grads.py)."""
        if self.main_grad is None:
            return
        # Last step's gradient DTensors are reused: re-pointed at this main gradient when the last
        # one went back to torch (grad_views.GradViews), as they are when it is the same memory.
        mg = self.main_grad
        views = self._grad_views
        views.follow(mg)
        make, rows = self._new_grad_view, self.weights.piece_view
        with no_grad():
            for i, dp in enumerate(self.dist_params):
                if not flags[i]:
                    continue
                cur = dp.grad
                # A gradient the user assigned between two backward() calls (``p.grad = p.grad * 2``,
                # ``p.grad = torch.zeros_like(p)``): _accumulate folded it into the main gradient
                # before adding this reduction, so the sum lives there; leaving the user's tensor in
                # ``.grad`` would hand the optimizer the value from before this backward (torch and
                # FSDP2 accumulate into whatever ``.grad`` holds).
                if cur is not None and (cur is views.cached(i) or not self._is_foreign_grad(cur, mg, i)):
                    continue
                dp.grad = views.get(i, mg, make, rows)

    def _new_grad_view(self, local: torch.Tensor, i: int) -> torch.Tensor:
        return self.grad_view(local, i, self.dist_params[i].shape)

    def grad_view(self, local: torch.Tensor, i: int, shape) -> torch.Tensor:
        """Parameter ``i``'s gradient DTensor over ``local`` (its rows of the main gradient),
        marked as ours: :meth:`_ensure_main_grad` drops such views when the main gradient is
        replaced and keeps any other ``.grad`` (the user's)."""
        g = self.as_dtensor(local, i, shape)
        setattr(g, _GRAD_VIEW, True)
        return g

    def _is_foreign_grad(self, grad: torch.Tensor, mg: torch.Tensor, i: int) -> bool:
        """Whether ``grad`` (a parameter's ``.grad``) is not parameter ``i``'s view of ``mg``."""
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        piece = self.weights.piece_view(mg, i)
        if piece.numel() == 0:
            return local.numel() != 0
        return local.data_ptr() != piece.data_ptr() or local.dtype != piece.dtype
