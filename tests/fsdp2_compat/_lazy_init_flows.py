"""The rank side of the lazy-init tests: torchtitan's model shape, the ways of preparing it
between ``fully_shard`` and the first forward, and the run that trains each of them under torch
FSDP2 and under mfsdp2's strategies in one spawn of ranks.

``TitanNet`` has an input layer owned by the root, blocks as units of their own, and the final norm
and the output layer together as one unit of two modules (``fully_shard([model.norm, model.head])``),
built in float64 with random LayerNorm affine values. Each flow in ``FLOWS`` returns a sharded model
holding the reference values (``_reference_values``) and extra facts for the checks (a refusal
message, gradient dtypes, a callback run before the first forward); ``_train`` runs three AdamW
steps and returns per-step mean losses, full parameters and the last step's full gradients.

Besides the flows, ``_run`` runs per runtime: torch's ``reset_sharded_param_in_lazy_init`` case
(``NormNet``: a meta parameter of the root replaced by a DTensor computed from two other units'
parameters), the refusals (a plain-tensor replacement, two dtypes in one unit, part of a unit on
meta, ``unshard`` of a meta unit), and a gathered unit's state dict and bf16 meta model outputs.
A failing flow or case is recorded with its traceback, for the test to report under its name.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from . import full
from ..models import F64, Block, batch, loss_fn, make_opt

STEPS, GB, D_IN = 3, 8, 12
RUNTIMES = {"fsdp2": None, "zero3": "optim_grads_params", "zero2": "optim_grads", "no_shard": "no_shard"}


def _ours(ws: int) -> tuple:
    """mfsdp2's strategies run at ``ws``: no_shard (Replicate placements) at world size 2 only."""
    return ("zero3", "zero2", "no_shard") if ws > 1 else ("zero3", "zero2")


class TitanNet(nn.Module):
    """torchtitan's layout: embedding-like input, blocks, final norm, output layer."""

    def __init__(self, d: int = 16, d_out: int = 5):
        super().__init__()
        self.inp = nn.Linear(D_IN, d)
        self.blocks = nn.ModuleList(Block(d, 40) for _ in range(2))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def _titan(seed: int = 0, dtype=F64, device=None) -> TitanNet:
    """Random LayerNorm affine values too (their default init is constant), built in fp32."""
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        m = TitanNet()
    if device != "meta":
        with torch.no_grad():
            for mod in m.modules():
                if isinstance(mod, nn.LayerNorm):
                    mod.weight.uniform_(0.5, 1.5)
                    mod.bias.uniform_(-0.5, 0.5)
    return m.to(dtype)


def _reference_values() -> dict:
    return {k: v.detach().clone() for k, v in _titan().named_parameters()}


def _shard_fn(rt: str, mesh):
    if rt == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        return functools.partial(fully_shard, mesh=mesh)
    from mfsdp2 import fully_shard

    return functools.partial(fully_shard, mesh=mesh, sharding_strategy=RUNTIMES[rt])


def _wrap(model, shard):
    for b in model.blocks:
        shard(b)
    shard([model.norm, model.head])  # one unit of two modules, as torchtitan's
    shard(model)
    return model


@torch.no_grad()
def _copy_init(model, ref: dict, skip=()) -> None:
    from torch.distributed.tensor import distribute_tensor

    for k, p in model.named_parameters():
        if not any(k.startswith(s) for s in skip):
            p.copy_(distribute_tensor(ref[k], p.device_mesh, p.placements))


def _train(model, rank: int, ws: int, before_first_forward=None) -> dict:
    opt = make_opt("adamw", model.parameters())
    if before_first_forward is not None:
        before_first_forward()
    losses, grads = [], {}
    n = GB // ws
    for s in range(STEPS):
        x, y = batch(s, GB, D_IN, dtype=F64)
        loss = loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
        loss.backward()
        if s == STEPS - 1:
            grads = {k: full(p.grad) for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / ws)
    return {"losses": losses, "params": {k: full(p) for k, p in model.named_parameters()}, "grads": grads}


def _forward_error(model, rank: int, ws: int):
    """The exception (type name, message) a forward raises, or None."""
    n = GB // ws
    x, _ = batch(0, GB, D_IN, dtype=F64)
    try:
        model(x[rank * n : (rank + 1) * n])
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e).__name__, str(e)
    return None


# -- the flows: each returns a sharded model holding the reference values ----------------------
def _to_empty(rt, mesh, ref, rank, ws):
    m = _wrap(_titan(device="meta"), _shard_fn(rt, mesh))
    m.to_empty(device="cpu")
    _copy_init(m, ref)
    return m, {}


def _to_empty_by_module(rt, mesh, ref, rank, ws):
    m = _wrap(_titan(device="meta"), _shard_fn(rt, mesh))
    for mod in (m.head, m.blocks[1], m.inp, m.norm, m.blocks[0]):  # m.inp: a plain module of the root's unit
        mod.to_empty(device="cpu")
    _copy_init(m, ref)
    return m, {}


def _to_float64(rt, mesh, ref, rank, ws):
    m = _wrap(_titan(dtype=torch.float32), _shard_fn(rt, mesh))
    m.to(F64)
    return m, {}


def _double_by_module(rt, mesh, ref, rank, ws):
    m = _wrap(_titan(dtype=torch.float32), _shard_fn(rt, mesh))
    for mod in (m.norm, m.blocks[0], m.head, m.blocks[1], m.inp):
        mod.double()
    return m, {}


def _meta_float64_materialize(rt, mesh, ref, rank, ws):
    m = _wrap(_titan(dtype=torch.float32, device="meta"), _shard_fn(rt, mesh))
    m.to(F64)  # a meta unit of two modules changes dtype
    if rt == "fsdp2":  # FSDP2 has no materialize: its recipe
        m.to_empty(device="cpu")
        _copy_init(m, ref)
        return m, {}
    import mfsdp2

    names = {id(mod): n for n, mod in m.named_modules()}

    def init(mod):
        prefix = names[id(mod)] + "." if names[id(mod)] else ""
        for k, p in mod.named_parameters(recurse=False):
            p.copy_(ref[prefix + k])

    mfsdp2.materialize(m, init_fn=init)
    return m, {}


def _to_empty_load_state_dict(rt, mesh, ref, rank, ws):
    from torch.distributed.tensor import Shard, distribute_tensor

    m = _wrap(_titan(device="meta"), _shard_fn(rt, mesh))
    m.to_empty(device="cpu")
    m.load_state_dict({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in ref.items()})
    return m, {}


def _to_empty_in_parts(rt, mesh, ref, rank, ws):
    m = _wrap(_titan(device="meta"), _shard_fn(rt, mesh))
    for mod in (m.blocks[0], m.blocks[1], m.inp, m.norm):  # not the head, the norm's unit partner
        mod.to_empty(device="cpu")
    _copy_init(m, ref, skip=("head.",))  # the norm's values are written before the head has memory
    refused = _forward_error(m, rank, ws) if rt != "fsdp2" else None  # FSDP2 cannot go on after its refusal
    m.head.to_empty(device="cpu")
    _copy_init(m, ref, skip=("inp.", "blocks.", "norm."))
    return m, {"refused": refused}


def _part_to_empty_then_materialize(rt, mesh, ref, rank, ws):
    m = _wrap(_titan(device="meta"), _shard_fn(rt, mesh))
    for mod in (m.norm, m.blocks[1]):
        mod.to_empty(device="cpu")
    _copy_init(m, ref, skip=("inp.", "blocks.0.", "head."))  # the head, the norm's partner, is still on meta
    if rt == "fsdp2":
        for mod in (m.inp, m.blocks[0], m.head):
            mod.to_empty(device="cpu")
        _copy_init(m, ref, skip=("norm.", "blocks.1."))
        return m, {}
    import mfsdp2

    names = {id(mod): n for n, mod in m.named_modules()}

    def init(mod):  # called for the modules whose parameters are still on meta only
        prefix = names[id(mod)] + "." if names[id(mod)] else ""
        assert not prefix.startswith(("norm.", "blocks.1.")), prefix
        for k, p in mod.named_parameters(recurse=False):
            p.copy_(ref[prefix + k])

    mfsdp2.materialize(m, init_fn=init)
    return m, {}


def _initial_grads() -> dict:
    """Gradients present when the model is converted (float32 values, exact in float64)."""
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=g) for k, v in _reference_values().items()}


def _double_by_module_with_grads(rt, mesh, ref, rank, ws):
    from torch.distributed.tensor import distribute_tensor

    m = _wrap(_titan(dtype=torch.float32), _shard_fn(rt, mesh))
    grads = _initial_grads()
    for k, p in m.named_parameters():  # assigned before the first forward: FSDP2 fixes its dtypes there
        p.grad = distribute_tensor(grads[k], p.device_mesh, p.placements)
    for mod in (m.head, m.blocks[0], m.inp, m.norm, m.blocks[1]):
        mod.double()  # the gradients are converted with their parameters; the first backward adds to them
    return m, {"grads_dtype": sorted({str(p.grad.dtype) for p in m.parameters()})}


def _float_roundtrip(rt, mesh, ref, rank, ws):
    m = _wrap(_titan(), _shard_fn(rt, mesh))
    m.norm.float()  # one module of the [norm, head] unit
    refused = _forward_error(m, rank, ws) if rt != "fsdp2" else None  # FSDP2 cannot go on after its refusal
    m.norm.double()
    return m, {"refused": refused}


def _replace_all(rt, mesh, ref, rank, ws):
    from torch.distributed.tensor import Shard, distribute_tensor

    m = _wrap(_titan(seed=1), _shard_fn(rt, mesh))  # other values, replaced below
    for name, mod in m.named_modules():
        for k in list(mod._parameters):
            key = f"{name}.{k}" if name else k
            setattr(mod, k, nn.Parameter(distribute_tensor(ref[key], mesh, [Shard(0)])))
    return m, {}


def _unshard_first(rt, mesh, ref, rank, ws):
    m = _wrap(_titan(), _shard_fn(rt, mesh))

    def unshard():  # after the optimizer took the (sharded) parameters, as a pipeline schedule runs
        handles = [b.unshard(async_op=True) for b in m.blocks] + [m.norm.unshard(async_op=True)]
        handles[0].wait()  # the others are waited by their units' forwards

    return m, {"before_first_forward": unshard}


FLOWS = {
    "to_empty": _to_empty,
    "to_empty_by_module": _to_empty_by_module,
    "to_float64": _to_float64,
    "double_by_module": _double_by_module,
    "meta_float64_materialize": _meta_float64_materialize,
    "to_empty_load_state_dict": _to_empty_load_state_dict,
    "to_empty_in_parts": _to_empty_in_parts,
    "part_to_empty_then_materialize": _part_to_empty_then_materialize,
    "double_by_module_with_grads": _double_by_module_with_grads,
    "float_roundtrip": _float_roundtrip,
    "replace_all": _replace_all,
    "unshard_first": _unshard_first,
}


# -- torch's reset_sharded_param_in_lazy_init: a meta parameter of the root replaced ----------
class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.pad = nn.Parameter(torch.zeros(5))  # so that the root's rows of weight_norm differ from the layers'
        self.weight_norm = nn.Parameter(torch.empty(3))

    @torch.no_grad()
    def init_weight_norm(self):
        norms = torch.linalg.norm(self.layer1.weight, dim=1) + torch.linalg.norm(self.layer2.weight, dim=1)
        self.weight_norm = nn.Parameter(norms)

    def forward(self, x):
        return self.layer2(self.layer1(x)).sum() + (self.weight_norm * self.weight_norm).sum() + self.pad.sum()


def _norm_net_values() -> dict:
    torch.manual_seed(3)
    return {"layer1.weight": torch.randn(3, 3, dtype=F64), "layer2.weight": torch.randn(3, 3, dtype=F64),
            "pad": torch.zeros(5, dtype=F64)}


def _weight_norm_case(rt, mesh, rank, ws):
    vals = _norm_net_values()
    shard = _shard_fn(rt, mesh)
    with torch.device("meta"):
        m = NormNet().double()
    shard(m.layer1)
    shard(m.layer2)
    shard(m)
    m.layer1.to_empty(device="cpu")
    m.layer2.to_empty(device="cpu")
    _copy_init(m.layer1, {"weight": vals["layer1.weight"]})
    _copy_init(m.layer2, {"weight": vals["layer2.weight"]})
    assert m.pad.is_meta and m.weight_norm.is_meta  # the root was never converted
    m.pad = nn.Parameter(_zeros_like(m.pad, mesh))
    m.init_weight_norm()
    saved = {k: full(v) for k, v in m.state_dict().items()}  # before the first forward takes it in
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank), dtype=F64)
    loss = m(x)
    loss.backward()
    t = loss.detach().clone()
    torch.distributed.all_reduce(t)
    return {"loss": t.item() / ws, "params": {k: full(p) for k, p in m.named_parameters()},
            "grads": {k: full(p.grad) for k, p in m.named_parameters()}, "saved": saved}


def _zeros_like(p, mesh):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(torch.zeros(p.shape, dtype=p.dtype), mesh, p.placements)


# -- refusals ---------------------------------------------------------------------------------
def _refusals(rt, mesh, rank, ws):
    out = {}
    m = _wrap(_titan(), _shard_fn(rt, mesh))
    m.head.weight = nn.Parameter(_titan().head.weight.detach().clone())  # a plain tensor
    out["plain_replacement"] = _forward_error(m, rank, ws)
    m = _wrap(_titan(), _shard_fn(rt, mesh))
    m.norm.float()
    out["two_dtypes"] = _forward_error(m, rank, ws)
    m = _wrap(_titan(), _shard_fn(rt, mesh))
    m.norm.float()
    m.to_empty(device="cpu")  # keeps every parameter's dtype: the norm's float32 too
    out["two_dtypes_after_to_empty"] = _forward_error(m, rank, ws)
    m = _wrap(_titan(device="meta"), _shard_fn(rt, mesh))
    for mod in (m.blocks[0], m.blocks[1], m.inp, m.norm):
        mod.to_empty(device="cpu")
    out["part_on_meta"] = _forward_error(m, rank, ws)
    m = _wrap(_titan(device="meta"), _shard_fn(rt, mesh))
    try:
        m.blocks[0].unshard()
        out["unshard_meta"] = None
    except Exception as e:  # noqa: BLE001
        out["unshard_meta"] = (type(e).__name__, str(e))
    return out


def _misc(rt, mesh, rank, ws):
    """A unit of several modules kept gathered after forward: its state dict is DTensors of the
    main weights (it gave the gathered plain tensors). A bf16 meta model after ``to_empty``
    computes in bf16 (it was rebuilt as an fp32 model, from its fp32 main weights' dtype)."""
    out = {}
    shard = _shard_fn(rt, mesh)
    m = _titan()
    for b in m.blocks:
        shard(b)
    shard([m.norm, m.head], reshard_after_forward=False)
    shard(m)
    x, _ = batch(0, GB, D_IN, dtype=F64)
    m(x[:2])
    sd = m.state_dict()
    out["gathered_state_dict"] = {k: (type(v).__name__, full(v)) for k, v in sd.items()}
    m = _wrap(_titan(device="meta", dtype=torch.bfloat16), shard)
    m.to_empty(device="cpu")
    _copy_init(m, {k: v.to(torch.bfloat16) for k, v in _reference_values().items()})
    y = m(x[:2].to(torch.bfloat16))
    out["bf16_output"] = (str(y.dtype), y.detach().float())
    m = _wrap(_titan(device="meta", dtype=torch.bfloat16), shard)
    m.to_empty(device="cpu")
    _copy_init(m, {k: v.to(torch.bfloat16) for k, v in _reference_values().items()})
    m.float()  # asks for a float32 model (whose parameters showed float32 main weights already)
    y = m(x[:2].float())
    out["bf16_float_output"] = (str(y.dtype), y.detach())
    return out


def _run(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    ref = _reference_values()
    out = {"flows": {}, "weight_norm": {}, "refusals": {}, "misc": {}}
    for flow, make in FLOWS.items():
        for rt in ("fsdp2",) + _ours(ws):
            try:
                model, info = make(rt, mesh, ref, rank, ws)
                out["flows"][(flow, rt)] = {**_train(model, rank, ws, info.pop("before_first_forward", None)), **info}
            except Exception:  # noqa: BLE001 - reported by the test, with the flow's name
                import traceback

                out["flows"][(flow, rt)] = {"error": traceback.format_exc()}
    for rt in ("fsdp2",) + _ours(ws):
        for key, case in (("weight_norm", _weight_norm_case), ("refusals", _refusals), ("misc", _misc)):
            try:
                out[key][rt] = case(rt, mesh, rank, ws)
            except Exception:  # noqa: BLE001
                import traceback

                out[key][rt] = {"error": traceback.format_exc()}
    return out
