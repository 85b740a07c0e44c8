"""``PipelineStage`` for ``torch.distributed.pipelining`` stages holding mfsdp2 units: the checks
and cases torch's own stage leaves to the data-parallel library.

mfsdp2 units are instances of torch's ``FSDPModule`` (:mod:`mfsdp2.frontend.torch_identity`), so
torch's own ``PipelineStage`` drives a stage whose module is a unit as it drives an FSDP2 one:
before each micro-batch's backward (full, input or weight pass) gradient sync, reshard after
backward and last-backward are off, so unsharded gradients accumulate locally and the units stay
gathered between a micro-batch's input and weight passes; the schedule's REDUCE_GRAD calls
each unit's ``post_backward()`` and the root's final callback (mfsdp2's answers to FSDP2's names,
:mod:`mfsdp2.runtime.fsdp2_state`), which reduce once per step; after the first step's metadata
inference it reshards the units and clears their gradients.

This class adds what torch's stage does not do:

* a stage module that is not itself a unit but holds units (torch's stage then takes its
  plain-module path, which would reduce every micro-batch and lose a weight pass's gradients):
  the same protocol through mfsdp2's public flags, reduced by
  :func:`mfsdp2.runtime.external_backward.finish_backward`;
* schedules without a REDUCE_GRAD action (``PipelineScheduleMulti``'s own loop scales the
  gradients after a stage's last backward): the accumulated gradients are reduced before they are
  scaled (torch's stage leaves FSDP2's unreduced there);
* split-backward schedules (zero bubble, DualPipeV) with units that reshard after forward: the
  input pass would run without their gathered parameters and the weight pass give them no
  gradient (torch FSDP2 computes wrong gradients in that configuration); refused (E52) with the
  advice to shard with ``reshard_after_forward=False``.
"""

from __future__ import annotations

import logging

import torch.nn as nn
from torch.distributed import pipelining as _pipelining

from ..runtime.external_backward import finish_backward
from ..frontend.module import FSDPModule

__all__ = ["PipelineStage"]

logger = logging.getLogger(__name__)


def _units(module: nn.Module) -> list:
    """The mfsdp2 units under ``module`` (itself included), each once."""
    seen, units = set(), []
    for m in module.modules():
        if isinstance(m, FSDPModule) and id(m._mfsdp2_state) not in seen:
            seen.add(id(m._mfsdp2_state))
            units.append(m)
    return units


class PipelineStage(_pipelining.PipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` with the same arguments, for a stage module
    that is (or holds) mfsdp2 units: gradients reduced once per schedule step in every schedule,
    as torch's stage does for FSDP2 modules at REDUCE_GRAD.

    With a schedule that splits backward into input and weight passes, the units must keep their
    weights gathered from a micro-batch's forward to its weight pass, which later micro-batches'
    forwards run in between: shard them with ``reshard_after_forward=False`` (what torchtitan does
    under pipeline parallelism). A unit that reshards after forward is refused there with that
    advice (torch FSDP2 computes wrong gradients in that configuration)."""

    def _set_accumulating(self, accumulating: bool) -> None:
        for m in _units(self.submod):
            m.set_requires_gradient_sync(not accumulating, recurse=False)
            m.set_reshard_after_backward(not accumulating, recurse=False)
            m.set_is_last_backward(not accumulating)

    def _check_split_backward(self) -> None:
        resharding = [m._mfsdp2_state.name for m in _units(self.submod) if m._mfsdp2_state.reshard_after_forward]
        if resharding:
            raise ValueError(
                f"mfsdp2 E52: pipeline stage {self.stage_index}: this schedule runs each micro-batch's weight "
                "gradients in a separate pass after later micro-batches' forwards, but units "
                f"{resharding} reshard their weights after forward: the input pass would then run without "
                "their gathered parameters and the weight pass would give them no gradient. Shard the "
                "stage's modules with fully_shard(..., reshard_after_forward=False) (or call "
                "set_reshard_after_forward(False) on them), or use a schedule without a separate weight "
                "pass (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)"
            )

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type in ("input", "weight"):
            self._check_split_backward()
        self._set_accumulating(True)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    def _reduce_accumulated(self) -> None:
        """Sync on again and reduce what the micro-batches accumulated (nothing to do unless a
        backward ran in accumulating mode since the last reduction)."""
        units = _units(self.submod)
        if all(m._mfsdp2_state.requires_gradient_sync for m in units):
            return
        self._set_accumulating(False)
        roots = []
        for m in units:
            ctx = m._mfsdp2_state.ctx  # None: no forward ran yet, nothing to reduce
            if ctx is not None and ctx not in roots:
                roots.append(ctx)
        for ctx in roots:
            finish_backward(ctx)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if not isinstance(self.submod, FSDPModule):
            self._reduce_accumulated()  # torch's stage reduces a unit stage itself, not a plain one
        super().perform_reduce_grad(grad_scale_factor)

    def scale_grads(self, grad_scale_factor: int) -> None:
        # Schedules without a REDUCE_GRAD action (PipelineScheduleMulti's own loop) call this after
        # a stage's last backward: the accumulated gradients must be reduced before they are
        # scaled. Called from perform_reduce_grad, nothing is left to reduce.
        self._reduce_accumulated()
        super().scale_grads(grad_scale_factor)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        # The first step's metadata inference runs a real forward (and an input-only backward):
        # leave no gathered weights and no gradients behind. torch does it for the units its
        # stage sees (``isinstance``), not for units inside a plain stage module or on a torch
        # without this cleanup.
        for m in _units(self.submod):
            m.reshard()
            for p in m.parameters():
                p.grad = None
