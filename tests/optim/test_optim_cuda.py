"""``mfsdp2.optim.AdamW`` on CUDA parameters (skipped without a GPU; the CPU suite covers the
same code paths' arithmetic on the host).

On an accelerator the flat step is one ``torch._fused_adamw_`` launch per group over the flat
pieces: the same bits as ``torch.optim.AdamW(fused=True)`` on the same sharded parameters (the
fused kernel is elementwise, so how tensors are grouped does not change an element's result).
With ``state_dtype=torch.bfloat16`` the PyTorch path (``bf16_states.step_piece``) runs per piece:
the same bits as that function applied to the unsharded parameters on the same GPU. One spawned
process with a world-size-1 NCCL group (``tests/system/_cuda_process.run_cuda``), three real steps, two
param groups (weight decay on matrices; amsgrad and maximize on the rest).
"""

from __future__ import annotations

import pytest
import torch

from ..models import batch, build, loss_fn
from ..system._cuda_process import run_cuda

pytestmark = pytest.mark.cuda

HYPER = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False),
         dict(lr=5e-3, betas=(0.5, 0.9), eps=1e-6, weight_decay=0.0, amsgrad=True, maximize=True)]


def _groups(named):
    return [dict(params=[p for n, p in named if p.dim() >= 2], **HYPER[0]),
            dict(params=[p for n, p in named if p.dim() < 2], **HYPER[1])]


def _sharded(make_opt, steps: int = 3):
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp2 import fully_shard

    dev = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (1,))
    model = build("net").to(dev)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_opt(_groups(list(model.named_parameters())))
    grads = []
    for step in range(steps):
        x, y = batch(step, 8, 12)
        loss_fn(model(x.to(dev)), y.to(dev)).backward()
        grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    params = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
    states = {(n, k): (v.full_tensor() if k != "step" else v).cpu() for n, p in model.named_parameters()
              for k, v in opt.state[p].items()}
    return params, states, grads


def _fused_pair():
    from mfsdp2.optim import AdamW

    ours = _sharded(lambda groups: AdamW(groups))
    torch_fused = _sharded(lambda groups: torch.optim.AdamW(groups, fused=True))
    return ours[:2], torch_fused[:2]


def _bf16_pair():
    from mfsdp2.optim import AdamW
    from mfsdp2.optim.bf16_states import step_piece

    params, states, grads = _sharded(lambda groups: AdamW(groups, state_dtype=torch.bfloat16, seed=3))
    dev = torch.device("cuda", torch.cuda.current_device())
    ref = build("net").to(dev)
    named = list(ref.named_parameters())
    order = [(n, HYPER[0]) for n, p in named if p.dim() >= 2] + [(n, HYPER[1]) for n, p in named if p.dim() < 2]
    by_name = dict(named)
    st = {n: [torch.zeros_like(by_name[n], dtype=torch.bfloat16) for _ in range(3)] + [torch.zeros(())]
          for n, _ in order}
    for g in grads:
        for pid, (n, cfg) in enumerate(order):
            s = st[n]
            step_piece(by_name[n].detach(), g[n], s[0], s[1], s[2] if cfg["amsgrad"] else None, s[3], cfg, seed=3,
                       param_id=pid, first_elem=0)
    want_p = {n: p.detach().cpu() for n, p in named}
    want_s = {}
    for n, cfg in order:
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if cfg["amsgrad"] else ())
        want_s.update({(n, k): v.cpu() for k, v in zip(keys, st[n])})
        want_s[(n, "step")] = st[n][3]
    return (params, states), (want_p, want_s)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.flatten(), b.flatten()
    if a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        nan = a.isnan()
        return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]))
    return bool(torch.equal(a, b))


@pytest.mark.parametrize("which", ["fused", "bf16_states"])
def test_cuda_flat_adamw_bits(which):
    (params, states), (want_p, want_s) = run_cuda(_fused_pair if which == "fused" else _bf16_pair)
    assert set(params) == set(want_p) and set(states) == set(want_s), (sorted(states), sorted(want_s))
    bad = [n for n in params if not _same(params[n], want_p[n])]
    bad += [k for k in states if not _same(states[k].float() if k[1] == "step" else states[k],
                                           want_s[k].float() if k[1] == "step" else want_s[k])]
    assert not bad, bad
