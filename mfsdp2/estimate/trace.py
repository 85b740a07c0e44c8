"""Activations, autograd's gradients and temporaries of one training step, from a fake-tensor
forward and backward of the unsharded model.

The model (built on the meta device) is copied, its parameters replaced by fake tensors in the
compute dtype (what the gathered weights are), and one forward, loss and backward run under
torch's ``FakeTensorMode``: every tensor has a shape, a dtype and a storage size but no memory,
so a 405B model at 8192 tokens traces on a laptop. A ``TorchDispatchMode`` above it counts the
bytes of every storage an op creates and, through weak references, when it dies -- the bytes
torch would hold -- leaving out the parameters (the runtime's gathered weights, counted by the
schedule instead).

The unit boundaries are marked where mfsdp2's hooks run, with the same mechanisms: a forward
pre-hook and hook on each unit (``fwd_begin`` / ``fwd_end``; the pre-hook also casts floating
inputs to ``param_dtype`` as ``cast_forward_inputs`` does), a multi-grad hook on the outputs
(``bwd_begin``) and an identity autograd function on the inputs that need grad (``bwd_end``,
mfsdp2's ``_PostBackward``). At ``bwd_end`` the unit's parameter gradients are dropped, as the
runtime packs them into its flat buffer and frees them there; units without an observable
backward (the root over token ids) drop theirs at the end of backward (the final callback).

Result: a list of :class:`Mark` -- the live bytes at each boundary, the peak since the previous
one, and the gradient bytes dropped there -- which :mod:`mfsdp2.estimate.schedule` walks with
the runtime's own buffers.
"""

from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

from ..precision.mixed_precision import MixedPrecisionPolicy

__all__ = ["Mark", "StepTrace", "trace_step"]


@dataclass
class Mark:
    """A unit boundary: ``kind`` is fwd_begin / fwd_end / bwd_begin / bwd_end / backward_end;
    ``live``: bytes alive just before it (activations, gradients, temporaries; not parameters);
    ``peak``: the most alive since the previous mark; ``grads``: gradient bytes the runtime
    packs and frees here (0 except at bwd_end and backward_end)."""

    kind: str
    unit: int
    live: int
    peak: int
    grads: int = 0


@dataclass
class StepTrace:
    marks: list[Mark]
    input_bytes: int
    buffer_bytes: int
    activation_peak: int  # the most alive at any time (activations + gradients + temporaries)


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create, while they live (weak references)."""

    def __init__(self, skip: set[int]):
        super().__init__()
        self.skip = skip
        self.refs: dict[int, Any] = {}
        self.live = 0
        self.peak = 0

    def _dead(self, key: int, nbytes: int, _ref) -> None:
        if self.refs.pop(key, None) is not None:
            self.live -= nbytes

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.refs or key in self.skip:
            return
        n = st.nbytes()
        self.refs[key] = weakref.ref(st, functools.partial(self._dead, key, n))
        self.live += n
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


class _BackwardDone(torch.autograd.Function):
    """Identity whose backward marks the end of a unit's backward (mfsdp2's ``_PostBackward``)."""

    @staticmethod
    def forward(ctx, done: Callable, *inputs):
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None,) + grads


def _fake_copy(model: nn.Module, mp: MixedPrecisionPolicy, device: torch.device) -> nn.Module:
    """A copy of the meta model whose parameters are fake tensors in their compute dtype (tied
    parameters stay tied) and whose buffers are fake tensors of their own dtype."""
    # Copied with meta stand-ins for its tensors: a model built with real memory is not duplicated.
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        memo[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        if isinstance(t, nn.Parameter):
            memo[id(t)] = nn.Parameter(memo[id(t)], requires_grad=t.requires_grad)
    fake = copy.deepcopy(model, memo)
    made: dict[int, nn.Parameter] = {}
    for m in fake.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=mp.compute_dtype(p.dtype), device=device),
                                           requires_grad=p.requires_grad)
            m._parameters[name] = made[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return fake


def _nbytes(x: Any) -> int:
    seen, n = set(), 0
    for t in tree_leaves(x):
        if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen:
            seen.add(t.untyped_storage()._cdata)
            n += t.untyped_storage().nbytes()
    return n


def trace_step(
    model: nn.Module,
    unit_paths: list[str],
    owned: list[list[int]],
    mp: MixedPrecisionPolicy,
    inputs: Callable[[], Any],
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    device: str = "cpu",
) -> StepTrace:
    """Trace one forward + loss + backward of ``model`` (on the meta device) under fake tensors.

    ``unit_paths``: module paths of the units, the root (``""``) last; ``owned[i]``: the ids of
    unit ``i``'s parameters in ``model``; ``inputs()`` returns the forward's positional arguments (a tuple, or
    one tensor); ``loss_fn(output)`` the scalar to back-propagate (default: the float sum of
    the output's first tensor)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev = torch.device(device)
    meta_params = {id(p): i for i, p in enumerate(model.parameters())}
    with FakeTensorMode(allow_non_fake_inputs=False):
        fake = _fake_copy(model, mp, dev)
        fparams = list(fake.parameters())
        units = [fake.get_submodule(p) if p else fake for p in unit_paths]
        unit_params = [[fparams[meta_params[pid]] for pid in ids if pid in meta_params] for ids in owned]
        buffer_bytes = sum(b.untyped_storage().nbytes() for b in fake.buffers())
        skip = {p.untyped_storage()._cdata for p in fparams} | {b.untyped_storage()._cdata for b in fake.buffers()}
        with torch.device(dev):
            args = inputs()
        if not isinstance(args, tuple):
            args = (args,)
        input_bytes = _nbytes(args)
        skip |= {t.untyped_storage()._cdata for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
        tracker = _LiveBytes(skip)
        marks: list[Mark] = []
        pending_bwd: dict[int, int] = {}
        handles = []

        def mark(kind: str, i: int, grads: int = 0) -> None:
            marks.append(Mark(kind, i, tracker.live, max(tracker.peak, tracker.live), grads))
            tracker.peak = tracker.live

        def drop_grads(i: int) -> int:
            n = 0
            for p in unit_params[i]:
                if p.grad is not None:
                    n += p.grad.untyped_storage().nbytes()
                    p.grad = None
            # The runtime frees them at the mark (packed): the next interval's peak starts without them.
            tracker.peak = tracker.live
            return n

        def bwd_end(i: int) -> None:
            pending_bwd[i] -= 1
            if pending_bwd[i] == 0:
                # The gradients are alive at the mark (packing reads them) and dropped after it.
                grads = sum(p.grad.untyped_storage().nbytes() for p in unit_params[i] if p.grad is not None)
                mark("bwd_end", i, grads)
                drop_grads(i)

        def pre(i: int, module: nn.Module, a: tuple, kw: dict):
            recompute = torch._C._current_graph_task_id() != -1  # activation checkpointing: the
            if not recompute:  # unit is already gathered for its backward, as in mfsdp2's hooks
                mark("fwd_begin", i)
            if mp.param_dtype is not None and mp.cast_forward_inputs:
                cast = functools.partial(_cast, dtype=mp.param_dtype)
                a, kw = tree_map(cast, a), tree_map(cast, kw)
            if not torch.is_grad_enabled() or recompute:
                return a, kw
            need = [t for t in tree_leaves((a, kw)) if isinstance(t, torch.Tensor) and t.requires_grad]
            if need:
                pending_bwd[i] = pending_bwd.get(i, 0) + 1
                outs = _BackwardDone.apply(functools.partial(bwd_end, i), *need)
                routed = {id(t): o for t, o in zip(need, outs)}
                a, kw = tree_map(lambda t: routed.get(id(t), t), (a, kw))
            return a, kw

        def post(i: int, module: nn.Module, a: tuple, kw: dict, out: Any):
            if torch._C._current_graph_task_id() != -1:
                return None
            mark("fwd_end", i)
            ts = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if ts:
                torch.autograd.graph.register_multi_grad_hook(ts, lambda *_: mark("bwd_begin", i), mode="any")
            return None

        for i, u in enumerate(units):
            handles.append(u.register_forward_pre_hook(functools.partial(pre, i), with_kwargs=True))
            handles.append(u.register_forward_hook(functools.partial(post, i), with_kwargs=True))
        try:
            with tracker:
                out = fake(*args)
                loss = loss_fn(out) if loss_fn is not None else _default_loss(out)
                del out
                loss.backward()
                del loss
                # The final callback reduces what no post-backward did (the root over token ids).
                for i in range(len(units)):
                    grads = sum(p.grad.untyped_storage().nbytes() for p in unit_params[i] if p.grad is not None)
                    if grads:
                        mark("final_reduce", i, grads)
                        drop_grads(i)
                mark("backward_end", len(units) - 1)
        finally:
            for h in handles:
                h.remove()
        peak = max((m.peak for m in marks), default=0)
    return StepTrace(marks, input_bytes, buffer_bytes, peak)


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


def _default_loss(out: Any) -> torch.Tensor:
    first = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    return first.float().sum()
