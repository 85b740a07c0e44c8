"""Parameters whose tensor subclass decides what is all-gathered: FSDP2's all-gather extension.

A tensor subclass that defines ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` (torchao's
float8 training weight, NF4, int8 / BitNet quantised training, the MoE float8 / MXFP8 training
wrappers) hands FSDP its packed inner tensors -- float8 bytes, NF4 codes and scalers, int8 values
and scales -- and rebuilds itself from the gathered ones. mfsdp2 keeps that protocol as torch
2.13's FSDP2 defines it (``_fsdp_param.py``), so such a model trains with the same bytes on the
wire and the same results:

* **Sharding as FSDP2 asks the subclass**: the parameter is split with ``torch.chunk`` on dim 0,
  the local piece padded to the first chunk's rows with ``new_zeros`` / ``narrow`` / ``copy_``
  (the ops every such subclass implements for FSDP2), and wrapped as a ``Shard(0)`` DTensor whose
  local tensor is the user's subclass. mfsdp2's row-aligned flat layout is *not* used for these
  parameters: a subclass splits only where its own blocks allow (NF4 in whole scaler blocks), and
  ``torch.chunk``'s split is the one every subclass promises FSDP2. So the optimizer, the state
  dict and DCP see exactly FSDP2's DTensor.
* **The gather**: ``fsdp_pre_all_gather`` runs on the local piece at every unshard (its signature
  is detected as FSDP2 detects it: ``(mesh)`` or ``(mesh, outer_size, outer_stride, module,
  mp_policy)``); its outputs, byte-viewed, go into one ``uint8`` all-gather with the unit's other
  ZeRO-3 groups riding along (their shards in their compute dtype, as their own gather would
  send them), so a unit of subclass and plain, frozen and trainable parameters is one collective,
  as in FSDP2. :mod:`mfsdp2.groups.subclass_gather` owns that collective.
* **The rebuild**: each input gets a persistent all-gather output tensor whose storage is
  allocated for the unshard and freed at the reshard (FSDP2's ``resize_``), so the first
  ``fsdp_post_all_gather`` builds the unsharded parameter over them and later ones are called
  with ``out=`` that parameter (the subclass checks its inner tensors *are* the outputs).
* **Gradients** (:mod:`mfsdp2.groups.subclass_grads`) are reduce-scattered in the parameter's
  dtype policy (``reduce_dtype``, else the gradient's dtype) in FSDP2's ``chunk_cat`` layout and
  land as ``Shard(0)`` DTensor ``.grad`` in the parameter's dtype.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..dtensors.placement import wrap_local

__all__ = [
    "SubclassParam",
    "has_all_gather_extension",
    "pre_all_gather",
    "free_storage",
    "alloc_storage",
    "torch_mp_policy",
]

logger = logging.getLogger(__name__)


def has_all_gather_extension(t: torch.Tensor, fqn: str = "") -> bool:
    """Whether ``t`` (a parameter or its local tensor) defines FSDP2's all-gather extension.
    One hook without the other is refused (E62), as FSDP2 asserts."""
    pre = hasattr(t, "fsdp_pre_all_gather")
    post = hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        raise ValueError(
            f"mfsdp2 E62: parameter {fqn!r} is a {type(t).__name__} that defines only "
            f"{'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'}; the all-gather extension needs both "
            "fsdp_pre_all_gather and fsdp_post_all_gather (define the missing one, or neither)"
        )
    return pre


def torch_mp_policy(mp) -> Any:
    """The policy FSDP2 would hand ``fsdp_pre_all_gather``: torch's own dataclass with FSDP2's
    four fields (a subclass may read ``param_dtype`` from it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    return TorchPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, output_dtype=mp.output_dtype,
                       cast_forward_inputs=mp.cast_forward_inputs)


def pre_all_gather(local: torch.Tensor, mesh: DeviceMesh, orig_size: torch.Size, stride: tuple, module: nn.Module,
                   policy: Any, fqn: str) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Call ``local.fsdp_pre_all_gather`` with the signature it declares, as torch 2.11-2.13's
    FSDP2 does: one parameter (``mesh``, the older form, kept by torch for compatibility) or five
    (``mesh, outer_size, outer_stride, module, mp_policy``). Any other count is refused (E63)."""
    fn = local.fsdp_pre_all_gather
    n = len(inspect.signature(fn).parameters)
    if n == 1:
        inputs, metadata = fn(mesh)
    elif n == 5:
        inputs, metadata = fn(mesh, orig_size, stride, module, policy)
    else:
        raise TypeError(
            f"mfsdp2 E63: parameter {fqn!r}: {type(local).__name__}.fsdp_pre_all_gather{inspect.signature(fn)} takes "
            f"{n} arguments; FSDP2's protocol calls it as fsdp_pre_all_gather(mesh) or fsdp_pre_all_gather(mesh, "
            "outer_size, outer_stride, module, mp_policy): give it one of those signatures"
        )
    return tuple(inputs), metadata


def alloc_storage(t: torch.Tensor) -> None:
    """Give ``t``'s storage its full size again (FSDP2's ``alloc_storage``): the same storage
    object, so every tensor built over it (the unsharded subclass) sees the new bytes."""
    nbytes = t.numel() * t.itemsize
    s = t.untyped_storage()
    if s.size() != nbytes:
        s.resize_(nbytes)


def free_storage(t: torch.Tensor) -> None:
    s = t.untyped_storage()
    if s.size() != 0:
        s.resize_(0)


def _chunk_with_empty(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    chunks = list(torch.chunk(t, n, dim=0))
    while len(chunks) < n:
        chunks.append(chunks[0].new_empty(0))
    return chunks


class SubclassParam:
    """One parameter with an all-gather extension: its ``Shard(0)`` DTensor (local tensor: the
    user's subclass, padded as FSDP2 pads it), the all-gather outputs and the unsharded
    parameter built over them."""

    def __init__(self, infos: list, param: nn.Parameter, mesh: DeviceMesh, rank: int, world_size: int, mp) -> None:
        self.infos = infos
        self.fqn = infos[0].fqn
        self.mesh = mesh
        self.mp = mp
        self.orig_size = param.size()
        self.stride = tuple(torch._prims_common.make_contiguous_strides_for(self.orig_size))
        self.orig_dtype = param.dtype
        self.param_dtype = mp.param_dtype if mp.param_dtype is not None and param.dtype.is_floating_point else None
        self.reduce_dtype = mp.reduce_dtype
        self.requires_grad = param.requires_grad
        self.world_size = world_size
        chunks = _chunk_with_empty(param.detach(), world_size)
        mine = chunks[rank]
        self.padded_size = chunks[0].size()
        self.sharded_size = mine.size() if mine.numel() > 0 else torch.Size((0,) + tuple(self.orig_size[1:]))
        with torch.no_grad():
            padded = param.detach().new_zeros(self.padded_size)
            if mine.numel() > 0:
                padded.narrow(0, 0, mine.size(0)).copy_(mine)
        self.padded = padded
        length = mine.size(0) if mine.numel() > 0 else 0
        local = padded.narrow(0, 0, length)
        self.dist_param = nn.Parameter(
            wrap_local(local, mesh, (Shard(0),), self.orig_size, self.stride), requires_grad=param.requires_grad
        )
        self.outputs: list[torch.Tensor] = []  # one 1-D all-gather output per input (N x input numel)
        self.inner: list[torch.Tensor] = []  # the unsharded subclass's own inner tensors (freed at reshard)
        self.unsharded: Optional[nn.Parameter] = None
        # Micro-batches' gradients accumulated in the reduce dtype without sync (subclass_grads.py).
        self.accumulated: Optional[torch.Tensor] = None
        self.metadata: Any = None
        self.input_sizes: list[torch.Size] = []
        self.posts = 0  # tests: fsdp_post_all_gather calls (the first builds, the rest are out=)

    @property
    def local(self) -> torch.Tensor:
        return self.dist_param._local_tensor

    # -- gather --------------------------------------------------------------------------------
    def inputs(self, module: nn.Module, policy: Any) -> list[torch.Tensor]:
        """The pre-all-gather outputs of this rank's piece, checked as FSDP2 checks them."""
        local = self.local
        inputs, self.metadata = pre_all_gather(local, self.mesh, self.orig_size, self.stride, module, policy, self.fqn)
        if local.size() != self.padded_size and any(t.size() != self.padded_size for t in inputs):
            raise ValueError(
                f"mfsdp2 E64: parameter {self.fqn!r} (a {type(local).__name__} of size {tuple(self.orig_size)}) "
                f"does not split evenly over {self.world_size} ranks, "
                "and its fsdp_pre_all_gather returned inputs of sizes "
                f"{[tuple(t.size()) for t in inputs]} instead of the padded shard size {tuple(self.padded_size)}; "
                "make dim 0 a multiple of the world size, or return padded inputs as FSDP2 requires"
            )
        sizes = [t.size() for t in inputs]
        if self.input_sizes and (sizes != self.input_sizes
                                 or [t.dtype for t in inputs] != [o.dtype for o in self.outputs]):
            raise ValueError(
                f"mfsdp2 E64: parameter {self.fqn!r}: fsdp_pre_all_gather returned "
                f"{[(tuple(s), t.dtype) for s, t in zip(sizes, inputs)]}, "
                "not the sizes and dtypes of its first gather; FSDP2 reuses the all-gather outputs, "
                "so they must stay fixed"
            )
        self.input_sizes = sizes
        return [t.contiguous().view(-1) for t in inputs]

    def alloc_outputs(self, inputs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        if not self.outputs:
            self.outputs = [torch.empty(t.numel() * self.world_size, dtype=t.dtype, device=device) for t in inputs]
        for t in self.outputs:
            alloc_storage(t)
        return self.outputs

    def rebuild(self) -> None:
        """``fsdp_post_all_gather`` over the filled outputs: builds the unsharded parameter once,
        then refreshes it in place (``out=``), as FSDP2's ``init_unsharded_param``."""
        outs = tuple(t.view(-1, *s[1:]) for t, s in zip(self.outputs, self.input_sizes))
        dtype = self.param_dtype or self.orig_dtype
        self.posts += 1
        if self.unsharded is not None:
            for t in self.inner:
                alloc_storage(t)
            self.local.fsdp_post_all_gather(outs, self.metadata, dtype, out=self.unsharded)
            self.metadata = None
            return
        tensor, inner = self.local.fsdp_post_all_gather(outs, self.metadata, dtype)
        self.metadata = None
        self.inner = list(inner)
        tensor = torch.as_strided(tensor, self.orig_size, self.stride, storage_offset=0)
        self.unsharded = nn.Parameter(tensor, requires_grad=self.dist_param.requires_grad)

    def free(self) -> None:
        for t in self.outputs + self.inner:
            free_storage(t)

    # -- modules -------------------------------------------------------------------------------
    def register(self, unsharded: bool) -> None:
        """Put the unsharded parameter (or the DTensor) on every module that holds it."""
        p = self.unsharded if unsharded else self.dist_param
        if unsharded:
            if p.requires_grad != self.dist_param.requires_grad:
                p.requires_grad_(self.dist_param.requires_grad)  # frozen (or unfrozen) since fully_shard
        for info in self.infos:
            info.owner._parameters[info.attr] = p

    def is_dist(self, t: Any) -> bool:
        return t is self.dist_param

    def is_unsharded(self, t: Any) -> bool:
        return t is not None and t is self.unsharded


def is_subclass_dtensor(p: Any) -> bool:
    """A ``Shard(0)`` DTensor whose local tensor carries the all-gather extension."""
    return isinstance(p, DTensor) and hasattr(p._local_tensor, "fsdp_pre_all_gather")
