"""Element-wise ``_foreach`` ops DTensor has no sharding rule for, on our row-sharded DTensors.

torch 2.11's DTensor has no rule for ``_foreach_sign_`` (``torch.optim.Rprop(foreach=True)``),
``_foreach_lerp_.ScalarList`` and ``_foreach_rsqrt_`` (``Adafactor(foreach=True)``) and some 80
more element-wise ``_foreach`` ops; torch 2.13 still lacks a few (``_foreach_addcdiv.Scalar``,
``_foreach_maximum_.Scalar``, ...). They raised "does not have a sharding strategy registered" on
mfsdp2 parameters, states and gradients. ``mfsdp2.dtensors.dtensor_ops`` runs them on the local pieces
when every DTensor of an index holds the same rows. Every result here is compared, on every rank,
with the op on the full tensors (float64, exactly: these ops compute each element alone), whether
or not the running torch has a rule for the op; ops mixing our rows with ``torch.chunk``'s must
not give a wrong value (a refusal is fine)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from mfsdp2 import fully_shard
from mfsdp2.base import compat
from mfsdp2.dtensors.placement import chunk_rows

from .._dist import run_ranks


def _inplace(fn):
    """Run an in-place foreach op on clones; return the clones."""

    def run(*lists):
        out = [[t.clone() for t in lists[0]]] + list(lists[1:])
        fn(*out)
        return out[0]

    return run


# name -> (op taking lists, op on full tensors per index, the aten overload it dispatches to)
_A = torch.ops.aten
OPS = {
    "sign_": (_inplace(lambda a, b: torch._foreach_sign_(a)), lambda a, b: torch.sign(a), _A._foreach_sign_.default),
    "rsqrt_": (_inplace(lambda a, b: torch._foreach_rsqrt_(a)), lambda a, b: torch.rsqrt(a.abs() + 1),
               _A._foreach_rsqrt_.default),
    "lerp_scalarlist_": (_inplace(lambda a, b: torch._foreach_lerp_(a, b, [0.25] * len(a))),
                         lambda a, b: torch.lerp(a, b, 0.25), _A._foreach_lerp_.ScalarList),
    "addcdiv_scalar": (lambda a, b: torch._foreach_addcdiv(a, b, [t.abs() + 1 for t in b], 0.5),
                       lambda a, b: torch.addcdiv(a, b, b.abs() + 1, value=0.5), _A._foreach_addcdiv.Scalar),
    "addcmul_tensor": (lambda a, b: torch._foreach_addcmul(a, b, b, torch.full((len(a),), 0.5, dtype=torch.float64)),
                       lambda a, b: torch.addcmul(a, b, b, value=0.5), _A._foreach_addcmul.Tensor),
    "maximum_scalar_": (_inplace(lambda a, b: torch._foreach_maximum_(a, 0.1)), lambda a, b: a.clamp(min=0.1),
                        _A._foreach_maximum_.Scalar),
    "minimum_scalarlist": (lambda a, b: torch._foreach_minimum(a, [0.1] * len(a)), lambda a, b: a.clamp(max=0.1),
                           _A._foreach_minimum.ScalarList),
    "add_tensor_": (_inplace(lambda a, b: torch._foreach_add_(a, torch.tensor(0.5, dtype=torch.float64))),
                    lambda a, b: a + 0.5, _A._foreach_add_.Tensor),
    "pow_scalar": (lambda a, b: torch._foreach_pow(a, 2.0), lambda a, b: a**2, _A._foreach_pow.Scalar),
}


def _model():
    torch.manual_seed(0)
    dims = [(4, 3), (3, 5), (5, 3), (3, 7)]
    return nn.Sequential(*(nn.Linear(i, o) for i, o in dims)).double()


def _run(rank, ws):
    model = _model()
    full = {k: p.detach().clone() for k, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (ws,))
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    a = [p.detach() for p in params.values()]
    b = [(p.detach() * 3).clone() for p in params.values()]  # same rows (row propagation)
    a_pos = [t.abs() + 1 for t in a]
    wrong, missing_rule = [], []
    for name, (on_lists, on_full, overload) in OPS.items():
        if not compat.dtensor_has_rule(overload):
            missing_rule.append(name)
        try:
            got = on_lists(a_pos if name == "rsqrt_" else a, b)
        except Exception as e:  # noqa: BLE001 (reported with the op's name)
            wrong.append((name, f"raised {type(e).__name__}: {e}"[:300]))
            continue
        for (k, p), g in zip(params.items(), got):
            want = on_full(full[k], full[k] * 3)
            if not isinstance(g, DTensor) or getattr(g.placements[0], "rows", None) != p.placements[0].rows:
                wrong.append((name, k, f"result placements {getattr(g, 'placements', None)}, not our rows"))
            elif g.shape != want.shape or not torch.equal(g.full_tensor(), want):
                wrong.append((name, k, "wrong value"))
    # With an operand split by torch.chunk (other rows): no wrong value; a refusal is fine.
    mixed = {}
    cases = {
        "lerp_ ours first": (lambda p, q: _inplace(lambda x, y: torch._foreach_lerp_(x, y, [0.25]))([p], [q])[0],
                             lambda f: torch.lerp(f, f * 3, 0.25)),
        "lerp_ chunk first": (lambda p, q: _inplace(lambda x, y: torch._foreach_lerp_(x, y, [0.25]))([q], [p])[0],
                              lambda f: torch.lerp(f * 3, f, 0.25)),
        "addcdiv": (lambda p, q: torch._foreach_addcdiv([p], [q], [q.abs() + 1], 0.5)[0],
                    lambda f: torch.addcdiv(f, f * 3, (f * 3).abs() + 1, value=0.5)),
    }
    for k, p in params.items():
        if p.dim() != 2 or tuple(p.placements[0].rows) == tuple(chunk_rows(p.shape[0], ws)):
            continue
        q = distribute_tensor(full[k] * 3, mesh, [Shard(0)])
        for case, (fn, on_full) in cases.items():
            try:
                res = fn(p.detach(), q)
            except Exception:  # noqa: BLE001 (DTensor's own refusal: every rank decides alike)
                mixed[(k, case)] = "refused"
                continue
            mixed[(k, case)] = "ran"
            if not torch.equal(res.full_tensor(), on_full(full[k])):
                wrong.append((case, k, "wrong value"))
    return wrong, missing_rule, mixed


def test_elementwise_foreach_ops_equal_the_full_tensor_op_on_our_rows():
    for rank, (wrong, missing_rule, mixed) in enumerate(run_ranks(_run, 2)):
        assert not wrong, f"rank {rank}: " + "\n".join(map(str, wrong))
        # Whatever the torch: some of these ops have no DTensor rule (2.13: addcdiv / addcmul /
        # maximum / minimum with scalars; 2.11: all of them), so the handler is what ran them.
        assert missing_rule, "every op has a DTensor rule on this torch: the cases prove nothing"
        assert mixed, "no parameter whose rows differ from torch.chunk's"
