"""The unit's all-gather when some of its parameters carry FSDP2's all-gather extension.

One ``uint8`` all-gather carries, per rank, ``[every subclass parameter's pre-all-gather inputs,
byte for byte, in parameter order | each riding group's shard in its compute dtype | pad]``:
``R`` bytes per rank, the gathered block rank-major, ``N x R``. Why one collective: FSDP2 gathers
a unit's parameters (quantised and plain, frozen and trainable) in one ``all_gather_into_tensor``,
``uint8`` as soon as two dtypes meet; a unit of an NF4 base weight, LoRA adapters and a norm
would otherwise pay gloo's fixed latency and a wait per group.

What travels equals FSDP2's for the subclass parameters: their inputs are packed with no
alignment padding (FSDP2 packs them the same way). A riding group's segment starts at a multiple
of 16 bytes (it is read back as its dtype), and ``R`` is rounded to 16: at most 15 bytes per
riding group and 15 per rank more than the sum, while the plain parameters themselves follow
mfsdp2's row-aligned layout, whose padding is below FSDP2's per-parameter chunk padding in
general (``tests/precision/test_subclass_params.py`` counts both).

The copy-out after the wait mirrors FSDP2's ``split_with_sizes_copy``: each input's ``N``
gathered pieces go into that parameter's persistent output tensor, each rider's into its
unsharded buffer; then ``fsdp_post_all_gather`` rebuilds (or refreshes, ``out=``) each parameter.
The block comes from the root's allocator and is freed at once.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn as nn

from ..comm.communicator import CommHandle, Communicator
from ..memory.buffer import leaked_blocks
from torch.distributed.tensor import DTensor

from .subclass_params import SubclassParam, has_all_gather_extension, torch_mp_policy
from .subclass_grads import SubclassGrads

__all__ = ["SubclassUnit", "riders_of", "split_subclass_params", "subclass_unit"]

logger = logging.getLogger(__name__)

# A mfsdp2.groups.param_group.ParameterGroup (that module is this folder's too, but the gather
# only needs its buffers' public methods).
Group = Any


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def riders_of(groups: list, taken: set[int], comm: Communicator) -> list[int]:
    """Indices of ``groups`` (a unit's) that ride in the subclass parameters' all-gather: every
    ZeRO-3 group not gathered in float8, not already riding elsewhere (``taken``), on the same
    communicator. Every rank has the same groups, so every rank picks the same riders."""
    return [
        j for j, g in enumerate(groups)
        if j not in taken and g.fp8 is None and not g.persistent and g.comm is comm
    ]


class SubclassUnit(SubclassGrads):
    """A unit's parameters with the all-gather extension: their gathers (with riders), their
    registration on the modules and (:class:`SubclassGrads`) their gradient reduction."""

    def __init__(self, unit_name: str, params: list[SubclassParam], comm: Communicator, module: nn.Module, mp) -> None:
        self.unit_name = unit_name
        self.params = params
        self.comm = comm
        self.module = module
        self.device = comm.device
        self.policy = torch_mp_policy(mp)
        self._block: Optional[tuple[torch.Tensor, Any, Any]] = None
        self.gathered = False
        self.gathers = 0  # tests: all-gathers issued
        self.bytes_per_rank = 0  # tests: R of the latest gather
        SubclassGrads.__init__(self)

    # -- gather --------------------------------------------------------------------------------
    def all_gather(self, allocator, key, label: str, riders: list[tuple[Group, Any]]) -> CommHandle:
        """Issue the unit's one all-gather (with ``riders``: ``(group, block key)``); the
        returned handle's ``wait()`` copies out and rebuilds every parameter."""
        N, r = self.comm.world_size, self.comm.rank
        inputs = [p.inputs(self.module, self.policy) for p in self.params]
        sizes = [[t.numel() * t.element_size() for t in ins] for ins in inputs]
        end = sum(sum(s) for s in sizes)
        spans = []
        for g, _ in riders:
            start = _align(end, 16)
            end = start + g.layout.shard_numel * g.weights.dtype.itemsize
            spans.append((start, end))
        R = _align(max(end, 1), 16)
        bkey = ("subclass", key)
        if allocator is not None:
            block = allocator.allocate(bkey, N * R, torch.uint8, self.device)
        else:  # an explicit unshard() before the root's first forward: no allocator yet
            block = torch.empty(N * R, dtype=torch.uint8, device=self.device)
        self._block = (block, allocator, bkey)
        mine = block[r * R : (r + 1) * R]
        off = 0
        with torch.no_grad():
            for ins in inputs:
                for t in ins:
                    n = t.numel() * t.element_size()
                    mine[off : off + n].copy_(t.view(torch.uint8))
                    off += n
            prev = off
            for (g, _), (start, stop) in zip(riders, spans):
                mine[prev:start].zero_()
                g.begin_gather()
                mine[start:stop].view(g.weights.dtype).copy_(g.weights.shard)  # its own gather's cast
                prev = stop
            mine[prev:].zero_()
        self.gathers += 1
        self.bytes_per_rank = R
        h = self.comm.all_gather(block, mine, label)

        def copy_out() -> None:
            h.wait()
            rows = block.view(N, R)
            with torch.no_grad():
                o = 0
                for p, ins, ss in zip(self.params, inputs, sizes):
                    outs = p.alloc_outputs(ins, self.device)
                    for out, n in zip(outs, ss):
                        with torch.autograd._unsafe_preserve_version_counter(out):
                            out.view(torch.uint8).view(N, n).copy_(rows[:, o : o + n])
                        o += n
                for (g, rkey), (start, stop) in zip(riders, spans):
                    g.weights.materialize(allocator, rkey)
                    g.weights.place_rows(rows[:, start:stop].view(g.weights.dtype))
                for p in self.params:
                    p.rebuild()
            self._free_block()
            self.gathered = True

        return CommHandle(then=copy_out, inner=h, label=label)

    def _free_block(self) -> None:
        if self._block is None:
            return
        block, alloc, key = self._block
        self._block = None
        if alloc is not None:
            alloc.free(key)

    def abandon_gather(self, why: str) -> None:
        """The gather did not provably end: its block may still be written, so it is leaked."""
        if self._block is not None:
            block, alloc, key = self._block
            self._block = None
            if alloc is not None:
                alloc.leak(key, why)
            else:
                leaked_blocks.append(block)
        self.reshard()

    # -- modules -------------------------------------------------------------------------------
    def register(self, unsharded: bool) -> None:
        if unsharded and not self.gathered:
            return
        for p in self.params:
            p.register(unsharded)

    def reshard(self) -> None:
        for p in self.params:
            p.free()
        self.gathered = False

    def dist_params(self) -> list[nn.Parameter]:
        return [p.dist_param for p in self.params]


def split_subclass_params(infos: list, params: list) -> tuple[list, list, list, list]:
    """``(infos, params)`` of the plain parameters and ``(infos, params)`` of those whose tensor
    carries FSDP2's all-gather extension, each in registration order."""
    plain_i, plain_p, sub_i, sub_p = [], [], [], []
    for info, p in zip(infos, params):
        if not isinstance(p, DTensor) and has_all_gather_extension(p, info[0].fqn):
            sub_i.append(info)
            sub_p.append(p)
        else:
            plain_i.append(info)
            plain_p.append(p)
    return plain_i, plain_p, sub_i, sub_p


def subclass_unit(unit_name: str, infos: list, params: list, mesh, comm: Communicator, module: nn.Module, mp,
                  *, shards_params: bool, offload: bool, hsdp: bool, partial_reshard: bool,
                  shard_dims: Optional[list[int]] = None) -> Optional[SubclassUnit]:
    """The unit's :class:`SubclassUnit` (None without such parameters); configurations FSDP2's
    protocol does not cover in mfsdp2 are refused here, naming the parameter, its class and what
    to do instead (E65)."""
    if not params:
        return None
    why = None
    if not shards_params:
        why = ("gathers it once per step and keeps it (sharding_strategy other than 'optim_grads_params')",
               "use sharding_strategy='optim_grads_params' for this unit")
    elif hsdp:
        why = ("is replicated across a second mesh dimension (HSDP)", "use a 1-D mesh for this unit")
    elif offload:
        why = ("would live in host memory (CPUOffloadPolicy)", "drop offload_policy for this unit")
    elif partial_reshard:
        why = ("reshards to a rank block after forward (reshard_after_forward=<int>); FSDP2 has no such "
               "path for tensor subclasses either", "pass reshard_after_forward=True or False")
    for i, (info, p) in enumerate(zip(infos, params)):
        fqn = info[0].fqn
        if why is None and shard_dims is not None and shard_dims[i] % max(p.dim(), 1) != 0:
            why = (f"is asked to shard on dim {shard_dims[i]} (shard_placement_fn)", "shard it on dim 0")
        if why is None and p.is_meta:
            why = ("is on the meta device; its subclass builds its shard from values",
                   "build it on a real device (or quantise after mfsdp2.materialize)")
        if why is None and p.dim() == 0:
            why = ("is 0-dimensional", "store it with shape (1,)")
        if why is not None:
            raise ValueError(
                f"mfsdp2 E65: parameter {fqn!r} of {unit_name} is a {type(p).__name__} "
                "with FSDP2's all-gather extension "
                f"(fsdp_pre_all_gather), which mfsdp2 supports for ZeRO-3 units on a 1-D mesh; this one {why[0]}: "
                f"{why[1]}, or keep the parameter out of the unit (ignored_params)"
            )
    sub = [SubclassParam(info, p, mesh, comm.rank, comm.world_size, mp) for info, p in zip(infos, params)]
    unit = SubclassUnit(unit_name, sub, comm, module, mp)
    unit.register(unsharded=False)
    logger.debug("mfsdp2: %s: %d parameters with the all-gather extension: %s", unit_name, len(sub),
                 [(p.fqn, type(p.local).__name__) for p in sub])
    return unit
