"""Mixed-precision policy: which dtype each copy of a parameter and gradient lives in.

FSDP2-compatible fields (``param_dtype``, ``reduce_dtype``, ``output_dtype``,
``cast_forward_inputs``) plus where the optimizer-facing copies live: ``main_params_dtype`` (the
sharded weights the optimizer updates) and ``main_grads_dtype`` (the sharded gradient it reads).
Keeping both in fp32 while computing in bf16 is what makes bf16 training match fp32 training.

``all_gather_dtype=torch.float8_e4m3fn`` gathers the matmul weights (parameters with two or more
dimensions) as float8 with one scale per parameter, half of bf16's bytes (see :mod:`mfsdp2.precision.fp8`).
Unlike FSDP2, parameters of different dtypes may share a module: each dtype gets its own group.
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
    that require grad (frozen parameters keep their own dtype: no optimizer reads them). They are
    a floor, never a downcast: a float64 parameter keeps float64 main weights and gradients (as
    FSDP2 keeps a float64 model in float64), so an exactness check in float64 stays exact.
    ``main_params_dtype=None`` keeps each parameter's own dtype for its optimizer copy, and the
    main gradient follows it: torch optimizers need a gradient in its parameter's dtype, so the two
    main dtypes can only differ by being left to follow each other.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    main_params_dtype: Optional[torch.dtype] = torch.float32
    main_grads_dtype: Optional[torch.dtype] = torch.float32
    all_gather_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype", "main_params_dtype", "main_grads_dtype"):
            d = getattr(self, name)
            if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
                raise ValueError(f"mfsdp2 E88: MixedPrecisionPolicy.{name} must be a floating-point torch.dtype "
                                 "or None, "
                                 f"got {d!r}")
        if (
            self.main_params_dtype is not None
            and self.main_grads_dtype is not None
            and self.main_params_dtype != self.main_grads_dtype
        ):
            raise ValueError(
                f"mfsdp2 E42: main_grads_dtype={self.main_grads_dtype} differs from main_params_dtype="
                f"{self.main_params_dtype}; torch optimizers need each gradient in its parameter's dtype "
                "(reduce in another dtype with reduce_dtype)"
            )
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        if self.all_gather_dtype is not None and self.all_gather_dtype not in fp8:
            raise ValueError(
                f"mfsdp2 E38: MixedPrecisionPolicy.all_gather_dtype must be None or a float8 dtype "
                f"(torch.float8_e4m3fn, torch.float8_e5m2), got {self.all_gather_dtype!r}"
            )
        if self.all_gather_dtype is not None and self.param_dtype in fp8:
            raise ValueError("mfsdp2 E89: param_dtype is the compute dtype; float8 goes in all_gather_dtype "
                             "(param_dtype=torch.bfloat16, all_gather_dtype=torch.float8_e4m3fn)")

    @classmethod
    def coerce(cls, policy, where: str = "fully_shard") -> "MixedPrecisionPolicy":
        """``policy`` as an mfsdp2 policy. torch's ``torch.distributed.fsdp.MixedPrecisionPolicy``
        (what a script written for FSDP2 imports next to ``fully_shard``) carries the four FSDP2
        fields; it becomes ours with those fields and our defaults for the rest, instead of
        failing later on a field it lacks."""
        if isinstance(policy, cls):
            return policy
        fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
        if not all(hasattr(policy, f) for f in fields):
            raise TypeError(
                f"mfsdp2 E90: mp_policy of {where} must be a MixedPrecisionPolicy (mfsdp2's or "
                f"torch.distributed.fsdp's), got {type(policy).__name__}"
            )
        return cls(**{f: getattr(policy, f) for f in fields})

    def compute_dtype(self, orig: torch.dtype) -> torch.dtype:
        return self.param_dtype if self.param_dtype is not None and orig.is_floating_point else orig

    def main_dtype(self, orig: torch.dtype, requires_grad: bool) -> torch.dtype:
        if requires_grad and orig.is_floating_point and self.main_params_dtype is not None:
            return _wider(self.main_params_dtype, orig)
        return orig

    def grad_dtype(self, orig: torch.dtype, requires_grad: bool = True) -> torch.dtype:
        """The main gradient's dtype: the main weights' (see the class docstring)."""
        if self.main_params_dtype is None:
            return self.main_dtype(orig, requires_grad)
        if self.main_grads_dtype is None or not (requires_grad and orig.is_floating_point):
            return self.main_dtype(orig, requires_grad)
        return _wider(self.main_grads_dtype, orig)

    def wire_reduce_dtype(self, compute: torch.dtype) -> torch.dtype:
        return self.reduce_dtype if self.reduce_dtype is not None else compute


def _wider(main: torch.dtype, orig: torch.dtype) -> torch.dtype:
    """``main`` unless ``orig`` has more bits (float64 parameters under the fp32 default)."""
    return orig if torch.finfo(orig).bits > torch.finfo(main).bits else main
