"""CPU offload keeps the main state in host memory when the mesh is a GPU's: no DTensor mfsdp2
builds moves its local tensor to the mesh's device.

``DTensor.from_local`` moves a local tensor whose device type differs from the mesh's
(``local.to(mesh.device_type)``). With ``CPUOffloadPolicy`` on a CUDA mesh that made every
parameter a CUDA *copy* of its host main shard: the optimizer stepped the copy, gathers read the
untouched host shard, the model never trained, and ``StateDictOptions(cpu_offload=True)`` handed
back GPU tensors.

How this is reproduced without a GPU: the mesh is labelled ``"cuda"`` (``init_device_mesh("cuda",
...)`` over the gloo world group works on a CPU-only torch), and mfsdp2's choice of compute device
for it (``mfsdp2.comm.devices.mesh_compute_device``) is pointed at the CPU. Everything mfsdp2 allocates
then lives on the CPU, exactly as on a GPU machine, while torch's DTensor machinery sees a CUDA mesh:
any move of a local tensor to the mesh's device type raises "Torch not compiled with CUDA enabled".
gloo serves CPU tensors, so the collectives DTensor runs for ``full_tensor()`` work where they are.
On top of that every parameter's local tensor must *alias* its group's host main weights (storage
identity), every ``.grad`` its host main gradient, optimizer states must sit beside the parameters,
state dicts must hold host tensors sharing the main weights' storage, and the run must match an
unsharded float64 reference (so the optimizer stepped the weights the gathers read).

The single-process checks use a mesh labelled ``"meta"``: ``from_local`` silently turns a CPU local
into a meta tensor there, which the storage checks catch.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, build, loss_fn, make_opt, reference_run

STEPS = 3
GLOBAL_BATCH = 8

CASES = {
    "ZeRO-3": dict(sharding_strategy="optim_grads_params"),
    "ZeRO-2": dict(sharding_strategy="optim_grads"),
    "ZeRO-1": dict(sharding_strategy="optim"),
    "no_shard": dict(sharding_strategy="no_shard"),
    "HSDP 2x1": dict(mesh_shape=(2, 1)),
}


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storage_facts(model) -> list[str]:
    """Every parameter's (and gradient's) local tensor against its group's host main state."""
    from mfsdp2.runtime.state import unit_state

    bad = []
    for m in model.modules():
        st = unit_state(m)
        if st is None:
            continue
        for g in st.groups:
            for i, dp in enumerate(g.dist_params):
                name = f"{g.unit_name}[{i}]"
                local = dp._local_tensor
                if local.device.type != "cpu" or _ptr(local) != _ptr(g.main_weight):
                    bad.append(f"param {name}: local on {local.device}, not the host main weights")
                if dp.grad is not None:
                    gl = dp.grad._local_tensor
                    if gl.device.type != "cpu" or g.main_grad is None or _ptr(gl) != _ptr(g.main_grad):
                        bad.append(f"grad {name}: local on {gl.device}, not the host main gradient")
    return bad


def _run(rank, ws, case):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import DTensor

    from mfsdp2 import fully_shard
    from mfsdp2.comm import devices
    from mfsdp2.checkpoint import state_dict as msd

    torch.set_num_threads(1)
    kw = dict(CASES[case])
    shape = kw.pop("mesh_shape", (ws,))
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cuda", shape, mesh_dim_names=names)  # a GPU's mesh, over gloo
    assert mesh.device_type == "cuda"
    devices.mesh_compute_device = lambda m: torch.device("cpu")  # ... computing on the CPU here

    model = build("net", dtype=F64)
    off = CPUOffloadPolicy(pin_memory=False)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, offload_policy=off, **kw)
    fully_shard(model, mesh=mesh, offload_policy=off, **kw)
    out = {"bad": _storage_facts(model)}
    opt = make_opt("adamw", model.parameters())
    n = GLOBAL_BATCH // ws
    losses = []
    for step in range(STEPS):
        x, y = batch(step, GLOBAL_BATCH, model.inp.in_features, dtype=F64)
        loss = loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
        loss.backward()
        out["bad"] += _storage_facts(model)  # grads exposed: views of the host main gradient
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / ws)
    out["losses"] = losses
    out["bad"] += _storage_facts(model)
    by_param = {id(p): p for p in model.parameters()}
    for pid, (p, s) in enumerate((by_param[id(p)], s) for p, s in opt.state.items()):
        for k, v in s.items():
            if isinstance(v, DTensor) and (v._local_tensor.device != p._local_tensor.device
                                           or v.device_mesh is not p.device_mesh):
                out["bad"].append(f"optimizer state {k} of parameter {pid}: on {v._local_tensor.device}, not beside it")
            elif isinstance(v, torch.Tensor) and v.device.type != "cpu":
                out["bad"].append(f"optimizer state {k} of parameter {pid}: on {v.device}")

    params = dict(model.named_parameters())

    def check_sd(label, sd):
        for k, v in sd.items():
            if isinstance(v, DTensor) and k in params:
                if v._local_tensor.device.type != "cpu" or _ptr(v._local_tensor) != _ptr(params[k]._local_tensor):
                    out["bad"].append(f"{label} {k}: local on {v._local_tensor.device}, not the host main weights")

    check_sd("state_dict()", model.state_dict())
    out["full"] = {k: v.full_tensor() for k, v in params.items()}  # DTensor's own gather, over gloo
    if kw.get("sharding_strategy", "no_shard") == "no_shard" or len(shape) == 2:
        return out  # the mfsdp2.checkpoint.state_dict helpers take 1-D row-sharded layouts only
    check_sd("cpu_offload=True", msd.get_model_state_dict(model, options=StateDictOptions(cpu_offload=True)))
    osd = msd.get_optimizer_state_dict(model, opt, options=StateDictOptions(cpu_offload=True))
    for s in osd["state"].values():
        for k, v in s.items():
            loc = v._local_tensor if isinstance(v, DTensor) else v
            if isinstance(loc, torch.Tensor) and loc.device.type != "cpu":
                out["bad"].append(f"optimizer state dict {k}: on {loc.device}")
    full = msd.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["full_sd"] = {k: v.clone() for k, v in full.items()}
    # Loading a full state dict writes into the host main weights (the parameters stay theirs).
    full_all = msd.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    msd.set_model_state_dict(model, {k: v * 0.5 for k, v in full_all.items()},
                             options=StateDictOptions(full_state_dict=True))
    out["bad"] += _storage_facts(model)
    after = msd.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["halved"] = all(torch.equal(after[k], full_all[k] * 0.5) for k in full_all)
    return out


def _run_all(rank, ws):
    return {case: _run(rank, ws, case) for case in CASES}  # one launch for every case


@pytest.mark.slow
def test_offload_keeps_main_state_on_host_under_a_gpu_mesh():
    ref_losses, ref_params = reference_run("net", "adamw", STEPS, GLOBAL_BATCH, dtype=F64)
    per_rank = run_ranks(_run_all, 2)
    for case in CASES:
        results = [r[case] for r in per_rank]
        for rank, r in enumerate(results):
            assert r["bad"] == [], f"{case} rank {rank}: {r['bad'][:6]}"
            assert r.get("halved", True), f"{case} rank {rank}: loading a full state dict did not reach the parameters"
            for a, b in zip(r["losses"], ref_losses):
                assert abs(a - b) <= REL_F64 * abs(b), f"{case}: loss {a} vs reference {b}"
        for key in ("full", "full_sd"):
            full = results[0].get(key)
            if full is None:
                continue
            assert set(full) == set(ref_params), case
            for k, ref in ref_params.items():
                assert full[k].device.type == "cpu", (case, key, k)
                assert_close_rel(full[k], ref, f"{case} {key} {k}", REL_F64)


# -- single process: the wrapping helpers on a mesh of another device type ------------------------


@pytest.fixture
def one_rank_group():
    import os

    import torch.distributed as dist

    from .._dist import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_wrapping_helpers_never_move_the_local_tensor(one_rank_group, monkeypatch):
    """Each helper that builds a DTensor around a local tensor wraps that very tensor, on a mesh
    whose device type differs from the tensor's (``from_local`` would hand back a meta copy)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    from mfsdp2.checkpoint._common import relabel_rows
    from mfsdp2.dtensors.dtensor_ops import _stand_in
    from mfsdp2.dtensors.placement import RowShard, communicable, data_parallel_dtensor, wrap_local
    from mfsdp2.dtensors.tensor_parallel import TPSpec, tp_dtensor

    mesh = DeviceMesh.from_group(one_rank_group, "meta")
    local = torch.arange(6.0).view(3, 2)
    made = {
        "wrap_local": wrap_local(local, mesh, [Replicate()], (3, 2), (2, 1)),
        "data_parallel_dtensor": data_parallel_dtensor(local, mesh, [3], (3, 2), 0),
        "tp_dtensor": tp_dtensor(local, TPSpec(mesh, (Replicate(),), torch.Size((3, 2)))),
    }
    like = made["data_parallel_dtensor"]
    made["relabel_rows"] = relabel_rows(local, like, (3,))
    for name, d in made.items():
        assert isinstance(d, DTensor) and d.device_mesh is mesh, name
        assert d._local_tensor is local, f"{name}: the local tensor was replaced ({d._local_tensor.device})"
        assert d.shape == (3, 2) and d.stride() == (2, 1), name
    assert isinstance(made["data_parallel_dtensor"].placements[0], RowShard)
    stand_in = _stand_in(like, 7.0)
    assert stand_in._local_tensor.device.type == "cpu" and stand_in.shape == like.shape
    # A group that runs collectives on the CPU (gloo) communicates the host tensor where it is;
    # one without a CPU backend (NCCL alone) gets it moved to the mesh's device first.
    assert communicable(like) is like
    monkeypatch.setattr("mfsdp2.dtensors.placement.group_backend", lambda group, device_type: None)
    monkeypatch.setattr(DTensor, "to", lambda self, *args, **kwargs: ("moved to", args))
    assert communicable(like) == ("moved to", ("meta",))


def test_no_dtensor_from_local_outside_wrap_local():
    """Every DTensor mfsdp2 builds around a local tensor goes through ``placement.wrap_local``:
    ``DTensor.from_local`` / ``distribute_tensor`` move the local tensor to the mesh's device, the
    bug above. (torch's own ``distribute_tensor`` on the user's full tensors is wrapped, not
    reimplemented, in row_splits.py, and keeps torch's semantics.)"""
    root = pathlib.Path(__file__).resolve().parents[2] / "mfsdp2"
    found = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            for call in (c for c in ast.walk(fn) if isinstance(c, ast.Call)):
                f = call.func
                if isinstance(f, ast.Attribute) and f.attr == "from_local" and not (
                    path.name == "placement.py" and fn.name == "wrap_local"
                ):
                    found.add(f"{path.relative_to(root.parent)}:{call.lineno}")
    assert not found, f"DTensor.from_local outside placement.wrap_local: {sorted(found)}"
