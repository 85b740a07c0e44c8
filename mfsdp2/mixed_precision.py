"""Mixed-precision policy: which dtype each copy of a parameter and gradient lives in.

FSDP2-compatible fields (``param_dtype``, ``reduce_dtype``, ``output_dtype``,
``cast_forward_inputs``) plus where the optimizer-facing copies live: ``main_params_dtype`` (the
sharded weights the optimizer updates) and ``main_grads_dtype`` (the sharded gradient it reads).
Keeping both in fp32 while computing in bf16 is what makes bf16 training match fp32 training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["MixedPrecisionPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``None`` means "the parameter's own dtype" for compute/reduce/output fields.

    ``main_params_dtype`` / ``main_grads_dtype`` default to fp32 for floating-point parameters
    that require grad (frozen parameters keep their own dtype: no optimizer reads them).
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    main_params_dtype: Optional[torch.dtype] = torch.float32
    main_grads_dtype: Optional[torch.dtype] = torch.float32

    def compute_dtype(self, orig: torch.dtype) -> torch.dtype:
        return self.param_dtype if self.param_dtype is not None and orig.is_floating_point else orig

    def main_dtype(self, orig: torch.dtype, requires_grad: bool) -> torch.dtype:
        if requires_grad and orig.is_floating_point and self.main_params_dtype is not None:
            return self.main_params_dtype
        return orig

    def grad_dtype(self, orig: torch.dtype) -> torch.dtype:
        return self.main_grads_dtype if self.main_grads_dtype is not None else orig

    def wire_reduce_dtype(self, compute: torch.dtype) -> torch.dtype:
        return self.reduce_dtype if self.reduce_dtype is not None else compute
