"""``mfsdp2.optim.AdamW``: torch's AdamW, stepping each mfsdp2 parameter group's flat main shard at once.

Why: ``torch.optim.AdamW`` on mfsdp2's (or FSDP2's) parameters walks them one DTensor at a time,
about ten DTensor-dispatched ops per parameter: on the 64-unit ``tiny`` model the CPU step took
six times DDP's, and under CPU offload the host step dominates a training step. Here every
parameter whose gradient is mfsdp2's view of its group's flat main gradient is stepped by one
native call over all flat shards on the host (:mod:`mfsdp2.optim.kernel`), or by one
``torch._fused_adamw_`` launch per group and device on an accelerator, on plain local tensors.

What it computes is torch's AdamW:

* on the CPU, bit for bit ``torch.optim.AdamW``'s for-loop / foreach result (the native kernel
  is used only after checking it reproduces torch's rounding on this machine; without it, torch's
  foreach arithmetic runs on the flat shards' pieces). ``fused=True`` runs torch's fused CPU
  kernel on the pieces instead, bit for bit ``torch.optim.AdamW(fused=True)``;
* on an accelerator, torch's fused AdamW (``torch.optim.AdamW(fused=True)``'s bits, whatever
  ``foreach`` / ``fused`` say; it differs from foreach by rounding only);
* amsgrad, maximize, weight decay, tensor ``lr`` / ``betas``, per-group hyper-parameters, LR
  schedulers, ``add_param_group``, parameters without a gradient (skipped, their step not
  counted) exactly as torch; ``capturable=True`` keeps torch's meaning on accelerators (steps on
  the device, no host synchronisation: the fused path reads nothing on the host) and is refused
  on CPU parameters, as torch refuses it; ``differentiable=True`` is refused (the flat step is
  not recorded by autograd).

``state_dtype=torch.bfloat16``: the flat states' moments are bfloat16, stepped in float32 and
stored by stochastic rounding (:mod:`mfsdp2.optim.bf16_states`; the native kernel on the host,
the same bits in PyTorch elsewhere); ``seed`` salts the rounding's random bits.

Parameters that are not mfsdp2's (plain tensors, ``ignored_params``, FSDP2's DTensors) and
mfsdp2 parameters whose ``.grad`` is not the group's view (a gradient the user assigned, DSD's
zero gradients when it initialises states) are stepped by torch's own AdamW code with the
group's flags, on their (possibly DTensor) tensors: the same result as ``torch.optim.AdamW``.

State: torch AdamW's per-parameter format (``step``, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq`` as DTensors like the parameters; :mod:`mfsdp2.optim.flat_state`), so
``state_dict()`` / ``load_state_dict``, DCP and DSD (``mfsdp2.checkpoint.state_dict`` and torch's) exchange
checkpoints with ``torch.optim.AdamW`` on mfsdp2, FSDP2 or an unsharded model, both ways.
``GradScaler``: the step takes no ``grad_scale`` (``_step_supports_amp_scaling`` is False), so
the scaler unscales the gradients and skips non-finite steps itself.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as _adam

from ..integrations.clip_grad import clip_grad_norm_
from ..groups.param_group import live_groups
from .bf16_states import step_piece, step_pieces
from .flat_state import FlatState
from .kernel import NativeStep, _module, native_arithmetic, torch_step
from .overlap import StepInBackward

__all__ = ["AdamW"]

_UNKNOWN = object()
_NATIVE_DTYPES = (torch.float32, torch.float64)


class AdamW(torch.optim.AdamW):
    """torch's AdamW (same signature, param groups, state format), stepping mfsdp2's flat shards.
    See the module docstring for what is stepped how."""

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 1e-3,
        betas: tuple = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        step_in_backward: bool = False,
        max_grad_norm: Optional[float] = None,
        state_dtype: Optional[torch.dtype] = None,
        seed: int = 0,
    ) -> None:
        if state_dtype is not None:
            if state_dtype != torch.bfloat16:
                raise ValueError(f"mfsdp2.optim.AdamW: state_dtype must be None (the parameters' dtype) or "
                                 f"torch.bfloat16, got {state_dtype}")
            if fused or capturable:
                raise ValueError("mfsdp2.optim.AdamW: state_dtype=torch.bfloat16 runs its own step (float32 "
                                 "arithmetic, stochastically rounded moments); fused=True and capturable=True "
                                 "name torch's kernels, which keep moments in the parameters' dtype: drop them")
        self.state_dtype: Optional[torch.dtype] = state_dtype
        self.seed = int(seed)
        if differentiable:
            raise ValueError("mfsdp2.optim.AdamW: differentiable=True is not supported (the flat step is not "
                             "recorded by autograd); use torch.optim.AdamW for a differentiable step")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=False, fused=fused)
        # The flat step takes no grad_scale / found_inf: GradScaler unscales and checks for us.
        self._step_supports_amp_scaling = False
        self._init_flat()
        if max_grad_norm is not None and not (float(max_grad_norm) > 0.0):
            raise ValueError(f"mfsdp2.optim.AdamW: max_grad_norm must be a positive number, got {max_grad_norm!r}")
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.last_grad_norm: Optional[torch.Tensor] = None  # the total norm the last clipped step saw
        self._overlap = StepInBackward(self) if step_in_backward else None

    def _init_flat(self) -> None:
        self._flat: dict[int, FlatState] = {}  # id(ParameterGroup) -> its flat state
        # id(param) -> (group, index, its local tensor's data_ptr, piece numel), or None: not mfsdp2's
        self._where: dict[int, Optional[tuple]] = {}
        # id(param) -> (param, group, index, flat state, data_ptr, numel): the last step's answer
        self._resolved: dict[int, tuple] = {}
        # id(param) -> what its last flat step checked and used (see step's fast path)
        self._fast: dict[int, tuple] = {}
        # NativeStep's last segment table per kind of batch (rebuilt only when its pieces change)
        self._tables: dict = {}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if not hasattr(self, "_flat"):
            self._init_flat()
        for k, v in (("max_grad_norm", None), ("last_grad_norm", None), ("_overlap", None), ("state_dtype", None),
                     ("seed", 0)):
            if not hasattr(self, k):
                setattr(self, k, v)
        self._pid = {}
        for group in self.param_groups:
            self._number(group["params"])

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update(state_dtype=self.state_dtype, seed=self.seed)  # a copy keeps its moments' dtype
        return state

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._number(self.param_groups[-1]["params"])

    def _number(self, params) -> None:
        """Give each new parameter the next id (its position among the optimizer's parameters:
        the same on every rank and at every world size)."""
        pid = self.__dict__.setdefault("_pid", {})
        for p in params:
            pid.setdefault(id(p), len(pid))

    @property
    def step_in_backward(self) -> bool:
        """Whether this optimizer steps CPU-offloaded groups in backward (see mfsdp2.optim.overlap)."""
        return self._overlap is not None

    # -- finding a parameter's group -------------------------------------------------------------
    def _rebuild_where(self) -> None:
        """Map every live mfsdp2 parameter to its group and index. A group replaced by a newer one
        (a dtype conversion, shared parameters taken over) still lists the parameter objects, but
        their local tensors are no longer its rows: such entries are skipped."""
        where: dict[int, Optional[tuple]] = {}
        for g in live_groups():
            w = g.main_weight
            size = w.element_size()
            for i, dp in enumerate(g.dist_params):
                pc = g.layout.piece(i, g.rank)
                ptr = w.data_ptr() + pc.shard_offset * size
                if pc.numel and dp._local_tensor.data_ptr() != ptr:
                    continue
                where[id(dp)] = (g, i, ptr, pc.numel)
        for group in self.param_groups:
            for p in group["params"]:
                where.setdefault(id(p), None)
        self._where = where
        groups = {id(h[0]) for h in where.values() if h is not None}
        for k, fs in list(self._flat.items()):
            if k not in groups:
                fs.retired = True
                del self._flat[k]

    def _find(self, p: torch.Tensor) -> Optional[tuple]:
        """``(group, index)`` of an mfsdp2 parameter, None for any other."""
        for attempt in range(2):
            hit = self._where.get(id(p), _UNKNOWN)
            if hit is None:
                return None
            if hit is not _UNKNOWN:
                g, i, ptr, n = hit
                if i < len(g.dist_params) and g.dist_params[i] is p and (not n or p._local_tensor.data_ptr() == ptr):
                    return g, i
            if attempt == 0:
                self._rebuild_where()
        return None

    def _state_for(self, g, i: int) -> FlatState:
        fs = self._flat.get(id(g))
        if fs is None or fs.group is not g or fs.stale():
            if fs is not None:
                fs.retired = True
            fs = self._flat[id(g)] = FlatState(g, self._indices_of(g), self.state_dtype)
        elif not fs.covers(i):
            fs.grow(self._indices_of(g), self.state.values())
        return fs

    def _resolve(self, p: torch.Tensor) -> Optional[tuple]:
        """``(group, index, flat state)`` of an mfsdp2 parameter, None for any other. The last
        answer is reused while the parameter's rows are where they were and its flat state is
        current (a handful of identity checks)."""
        r = self._resolved.get(id(p))
        if r is not None and r[0] is p and not r[3].retired and (not r[5] or p._local_tensor.data_ptr() == r[4]) \
                and r[3].covers(r[2]) and not r[3].stale():
            return r[1], r[2], r[3]
        hit = self._find(p)
        if hit is None:
            self._resolved.pop(id(p), None)
            return None
        g, i = hit
        fs = self._state_for(g, i)
        _, _, ptr, n = self._where[id(p)]
        self._resolved[id(p)] = (p, g, i, fs, ptr, n)
        return g, i, fs

    def _indices_of(self, g) -> set[int]:
        """Indices of ``g``'s parameters this optimizer holds."""
        out = set()
        for group in self.param_groups:
            for p in group["params"]:
                hit = self._where.get(id(p))
                if hit is not None and hit[0] is g:
                    out.add(hit[1])
        return out

    @staticmethod
    def _name(g, i: int) -> str:
        fqn = g.infos[i][0].fqn
        return fqn if g.unit_name == "root" else f"{g.unit_name}.{fqn}"

    @staticmethod
    def _grad_is_view(fs: FlatState, g, i: int, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is the group's view of parameter ``i``'s rows of its main gradient."""
        if not fs.grad_usable():
            return False
        views = g._grad_views
        if views is not None and views.cached(i) is grad:
            return True
        return not g._is_foreign_grad(grad, g.main_grad, i)

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        self._accelerator_graph_capture_health_check()
        if self._overlap is not None:
            return self._overlap.step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.max_grad_norm is not None:
            self._clip()
        self._step_params(((i, g, g["params"]) for i, g in enumerate(self.param_groups)))
        return loss

    def _clip(self) -> None:
        """``max_grad_norm``: ``mfsdp2.clip_grad_norm_`` over this optimizer's parameters, first."""
        params = [p for group in self.param_groups for p in group["params"]]
        self.last_grad_norm = clip_grad_norm_(params, self.max_grad_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._overlap is not None:
            self._overlap.before_zero_grad()
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict:
        if self._overlap is not None:
            self._overlap.settle()  # never read states a step in backward is writing
        return super().state_dict()

    def _step_params(self, items, skip: Optional[set] = None, flat_only: bool = False) -> list:
        """Step the parameters of ``items`` (``(param group index, param group, params)``) that
        have a gradient, except those whose id is in ``skip``. ``flat_only``: only parameters
        taking the flat step (the others are left for ``step()``). Returns the flat-stepped ones."""
        arithmetic = native_arithmetic()
        batches: dict = {}
        state, fast = self.state, self._fast
        bf16 = self.state_dtype is not None
        stepped = []
        for index, group, params in items:
            amsgrad = group["amsgrad"]
            native_ok = arithmetic is not None and group["fused"] is not True and not group["capturable"]
            pieces, other, rows, assigned = [], [], {}, []
            for p in params:
                grad = p.grad
                if grad is None or (skip is not None and id(p) in skip):
                    continue
                # Fast path: the same parameter rows and state entries as at the parameter's last
                # step, and a gradient that is the group's current view; identity checks only. The
                # gradient is not kept in the cache: a reference would keep the main gradient's
                # memory alive past its release and make the group rebuild the view each step.
                e = fast.get(id(p))
                if e is not None and e[0] is p and p._local_tensor is e[1] and not e[4].retired \
                        and e[5]._grad_views is not None and e[5]._grad_views.cached(e[6]) is grad \
                        and e[8] == amsgrad and state.get(p) is e[3]:
                    st, sv = e[3], e[7]  # the state entries must still be our views (unrolled: per parameter)
                    if st.get("step") is sv[0] and st.get("exp_avg") is sv[1] and st.get("exp_avg_sq") is sv[2] \
                            and (sv[3] is None or st.get("max_exp_avg_sq") is sv[3]):
                        fs, i, batch, pid = e[4], e[6], e[9], e[10]
                    else:
                        e = None
                else:
                    e = None
                if e is None:
                    fast.pop(id(p), None)
                    hit = self._resolve(p)
                    if hit is None:
                        other.append(p)
                        continue
                    g, i, fs = hit
                    st = state[p]
                    if not fs.owns(st, i, amsgrad):
                        fs.ensure(st, i, amsgrad, self._name(g, i))
                    if not self._grad_is_view(fs, g, i, grad):
                        if bf16:  # its states are our bfloat16 views: torch's step cannot take them
                            if not flat_only:
                                assigned.append((fs, i, p, self._local_grad(g, i, p, grad)))
                                stepped.append(p)
                        else:
                            other.append(p)
                        continue
                    w = fs.weight
                    if bf16:
                        if w.dtype != torch.float32:
                            raise ValueError(f"mfsdp2.optim.AdamW(state_dtype=torch.bfloat16): parameter "
                                             f"{self._name(g, i)!r} has {w.dtype} main weights; bfloat16 moments are "
                                             f"stepped in float32 arithmetic and need float32 main weights")
                        batch = "bf16" if native_ok and w.device.type == "cpu" else None
                    else:
                        batch = w.dtype if native_ok and w.device.type == "cpu" and w.dtype in _NATIVE_DTYPES else None
                    views = fs.views[i]
                    pid = self._pid.get(id(p), 0)
                    fast[id(p)] = (p, p._local_tensor, None, st, fs, g, i,
                                   (views["step"], views["exp_avg"], views["exp_avg_sq"],
                                    views["max_exp_avg_sq"] if amsgrad else None), amsgrad, batch, pid)
                stepped.append(p)
                if batch is None or not native_ok:
                    pieces.append((fs, i, p))
                    continue
                b = batches.get(batch)
                if b is None:
                    b = batches[batch] = (
                        NativeStep(_module(), arithmetic, torch.float32, bf16_seed=self.seed, cache=self._tables)
                        if batch == "bf16" else NativeStep(_module(), arithmetic, batch, cache=self._tables))
                row = rows.get(batch)
                if row is None:
                    row = rows[batch] = b.hyper_row(index, group)
                b.add(fs, i, row, pid)
            if other and not flat_only:
                self._torch_step(group, other)
            if pieces:
                self._pieces_step(group, pieces)
            for fs, i, p, grad in assigned:
                self._bf16_step(group, fs, i, p, grad)
        for batch in batches.values():
            batch.run()
        return stepped

    def _bf16_step(self, group: dict, fs: FlatState, i: int, p: torch.Tensor, grad: torch.Tensor) -> None:
        """One piece with bfloat16 moments, in PyTorch (:func:`~mfsdp2.optim.bf16_states.step_piece`)."""
        v = fs.views[i]
        vmax = v.get("max_exp_avg_sq") if group["amsgrad"] else None
        step_piece(p._local_tensor, grad, v["exp_avg"]._local_tensor, v["exp_avg_sq"]._local_tensor,
                   None if vmax is None else vmax._local_tensor, v["step"], group, seed=self.seed,
                   param_id=self._pid.get(id(p), 0), first_elem=fs.first_elem[i])

    def _local_grad(self, g, i: int, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """A gradient that is not the group's view, as this rank's rows of parameter ``i``."""
        local = p._local_tensor
        t = grad._local_tensor if isinstance(grad, DTensor) else grad
        if t.shape != local.shape:
            raise ValueError(f"mfsdp2.optim.AdamW(state_dtype=torch.bfloat16): the gradient of "
                             f"{self._name(g, i)!r} has local shape {tuple(t.shape)}, not the parameter's rows "
                             f"{tuple(local.shape)}; assign a gradient laid out like the parameter (a DTensor of "
                             f"its placements) or let backward write it")
        return t.to(dtype=local.dtype, device=local.device)

    def _pieces_step(self, group: dict, items: list) -> None:
        """torch's AdamW arithmetic on the plain local tensors of flat pieces: fused on
        accelerators and for ``fused=True``, foreach otherwise; with bfloat16 moments,
        :func:`~mfsdp2.optim.bf16_states.step_pieces` per flat state."""
        if self.state_dtype is not None:
            by_flat: dict[int, tuple] = {}
            for fs, i, p in items:
                by_flat.setdefault(id(fs), (fs, []))[1].append(
                    (*fs.pieces[i], self._pid.get(id(p), 0), fs.first_elem[i], fs.views[i]["step"]))
            for fs, pieces in by_flat.values():
                step_pieces(fs.weight, fs.grad_span(), fs.exp_avg, fs.exp_avg_sq, fs.max_exp_avg_sq, pieces, group,
                            seed=self.seed, cache=fs.bf16_keys)
            return
        by_kind: dict[bool, list] = {}
        for fs, i, p in items:
            fused = group["fused"] is True or fs.weight.device.type != "cpu"
            by_kind.setdefault(fused, []).append((fs, i, p))
        for fused, its in by_kind.items():
            lists = ([], [], [], [], [], [])
            for fs, i, p in its:
                v = fs.views[i]
                lists[0].append(p._local_tensor)
                lists[1].append(p.grad._local_tensor)
                lists[2].append(v["exp_avg"]._local_tensor)
                lists[3].append(v["exp_avg_sq"]._local_tensor)
                if group["amsgrad"]:
                    lists[4].append(v["max_exp_avg_sq"]._local_tensor)
                lists[5].append(v["step"])
            torch_step(group, *lists, fused=fused)

    def _torch_step(self, group: dict, params: list) -> None:
        """torch AdamW's own step (its ``_init_group`` and functional ``adam`` with the group's
        flags) for parameters outside the flat path."""
        sub = dict(group, params=params)
        params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(sub, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        _adam(
            params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
            foreach=group["foreach"], capturable=group["capturable"], differentiable=False, fused=group["fused"],
            grad_scale=None, found_inf=None, decoupled_weight_decay=True,
        )

    # -- loading -------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict`` (a state of torch AdamW or of this class, from mfsdp2,
        FSDP2 or an unsharded model), then each mfsdp2 parameter's state is copied into the flat
        states and replaced by their views. Collective where a loaded DTensor's rows must be
        gathered (a ``Shard(0)`` state of FSDP2's): call it on every rank."""
        if self._overlap is not None:
            self._overlap.before_load()
        super().load_state_dict(state_dict)
        self._fast.clear()
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                hit = self._find(p)
                if hit is None:
                    continue
                g, i = hit
                amsgrad = group["amsgrad"] or "max_exp_avg_sq" in st
                fs = self._state_for(g, i)
                if not fs.owns(st, i, amsgrad):
                    fs.ensure(st, i, amsgrad, self._name(g, i))

