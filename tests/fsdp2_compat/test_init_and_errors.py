"""What ``fully_shard`` does to a module, and the errors users catch, side by side with torch FSDP2
in the same process.

* Parameter registration: after forward the unit's parameters are plain tensors (kept unsharded)
  or DTensors (resharded) exactly as FSDP2's are for ``reshard_after_forward`` True / False / 1 /
  None, on a lone root and on nested units; ``reshard()`` and backward leave DTensors; the values
  are the unsharded model's.
* ``named_parameters``: the same names (a module shared by two parents listed once), and each
  parameter's global shape, stride, dtype, ``requires_grad``, leaf-ness, ``nn.Parameter`` type,
  mesh and a dim-0 ``Shard`` placement; full values equal the original tensors.
* The class swap: ``FSDP<Cls>``, still a ``Cls``; slicing a wrapped ``nn.Sequential`` gives a
  plain ``Sequential`` (it was an ``FSDPSequential`` without unit state).
* User forward pre-hooks on a unit see its unsharded (plain, full, contiguous) parameters, its
  post-hooks see what FSDP2's see (resharded or kept).
* ``unshard()`` before the first forward gathers the original values; ``unshard(async_op=True)``
  on a unit without parameters returns a handle that waits.
* Errors: for each misuse FSDP2 refuses, mfsdp2 raises an exception of FSDP2's type (or a
  subclass of it carrying mfsdp2's message): applying ``fully_shard`` twice, a container without
  ``forward``, a 0-dim parameter, a 3-D mesh, a shard dim the parameter lacks, a forward before
  meta-device parameters are initialised, prefetching a module that is no unit,
  ``reset_iter_state`` below the root, invalid ``set_reduce_scatter_max_input_buffers`` values,
  ``deepcopy``, a hook stream with HSDP.
* Non-contiguous (channels-last) parameters, which FSDP2 refuses (NotImplementedError), train in
  mfsdp2 exactly like the unsharded model (float64, REL_F64).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from . import full, runtimes
from .._dist import run_ranks
from ..models import REL_F64, assert_close_rel

WS = 2


class MLP(nn.Module):
    def __init__(self, d=8, mult=1):
        super().__init__()
        self.in_proj = nn.Linear(d, d * mult)
        self.out_proj = nn.Linear(d * mult, d)

    def forward(self, x):
        return self.out_proj(F.relu(self.in_proj(x)))


def _is_dt(p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def registration(shard, mesh):
    out = {}
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    for raf in (True, False, 1, None):
        for nested in (False, True):
            torch.manual_seed(42)
            model = nn.Sequential(MLP(3), MLP(3)) if nested else MLP(3)
            ref = {k: v.detach().clone() for k, v in model.named_parameters()}
            if nested:
                shard(model[0].in_proj, mesh=mesh, reshard_after_forward=raf)
                shard(model[0].out_proj, mesh=mesh, reshard_after_forward=raf)
            shard(model, mesh=mesh, reshard_after_forward=raf)
            rec = {}
            y = model(x)
            rec["after_forward"] = {k: _is_dt(p) for k, p in model.named_parameters()}
            rec["values"] = all(torch.equal(full(p), ref[k]) for k, p in model.named_parameters())
            y.sum().backward()
            rec["after_backward"] = {k: _is_dt(p) for k, p in model.named_parameters()}
            model(x)
            for m in model.modules():
                if hasattr(m, "reshard") and hasattr(m, "unshard"):
                    m.reshard()
            rec["after_reshard"] = {k: _is_dt(p) for k, p in model.named_parameters()}
            out[(repr(raf), nested)] = rec  # repr: 1 == True as a dict key
    return out


def parameters(shard, mesh):
    out = {}
    for kind in ("plain", "shared_module"):
        torch.manual_seed(0)
        model = nn.Sequential(*[MLP(3, mult=3) for _ in range(3)])  # odd sizes: uneven shards
        if kind == "shared_module":
            model[0].in_proj = model[1].in_proj
        orig = {k: v.detach().clone() for k, v in model.named_parameters()}
        shard(model, mesh=mesh)
        rows = []
        for k, p in model.named_parameters():
            rows.append(
                (k, tuple(p.shape), p.stride(), p.dtype, p.requires_grad, p.is_leaf, isinstance(p, nn.Parameter),
                 _is_dt(p))
            )
            assert p.device_mesh == mesh and len(p.placements) == 1 and p.placements[0].is_shard(0), (k, p.placements)
            assert torch.equal(full(p), orig[k]), k
        out[kind] = rows
    return out


def classes(shard, mesh):
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    shard(seq, mesh=mesh)
    sliced = seq[:2]
    mlp = MLP()
    shard(mlp, mesh=mesh)
    return {
        "seq": type(seq).__name__,
        "seq_is_sequential": isinstance(seq, nn.Sequential),
        "sliced": type(sliced).__name__,
        "sliced_is_unit": hasattr(sliced, "unshard"),
        "sliced_children": [id(m) for m in sliced] == [id(m) for m in list(seq)[:2]],
        "mlp": type(mlp).__name__,
        "mlp_is_mlp": isinstance(mlp, MLP),
    }


def unshard_before_forward(shard, mesh):
    torch.manual_seed(0)
    model = MLP(4)
    ref = {k: v.detach().clone() for k, v in model.named_parameters()}
    shard(model, mesh=mesh)
    model.unshard()
    gathered = {k: (not _is_dt(p), torch.equal(p.detach(), ref[k])) for k, p in model.named_parameters()}
    model.reshard()
    empty = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for m in empty:
        shard(m, mesh=mesh)
    shard(empty, mesh=mesh)
    empty.unshard(async_op=True).wait()  # the root owns no parameters
    return {"gathered": gathered, "resharded": all(_is_dt(p) for p in model.parameters())}


def user_hooks(shard, mesh):
    """Forward pre/post hooks a user registers on a unit after ``fully_shard``: what the
    parameters are when they run (FSDP2 runs its own pre-forward first, its post-forward first)."""
    out = {}
    for raf in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(MLP(4), MLP(4))
        for m in model:
            shard(m, mesh=mesh, reshard_after_forward=raf)
        shard(model, mesh=mesh)
        seen = []

        def pre(m, args):
            seen.append(("pre", [(_is_dt(p), tuple(p.shape), p.is_contiguous()) for p in m.parameters()]))

        def post(m, args, output):
            seen.append(("post", [_is_dt(p) for p in m.parameters()]))

        model[0].register_forward_pre_hook(pre)
        model[0].register_forward_hook(post)
        model(torch.randn(2, 4)).sum().backward()
        out[raf] = seen
    return out


def errors(shard, mesh):
    from torch.distributed.tensor import Shard

    out = {}

    def rec(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as e:  # the type is what is compared
            out[name] = [c.__name__ for c in type(e).__mro__]

    def twice():
        m = nn.Linear(4, 4)
        shard(m, mesh=mesh)
        shard(m, mesh=mesh)

    def scalar():
        m = nn.Linear(2, 2)
        m.s = nn.Parameter(torch.tensor(1.0))
        shard(m, mesh=mesh)

    def meta_forward():
        with torch.device("meta"):
            m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        shard(m[0], mesh=mesh)
        shard(m, mesh=mesh)
        m(torch.randn(2, 4))

    def units():
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        shard(m[0], mesh=mesh)
        shard(m, mesh=mesh)
        return m

    def reset_below_root():
        m = units()
        m(torch.randn(2, 4)).sum().backward()
        m[0].reset_iter_state()

    def buffers(value):
        return lambda: shard(nn.Linear(4, 4), mesh=mesh).set_reduce_scatter_max_input_buffers(value)

    def deep():
        copy.deepcopy(shard(nn.Linear(4, 4), mesh=mesh))

    def hook_stream():
        hsdp = init_device_mesh("cpu", (WS, 1), mesh_dim_names=("replicate", "shard"))
        shard(nn.Linear(4, 4), mesh=hsdp).set_all_reduce_hook(lambda t: None, stream=torch.cpu.Stream())

    rec("twice", twice)
    rec("module_list", lambda: shard(nn.ModuleList([nn.Linear(2, 2)]), mesh=mesh))
    rec("module_dict", lambda: shard(nn.ModuleDict({"a": nn.Linear(2, 2)}), mesh=mesh))
    rec("scalar_parameter", scalar)
    rec("mesh_3d", lambda: shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (WS, 1, 1))))
    rec("shard_dim_missing",
        lambda: shard(nn.Sequential(nn.Linear(16, 16)), mesh=mesh, shard_placement_fn=lambda p: Shard(1)))
    rec("meta_forward", meta_forward)
    rec("prefetch_not_a_unit", lambda: units()[0].set_modules_to_forward_prefetch([units()[1]]))
    rec("reset_below_root", reset_below_root)
    rec("max_input_buffers_0", buffers(0))
    rec("max_input_buffers_float", buffers(2.5))
    rec("max_input_buffers_bool", buffers(True))
    rec("deepcopy", deep)
    rec("hook_stream_hsdp", hook_stream)
    assert tuple(out) == ERROR_CASES, tuple(out)
    return out


ERROR_CASES = (
    "twice", "module_list", "module_dict", "scalar_parameter", "mesh_3d", "shard_dim_missing", "meta_forward",
    "prefetch_not_a_unit", "reset_below_root", "max_input_buffers_0", "max_input_buffers_float",
    "max_input_buffers_bool", "deepcopy", "hook_stream_hsdp",
)
# Cases calling an FSDPModule method of torch 2.13 that older FSDP2 lacks (it raises
# AttributeError there): the method, and the type torch 2.13's FSDP2 raises.
FSDP2_2_13_METHODS = {
    "reset_below_root": ("reset_iter_state", "RuntimeError"),
    "max_input_buffers_0": ("set_reduce_scatter_max_input_buffers", "ValueError"),
    "max_input_buffers_float": ("set_reduce_scatter_max_input_buffers", "TypeError"),
    "max_input_buffers_bool": ("set_reduce_scatter_max_input_buffers", "TypeError"),
}


def _fsdp2_lacks(case: str):
    from torch.distributed.fsdp import FSDPModule

    method = FSDP2_2_13_METHODS.get(case, (None,))[0]
    return method is not None and not hasattr(FSDPModule, method)


def channels_last(rank, ws):
    """mfsdp2 only (FSDP2 refuses non-contiguous parameters): against the unsharded model."""
    from mfsdp2 import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 6, 3), nn.ReLU(), nn.Conv2d(6, 2, 3)).double().to(
        memory_format=torch.channels_last)
    ref = copy.deepcopy(model)
    assert not model[0].weight.is_contiguous()
    fully_shard(model, mesh=init_device_mesh("cpu", (ws,)))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    xs = [torch.randn(2, 4, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(ws)]
    out = {"grads": [], "ref_grads": []}
    for _ in range(2):
        model(xs[rank]).pow(2).sum().backward()
        (sum(ref(x).pow(2).sum() for x in xs) / ws).backward()
        out["grads"].append([full(p.grad) for p in model.parameters()])
        out["ref_grads"].append([p.grad.clone() for p in ref.parameters()])
        for o in opts:
            o.step()
            o.zero_grad()
    out["params"] = [full(p) for p in model.parameters()]
    out["ref_params"] = [p.detach().clone() for p in ref.parameters()]
    return out


def _rank(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for lib, shard in runtimes().items():
        for fn in (registration, parameters, classes, unshard_before_forward, user_hooks, errors):
            out[(fn.__name__, lib)] = fn(shard, mesh)
    out["channels_last"] = channels_last(rank, ws)
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(_rank, WS, timeout=300)


@pytest.mark.parametrize("what", ["registration", "parameters", "unshard_before_forward", "user_hooks"])
def test_registered_parameters_match_fsdp2(what):
    for res in _results():
        ours, theirs = res[(what, "mfsdp2")], res[(what, "fsdp2")]
        assert ours == theirs, {k: (ours.get(k), v) for k, v in theirs.items() if ours.get(k) != v}
    if what == "registration":  # FSDP2's answers, spelled out: unsharded after forward iff kept
        theirs = _results()[0][(what, "fsdp2")]
        assert not any(theirs[("False", False)]["after_forward"].values())
        assert not any(theirs[("1", True)]["after_forward"].values())  # kept whole (world size 1)
        assert all(theirs[("True", True)]["after_forward"].values())
        assert all(all(r["after_reshard"].values()) and all(r["after_backward"].values()) and r["values"]
                   for r in theirs.values())


def test_class_swap_and_slicing_match_fsdp2():
    for res in _results():
        ours, theirs = res[("classes", "mfsdp2")], res[("classes", "fsdp2")]
        assert theirs["sliced"] == "Sequential" and not theirs["sliced_is_unit"], theirs
        assert ours == theirs, (ours, theirs)


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_have_fsdp2s_types(case):
    if _fsdp2_lacks(case):
        pytest.skip(f"this torch's FSDP2 has no FSDPModule.{FSDP2_2_13_METHODS[case][0]} (torch 2.13); "
                    "mfsdp2's error type: test_errors_of_methods_older_fsdp2_lacks")
    for res in _results():
        ours, mro = res[("errors", "mfsdp2")][case], res[("errors", "fsdp2")][case]
        assert mro is not None, f"{case}: FSDP2 accepts it"
        assert ours is not None, f"{case}: mfsdp2 raised nothing, FSDP2 {mro[0]}"
        assert mro[0] in ours, f"{case}: mfsdp2 raised {ours[0]} (bases {ours[1:]}), FSDP2 {mro[0]}"


def test_errors_of_methods_older_fsdp2_lacks():
    """mfsdp2 raises torch 2.13 FSDP2's error types on any torch (and that table is FSDP2's where
    the installed FSDP2 has the method)."""
    for res in _results():
        for case, (method, etype) in FSDP2_2_13_METHODS.items():
            ours = res[("errors", "mfsdp2")][case]
            assert ours is not None and etype in ours, f"{case}: mfsdp2 raised {ours}, torch 2.13's FSDP2 {etype}"
            if not _fsdp2_lacks(case):
                assert res[("errors", "fsdp2")][case][0] == etype, (case, res[("errors", "fsdp2")][case])


def test_channels_last_parameters_train_like_the_unsharded_model():
    for res in _results():
        r = res["channels_last"]
        for step, (gs, rgs) in enumerate(zip(r["grads"], r["ref_grads"])):
            for i, (g, rg) in enumerate(zip(gs, rgs)):
                assert_close_rel(g, rg, f"step {step} grad {i}", REL_F64)
        for i, (p, rp) in enumerate(zip(r["params"], r["ref_params"])):
            assert_close_rel(p, rp, f"param {i}", REL_F64)
