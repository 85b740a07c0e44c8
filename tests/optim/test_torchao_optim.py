"""torchao's low-bit AdamW (8-bit, 4-bit: quantised optimizer states, a compiled step per
parameter) over mfsdp2's row shards.

* Against FSDP2 on a model where the two runtimes shard differently (mfsdp2 keeps each matrix
  whole on one rank, FSDP2 halves both): torchao quantises each rank's piece of a state in blocks
  of its own, and with rows that are whole blocks the blocks are the same whichever rank holds
  them, so parameters and states after 3 steps agree bit for bit (docs/optim.md, "torchao's
  low-bit optimizers").
* Full optimizer state dicts (``get_optimizer_state_dict(full_state_dict=True)``): each state's
  ``full_tensor()`` gathers a quantised piece through ops the subclass implements.
* ``torch.compile`` with one inductor cache shared by the ranks of the machine (torch's default),
  launched twice (cold, then warm) at 2 and 4 ranks, whose shards differ in shape across ranks:
  no rank loads another's graph, and the warm launch gives the cold one's results bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from .._dist import run_ranks

pytest.importorskip("torchao")

pytestmark = pytest.mark.slow



class _Net(nn.Module):
    """Two (64, 256) matrices: 16384 elements each, rows of 256 (one 8-bit block, two 4-bit ones)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Parameter(torch.randn(64, 256) / 16)
        self.b = nn.Parameter(torch.randn(64, 256) / 16)

    def forward(self, x):
        return torch.tanh(x @ self.a.t()) @ self.b


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if hasattr(t, "dequantize") and type(t) is not torch.Tensor else t


def _train(runtime: str, rank: int, ws: int, optim: str, steps: int = 3):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.optim import AdamW4bit, AdamW8bit

    if runtime == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from mfsdp2 import fully_shard
    model = _Net()
    fully_shard(model, mesh=init_device_mesh("cpu", (ws,)))
    opt = {"8bit": AdamW8bit, "4bit": AdamW4bit}[optim](model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(ws * 4, 256, generator=g)[rank * 4 : (rank + 1) * 4]
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    states = {n: {k: _plain(v.full_tensor()) for k, v in opt.state[p].items() if k != "step"}
              for n, p in model.named_parameters()}
    quantised = {n: type(opt.state[p]["exp_avg"].to_local()).__name__ for n, p in model.named_parameters()}
    local_rows = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
    full_sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    sd_states = {k: {s: _plain(v) for s, v in st.items() if s != "step"} for k, st in full_sd["state"].items()}
    return {"losses": losses, "params": params, "states": states, "quantised": quantised,
            "local_rows": local_rows, "sd_states": sd_states}


def _both(rank: int, ws: int, optim: str, cache: str):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    return _train("fsdp2", rank, ws, optim), _train("mfsdp2", rank, ws, optim)


def _compiled(rank: int, ws: int, optim: str, cache: str):
    """mfsdp2 alone (a warm launch over ``cache``)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    out = _train("mfsdp2", rank, ws, optim)
    import torch._functorch.config as fc

    out["autograd_cache"] = fc.enable_autograd_cache
    return out


def _same_run(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), n
        for k in a["states"][n]:
            assert torch.equal(a["states"][n][k], b["states"][n][k]), (n, k)


def test_low_bit_adamw_matches_fsdp2_where_shards_differ_then_warm_cache(tmp_path):
    """World size 2, 8-bit AdamW: FSDP2 and mfsdp2 in one launch on a fresh inductor cache shared
    by the ranks (mfsdp2's compile is the cold one), then mfsdp2 again on the warm cache."""
    res = run_ranks(_both, 2, "8bit", str(tmp_path), timeout=600)
    rows = [(f["local_rows"], m["local_rows"]) for f, m in res]
    # The layouts differ: FSDP2 halves each matrix, mfsdp2 keeps each whole on one rank.
    assert rows[0] == ({"a": 32, "b": 32}, {"a": 64, "b": 0}), rows
    assert rows[1] == ({"a": 32, "b": 32}, {"a": 0, "b": 64}), rows
    for f, m in res:
        # Each piece of >= 4096 elements is quantised (torchao's rule per rank); mfsdp2's empty
        # pieces hold plain (empty) states.
        assert set(f["quantised"].values()) == {"OptimState8bit"}
        _same_run(f, m)
        assert set(f["sd_states"]) == set(m["sd_states"]) == {"a", "b"}
        for n in f["sd_states"]:
            for k in f["sd_states"][n]:
                assert torch.equal(f["sd_states"][n][k], m["sd_states"][n][k]), (n, k)
                assert torch.equal(m["sd_states"][n][k], m["states"][n][k]), (n, k)
    assert any(os.scandir(tmp_path)), "nothing was cached"
    warm = run_ranks(_compiled, 2, "8bit", str(tmp_path), timeout=600)
    for (_, cold), w in zip(res, warm):
        assert w["autograd_cache"] is False
        _same_run(cold, w)


def test_compile_with_one_shared_cache_at_4_ranks(tmp_path):
    """World size 4, 4-bit AdamW: launched twice over one fresh inductor cache (cold, warm); the
    ranks' pieces differ in shape, the warm launch gives the cold one's results bit for bit and
    the full optimizer state dict holds each state's gathered values."""
    cold = run_ranks(_compiled, 4, "4bit", str(tmp_path), timeout=600)
    warm = run_ranks(_compiled, 4, "4bit", str(tmp_path), timeout=600)
    shapes = {tuple(sorted(r["local_rows"].items())) for r in cold}
    assert len(shapes) > 1, shapes  # ranks hold pieces of different shapes of the same parameters
    for c, w in zip(cold, warm):
        _same_run(c, w)
        for n in c["sd_states"]:
            for k in c["sd_states"][n]:
                assert torch.equal(c["sd_states"][n][k], c["states"][n][k]), (n, k)
