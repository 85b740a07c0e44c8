"""State dicts and DCP of parameters with FSDP2's all-gather extension (torchao float8 training
weights, NF4), against torch FSDP2 in the same ranks.

``model.state_dict()`` holds, for such a parameter, what FSDP2's holds: a ``Shard(0)`` DTensor
over the ``torch.chunk`` piece whose local tensor is the subclass (compared by type, placement
and every inner tensor), also while the unit is gathered. DCP moves checkpoints both ways: saved
from mfsdp2 and loaded into FSDP2, and the reverse, with every parameter equal afterwards; the
loaded mfsdp2 model then trains on as the FSDP2 one does (one more step, losses equal). Full
model and optimizer state dicts (DSD's ``full_state_dict=True``) hold the same full tensors, and
the optimizer's loads back.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .._dist import run_ranks
from ..precision._torchao_cases import build, inner_tensors

pytest.importorskip("torchao")

pytestmark = pytest.mark.slow


def _shard(case: str, runtime: str, ws: int):
    from torch.distributed.device_mesh import init_device_mesh

    if runtime == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from mfsdp2 import fully_shard
    mesh = init_device_mesh("cpu", (ws,))
    model, d = build(case)
    for blk in model[:2]:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, d


def _step(model, d: int, rank: int, ws: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ws * 32, d, generator=g)[rank * 32 : (rank + 1) * 32]
    loss = model(x).float().pow(2).mean()
    loss.backward()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item()


def _describe(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, DTensor) and hasattr(v._local_tensor, "fsdp_pre_all_gather"):
            out[k] = (type(v._local_tensor).__name__, v.placements, tuple(v.shape), inner_tensors(v._local_tensor))
    return out


def _same_description(a: dict, b: dict) -> list:
    bad = []
    if set(a) != set(b) or not a:
        return [("keys", sorted(a), sorted(b))]
    for k in a:
        (ta, pa, sa, ia), (tb, pb, sb, ib) = a[k], b[k]
        if (ta, sa) != (tb, sb) or pa != pb or pa != (Shard(0),):
            bad.append((k, ta, tb, pa, pb))
        elif len(ia) != len(ib) or not all(torch.equal(x, y) for x, y in zip(ia, ib)):
            bad.append((k, "inner tensors differ"))
    return bad


def _run(rank: int, ws: int, case: str, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out = {}
    f, d = _shard(case, "fsdp2", ws)
    m, _ = _shard(case, "mfsdp2", ws)
    out["same_state_dict"] = _same_description(_describe(f.state_dict()), _describe(m.state_dict()))
    # While the blocks are gathered (explicit unshard), the state dict still holds the DTensors.
    for blk in (f[0], m[0]):
        blk.unshard()
    out["same_gathered"] = _same_description(_describe(f.state_dict()), _describe(m.state_dict()))
    for blk in (f[0], m[0]):
        blk.reshard()
    full_f = get_model_state_dict(f, options=StateDictOptions(full_state_dict=True))
    full_m = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
    out["full_keys"] = (sorted(full_f) == sorted(full_m))
    out["full_equal"] = [k for k in full_f if not all(
        torch.equal(x, y) for x, y in zip(inner_tensors(full_f[k]), inner_tensors(full_m[k])))]
    # Train each a step apart so the checkpoints differ from a fresh model, then move them over.
    for model in (f, m):
        _step(model, d, rank, ws, seed=3)
    dcp.save(m.state_dict(), checkpoint_id=f"{root}/from_mfsdp2")
    dcp.save(f.state_dict(), checkpoint_id=f"{root}/from_fsdp2")
    f2, _ = _shard(case, "fsdp2", ws)
    m2, _ = _shard(case, "mfsdp2", ws)
    sd = f2.state_dict()
    dcp.load(sd, checkpoint_id=f"{root}/from_mfsdp2")
    f2.load_state_dict(sd)
    sd = m2.state_dict()
    dcp.load(sd, checkpoint_id=f"{root}/from_fsdp2")
    m2.load_state_dict(sd)
    out["loaded_into_fsdp2"] = _same_description(_describe(m.state_dict()), _describe(f2.state_dict()))
    out["loaded_into_mfsdp2"] = _same_description(_describe(f.state_dict()), _describe(m2.state_dict()))
    out["losses"] = (_step(f2, d, rank, ws, seed=4), _step(m2, d, rank, ws, seed=4))
    out["optim"] = _optimizer_state_dicts(rank, ws, case)
    return out


def _optimizer_state_dicts(rank: int, ws: int, case: str) -> list:
    """Full optimizer state dicts (DSD) after 2 steps: the same entries, types and values as
    FSDP2's, and they load back (a resume)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict,
    )

    from ..precision._torchao_cases import train

    opts = StateDictOptions(full_state_dict=True)
    got = {}
    for rt in ("fsdp2", "mfsdp2"):
        r = train(case, rt, rank, ws, steps=2)
        osd = get_optimizer_state_dict(r["model"], r["opt"], options=opts)
        got[rt] = {k: {s: (type(v).__name__, inner_tensors(v)) for s, v in st.items() if isinstance(v, torch.Tensor)}
                   for k, st in osd["state"].items()}
        set_optimizer_state_dict(r["model"], r["opt"], osd, options=opts)
    bad = [] if set(got["fsdp2"]) == set(got["mfsdp2"]) else [("keys", sorted(got["fsdp2"]), sorted(got["mfsdp2"]))]
    for k, st in got["fsdp2"].items():
        for s, (t, inner) in st.items():
            mt, minner = got["mfsdp2"].get(k, {}).get(s, (None, []))
            if t != mt or len(inner) != len(minner) or not all(torch.equal(a, b) for a, b in zip(inner, minner)):
                bad.append((k, s, t, mt))
    return bad


@pytest.mark.parametrize("case", ["nf4", "float8"])
def test_state_dicts_and_dcp_as_fsdp2(case, tmp_path):
    for r in run_ranks(_run, 2, case, str(tmp_path), timeout=400):
        assert r["same_state_dict"] == [], r["same_state_dict"]
        assert r["same_gathered"] == [], r["same_gathered"]
        assert r["full_keys"] and r["full_equal"] == [], r["full_equal"]
        assert r["loaded_into_fsdp2"] == [], r["loaded_into_fsdp2"]
        assert r["loaded_into_mfsdp2"] == [], r["loaded_into_mfsdp2"]
        assert r["losses"][0] == r["losses"][1], r["losses"]
        assert r["optim"] == [], r["optim"]
