"""``mfsdp2.optim.AdamW(..., step_in_backward=True)``: the host optimizer step of a CPU-offloaded
parameter group starts as soon as the group's reduced gradient has landed in host memory, while
the rest of backward still runs; ``optimizer.step()`` then waits for those steps and does the rest.

Why: under ``CPUOffloadPolicy`` the optimizer step runs on the host over every main shard after
backward, and it dominates a step (users report 2x and more). The last units' gradients land early
in backward -- backward runs the layers in reverse and each unit's reduction lands when the next
one is issued -- so their steps can run beside the earlier layers' backward: on a GPU while the
device computes, on the CPU on a worker thread while the main thread runs autograd (torch's kernels
and the native AdamW kernel release the GIL).

How (see docs/offload.md, *Step in backward*): the optimizer puts a listener on each offloaded
:class:`~mfsdp2.groups.param_group.ParameterGroup` holding its parameters
(``GradientReduction.grad_listeners``). When a group's reduction lands (``grad_landed``) and it is
*final* -- issued in a backward with ``is_last_backward`` on, with no other forward pass of the unit
still awaiting its backward (``hooks.post_backward`` sets ``reduce_final``) -- a job on one worker
thread steps this optimizer's flat parameters of that group (the same flat step ``step()`` runs:
the native kernel or torch's arithmetic, element-wise, so splitting the step by group changes no
bit). On CUDA the job first waits for the group's copy-out event and the latest copy-in event (the
main shard is read by gathers, and written here). ``step()`` waits for the jobs, checks nothing
they used changed, and steps the parameters no job stepped (groups not offloaded, plain
parameters, gradients that landed late or not finally).

What is exact, and what is refused (never a silent difference):

* ``max_grad_norm`` (clipping by the optimizer): a clip needs the global norm before any step,
  and that norm is known only once every gradient has landed. So with ``max_grad_norm`` nothing
  is stepped in backward, and ``step()`` is ``mfsdp2.clip_grad_norm_(params, max_grad_norm)``
  then the step: exact, whatever happens between backward and ``step()``, with no overlap. (The
  local norms could be computed as gradients land, but reusing them safely needs a check that the
  gradients did not change since -- a pass over them costing as much as the norm itself.) The
  total norm is kept in ``last_grad_norm``.
* without ``max_grad_norm`` a group's gradient is consumed by its step in backward: bit for bit
  the step ``step()`` would take (same kernel, same order per element). Until ``step()``
  acknowledges it, each of these raises :class:`StepInBackwardError` before it changes anything:
  a further reduction into the group (gradient accumulation over several synced ``backward()``
  calls; ``set_requires_gradient_sync(False)`` / ``no_sync`` or ``set_is_last_backward(False)``
  for the micro-batches before the last are exact), a gather of its unit (a forward before
  ``step()``), ``mfsdp2.clip_grad_norm_`` over it, ``zero_grad()`` (e.g. ``GradScaler`` skipping
  the step), ``load_state_dict``. ``step()`` raises when a consumed gradient was written (the job
  copies the main gradient it steps with into host memory, and ``step()`` compares the bits:
  torch's ``clip_grad_norm_``, ``GradScaler.unscale_``, ``p.grad.mul_``; version counters do not
  see ``_foreach`` writes through DTensors, and a sum or fingerprint misses a power-of-two
  unscale) or replaced (``p.grad = ...``),
  or when a hyper-parameter the step used changed (an LR scheduler stepped before ``step()``).
  Those come after the step in backward updated the weights: stop and reload a checkpoint. (A
  write that lands before the job has read the gradient is what the step uses, as ``step()``
  without overlap would: the copy is taken by the job just before it steps, so only a write
  after that -- which makes the step differ -- is refused.) Cost: one host copy of the offloaded
  gradients (4 bytes per float32 parameter), made by the worker, compared by ``step()``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from ..memory import offload
from ..base.profiling import event_log
from ..groups.weight_watch import as_words

__all__ = ["StepInBackward", "StepInBackwardError"]

logger = logging.getLogger(__name__)

# The hyper-parameters a flat step reads (checked unchanged at step()).
_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused", "capturable")


class StepInBackwardError(RuntimeError):
    """Something between backward and ``optimizer.step()`` conflicts with a step already taken in
    backward (``step_in_backward=True``)."""


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return float(v)
    if isinstance(v, (tuple, list)):
        return tuple(_plain(x) for x in v)
    return v


class _Listener:
    """What a group holds (``grad_listeners``): forwards to its optimizer's StepInBackward while
    that lives (held weakly: a group never keeps an optimizer alive)."""

    __slots__ = ("_owner", "__weakref__")

    def __init__(self, owner: "StepInBackward"):
        self._owner = weakref.ref(owner)

    def _call(self, name: str, *args) -> None:
        owner = self._owner()
        if owner is not None:
            getattr(owner, name)(*args)

    def before_reduce(self, g) -> None:
        self._call("before_reduce", g)

    def grad_landed(self, g, final: bool) -> None:
        self._call("grad_landed", g, final)

    def before_gather(self, g) -> None:
        self._call("before_gather", g)

    def before_clip(self, g) -> None:
        self._call("before_clip", g)


class _Consumed:
    """A group whose gradient a job steps (or stepped) in backward."""

    __slots__ = ("group", "main_grad", "grads", "hyper", "future", "stepped", "digest")

    def __init__(self, group, main_grad, grads, hyper, future):
        self.group = group
        self.main_grad = main_grad
        self.grads = grads  # (param, its .grad) of the parameters with a gradient when the job was made
        self.hyper = hyper  # param group index -> the hyper-parameters the job used
        self.future: Future = future
        self.stepped: list = []
        self.digest = None  # a copy of the main gradient the job stepped with


class StepInBackward:
    """The step-in-backward machinery of one :class:`mfsdp2.optim.AdamW` (see the module docstring)."""

    def __init__(self, optimizer) -> None:
        self._opt = weakref.ref(optimizer)
        self._listener = _Listener(self)
        self._members: dict[int, tuple] = {}  # id(group) -> (group, [(param group index, [(i, param)])])
        self._consumed: dict[int, _Consumed] = {}
        self._pool: Optional[ThreadPoolExecutor] = None
        self._copies: dict[int, torch.Tensor] = {}  # id(group) -> host copy of its consumed main gradient
        self._lock = threading.Lock()
        self.jobs_done = 0  # steps taken in backward (tests, diagnostics)
        self.register()

    # -- which groups ------------------------------------------------------------------------
    def register(self) -> None:
        """Listen to every CPU-offloaded group holding parameters of the optimizer (again at each
        ``step()``: param groups added, groups replaced by a conversion)."""
        opt = self._opt()
        members: dict[int, tuple] = {}
        for index, group in enumerate(opt.param_groups):
            for p in group["params"]:
                hit = opt._find(p)
                if hit is None:
                    continue
                g, i = hit
                if not (g.main.offloaded and g.requires_grad):
                    continue
                entry = members.setdefault(id(g), (g, {}))
                entry[1].setdefault(index, []).append((i, p))
        self._members = {k: (g, sorted(by.items())) for k, (g, by) in members.items()}
        for g, _ in self._members.values():
            if self._listener not in g.grad_listeners:
                g.grad_listeners = g.grad_listeners + (self._listener,)

    def _member(self, g):
        entry = self._members.get(id(g))
        return entry[1] if entry is not None and entry[0] is g else None

    # -- the worker --------------------------------------------------------------------------
    def _submit(self, fn: Callable, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfsdp2-step-in-backward")
        threads = torch.get_num_threads()
        return self._pool.submit(self._run, threads, fn, *args)

    @staticmethod
    def _run(threads: int, fn: Callable, *args):
        # The main thread's intra-op thread count (per thread with OpenMP / MKL): the same
        # reductions (norms) as step() computes on the main thread.
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        with torch.no_grad():
            return fn(*args)

    def settle(self) -> None:
        """Wait for every job; the first failure is raised (its group stays consumed)."""
        error = None
        for rec in list(self._consumed.values()):
            try:
                rec.stepped, rec.digest = rec.future.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after every job ended
                error = error or e
        if error is not None:
            raise StepInBackwardError(f"mfsdp2.optim.AdamW: a step in backward failed: {error!r}") from error

    # -- landing -----------------------------------------------------------------------------
    def grad_landed(self, g, final: bool) -> None:
        """A reduction landed in ``g``'s main gradient (main thread, inside backward)."""
        by_index = self._member(g)
        if by_index is None or not final or id(g) in self._consumed:
            return
        opt = self._opt()
        mg = g.main_grad
        # CUDA: the copy of this reduction into host memory, and the latest copy out of it (the
        # gathers read the main shard this job writes), must be done before the job reads / writes.
        events = [e for e in (g.copy_out_event, *offload._host_reads.values()) if e is not None]
        if opt.max_grad_norm is not None:
            return  # clipping: every step waits for the global norm (see the module docstring)
        items = [(index, opt.param_groups[index], [p for _, p in its]) for index, its in by_index]
        grads = tuple((p, p.grad) for _, _, ps in items for p in ps if p.grad is not None)
        if not grads:
            return
        hyper = {index: tuple(_plain(group[k]) for k in _HYPER) for index, group, _ in items}
        fut = self._submit(self._step_job, g, mg, items, events)
        self._consumed[id(g)] = _Consumed(g, mg, grads, hyper, fut)

    def _step_job(self, g, mg, items, events) -> tuple:
        for e in events:
            e.synchronize()
        event_log.record("optim_step_begin", g.name)
        # What step() compares with, bit for bit: the gradient as the step reads it (a copy in
        # host memory kept per group; sums or fingerprints miss structured writes such as a
        # power-of-two unscale, whose change of every word is the same multiple of 2^23).
        copy = self._copies.get(id(g))
        if copy is None or copy.shape != mg.shape or copy.dtype != mg.dtype:
            copy = self._copies[id(g)] = torch.empty_like(mg)
        copy.copy_(mg)
        stepped = self._opt()._step_params(items, flat_only=True)
        event_log.record("optim_step_end", g.name)
        with self._lock:
            self.jobs_done += 1
        return stepped, copy

    # -- refusals ----------------------------------------------------------------------------
    def _refuse(self, g, what: str, fix: str) -> None:
        rec = self._consumed.get(id(g))
        if rec is None or rec.group is not g:
            return
        try:
            self.settle()  # no job may still be writing when control leaves with the error
        except StepInBackwardError:
            pass
        raise StepInBackwardError(
            f"mfsdp2.optim.AdamW(step_in_backward=True): {what} of parameter group {g.name!r}, whose optimizer "
            f"step already ran in backward with the gradient that had landed; without step_in_backward the "
            f"result would differ, so it is refused. {fix}"
        )

    def before_reduce(self, g) -> None:
        self._refuse(g, "another gradient reduction (a further backward() before optimizer.step())",
                     "For gradient accumulation call model.set_requires_gradient_sync(False) (or "
                     "set_is_last_backward(False)) before the backward of every micro-batch but the last, or "
                     "build the optimizer with step_in_backward=False")

    def before_gather(self, g) -> None:
        self._refuse(g, "a forward / all-gather before optimizer.step()",
                     "Call optimizer.step() right after backward() (a GradScaler that skipped optimizer.step() "
                     "cannot be used with step_in_backward), or build the optimizer with step_in_backward=False")

    def before_clip(self, g) -> None:
        self._refuse(g, "clip_grad_norm_ on the gradients",
                     "Pass max_grad_norm=... to mfsdp2.optim.AdamW instead (exact: the steps then wait for the "
                     "global norm)")

    def before_zero_grad(self) -> None:
        for rec in list(self._consumed.values()):
            self._refuse(rec.group, "zero_grad() without optimizer.step()",
                         "Call optimizer.step() after every backward() (a GradScaler that skips steps cannot "
                         "be used with step_in_backward)")

    def before_load(self) -> None:
        for rec in list(self._consumed.values()):
            self._refuse(rec.group, "load_state_dict() before optimizer.step()", "Call optimizer.step() first")

    # -- the step ----------------------------------------------------------------------------
    def _verify(self) -> set:
        """The ids of the parameters stepped in backward, after checking nothing they used changed."""
        opt = self._opt()
        skip: set = set()
        for rec in self._consumed.values():
            g = rec.group
            bad = None
            if g.main_grad is not rec.main_grad or any(p.grad is not grad for p, grad in rec.grads) \
                    or not torch.equal(as_words(rec.main_grad), as_words(rec.digest)):
                bad = ("was modified in place, replaced or cleared after it was used (clip_grad_norm_, "
                       "GradScaler.unscale_, .grad.mul_, .grad = ...)")
            if bad is None:
                for index, used in rec.hyper.items():
                    group = opt.param_groups[index] if index < len(opt.param_groups) else None
                    if group is None or tuple(_plain(group[k]) for k in _HYPER) != used:
                        bad = "was stepped with hyper-parameters that changed since (lr set before optimizer.step()?)"
                        break
            if bad is not None:
                raise StepInBackwardError(
                    f"mfsdp2.optim.AdamW(step_in_backward=True): the gradient of parameter group {g.name!r} {bad}; "
                    "its optimizer step already ran in backward, so the weights no longer match what "
                    "step_in_backward=False computes. Reload the last checkpoint; change gradients and "
                    "hyper-parameters only where no step in backward precedes (or use max_grad_norm= for "
                    "clipping, or step_in_backward=False)"
                )
            skip.update(id(p) for p in rec.stepped)
        return skip

    def step(self, closure: Optional[Callable[[], float]]):
        opt = self._opt()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.settle()
        skip = self._verify()
        if opt.max_grad_norm is not None:
            opt._clip()
        opt._step_params(((i, grp, grp["params"]) for i, grp in enumerate(opt.param_groups)), skip=skip)
        self._consumed.clear()
        self.register()
        return loss

    @property
    def pending(self) -> list[str]:
        """Names of the groups stepped in backward and not yet acknowledged by ``step()``."""
        return [rec.group.name for rec in self._consumed.values()]

    def jobs(self) -> list[Future]:
        """The futures of this step's jobs (tests)."""
        return [rec.future for rec in self._consumed.values()]
