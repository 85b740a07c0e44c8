"""Every row of docs/errors.md: provoke the error, check its type and message.

The rows are provoked in a few spawned processes (one per world size) and the messages returned;
each row is then its own test case. A row listed in the docs but not provoked here (or the
reverse) fails ``test_every_documented_error_is_exercised``.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mfsdp2 import CollectiveError, MixedPrecisionPolicy
from mfsdp2.frontend.fully_shard import AlreadyShardedError, InvalidShardDimError
from mfsdp2.frontend.module import NotAnFSDPModuleError
from mfsdp2.runtime.step_guard import (
    DuplicateParameterError,
    StaleParameterError,
    UnreducedGradientsError,
    UnsupportedOptimizerError,
    UnsyncedGradientsError,
)

from .._dist import run_ranks
from .._pipeline_stages import without_self_links
from .test_errors_api import EXPECTED_API, _capture
from ..models import Net, batch, build, loss_fn

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "errors.md")

# row id -> (exception type, fragment of the message)
EXPECTED = {
    "E01": (AlreadyShardedError, "fully_shard was already applied"),
    "E02": (ValueError, "is already a DTensor"),
    "E03": (ValueError, "0-dimensional"),
    "E04": (RuntimeError, "call mfsdp2.materialize(model)"),
    "E05": (ValueError, "got a 3-D mesh"),
    "E06": (ValueError, "not part of the given mesh"),
    "E07": (ValueError, "must be True, False or a divisor"),
    "E08": (ValueError, "unknown allocator"),
    "E09": (ValueError, "which is not the root"),
    "E10": (ValueError, "prefetch depth must be >= 0"),
    "E11": (NotAnFSDPModuleError, "is not an FSDP module"),
    "E12": (RuntimeError, "needs torch.distributed initialised"),
    "E13": (RuntimeError, "becomes its root"),
    "E14": (RuntimeError, "was replaced (or deleted) after fully_shard"),
    "E15": (RuntimeError, "started while its backward is still running"),
    "E16": (RuntimeError, "never finished their forward"),
    "E17": (RuntimeError, "mid-forward/backward"),
    "E18": (RuntimeError, "while it is unsharded"),
    "E19": (RuntimeError, "overlaps its input"),
    "E20": (RuntimeError, "is already live"),
    "E21": (FloatingPointError, "non-finite gradients"),
    "E22": (AssertionError, "overlap in the flat buffer"),
    "E23": (KeyError, "is not in the state dict"),
    "E24": (ValueError, "names but"),
    "E25": (KeyError, "not in the state dict"),
    "E26": (KeyError, "no tensor in"),
    "E27": (ValueError, "world_size must be >= 1"),
    "E28": (ValueError, "broadcast_from_rank0 expects full tensors"),
    "E29": (CollectiveError, "did not finish within 2 s"),
    "E30": (ValueError, "mixes parameters on the meta device"),
    "E31": (RuntimeError, "but no reset_parameters()"),
    "E32": (ValueError, "belongs to the lowest common ancestor"),
    "E33": (CollectiveError, "about to issue different collectives"),
    "E34": (ValueError, "unknown sharding_strategy 'zero3'"),
    "E35": (ValueError, "replicates over every rank"),
    "E36": (ValueError, "applies to sharding_strategy='optim_grads_params' only"),
    "E37": (ValueError, "needs sharding_strategy='optim_grads_params'"),
    "E38": (ValueError, "must be None or a float8 dtype"),
    "E39": (ValueError, "gradient divide factor must be > 0"),
    "E40": (ValueError, "not the other dimension of the data-parallel mesh's 2-D parent"),
    "E41": (ValueError, "cannot combine with TP here"),
    "E42": (ValueError, "torch optimizers need each gradient in its parameter's dtype"),
    "E43": (ValueError, "helpers handle row-sharded 1-D layouts"),
    "E44": (ValueError, "is a UninitializedParameter, a tensor subclass"),
    "E45": (ValueError, "a container without a forward of its own"),
    "E46": (ValueError, "on one dimension: return Shard(d) or None"),
    "E47": (InvalidShardDimError, "which has 1 dims; return Shard(d) with -1 <= d < 1, or None"),
    "E48": (ValueError, "all-reduce bucket size must be >= 0 MiB"),
    "E100": (ValueError, "all-gather bucket size must be >= 0 MiB"),
    "E49": (UnreducedGradientsError, "no backward reduced"),
    "E50": (RuntimeError, "are still on the meta device (the model was built under torch.device('meta')); "
                          "give them memory first"),
    "E51": (ValueError, "all_gather_dtype (FP8 all-gather) with CPUOffloadPolicy for Linear is not supported"),
    "E52": (ValueError, "reshard their weights after forward"),
    "E53": (RuntimeError, "parameter 'fc1.weight' of unit 'blocks.0' had its .data assigned after fully_shard"),
    "E55": (UnsyncedGradientsError, "hold gradients accumulated with gradient sync off"),
    "E56": (RuntimeError, "was replaced after fully_shard by a plain Parameter of shape (40, 16)"),
    "E57": (RuntimeError, "have different dtypes after some of them were converted or replaced"),
    "E58": (RuntimeError, "parameter 'fc1.weight' of unit 'blocks.0' was converted (.to / to_empty / .half ...) "
                          "after the first forward"),
    "E59": (RuntimeError, "the state dict's value is on the meta device (no values"),
    "E54": (StaleParameterError, "SGD holds parameter 'inp.weight' of unit 'root' as it was before fully_shard"),
    "E60": (UnsupportedOptimizerError,
            "torch.optim.Adafactor cannot step sharded parameter 'inp.weight' of unit 'root'"),
    "E61": (DuplicateParameterError, "SGD holds parameter 'head.bias' of unit 'root' 2 times"),
    "E62": (ValueError, "the all-gather extension needs both fsdp_pre_all_gather and fsdp_post_all_gather"),
    "E63": (TypeError, "FSDP2's protocol calls it as fsdp_pre_all_gather(mesh) or "
                       "fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)"),
    "E64": (ValueError, "not the sizes and dtypes of its first gather"),
    "E65": (ValueError, "which mfsdp2 supports for ZeRO-3 units on a 1-D mesh; "
                        "this one gathers it once per step and keeps it"),
    "E70": (ValueError, "returned a ShardPlacementResult with mesh info DDPMeshInfo for parameter 'weight' of Linear; "
                        "a per-parameter mesh must shard"),
    "E71": (ValueError, "parameter 'weight' of Linear is an expert-parallel DTensor on mesh (ep=1)"),
    "E72": (ValueError, "is sharded over the 2-D (replicate, shard) mesh (rep=1, shard=1) (HSDP)"),
    "E73": (ValueError, "reshard_after_forward=1 (an int) for Linear, whose parameters are sharded over 2 meshes"),
}


def _gathered_classes():
    """Wrapper subclasses (torchao's int8 mixed-precision weight, whose ops keep the subclass)
    with FSDP2's all-gather extension of a wrong kind: a two-argument ``fsdp_pre_all_gather``
    (E63) and one whose inputs change dtype at the second gather (E64)."""
    from torchao.prototype.quantized_training import Int8MixedPrecisionTrainingLinearWeight as Weight

    class TwoArgPre(Weight):
        def fsdp_pre_all_gather(self, mesh, module):
            return (self._data,), (self.config,)

    class Changing(Weight):
        calls = 0

        def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None, mp_policy=None):
            Changing.calls += 1
            return ((self._data if Changing.calls == 1 else self._data.double()),), (self.config,)

    return Weight, TwoArgPre, Changing


class _OnlyPre(torch.Tensor):
    def fsdp_pre_all_gather(self, mesh):
        return (self.as_subclass(torch.Tensor),), None


def _with_weight(make) -> nn.Module:
    m = nn.Linear(4, 4)
    m.weight = nn.Parameter(make(m.weight.detach()))
    return m


def _subclass_rows(out: dict, mesh) -> None:
    """E62-E65: parameters whose tensor subclass carries (part of) FSDP2's all-gather extension."""
    from torchao.prototype.quantized_training import Int8MixedPrecisionTrainingConfig

    from mfsdp2 import fully_shard

    Weight, TwoArgPre, Changing = _gathered_classes()
    cfg = Int8MixedPrecisionTrainingConfig()
    _capture(out, "E62", lambda: fully_shard(_with_weight(lambda w: w.as_subclass(_OnlyPre)), mesh=mesh))
    two = fully_shard(_with_weight(lambda w: TwoArgPre(w, cfg)), mesh=mesh)
    _capture(out, "E63", two.unshard)
    changing = fully_shard(_with_weight(lambda w: Changing(w, cfg)), mesh=mesh)

    def twice():
        changing.unshard()
        changing.reshard()
        changing.unshard()

    _capture(out, "E64", twice)
    _capture(out, "E65", lambda: fully_shard(_with_weight(lambda w: Weight(w, cfg)), mesh=mesh,
                                             sharding_strategy="optim_grads"))


def _sharded_net(mesh, **root_kw):
    from mfsdp2 import fully_shard

    m = build("net")
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh, **root_kw)
    return m


def _pipeline_rows(out: dict, mesh) -> None:
    """E52: a zero-bubble schedule over mfsdp2 stages whose blocks reshard after forward (two
    stages on this one rank). E49: a gradient written into a gathered unit after its backward."""
    import torch.distributed.pipelining as pipelining

    from mfsdp2.integrations.pipelining import PipelineStage

    from mfsdp2 import fully_shard

    net = build("net")
    for b in net.blocks:
        fully_shard(b, mesh=mesh)  # reshard_after_forward=True (the default below the root)
    halves = [nn.Sequential(net.inp, net.blocks[0]), nn.Sequential(net.blocks[1], net.blocks[2], net.head)]
    stage_cls = without_self_links(PipelineStage)  # one rank: torch 2.11 would send gloo to itself
    stages = [stage_cls(fully_shard(h, mesh=mesh), i, 2, torch.device("cpu")) for i, h in enumerate(halves)]
    sched = pipelining.ScheduleInterleavedZeroBubble(stages, 2, loss_fn=loss_fn)
    x, y = batch(0, 4, 12)
    _capture(out, "E52", lambda: sched.step(x, target=y))

    net = _sharded_net(mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.zeros(1, 12)).sum().backward()
    net.unshard()
    net.inp.weight.grad = torch.ones_like(net.inp.weight)
    _capture(out, "E49", opt.step)
    net.reshard()


def _mesh_rows(out: dict, mesh) -> None:
    """E70-E73: per-parameter meshes (``ShardPlacementResult``) and expert-parallel parameters."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        DDPMeshInfo,
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard, distribute_tensor

    from mfsdp2 import fully_shard

    def placed(info):
        return lambda p: ShardPlacementResult(placement=Shard(0), mesh_info=info) if p.dim() == 2 else None

    ddp = DDPMeshInfo(mesh, replicate_mesh_dim=0)
    _capture(out, "E70", lambda: fully_shard(nn.Linear(3, 3), mesh=mesh, shard_placement_fn=placed(ddp)))

    def experts():  # an expert-parallel weight, Shard(0) on a mesh named "ep"
        m = nn.Linear(3, 4)
        ep = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), ep, [Shard(0)]))
        return m

    _capture(out, "E71", lambda: fully_shard(experts(), mesh=mesh))
    hsdp = HSDPMeshInfo(init_device_mesh("cpu", (1, 1), mesh_dim_names=("rep", "shard")), shard_mesh_dim=1,
                        replicate_mesh_dim=0)
    _capture(out, "E72", lambda: fully_shard(experts(), mesh=mesh, shard_placement_fn=placed(hsdp)))
    own = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group([0]), "cpu", mesh_dim_names=("own",)), shard_mesh_dim=0)
    _capture(out, "E73", lambda: fully_shard(nn.Linear(3, 3), mesh=mesh, shard_placement_fn=placed(own),
                                             reshard_after_forward=1))


def _rows_ws1(rank, ws):
    from mfsdp2 import TracePoolAllocator, fully_shard
    from mfsdp2.checkpoint.fused import join_fused, split_fused
    from mfsdp2.checkpoint.hf import load_hf_safetensors
    from mfsdp2.runtime.diagnostics import check_buffers, check_finite_grads
    from mfsdp2.memory.layout import plan_layout

    mesh = init_device_mesh("cpu", (ws,))
    out: dict = {}

    m = nn.Linear(3, 3)
    fully_shard(m, mesh=mesh)
    _capture(out, "E01", lambda: fully_shard(m, mesh=mesh))

    parent = Net()
    fully_shard(parent, mesh=mesh)
    _capture(out, "E02", lambda: fully_shard(parent.blocks[0], mesh=mesh))

    scalar = nn.Module()
    scalar.s = nn.Parameter(torch.tensor(1.0))
    _capture(out, "E03", lambda: fully_shard(scalar, mesh=mesh))

    with torch.device("meta"):
        meta = nn.Linear(3, 3)
    fully_shard(meta, mesh=mesh)  # fine: shapes are all it needs; values come from materialize()
    _capture(out, "E04", lambda: meta(torch.zeros(1, 3)))
    from mfsdp2.checkpoint import state_dict as msd

    _capture(out, "E50", lambda: msd.get_optimizer_state_dict(meta, torch.optim.SGD(meta.parameters(), lr=0.1)))
    with torch.device("meta"):
        other = nn.Linear(3, 3)
    fully_shard(other, mesh=mesh)
    _capture(out, "E59", lambda: meta.load_state_dict(other.state_dict()))

    with torch.device("meta"):
        mixed = nn.Sequential(nn.Linear(3, 3))
    mixed.append(nn.Linear(3, 3))
    _capture(out, "E30", lambda: fully_shard(mixed, mesh=mesh))

    class Bare(nn.Module):  # a parameter but no reset_parameters()
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))

    with torch.device("meta"):
        bare = Bare()
    fully_shard(bare, mesh=mesh)
    from mfsdp2 import materialize

    _capture(out, "E31", lambda: materialize(bare))

    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    fully_shard(tied[0], mesh=mesh)  # two sibling units would share it: refused at the second
    _capture(out, "E32", lambda: fully_shard(tied[1], mesh=mesh))

    _capture(out, "E05", lambda: fully_shard(nn.Linear(3, 3), mesh=init_device_mesh("cpu", (1, 1, 1))))
    _capture(out, "E34", lambda: fully_shard(nn.Linear(3, 3), mesh=mesh, sharding_strategy="zero3"))
    _capture(out, "E35", lambda: fully_shard(nn.Linear(3, 3), mesh=init_device_mesh("cpu", (1, 1)),
                                             sharding_strategy="no_shard"))
    _capture(out, "E36", lambda: fully_shard(nn.Linear(3, 3), mesh=mesh, reshard_after_forward=2,
                                             sharding_strategy="optim"))
    fp8 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather_dtype=torch.float8_e4m3fn)
    _capture(out, "E37", lambda: fully_shard(nn.Linear(3, 3), mesh=mesh, mp_policy=fp8,
                                             sharding_strategy="optim_grads"))
    _capture(out, "E38", lambda: MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather_dtype=torch.bfloat16))
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    stray = nn.Linear(3, 3)
    stray.weight = nn.Parameter(distribute_tensor(stray.weight.detach(),
                                                  init_device_mesh("cpu", (1,), mesh_dim_names=("x",))))
    _capture(out, "E40", lambda: fully_shard(stray, mesh=mesh))
    mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    tp = parallelize_module(nn.Linear(3, 3), mesh2["tp"], ColwiseParallel())
    _capture(out, "E41", lambda: fully_shard(tp, mesh=mesh2["dp"], sharding_strategy="no_shard"))
    _capture(out, "E42", lambda: MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16))

    _capture(out, "E44", lambda: fully_shard(nn.LazyLinear(3), mesh=mesh))
    _subclass_rows(out, mesh)
    _capture(out, "E45", lambda: fully_shard(nn.ModuleList([nn.Linear(3, 3)]), mesh=mesh))
    from torch.distributed.tensor import Shard

    from torch.distributed.tensor import Replicate

    _capture(out, "E46", lambda: fully_shard(nn.Linear(3, 3), mesh=mesh, shard_placement_fn=lambda p: Replicate()))
    _capture(out, "E47", lambda: fully_shard(nn.Linear(3, 3), mesh=mesh, shard_placement_fn=lambda p: Shard(1)))
    _mesh_rows(out, mesh)
    from torch.distributed.fsdp import CPUOffloadPolicy

    _capture(out, "E51", lambda: fully_shard(nn.Linear(3, 3), mesh=mesh, mp_policy=fp8,
                                             offload_policy=CPUOffloadPolicy()))
    _pipeline_rows(out, mesh)
    replicated = fully_shard(nn.Linear(3, 3), mesh=mesh, sharding_strategy="no_shard")
    _capture(out, "E43", lambda: msd.get_model_state_dict(replicated,
                                                          options=msd.StateDictOptions(full_state_dict=True)))
    divided = fully_shard(nn.Linear(3, 3), mesh=mesh)
    _capture(out, "E39", lambda: divided.set_gradient_divide_factor(0))
    _capture(out, "E07", lambda: fully_shard(nn.Linear(3, 3), mesh=mesh, reshard_after_forward=3))
    _capture(out, "E08", lambda: fully_shard(nn.Linear(3, 3), mesh=mesh, allocator="pool"))

    net = build("net")
    fully_shard(net.blocks[0], mesh=mesh, allocator="dynamic")
    fully_shard(net, mesh=mesh)
    _capture(out, "E09", lambda: net(torch.zeros(1, 12)))

    net = _sharded_net(mesh)
    _capture(out, "E10", lambda: net.set_prefetch_depth(-1))
    _capture(out, "E48", lambda: net.set_all_reduce_bucket_cap_mb(-1))
    _capture(out, "E100", lambda: net.set_all_gather_bucket_cap_mb(-1))
    _capture(out, "E11", lambda: net.set_modules_to_forward_prefetch([nn.Linear(2, 2)]))

    net = _sharded_net(mesh)
    net.blocks[1](torch.zeros(1, 16))  # its own root: keeps its parameters gathered after forward
    _capture(out, "E13", lambda: net(torch.zeros(1, 12)))

    net = _sharded_net(mesh)
    net.blocks[0].fc1.weight = nn.Parameter(torch.zeros(40, 16))  # before the first forward: not a DTensor
    _capture(out, "E56", lambda: net(torch.zeros(1, 12)))

    net = _sharded_net(mesh)
    net.blocks[0].norm.double()  # part of the unit's float32 group
    _capture(out, "E57", lambda: net(torch.zeros(1, 12)))

    net = _sharded_net(mesh)
    net(torch.zeros(1, 12)).sum().backward()
    net.blocks[0].fc1.double()  # a plain module inside the unit, after the first forward
    _capture(out, "E58", lambda: net(torch.zeros(1, 12)))

    net = _sharded_net(mesh)
    net(torch.zeros(1, 12)).sum().backward()
    net.blocks[0].fc1.weight = nn.Parameter(torch.zeros(40, 16))
    _capture(out, "E14", lambda: net(torch.zeros(1, 12)))

    # p.data = ... on a DTensor parameter is lost (the local shard keeps the old values).
    net = _sharded_net(mesh)
    net(torch.zeros(1, 12)).sum().backward()
    with torch.no_grad():
        net.blocks[0].fc1.weight.data = net.blocks[0].fc1.weight.data * 2
    _capture(out, "E53", lambda: net(torch.zeros(1, 12)))

    # An optimizer built before fully_shard holds the replaced original parameters.
    from mfsdp2 import fully_shard

    net = build("net")
    early = torch.optim.SGD(net.parameters(), lr=0.1)
    for b in net.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    net(torch.zeros(1, 12)).sum().backward()
    _capture(out, "E54", lambda: early.step())
    torch.optim.SGD(net.parameters(), lr=0.1).step()  # one built after fully_shard steps

    # A step while micro-batches accumulated with gradient sync off were never reduced.
    net = _sharded_net(mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net.set_requires_gradient_sync(False)
    net(torch.zeros(1, 12)).sum().backward()
    _capture(out, "E55", lambda: opt.step())
    net.set_requires_gradient_sync(True)  # the last micro-batch syncs: the step goes through
    net(torch.zeros(1, 12)).sum().backward()
    opt.step()

    # Adafactor on a row-sharded matrix (its vectors alone step).
    net = _sharded_net(mesh)
    net(torch.zeros(1, 12)).sum().backward()
    _capture(out, "E60", lambda: torch.optim.Adafactor(net.parameters(), lr=0.01).step())
    torch.optim.Adafactor([p for p in net.parameters() if p.dim() == 1], lr=0.01).step()

    # An optimizer whose parameter list was rewritten to hold a parameter twice (Accelerate's
    # prepare() maps parameters by data_ptr(), 0 for every empty piece).
    net = _sharded_net(mesh)
    net(torch.zeros(1, 12)).sum().backward()
    twice = torch.optim.SGD(net.parameters(), lr=0.1)
    twice.param_groups[0]["params"][-2] = net.head.bias
    _capture(out, "E61", lambda: twice.step())

    # A backward that raised midway leaves its callback pending: the next forward must say so.
    net = _sharded_net(mesh)
    x = torch.zeros(2, 12, requires_grad=True)
    y = net(x)
    x.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("user hook failed")))
    try:
        y.sum().backward()
    except RuntimeError:
        pass
    _capture(out, "E15", lambda: net(torch.zeros(1, 12)))

    # A forward that raised inside a unit, then a backward through what was computed before it.
    net = _sharded_net(mesh)
    stash = []
    hs = net.blocks[1].register_forward_hook(lambda mod, args, output: stash.append(output))

    def failing(mod, args):
        raise RuntimeError("bad input")

    hk = net.blocks[2].fc1.register_forward_pre_hook(failing)
    try:
        net(torch.zeros(2, 12))  # root and blocks[0..1] run; blocks[2] raises inside its forward
    except RuntimeError:
        pass
    hk.remove()
    hs.remove()
    _capture(out, "E16", lambda: stash[0].sum().backward())
    net.reset()

    net = _sharded_net(mesh)

    def load_in_forward(mod, args, output):
        net.load_state_dict(net.state_dict())

    hk = net.blocks[0].register_forward_hook(load_in_forward)
    _capture(out, "E17", lambda: net(torch.zeros(1, 12)))
    hk.remove()
    net.reset()

    net = _sharded_net(mesh)
    net.blocks[0].unshard()
    _capture(out, "E18", lambda: net.load_state_dict(net.state_dict()))
    net.blocks[0].reshard()

    comm = net._mfsdp2_state.comm
    t = torch.zeros(4)
    _capture(out, "E19", lambda: comm.reduce_scatter(t[:4], t))

    tp = TracePoolAllocator()
    tp.allocate("k", 4, torch.float32, "cpu")
    _capture(out, "E20", lambda: tp.allocate("k", 4, torch.float32, "cpu"))

    net = _sharded_net(mesh)
    xb, yb = batch(0, 4, 12)
    loss_fn(net(xb * float("nan")), yb).backward()
    _capture(out, "E21", lambda: check_finite_grads(net))

    from dataclasses import replace

    g = net.blocks[0]._mfsdp2_state.groups[0]
    slots = list(g.layout.slots)
    slots[1] = replace(slots[1], offset=slots[0].offset + 1)
    object.__setattr__(g.layout, "slots", tuple(slots))
    _capture(out, "E22", lambda: check_buffers(net))

    sd = {"w": torch.zeros(6, 2)}
    _capture(out, "E23", lambda: split_fused(dict(sd), "missing", ["a", "b"]))
    _capture(out, "E24", lambda: split_fused(dict(sd), "w", ["a", "b"], sizes=[1, 2, 3]))
    _capture(out, "E25", lambda: join_fused(dict(sd), ["w", "v"], "wv"))

    import tempfile

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as d:
        save_file({"other": torch.zeros(2)}, os.path.join(d, "model.safetensors"))
        _capture(out, "E26", lambda: load_hf_safetensors(_sharded_net(mesh), d))

    _capture(out, "E27", lambda: plan_layout([(4, 4)], 0))

    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from mfsdp2.checkpoint.state_dict import set_model_state_dict

    net = _sharded_net(mesh)
    sharded_sd = net.state_dict()  # DTensors where full tensors are expected
    _capture(out, "E28", lambda: set_model_state_dict(
        net, sharded_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)))
    return out


def _rows_ws2(rank, ws):
    from mfsdp2 import fully_shard

    out: dict = {}
    mesh0 = DeviceMesh("cpu", [0])  # a mesh of rank 0 only, created on every rank
    if rank == 1:
        _capture(out, "E06", lambda: fully_shard(nn.Linear(3, 3), mesh=mesh0))
    # A rank that leaves (dies) while the other still runs a step.
    import mfsdp2

    net = _sharded_net(init_device_mesh("cpu", (ws,)))
    dist.barrier()
    if rank == 0:
        return out  # rank 0 leaves; rank 1 waits for its first all-gather
    mfsdp2.set_collective_timeout(2)
    _capture(out, "E29", lambda: net(torch.zeros(1, 12)))
    mfsdp2.set_collective_timeout(None)
    return out


def _rows_ws2_checks(rank, ws):
    import mfsdp2

    out: dict = {}
    mfsdp2.set_collective_checks(True)
    net = _sharded_net(init_device_mesh("cpu", (ws,)))
    # Rank 1 runs one block on its own first: its first collective differs from rank 0's.
    _capture(out, "E33", lambda: (net.blocks[1] if rank == 1 else net)(torch.zeros(1, 12 if rank == 0 else 16)))
    mfsdp2.set_collective_checks(False)
    return out


def _e55_other_flags(rank, ws, flag):
    """E55's other forms: HSDP shard-group sums kept by set_requires_all_reduce(False), and
    reductions left in flight by set_is_last_backward(False), at a step."""
    from mfsdp2 import fully_shard

    mesh = init_device_mesh("cpu", (ws, 1), mesh_dim_names=("replicate", "shard")) if flag == "all_reduce" else \
        init_device_mesh("cpu", (ws,))
    net = build("net")
    for b in net.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    setter = net.set_requires_all_reduce if flag == "all_reduce" else net.set_is_last_backward
    setter(False)
    net(torch.zeros(1, 12)).sum().backward()
    out: dict = {}
    _capture(out, "E55", lambda: opt.step())
    setter(True)
    net(torch.zeros(1, 12)).sum().backward()
    opt.step()  # the last micro-batch completes its reductions: the step goes through
    return out["E55"]


@pytest.mark.parametrize("flag", ["all_reduce", "last_backward"])
def test_e55_other_flags_at_a_step(flag):
    for typ, msg in run_ranks(_e55_other_flags, 2, flag):
        assert typ == UnsyncedGradientsError.__name__ and "no backward completed" in msg, (typ, msg)


@pytest.fixture(scope="module")
def messages() -> dict:
    out = dict(run_ranks(_rows_ws1, 1)[0])
    out.update(run_ranks(_rows_ws2, 2)[1])
    out.update(run_ranks(_rows_ws2_checks, 2)[0])
    # Without an initialised process group (this pytest process has none).
    assert not dist.is_initialized()
    from mfsdp2 import fully_shard

    _capture(out, "E12", lambda: fully_shard(nn.Linear(3, 3)))
    return out


@pytest.mark.parametrize("row", sorted(EXPECTED))
def test_error_row(messages, row):
    etype, fragment = EXPECTED[row]
    got_type, msg = messages[row]
    assert got_type == etype.__name__, f"{row}: expected {etype.__name__}, got {got_type}: {msg}"
    assert fragment in msg, f"{row}: {fragment!r} not in {msg!r}"
    assert f"mfsdp2 {row}: " in msg, f"{row}: the message does not carry its code ('mfsdp2 {row}: ...'): {msg!r}"


def test_every_documented_error_is_exercised():
    with open(DOC) as f:
        doc_rows = set(re.findall(r"^\| (E\d+) \|", f.read(), flags=re.M))
    assert len(doc_rows) >= 20
    rows = set(EXPECTED) | set(EXPECTED_API)
    assert not set(EXPECTED) & set(EXPECTED_API)
    assert doc_rows == rows, sorted(doc_rows ^ rows)
