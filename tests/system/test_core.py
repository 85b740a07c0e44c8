"""Core runtime properties: zero-copy gather, non-aliasing reduce-scatter, DTensor semantics of
the optimizer-facing parameters, empty pieces, once-per-step casts, manual unshard/reshard and
clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from mfsdp2 import MixedPrecisionPolicy, RowShard, fully_shard
from mfsdp2.comm.communicator import tensors_overlap

from .._dist import run_ranks
from ..models import (
    F64, REL_F64, Net, assert_close_rel, assert_losses_close, batch, build, loss_fn, make_opt, same_cast_tolerances,
)


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _zero_copy_and_alias(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net")
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_all_reduce_bucket_cap_mb(0)  # the reduce-scatter itself is checked (not a shared bucket)
    block = model.blocks[0]
    group = block._mfsdp2_state.groups[0]
    block.unshard()
    buf = group.weights.unsharded
    lo, hi = _storage_span(buf)
    # Every registered (unsharded) parameter is a view into the gathered buffer: zero copy.
    for name, p in block.named_parameters():
        assert not hasattr(p, "placements"), name
        assert p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), name
        a, b = _storage_span(p)
        assert lo <= a and b <= hi, name
    # ... at the offsets the layout planned, holding the full parameter values.
    full = {n: p.detach().clone() for n, p in block.named_parameters()}
    block.reshard()
    for n, p in block.named_parameters():
        assert torch.equal(p.full_tensor(), full[n]), n
    assert group.weights.unsharded.untyped_storage().nbytes() == 0  # freed after reshard

    # Reduce-scatter writes a separate output: it never aliases its input.
    x, y = batch(0, 2 * ws, 12)
    seen = []
    orig = group.weights.comm.reduce_scatter

    def spy(out, inp, op=dist.ReduceOp.AVG, scratch=None, label=""):
        overlap = tensors_overlap(out, inp)
        if scratch is not None:  # gloo's p2p path receives into scratch: it must alias neither
            overlap = overlap or tensors_overlap(scratch, inp) or tensors_overlap(scratch, out)
        seen.append((overlap, out.numel(), inp.numel()))
        return orig(out, inp, op, scratch, label)

    group.weights.comm.reduce_scatter = spy
    loss_fn(model(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]).backward()
    assert seen and all(not overlap for overlap, _, _ in seen)
    assert all(n_in == ws * n_out for _, n_out, n_in in seen)
    # And the guard refuses an aliasing call outright.
    t = torch.zeros(4 * ws)
    try:
        orig(t[:4], t)
    except RuntimeError as e:
        assert "overlaps its input" in str(e)
    else:
        raise AssertionError("aliasing reduce-scatter was not refused")
    return True


def test_zero_copy_gather_and_non_aliasing_reduce_scatter():
    assert all(run_ranks(_zero_copy_and_alias, 2))


def _dtensor_semantics(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.LayerNorm(3))
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.LayerNorm(3))
    model.load_state_dict(ref.state_dict())
    fully_shard(model, mesh=mesh)
    out = {}
    for name, p in model.named_parameters():
        r = ref.get_parameter(name).detach()
        (pl,) = p.placements
        assert isinstance(pl, RowShard) and pl.dim == 0 and sum(pl.rows) == r.shape[0]
        assert tuple(p.shape) == tuple(r.shape)
        assert torch.equal(p.full_tensor(), r), name
        assert torch.equal(p.redistribute(mesh, [Replicate()]).to_local(), r), name
        if r.dim() == 2:  # through a full tensor onto torch.chunk splits of another dim
            s1 = p.redistribute(mesh, [Shard(1)])
            chunks = r.chunk(ws, dim=1)
            expect = chunks[rank] if rank < len(chunks) else r[:, :0]
            assert torch.equal(s1.to_local(), expect), name
        # DCP chunk metadata: the rows this rank really holds.
        shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)
        local = p.to_local()
        assert tuple(shape) == tuple(local.shape)
        assert torch.equal(r[offset[0] : offset[0] + shape[0]], local), name
        out[name] = pl.rows
    # An optimizer state created like Adam's (zeros_like, then in-place updates) keeps the true
    # row split. (Out-of-place ops come back labelled plain Shard(0): see placement.py.)
    p = next(model.parameters())
    st = torch.zeros_like(p)
    st.add_(1)
    assert st.placements == p.placements and isinstance(st.placements[0], RowShard)
    assert st.full_tensor().sum().item() == p.numel()
    return out


def test_dtensor_params_full_tensor_redistribute_and_chunk_metadata():
    rows = run_ranks(_dtensor_semantics, 4)
    assert rows[0] == rows[1]
    # The split is genuinely not torch.chunk's for some parameter (otherwise this proves little).
    def chunk_rows(n):
        c = [len(x) for x in torch.arange(n).chunk(4)]
        return tuple(c + [0] * (4 - len(c)))

    assert any(r != chunk_rows(sum(r)) for r in rows[0].values()), rows[0]


def _empty_pieces(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    model = build("tiny")
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-2, foreach=True)
    x, y = batch(0, 8, 3)
    loss_fn(model(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]).backward()
    empty = []
    for name, p in model.named_parameters():
        if p.to_local().numel() == 0:
            empty.append(name)
        # Every rank has a grad, an empty one where it holds no rows (as torch FSDP2).
        assert p.grad is not None and p.grad.to_local().shape == p.to_local().shape, name
    opt.step()
    return empty


def test_empty_pieces_get_empty_grads():
    empties = run_ranks(_empty_pieces, 4)
    assert any(empties), "the tiny model should leave some rank without rows of some parameter"


def _bf16_cast_once(rank, ws, strategy):
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp, sharding_strategy=strategy)
    fully_shard(model, mesh=mesh, mp_policy=mp, sharding_strategy=strategy)
    opt = make_opt("adamw", model.parameters())
    groups = [g for m in model.modules() if hasattr(m, "_mfsdp2_state") for g in m._mfsdp2_state.groups]
    assert all(g.main_weight.dtype == torch.float32 and g.weights.dtype == torch.bfloat16 for g in groups)
    casts0 = [g.casts for g in groups]
    losses = []
    for step in range(BF16_STEPS):
        x, y = batch(step, 8, 12)
        out = model(x[rank * 4 : rank * 4 + 4])
        assert out.dtype == torch.bfloat16
        loss = loss_fn(out.float(), y[rank * 4 : rank * 4 + 4])
        loss.backward()
        for p in model.parameters():
            assert p.grad is None or p.grad.dtype == torch.float32
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / ws)
    if strategy == "optim_grads":
        # Persistent weights: one cast into the local slice per gather, and a gather only after a
        # change: the first forward's (no cast at construction, the init may follow) and one per
        # optimizer step whose result is used (the last step's is not gathered here).
        assert casts0 == [0] * len(groups), casts0
        assert [g.casts for g in groups] == [BF16_STEPS] * len(groups), [g.casts for g in groups]
    else:
        # ZeRO-3 keeps no bf16 copy between gathers (as FSDP2): the gather input is the main shard
        # cast on the way in, and the gathered weights are exactly the bf16 of the main weights.
        assert all(g.weights.shard is g.main_weight and g.casts == casts0[i] for i, g in enumerate(groups))
        assert model.memory_stats()["model_weight_bytes"] == 0
        blk = model.blocks[1]
        full = blk.fc1.weight.full_tensor()
        blk.unshard()
        assert torch.equal(blk.fc1.weight.detach(), full.to(torch.bfloat16))
        blk.reshard()
    return losses, {k: p.full_tensor() for k, p in model.named_parameters()}


BF16_STEPS = 4


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_bf16_compute_casts_main_weights_once_per_step(strategy):
    # Against an unsharded reference making the same casts (bf16 compute, grads averaged in bf16:
    # reduce_dtype defaults to param_dtype), with tolerances from its own spread between the
    # per-rank micro-batches and one micro-batch of the whole batch (see same_cast_tolerances).
    ref_losses, ref_params, loss_tol, tol = same_cast_tolerances(BF16_STEPS, 2, 8, reduce_dtype=torch.bfloat16)
    for rank, (losses, full) in enumerate(run_ranks(_bf16_cast_once, 2, strategy)):
        assert_losses_close(losses, ref_losses, f"rank {rank}", loss_tol)
        for name, ref in ref_params.items():
            assert_close_rel(full[name], ref, f"rank {rank} {name}", tol[name])
    assert ref_losses[-1] < ref_losses[0]


def _manual_unshard(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=F64)
    ref = build("net", dtype=F64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = model.blocks[1].unshard(async_op=True)
    handle.wait()
    w = model.blocks[1].fc1.weight
    assert not hasattr(w, "placements") and torch.equal(w, ref.blocks[1].fc1.weight)
    model.blocks[1].reshard()
    assert hasattr(model.blocks[1].fc1.weight, "placements")
    x, _ = batch(0, 4, 12, dtype=F64)
    with torch.no_grad():
        out = model(x)
        expect = ref(x)
    # After an eval forward nothing stays gathered.
    assert all(not m._mfsdp2_state.groups[0].is_unsharded for m in model.modules() if hasattr(m, "_mfsdp2_state"))
    return out, expect


def test_manual_unshard_reshard_and_eval_forward():
    for rank, (out, expect) in enumerate(run_ranks(_manual_unshard, 2)):
        assert_close_rel(out, expect, f"rank {rank} eval output", REL_F64)


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(12, 6)
        self.unused = nn.Linear(12, 6)

    def forward(self, x):
        return self.used(x)


def _params_and_reference(model, ref) -> dict:
    """Every parameter's full tensor next to the unsharded reference's."""
    return {n: (p.full_tensor(), ref.get_parameter(n).detach().clone()) for n, p in model.named_parameters()}


def _assert_matches_reference(fn) -> None:
    """Run ``fn`` on 2 ranks; each rank's parameters equal the float64 reference's."""
    for rank, params in enumerate(run_ranks(fn, 2)):
        for name, (got, ref) in params.items():
            assert_close_rel(got, ref, f"rank {rank} {name}", REL_F64)


def _unused_params(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = _WithUnused().to(F64)
    torch.manual_seed(0)
    ref = _WithUnused().to(F64)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x, y = batch(step, 8, 12, dtype=F64)
        loss_fn(model(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]).backward()
        loss_fn(ref(x), y).backward()
        assert model.unused.weight.grad is None and model.unused.bias.grad is None
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    return _params_and_reference(model, ref)


def test_unused_parameters_keep_grad_none_and_match_reference():
    _assert_matches_reference(_unused_params)


def _errors(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    msgs = []
    m = Net()
    fully_shard(m.blocks[0], mesh=mesh)
    try:
        fully_shard(m.blocks[0], mesh=mesh)
    except ValueError as e:
        msgs.append(str(e))
    fully_shard(m, mesh=mesh)
    try:
        fully_shard(m.blocks[1], mesh=mesh)  # child after its parent
    except ValueError as e:
        msgs.append(str(e))
    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.tensor(1.0))
    try:
        fully_shard(Scalar(), mesh=mesh)
    except ValueError as e:
        msgs.append(str(e))
    with torch.device("meta"):
        meta = nn.Linear(3, 3)
    fully_shard(meta, mesh=mesh)  # accepted: shapes suffice; the values come from materialize()
    try:
        meta(torch.zeros(1, 3))
    except RuntimeError as e:
        msgs.append(str(e))
    return msgs


def test_clear_errors():
    msgs = run_ranks(_errors, 2)[0]
    assert len(msgs) == 4, msgs
    assert "already applied" in msgs[0]
    assert "'norm.weight' of Block" in msgs[1] and "wrap children first" in msgs[1]
    assert "0-dimensional" in msgs[2] and "'s'" in msgs[2]
    assert "meta device" in msgs[3] and "mfsdp2.materialize(model)" in msgs[3]


class _Boom(Exception):
    pass


def _reset_after_exception(rank, ws):
    mesh = init_device_mesh("cpu", (ws,))
    model = build("net", dtype=F64)
    ref = build("net", dtype=F64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_opt("sgd", model.parameters())
    ropt = make_opt("sgd", ref.parameters())
    fail = {"on": False}

    def maybe_raise(module, args):
        if fail["on"]:
            raise _Boom("injected failure inside blocks.1's forward")

    model.blocks[1].register_forward_pre_hook(maybe_raise)
    for step in range(4):
        x, y = batch(step, 8, 12, dtype=F64)
        fail["on"] = step == 1
        try:
            loss_fn(model(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]).backward()
        except _Boom:
            model.reset()  # blocks.0 and the root are unsharded mid-forward; clean up and go on
            opt.zero_grad()
            assert all(not g.is_unsharded
                       for m in model.modules() if hasattr(m, "_mfsdp2_state") for g in m._mfsdp2_state.groups)
            continue
        opt.step()
        opt.zero_grad()
        loss_fn(ref(x), y).backward()
        ropt.step()
        ropt.zero_grad()
    return _params_and_reference(model, ref)


def test_reset_after_exception_in_forward_lets_training_continue():
    _assert_matches_reference(_reset_after_exception)
