"""The other ways torch's checkpoint tools write and read a sharded state dict, as trainers and
their export scripts use them, on mfsdp2 and on torch FSDP2 in the same ranks:

* DCP's Hugging Face format (``HuggingFaceStorageWriter`` with ``save_distributed`` and
  consolidation: torchtitan's ``checkpoint.last_save_in_hf``), read back with safetensors and with
  ``HuggingFaceStorageReader`` into a fresh sharded model;
* ``format_utils.dcp_to_torch_save`` (the offline conversion of a DCP checkpoint to one
  ``torch.save`` file) and ``_load_state_dict_from_keys`` (a few keys of a checkpoint, in a process
  without a process group), model and optimizer.

What can go wrong: our pieces are row ranges of uneven sizes (``RowShard``), some empty, where
FSDP2's are ``Shard(0)`` chunks; every consumer above rebuilds full tensors from the chunk
offsets DCP recorded. Each must give the full state dict of the run, bit for bit, as it does for
FSDP2's checkpoint of the same training.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd

from .._dist import run_ranks
from ..models import make_opt
from .test_checkpoint import _assert_same, _sharded, _train

FULL = dsd.StateDictOptions(full_state_dict=True)
WS = 2
RUNTIMES = ("mfsdp2", "fsdp2")


def _clone(sd: dict) -> dict:
    return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in sd.items()}


def _rank(rank: int, ws: int, root: str) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    out = {}
    for runtime in RUNTIMES:
        fsdp2 = runtime == "fsdp2"
        model = _sharded("net", ws, fsdp2=fsdp2)
        opt = make_opt("adamw", model.parameters())
        _train(model, opt, 2, 0, rank, ws)
        full_model, full_optim = dsd.get_state_dict(model, opt, options=FULL)
        res = {"full_model": _clone(full_model),
               "full_optim": {k: _clone(v) for k, v in full_optim["state"].items()}}

        hf = f"{root}/{runtime}_hf"
        dcp.save(dsd.get_model_state_dict(model),
                 storage_writer=HuggingFaceStorageWriter(hf, save_distributed=True, enable_consolidation=True))
        dist.barrier()  # the consolidated file is written by rank 0
        res["safetensors"] = {}
        for f in sorted(os.listdir(hf)):
            if f.endswith(".safetensors"):
                res["safetensors"].update(load_file(os.path.join(hf, f)))
        fresh = _sharded("net", ws, seed=1, fsdp2=fsdp2)
        sd = dsd.get_model_state_dict(fresh)
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(hf))
        dsd.set_model_state_dict(fresh, sd)
        res["hf_loaded"] = _clone(dsd.get_model_state_dict(fresh, options=FULL))

        m_sd, o_sd = dsd.get_state_dict(model, opt)
        dcp.save({"model": m_sd, "optim": o_sd}, checkpoint_id=f"{root}/{runtime}_dcp")
        out[runtime] = res
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("formats"))
    return root, run_ranks(_rank, WS, root, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_hugging_face_format_consolidates_and_loads_back(runs, runtime):
    _, results = runs
    for rank, res in enumerate(results):
        r = res[runtime]
        if rank == 0:
            _assert_same(r["safetensors"], r["full_model"], f"{runtime}: consolidated safetensors")
        _assert_same(r["hf_loaded"], r["full_model"], f"{runtime} rank {rank}: loaded from the HF checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_offline_conversion_and_key_reads(runs, tmp_path, runtime):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    root, results = runs
    want = results[0][runtime]
    dcp_to_torch_save(f"{root}/{runtime}_dcp", str(tmp_path / "converted.pt"))
    converted = torch.load(tmp_path / "converted.pt", weights_only=False)
    _assert_same(converted["model"], want["full_model"], f"{runtime}: dcp_to_torch_save model")
    for fqn, states in want["full_optim"].items():
        _assert_same(converted["optim"]["state"][fqn], states, f"{runtime}: dcp_to_torch_save optimizer {fqn}")
    keys = {"model.head.weight", "model.blocks.1.fc1.bias"}
    part = _load_state_dict_from_keys(keys, checkpoint_id=f"{root}/{runtime}_dcp")
    _assert_same(part["model"], {k.split(".", 1)[1]: want["full_model"][k.split(".", 1)[1]] for k in keys},
          f"{runtime}: keys read from the checkpoint")
