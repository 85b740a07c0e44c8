"""AdamW state as flat tensors beside a parameter group's flat main-weight shard, and the
per-parameter views torch's optimizer format is made of.

Why flat: a :class:`~mfsdp2.groups.param_group.ParameterGroup`'s optimizer-facing parameters are views
of one flat main-weight shard (``main_weight``) and their gradients views of one flat main-grad
shard (``main_grad``), at the same offsets (``layout.piece(i, rank).shard_offset``). Keeping
``exp_avg`` / ``exp_avg_sq`` / ``max_exp_avg_sq`` as flat tensors with the same offsets lets one
kernel step a whole group -- every strategy alike: ZeRO-3/2 step their shard, ZeRO-1 its rows of
the full gradient (``main_grad`` is that slice), no_shard the whole buffer, HSDP replicas the same
rows, CPU offload host memory. Padding between parameters is never stepped (segments are the
parameters' pieces) and stays zero in the states.

What the optimizer's ``state`` holds per parameter is torch AdamW's format: ``step`` (a float32
0-dim tensor: a view of :attr:`FlatState.steps`), ``exp_avg``, ``exp_avg_sq`` (and
``max_exp_avg_sq``) -- DTensors like the parameter (same mesh, placements, global shape), whose
local tensors are views of the flat states. ``state_dict()``, DCP and DSD see exactly what torch
AdamW on mfsdp2's (or FSDP2's) parameters has. A state that is not our view any more (a
``load_state_dict``, an assignment) is copied into the views and replaced by them (:meth:`adopt`).

The flat tensors cover only the span of the shard holding this optimizer's parameters of the
group, so optimizers over parts of a model (one per parameter, optimizer-in-backward) do not
each allocate a whole shard; a span that must grow (``add_param_group``) is re-made and the
states move with it.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_scalar_dtype

from ..dtensors.placement import offset_free

__all__ = ["FlatState", "STATE_KEYS"]

STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class FlatState:
    """One optimizer's AdamW state for (some of) the parameters of one ParameterGroup."""

    def __init__(self, group, indices: Iterable[int], state_dtype: Optional[torch.dtype] = None):
        """``state_dtype``: the moments' dtype (None: the main weights'; ``torch.bfloat16`` for
        :mod:`mfsdp2.optim.bf16_states`, whose step counters stay on the host, as torch keeps a
        non-capturable AdamW's)."""
        self.group = group
        self.state_dtype = state_dtype
        self.source = group.main_weight  # the shard the spans are offsets into (re-made if replaced)
        self.retired = False  # replaced by a newer flat state of the optimizer
        self.indices: set[int] = set()
        self.views: dict[int, dict[str, torch.Tensor]] = {}
        self.max_exp_avg_sq: Optional[torch.Tensor] = None
        self._make(set(indices))

    # -- geometry ------------------------------------------------------------------------------
    def _make(self, indices: set[int]) -> None:
        g = self.group
        lay = g.layout
        pieces = {i: lay.piece(i, g.rank) for i in indices}
        used = [(pc.shard_offset, pc.numel) for pc in pieces.values() if pc.numel]
        self.base = min((o for o, _ in used), default=0)
        self.span = max((o + n for o, n in used), default=self.base) - self.base
        # (offset in the span, length); an empty piece's offset is never used
        self.pieces = {i: (pc.shard_offset - self.base if pc.numel else 0, pc.numel) for i, pc in pieces.items()}
        # the index of each piece's first element in its whole parameter (storage order)
        self.first_elem = {i: pc.row_start * lay.slots[i].row_numel for i, pc in pieces.items()}
        self.indices = indices
        self.bf16_keys: dict = {}  # bf16_states.step_pieces' gather indices and element keys
        w = g.main_weight
        self.weight = w[self.base:self.base + self.span]
        self.exp_avg = torch.zeros(self.span, dtype=self.state_dtype or w.dtype, device=w.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        if self.max_exp_avg_sq is not None:
            self.max_exp_avg_sq = torch.zeros_like(self.exp_avg)
        # torch's dtype for non-fused steps: float32, float64 under a float64 default dtype
        steps_device = "cpu" if self.state_dtype is not None else w.device
        self.steps = torch.zeros(len(g.dist_params), dtype=_get_scalar_dtype(), device=steps_device)

    def covers(self, i: int) -> bool:
        return i in self.indices

    def grow(self, indices: Iterable[int], state: dict) -> None:
        """Cover more parameters (``add_param_group``): new flat tensors over the union of the
        spans; the values and the optimizer's state entries move to them."""
        old = (self.base, self.span, self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq, self.steps)
        old_views = self.views
        self._make(self.indices | set(indices))
        ob, ospan = old[0], old[1]
        if ospan:
            at = ob - self.base
            for new, prev in zip((self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq), old[2:5]):
                if new is not None and prev is not None:
                    new[at:at + ospan].copy_(prev)
        self.steps.copy_(old[5])
        self.views = {}
        for i, views in old_views.items():
            fresh = self.views_of(i)
            for p_state in state:
                for k, v in views.items():
                    if p_state.get(k) is v:
                        p_state[k] = fresh[k]

    def need_max(self) -> None:
        """amsgrad (turned on now, or from the start): the third flat state, zeros."""
        if self.max_exp_avg_sq is None:
            self.max_exp_avg_sq = torch.zeros_like(self.exp_avg)

    # -- views -----------------------------------------------------------------------------------
    def _local(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        g = self.group
        slot = g.layout.slots[i]
        pc = g.layout.piece(i, g.rank)
        off, n = self.pieces[i]
        t = flat[off:off + n]
        return t.view(()) if len(slot.shape) == 0 else t.view((pc.num_rows,) + tuple(slot.shape[1:]))

    def views_of(self, i: int) -> dict[str, torch.Tensor]:
        """Parameter ``i``'s state entries (made once): DTensors like the parameter over the flat
        states, and its step counter."""
        v = self.views.get(i)
        if v is None or ("max_exp_avg_sq" not in v and self.max_exp_avg_sq is not None):
            g = self.group
            shape = g.dist_params[i].shape
            v = {"step": self.steps[i]}
            for k in STATE_KEYS:
                flat = getattr(self, k)
                if flat is not None:
                    v[k] = offset_free(g.as_dtensor(self._local(flat, i), i, shape))  # state-dict entries
            self.views[i] = v
        return v

    @staticmethod
    def _keys(amsgrad: bool) -> tuple:
        return ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("step", "exp_avg", "exp_avg_sq")

    def ensure(self, st: dict, i: int, amsgrad: bool, name: str) -> None:
        """Make the state dict ``st`` of parameter ``i`` hold our views (``max_exp_avg_sq`` only
        with amsgrad, as torch): fresh zeros (torch's lazy initialisation) when empty, else the
        values it holds, copied in."""
        if amsgrad:
            self.need_max()
        v = self.views_of(i)
        fresh = not st
        for k in self._keys(amsgrad):
            t = v[k]
            cur = st.get(k)
            if cur is t:
                continue
            if cur is None:  # a fresh state; or amsgrad turned on with states already there (torch fails)
                if fresh or k == "max_exp_avg_sq":
                    (t._local_tensor if isinstance(t, DTensor) else t).zero_()
                    st[k] = t
                continue
            _copy_into(t, cur, self.group, i, f"{name}[{k!r}]")
            st[k] = t

    def owns(self, st: dict, i: int, amsgrad: bool) -> bool:
        """Whether ``st`` holds exactly our views of parameter ``i`` (amsgrad's included)."""
        v = self.views.get(i)
        if v is None:
            return False
        for k in self._keys(amsgrad):
            t = v.get(k)
            if t is None or st.get(k) is not t:
                return False
        return True

    # -- the step's inputs -----------------------------------------------------------------------
    def grad_span(self) -> Optional[torch.Tensor]:
        """The span of the group's current main gradient, sliced at each call (one view per flat
        state per step): a slice kept here would keep the main gradient's memory alive after the
        group gives it back at the next forward."""
        mg = self.group.main_grad
        if mg is None:
            return None
        return mg[self.base:self.base + self.span]

    def grad_usable(self) -> bool:
        """The group has a main gradient matching the weights (dtype, device)."""
        mg = self.grad_span()
        return mg is not None and mg.dtype == self.weight.dtype and mg.device == self.weight.device

    def stale(self) -> bool:
        """The group's main weights were replaced (``allocate``, a dtype conversion)."""
        return self.group.main_weight is not self.source


def _copy_into(view: torch.Tensor, value, group, i: int, what: str) -> None:
    """Copy a state value (a DTensor of any placement, a plain tensor of the parameter's full or
    this rank's local shape, a number for ``step``) into one of our views."""
    with torch.no_grad():
        if not isinstance(view, DTensor):  # step
            view.copy_(torch.as_tensor(value, dtype=view.dtype).reshape(()))
            return
        if isinstance(value, DTensor):
            view.copy_(value)
            return
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"mfsdp2.optim.AdamW: state {what} is a {type(value).__name__}, expected a tensor")
        local = view._local_tensor
        value = value.to(device=local.device, dtype=local.dtype)
        if value.shape == local.shape:
            local.copy_(value)
        elif value.shape == view.shape and group.tp_specs[i] is None:
            pc = group.layout.piece(i, group.rank)
            local.copy_(value if value.dim() == 0 else value[pc.row_start:pc.row_end])
        else:
            raise ValueError(
                f"mfsdp2.optim.AdamW: state {what} has shape {tuple(value.shape)}; expected the parameter's "
                f"full shape {tuple(view.shape)} or this rank's piece {tuple(local.shape)} (or a DTensor)"
            )
