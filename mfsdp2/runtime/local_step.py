"""Steps of torch's elementwise optimizers on the local tensors of DTensor parameters.

Why: a torch optimizer steps each DTensor parameter through DTensor's dispatch, which runs the
same operator on the local tensors after a sharding propagation per call. On CPU (torch's default
there is the per-parameter for-loop) that propagation costs several times the arithmetic of a
small parameter: on a model of many small units it makes the optimizer step half of a no_shard
step.
An elementwise update of tensors that share one placement is the same operator on their local
tensors, so stepping the locals gives the bits the DTensor step gives, without the dispatch.

How: while a step runs, each DTensor parameter with a gradient is replaced in its param group by
its local tensor (whose ``.grad`` is the gradient's local tensor), and its optimizer state is
keyed by that local tensor with DTensor values replaced by their locals. Afterwards everything is
put back; a state tensor the step created (or replaced) that is shaped like the local parameter
becomes a DTensor of the parameter's placement, as torch's ``zeros_like`` of a DTensor would be.

When (anything else takes torch's path unchanged):

* the optimizer's class is one of :data:`ELEMENTWISE` exactly (a subclass may compute anything),
  not ``differentiable``, stepped without a closure (a closure's backward would write gradients
  after the swap), outside compilation and outside backward;
* no hook could see the swapped parameters: the optimizer has no step hooks of its own, the
  global pre-hook here is the last one and its post-hook the first;
* every DTensor parameter is mfsdp2's (torch FSDP2's, in the same process, keep torch's path:
  the tests compare against them), of dimension one or more (a new 0-d state tensor is
  ambiguous: a ``step`` count is plain, a moment of a 0-d parameter a DTensor), and each gradient
  has its parameter's placements and local shape;
* the optimizer's first step here ran torch's path: it created the state through DTensor, and it
  installed the instance's ``step`` wrapper that puts everything back if the step raises.
"""

from __future__ import annotations

import logging
import types
import weakref
from typing import Optional

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    _global_optimizer_post_hooks,
    _global_optimizer_pre_hooks,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..base.markers import ORIGINAL_PARAM, marked_reads_no_params
from ..dtensors.placement import wrap_local

__all__ = ["ELEMENTWISE", "install", "steps_taken"]

logger = logging.getLogger(__name__)

#: torch optimizers whose update of a parameter reads only that parameter's elements, its
#: gradient's and its state's at the same index (plus scalars).
ELEMENTWISE: tuple = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop,
)

_pre_handle = None
_post_handle = None
# Optimizer -> its swap in progress (None between steps); also marks the wrapper as installed.
_active: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_counter = [0]


def steps_taken() -> int:
    """How many steps took the local path in this process (tests read it)."""
    return _counter[0]


def install() -> None:
    """Install the global step hooks (once, after the step guard's own pre-hook)."""
    global _pre_handle, _post_handle
    if _pre_handle is None:
        _pre_handle = register_optimizer_step_pre_hook(_pre)
        _post_handle = register_optimizer_step_post_hook(_post)


def _eligible(opt, args, kwargs) -> bool:
    # A closure given as None (Accelerate's wrapper passes it positionally) is no closure.
    if type(opt) not in ELEMENTWISE or any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
        return False
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return False
    # Pre-hooks run in registration order, post-hooks too: those after the pre-hook here and
    # those before the post-hook here see the swapped parameters.
    if not _blind_after(_global_optimizer_pre_hooks, list(_global_optimizer_pre_hooks), _pre_handle.id):
        return False
    if not _blind_after(_global_optimizer_post_hooks, list(reversed(_global_optimizer_post_hooks)), _post_handle.id):
        return False
    if torch.compiler.is_compiling() or torch._C._current_graph_task_id() != -1:
        return False
    return not any(g.get("differentiable", False) for g in opt.param_groups)


def _blind_after(table: dict, ids: list, after: int) -> bool:
    """Whether every hook of ``table`` after ``after`` in ``ids`` is one of mfsdp2's that reads
    nothing of the optimizer (:func:`~mfsdp2.base.markers.reads_no_params`)."""
    seen = False
    for k in ids:
        if seen and not marked_reads_no_params(table[k]):
            return False
        seen = seen or k == after
    return seen


def _pre(opt, args, kwargs) -> None:
    if not _eligible(opt, args, kwargs):
        return
    if opt not in _active:
        # First step here: torch's path creates the state as DTensors; from the next step on the
        # instance's wrapper restores the parameters and state if the step raises.
        _active[opt] = None
        opt.step = _guarded_step(opt)
        return
    swap = _collect(opt)
    if swap is None:
        return
    for params, i, p, loc, st, originals in swap:
        loc.grad = p.grad._local_tensor
        params[i] = loc
        if st is not None:
            for k in originals:
                st[k] = originals[k]._local_tensor
            del opt.state[p]
            opt.state[loc] = st
    _active[opt] = swap
    _counter[0] += 1


def _collect(opt) -> Optional[list]:
    """The replacements of this step, ``(params list, index, dtensor, local, state, originals)``
    each, or None when a parameter rules the local path out."""
    swap = []
    state = opt.state
    for group in opt.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            if type(p) is not DTensor:
                continue
            if ORIGINAL_PARAM not in p.__dict__ or p.dim() == 0:
                return None  # a 0-d parameter, or not mfsdp2's (torch FSDP2's keeps torch's path)
            g = p.grad
            if g is None:
                continue
            # Specs and placements are read directly (each DTensor property is a call), and the
            # identity tests settle the usual case: the gradient and the states were made with
            # the parameter's spec, or its placements tuple, on its mesh object.
            ps, loc = p._spec, p._local_tensor
            shape, placements = loc.shape, ps.placements
            if type(g) is not DTensor or g._local_tensor.shape != shape:
                return None
            gs = g._spec
            if gs is not ps and ((gs.placements is not placements and gs.placements != placements)
                                 or (gs.mesh is not ps.mesh and gs.mesh != ps.mesh)):
                return None
            st = state.get(p)
            originals = {}
            if st is not None:
                for k, v in st.items():
                    if type(v) is DTensor:
                        vp = v._spec.placements
                        if (vp is not placements and vp != placements) or v._local_tensor.shape != shape:
                            return None
                        originals[k] = v
            swap.append((params, i, p, loc, st, originals))
    return swap or None


def _post(opt, args, kwargs) -> None:
    swap = _active.get(opt)
    if swap is not None:
        _restore(opt, swap)


def _restore(opt, swap: list) -> None:
    _active[opt] = None
    for params, i, p, loc, _, originals in swap:
        params[i] = p
        loc.grad = None
        cur = opt.state.pop(loc, None)
        if cur is None:
            continue
        for k, v in cur.items():
            orig = originals.get(k)
            if orig is not None and v is orig._local_tensor:
                cur[k] = orig
            elif type(v) is torch.Tensor and v.dim() > 0 and v.shape == loc.shape:
                # Not from_local: it would move a host state (CPU offload) to the mesh's device.
                cur[k] = wrap_local(v, p.device_mesh, p.placements, p.shape, p.stride())
        opt.state[p] = cur


def _guarded_step(opt):
    """The optimizer's ``step`` as a bound method (LR schedulers wrap ``step.__func__``): torch's,
    then the parameters and state put back if the step raised before the post-hook ran. An
    instance-level ``step`` already there (an LR scheduler's call tracker) runs inside it, and its
    mark stays visible, so the scheduler does not take the wrapper for a user's override."""
    inner = opt.__dict__.get("step")

    def step(self, *args, **kwargs):
        try:
            return inner(*args, **kwargs) if inner is not None else type(self).step(self, *args, **kwargs)
        finally:
            swap = _active.get(self)
            if swap is not None:
                _restore(self, swap)

    if inner is not None and hasattr(inner, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True
    return types.MethodType(step, opt)
