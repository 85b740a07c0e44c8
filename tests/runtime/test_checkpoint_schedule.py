"""Activation checkpointing under the scheduler, inside FSDP units (the unit's hooks wrap a
checkpointed forward) and around whole FSDP modules (the hooks run inside the checkpointed region;
the reentrant flavour runs the forward under no_grad and recomputes it in backward).

For each of the four modes the model must train like the unsharded reference, gather each unit
once per forward and each block once per backward (the recompute reuses the backward's gather),
keep prefetching in backward once the order is recorded, and never mispredict. With an
``output_dtype`` mixed-precision policy, the recompute must cast the unit's output as the forward
did, or the non-reentrant checkpoint rejects the recomputed saved tensors.

The model, the unsharded reference and the rank-side runner are in ``_schedule_runs.py``; the
module-scoped fixture is one spawn of ranks that runs every mode.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from mfsdp2 import MixedPrecisionPolicy, fully_shard

from ..models import Block, assert_close_rel
from ._schedule_runs import BLOCKS, N_BLOCKS, N_UNITS, _pos, _spawn, assert_parity


# =================================================================================================
# activation checkpointing inside FSDP units and around whole FSDP modules
# =================================================================================================
CKPT_MODES = ["inside-reentrant", "inside-nonreentrant", "around-reentrant", "around-nonreentrant"]
CKPT = {m: dict(opt="adamw", batch=8, steps=4, ckpt=m) for m in CKPT_MODES}


def _mp_region(block, x):
    """A checkpointed region where an FSDP unit's (cast) output is saved by an op after it."""
    return torch.sin(block(x))


def _mp_region_inputs():
    torch.manual_seed(0)
    return Block(8, 16), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _run_mp_region(rank, ws, cfg):
    block, x = _mp_region_inputs()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    fully_shard(block, mesh=init_device_mesh("cpu", (ws,)), mp_policy=mp)
    x.requires_grad_()
    y = checkpoint(_mp_region, block, x, use_reentrant=False)
    y.sum().backward()
    return {"y": y.detach(), "x_grad": x.grad}


CKPT["mp_output_cast"] = dict(fn=_run_mp_region)


@pytest.fixture(scope="module")
def ckpt_run():
    return _spawn(CKPT)


@pytest.mark.parametrize("mode", CKPT_MODES)
def test_checkpoint_parity(ckpt_run, mode):
    assert_parity([r[mode] for r in ckpt_run], CKPT[mode])


def test_checkpoint_recompute_casts_outputs_like_forward(ckpt_run):
    """With ``output_dtype``, the recompute must produce what the forward produced (fp32 here, from
    bf16 compute), or the non-reentrant checkpoint rejects the recomputed saved tensors."""
    block, x = _mp_region_inputs()
    ref_block = block.to(torch.bfloat16)  # what the unit computes with: bf16 weights and inputs
    x.requires_grad_()
    y = torch.sin(ref_block(x.to(torch.bfloat16)).float())
    y.sum().backward()
    for rank, res in enumerate(r["mp_output_cast"] for r in ckpt_run):
        assert res["y"].dtype == torch.float32
        # The same casts on the same values: a bf16 rounding (2^-8 = 3.9e-3 relative) of any
        # intermediate differing would exceed 1e-3, so this asks for the same computation.
        assert_close_rel(res["y"], y.detach(), f"rank {rank} y", rel=1e-3)
        assert_close_rel(res["x_grad"], x.grad, f"rank {rank} x.grad", rel=1e-3)


@pytest.mark.parametrize("mode", CKPT_MODES)
def test_checkpoint_gathers_once_per_pass(ckpt_run, mode):
    """One all-gather per unit per forward, one per block per backward, none for the recompute."""
    for rank, res in enumerate(r[mode] for r in ckpt_run):
        for step, s in enumerate(res["steps"]):
            mb = s["micro"][0]
            where = (rank, step, mb["fwd_ag"], mb["ag"], mb["rs"])
            assert mb["fwd_ag"] == N_UNITS, where
            assert mb["ag"] == 1 + 2 * N_BLOCKS, where
            assert mb["rs"] == N_UNITS, where
            assert mb["bwd_peak_grad"] <= 2 and mb["live_weight_after_bwd"] == 0, where
            if mode.startswith("around"):
                # The recompute ran the FSDP module again inside backward (its hooks saw it) ...
                for b in BLOCKS:
                    assert ("forward_begin", b) in mb["bwd_events"], (where, mb["bwd_events"])
            if step >= 1:
                # ... and the backward still prefetches the next block in steady state.
                ev = mb["bwd_events"]
                for i in range(1, N_BLOCKS):
                    assert _pos(ev, "ag_issue", BLOCKS[i - 1]) < _pos(ev, "backward_begin", BLOCKS[i]), (where, ev)
        # Never a misprediction: the reentrant flavour around whole modules (whose forward runs
        # under no_grad, unhooked) is learned in step 0 and predicted from step 1 on.
        assert [s["mispredictions_after"] for s in res["steps"]] == [0] * len(res["steps"])
