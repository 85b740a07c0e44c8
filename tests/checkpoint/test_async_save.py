"""``torch.distributed.checkpoint.async_save`` of mfsdp2 state dicts, as torchtitan's
``checkpoint.async_mode`` runs it: DSD's ``get_state_dict``, the save staged and written in the
background (a thread, or torch's checkpointing process) over a gloo group of its own, training
going on while it is in flight.

What can go wrong: the stager copies every tensor to host memory before ``async_save`` returns,
telling a DTensor wrapper from a plain tensor by ``data_ptr() == 0``. Our parameters' local
tensors are views into flat shards, and a DTensor wrapper takes its local tensor's storage offset,
so without :func:`mfsdp2.dtensors.placement.offset_free` on the state-dict entries the stager reads
the wrappers' absent storage and fails ("invalid python storage"). The flat AdamW's states are
views of flat buffers too. And the copy must be taken before the next step writes the weights: a
checkpoint holding a torn or later state would resume silently wrong.

Each case: two steps, ``async_save``, a third step while the save is in flight, then the
checkpoint loaded into a fresh model and optimizer (trained one step on other weights, so its
states exist and differ) must equal the step-2 state bit for bit, model and optimizer. torch
FSDP2 runs the same case in the same ranks, and each runtime loads the other's checkpoint.

``copy.deepcopy(model.state_dict())`` (a "best weights so far" copy) goes through the same test in
``Tensor.__deepcopy__``: each case also takes one before the save and checks it still holds the
step-2 weights after the third step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd

from mfsdp2.checkpoint.state_dict import tensors_by_path

from .._dist import run_ranks
from ..models import make_opt
from .test_checkpoint import _assert_same, _sharded, _train

FULL = dsd.StateDictOptions(full_state_dict=True)
WS = 2
CASES = {  # name: (runtime, optimizer, executor)
    "fsdp2": ("fsdp2", "torch", "thread"),
    "mfsdp2": ("mfsdp2", "torch", "thread"),
    "mfsdp2_flat_adamw": ("mfsdp2", "flat", "thread"),
    "mfsdp2_process": ("mfsdp2", "torch", "process"),
}


def _build(runtime: str, optimizer: str, seed: int):
    model = _sharded("net", WS, seed=seed, fsdp2=runtime == "fsdp2")
    if optimizer == "flat":
        from mfsdp2.optim import AdamW

        return model, AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, make_opt("adamw", model.parameters())


def _snapshot(model, opt) -> dict:
    full = dsd.get_state_dict(model, opt, options=FULL)
    return {k: v.detach().clone() for k, v in tensors_by_path(full).items()}


def _loaded(runtime: str, optimizer: str, path: str, rank: int) -> dict:
    """A fresh model and optimizer with states of their own, then the checkpoint at ``path``."""
    model, opt = _build(runtime, optimizer, seed=1)
    _train(model, opt, 1, 5, rank, WS)
    m_sd, o_sd = dsd.get_state_dict(model, opt)
    sd = {"model": m_sd, "optim": o_sd}
    dcp.load(sd, checkpoint_id=path)
    dsd.set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return _snapshot(model, opt)


def _rank(rank: int, ws: int, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    saver_group = dist.new_group(backend="gloo")  # the background save's collectives (torchtitan's)
    out = {}
    for name, (runtime, optimizer, executor) in CASES.items():
        model, opt = _build(runtime, optimizer, seed=0)
        _train(model, opt, 2, 0, rank, ws)
        at_save = _snapshot(model, opt)
        m_sd, o_sd = dsd.get_state_dict(model, opt)
        kept = copy.deepcopy(model.state_dict())
        kind = AsyncCheckpointerType.PROCESS if executor == "process" else AsyncCheckpointerType.THREAD
        future = dcp.async_save({"model": m_sd, "optim": o_sd}, checkpoint_id=f"{root}/{name}",
                                process_group=saver_group, async_checkpointer_type=kind)
        _train(model, opt, 1, 2, rank, ws)  # writes the weights and states the save was given
        future.result()
        out[name] = {"at_save": at_save, "after": _snapshot(model, opt),
                     "deepcopy": {k: v.full_tensor() for k, v in kept.items()},
                     "loaded": _loaded(runtime, optimizer, f"{root}/{name}", rank)}
    # Each runtime loads the other's checkpoint (torch's AdamW on both sides).
    out["fsdp2_from_mfsdp2"] = _loaded("fsdp2", "torch", f"{root}/mfsdp2", rank)
    out["mfsdp2_from_fsdp2"] = _loaded("mfsdp2", "torch", f"{root}/fsdp2", rank)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_rank, WS, str(tmp_path_factory.mktemp("async_save")), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_async_checkpoint_holds_the_state_at_save_time(runs, case):
    for rank, res in enumerate(runs):
        r = res[case]
        changed = [k for k in r["at_save"] if not torch.equal(r["at_save"][k], r["after"][k])]
        assert changed, f"rank {rank}: the step after the save changed nothing: the test has no signal"
        _assert_same(r["loaded"], r["at_save"], f"{case} rank {rank}")
        model_at_save = {k[1:]: v for k, v in r["at_save"].items() if k[0] == 0}  # (model, optimizer)
        _assert_same({(k,): v for k, v in r["deepcopy"].items()}, model_at_save, f"{case} rank {rank}: deep copy")


@pytest.mark.slow
def test_async_checkpoints_load_across_runtimes(runs):
    for rank, res in enumerate(runs):
        _assert_same(res["fsdp2_from_mfsdp2"], res["mfsdp2"]["at_save"], f"FSDP2 from mfsdp2's checkpoint, rank {rank}")
        _assert_same(res["mfsdp2_from_fsdp2"], res["fsdp2"]["at_save"], f"mfsdp2 from FSDP2's checkpoint, rank {rank}")
