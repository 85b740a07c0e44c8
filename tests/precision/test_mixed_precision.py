"""MixedPrecisionPolicy: parameters of several dtypes in one module (one group per dtype; FSDP2
refuses this), ``cast_forward_inputs`` and ``output_dtype``, and the main dtypes."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import MixedPrecisionPolicy, fully_shard

from .._dist import run_ranks
from ..models import assert_close_rel, batch, loss_fn, rel_dist

STEPS = 5
GLOBAL_BATCH = 8


class TwoDtypes(nn.Module):
    """fp32 layers around a bf16 layer, all in one unit."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 16)
        self.b = nn.Linear(16, 16).to(torch.bfloat16)
        self.c = nn.Linear(16, 5)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h.to(torch.bfloat16))).float()
        return self.c(h)


def _reference(micro: int):
    """Unsharded; each step's batch in ``micro`` equal micro-batches whose grads accumulate in the
    parameters' own dtypes (bf16 for ``b``), as a sharded run at world size ``micro`` averages them."""
    torch.set_num_threads(1)
    model = TwoDtypes()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    n = GLOBAL_BATCH // micro
    for step in range(STEPS):
        x, y = batch(step, GLOBAL_BATCH, 12)
        for r in range(micro):
            (loss_fn(model(x[r * n : (r + 1) * n]), y[r * n : (r + 1) * n]) / micro).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _two_dtypes(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    model = TwoDtypes()
    # main_params_dtype=None: each parameter's optimizer copy keeps its own dtype, as in the reference.
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(main_params_dtype=None))
    groups = model._mfsdp2_state.groups
    dtypes = sorted(str(g.orig_dtype) for g in groups)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    n = GLOBAL_BATCH // ws
    for step in range(STEPS):
        x, y = batch(step, GLOBAL_BATCH, 12)
        loss_fn(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        opt.step()
        opt.zero_grad()
    return dtypes, {k: p.full_tensor() for k, p in model.named_parameters()}


def test_parameters_of_two_dtypes_in_one_module_train_like_the_reference():
    # The reference with the ranks' micro-batches; the tolerance is 4x its distance to the same
    # training on the whole batch at once (an equally legitimate order of the bf16 gradient sums).
    # The sharded run reduces in yet another order (bf16 all-reduce of the two ranks' grads), and
    # lands about one such spread from either reference: 4x leaves room for that on any machine,
    # while a lost or doubled micro-batch moves the weights by percents.
    ref = _reference(2)
    whole = _reference(1)
    tol = {k: 4 * rel_dist(whole[k], r) for k, r in ref.items()}
    for rank, (dtypes, full) in enumerate(run_ranks(_two_dtypes, 2)):
        assert dtypes == ["torch.bfloat16", "torch.float32"], dtypes
        for name, r in ref.items():
            assert_close_rel(full[name], r, f"rank {rank} {name}", tol[name])  # dtypes compared too


def _casts(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    seen = {}
    out = {}
    for cast in (True, False):
        model = nn.Sequential(nn.Linear(12, 8), nn.Linear(8, 3))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float64, cast_forward_inputs=cast)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        model.register_forward_pre_hook(lambda m, args, cast=cast: seen.__setitem__(cast, args[0].dtype))
        x = torch.randn(4, 12)
        try:
            out[cast] = model(x).dtype
        except RuntimeError:  # fp32 input meets bf16 weights: the caller asked not to cast
            out[cast] = None
    return seen, out


def test_cast_forward_inputs_and_output_dtype():
    seen, out = run_ranks(_casts, 2)[0]
    assert seen[True] == torch.bfloat16 and out[True] == torch.float64
    assert seen[False] == torch.float32 and out[False] is None


def test_policy_is_frozen_and_copyable():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert copy.deepcopy(mp) == mp and hash(mp) == hash(copy.copy(mp))
    try:
        mp.param_dtype = torch.float16  # type: ignore[misc]
    except Exception as e:
        assert "cannot assign" in str(e)
    else:
        raise AssertionError("MixedPrecisionPolicy must be frozen")
    assert dist.is_available()
