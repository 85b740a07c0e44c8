"""``torch.amp.GradScaler`` over an mfsdp2 model behaves as over FSDP2: a normal step unscales
and steps to FSDP2's weights, and a non-finite gradient on *one* rank's shard makes every rank
skip the step and halve the scale (a rank that stepped while another skipped would silently
desynchronise the replicas). Same process, same model and data; float64 weights, so the stepped
weights agree to REL_F64."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from . import sharded_pair
from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel, batch, loss_fn, make_opt

WS, GB = 2, 8


def _run(rank, ws):
    out = {}
    for name, model in sharded_pair(init_device_mesh("cpu", (ws,))).items():
        opt = make_opt("sgd", model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        record = []
        for step in range(2):
            x, y = batch(step, GB, model.inp.in_features, dtype=F64)
            n = GB // ws
            scaler.scale(loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])).backward()
            if step == 1:  # an inf on one rank's piece only
                w = model.blocks[1].fc1.weight
                holder = max(r for r, k in enumerate(_rows(w)) if k > 0)
                if rank == holder:
                    w.grad.to_local().view(-1)[0] = float("inf")
            before = {k: p.full_tensor() for k, p in model.named_parameters()}
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            after = {k: p.full_tensor() for k, p in model.named_parameters()}
            record.append((scaler.get_scale(), any(not torch.equal(before[k], after[k]) for k in before), after))
        out[name] = record
    return out


def _rows(p):
    """Rows per rank of a parameter sharded on dim 0 (either runtime)."""
    shapes = [None] * p.device_mesh.size()
    torch.distributed.all_gather_object(shapes, tuple(p.to_local().shape))
    return [s[0] for s in shapes]


def test_grad_scaler_steps_and_skips_like_fsdp2():
    for out in run_ranks(_run, WS):
        (s1, stepped1, w1), (s2, stepped2, w2) = out["fsdp2"][0], out["mfsdp2"][0]
        assert stepped1 and stepped2 and s1 == s2 == 1024.0
        for k, w in w1.items():
            assert_close_rel(w2[k], w, f"step 0 {k}", REL_F64)
        (s1, stepped1, _), (s2, stepped2, _) = out["fsdp2"][1], out["mfsdp2"][1]
        assert not stepped1 and not stepped2, "a rank stepped past a non-finite gradient on another rank"
        assert s1 == s2 == 512.0
