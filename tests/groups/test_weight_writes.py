"""Writes to the weights that do not go through the optimizer are seen by the next forward.

Users write weights in many ways that bump no version counter: ``p.data.add_``, writes to
``p.to_local().data``, ``torch.nn.init.*_(p.data)``, an EMA copied in for an eval pass and copied
back. The strategies that keep full model weights between steps (ZeRO-1/2, no_shard) and the FP8
gather (scales, quantised shard) used to decide from version counters alone whether the weights
changed, so they computed with the old weights. ZeRO-3 casts/copies the main shard into every
gather, which these tests prove too.

Every case is checked against an independent reference: an unsharded single-process copy of the
model loaded with the *current* main weights (``full_tensor()`` of every parameter), fed the same
input. float64 models compare within 1e-10 relative (float64 rounding of a few hundred products
is ~1e-14; nothing else differs). bf16 compute compares exactly: the reference applies the same
cast (main -> bf16, input -> bf16) and runs the same kernels on the same shapes. FP8 compares
exactly too: the reference quantises each matrix with the global amax exactly as the runtime
defines it (``scale = finfo.max / amax`` in float32, clamp, float8, back, to bf16).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import MixedPrecisionPolicy, fully_shard

from .._dist import run_ranks
from ..models import batch, build, loss_fn

E4M3 = torch.float8_e4m3fn
STRATEGIES = ["optim_grads_params", "optim_grads", "optim", "no_shard"]


def _shard(model, ws, strategy, mp, **kw):
    mesh = init_device_mesh("cpu", (ws,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp, sharding_strategy=strategy, **kw)
    fully_shard(model, mesh=mesh, mp_policy=mp, sharding_strategy=strategy, **kw)
    return model


def _reference_output(model, template, x, compute, fp8):
    """The unsharded model with the sharded model's current main weights, cast as the runtime casts."""
    ref = copy.deepcopy(template).to(compute) if compute is not None else copy.deepcopy(template)
    full = {k: p.full_tensor().detach() for k, p in model.named_parameters()}
    with torch.no_grad():
        for k, p in ref.named_parameters():
            w = full[k]
            if fp8 and w.dim() >= 2:
                w32 = w.float()
                amax = w32.abs().max()
                scale = torch.finfo(E4M3).max / amax if amax > 0 else torch.ones(())
                w = (w32 * scale).clamp(-448, 448).to(E4M3).float() / scale
            p.copy_(w.to(compute) if compute is not None else w)
        out = ref(x.to(compute) if compute is not None else x)
    return out


def _writes(model, opt, template, rank, ws):
    """Yield (case name) after each kind of write; the caller compares a forward after each."""
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(99)
    noise = {k: torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1 for k, p in params.items()}

    with torch.no_grad():
        for p in params.values():
            p.data.add_(0.25)  # .data: a fresh version counter, the write bumps nothing we see
    yield "p.data.add_"

    with torch.no_grad():
        for p in params.values():
            p.to_local().data.mul_(-0.5)
    yield "p.to_local().data.mul_"

    with torch.no_grad():
        for k, p in params.items():
            local = p.to_local()
            # A rank-independent init: the same full tensor everywhere, this rank's rows copied in.
            rows = local.shape[0]
            start = _first_row(p)
            torch.nn.init.constant_(p.data, 0.0)
            p.to_local().data.copy_(noise[k][start : start + rows])
    yield "torch.nn.init.constant_(p.data) + copy into to_local().data"

    with torch.no_grad():
        for p in params.values():
            torch.nn.init.ones_(p.data)
    yield "torch.nn.init.ones_(p.data)"

    sd = build("net", seed=5).to(next(iter(params.values())).dtype).state_dict()
    model.load_state_dict(sd)
    yield "load_state_dict"

    x, y = batch(0, 8, 12)
    x, y = x.to(template.inp.weight.dtype), y.to(template.inp.weight.dtype)
    out = model(x[rank * 8 // ws : (rank + 1) * 8 // ws])
    loss_fn(out if out.dtype == torch.float64 else out.float(), y[rank * 8 // ws : (rank + 1) * 8 // ws]).backward()
    opt.step()
    opt.zero_grad()
    yield "optimizer step"

    backup = {k: p.detach().clone() for k, p in params.items()}
    with torch.no_grad():  # EMA-style swap-in for evaluation ...
        for k, p in params.items():
            p.data.copy_(p.detach() * 0.9 + 0.01)
    yield "EMA swap-in (eval)"
    with torch.no_grad():  # ... and back for training
        for k, p in params.items():
            p.data.copy_(backup[k])
    yield "swap back"


def _first_row(p):
    from mfsdp2 import RowShard

    for dim, pl in enumerate(p.placements):
        if isinstance(pl, RowShard):
            return pl.starts[p.device_mesh.get_local_rank(dim)]
    return 0


def _run(rank, ws, strategy, dtype, compute, fp8, detect=True, offload=False):
    """``detect=False``: ``set_detect_data_writes(False)``, and every write is announced with
    ``mark_weights_changed()`` -- the documented contract of that mode. ``offload``:
    ``CPUOffloadPolicy``, whose main weights never share the model buffer and whose content
    check runs on the host."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    torch.manual_seed(0)
    template = build("net").to(dtype)
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    model = _shard(copy.deepcopy(template), ws, strategy,
                   MixedPrecisionPolicy(param_dtype=compute, all_gather_dtype=E4M3 if fp8 else None), **kw)
    if not detect:
        model.set_detect_data_writes(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(7), dtype=dtype)
    results = []

    def check(case):
        if not detect:
            model.mark_weights_changed()
        with torch.no_grad():
            got = model(x)
        want = _reference_output(model, template, x, compute, fp8)
        if compute is None:
            err = ((got - want).abs().max() / want.abs().max()).item()
            results.append((case, err <= 1e-10, err))
        else:
            results.append((case, torch.equal(got, want), (got.double() - want.double()).abs().max().item()))

    check("initial")
    for case in _writes(model, opt, template, rank, ws):
        check(case)
    return results


def _assert_all_seen(results, what):
    bad = [f"rank {r}: {case}: err {err:.3e}" for r, res in enumerate(results) for case, ok, err in res if not ok]
    assert not bad, f"{what}: the forward computed with weights other than the current ones:\n" + "\n".join(bad)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_writes_are_seen_float64(strategy):
    _assert_all_seen(run_ranks(_run, 2, strategy, torch.float64, None, False), f"{strategy}, float64")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_writes_are_seen_bf16_compute(strategy):
    _assert_all_seen(run_ranks(_run, 2, strategy, torch.float32, torch.bfloat16, False), f"{strategy}, bf16 compute")


def test_writes_are_seen_fp8_gather():
    _assert_all_seen(run_ranks(_run, 2, "optim_grads_params", torch.float32, torch.bfloat16, True),
                     "ZeRO-3, FP8 gather")


def _offloaded(rank, ws):
    return [(f"{s}: {case}", ok, err) for s in STRATEGIES
            for case, ok, err in _run(rank, ws, s, torch.float64, None, False, offload=True)]


def test_writes_are_seen_with_cpu_offload():
    """Offloaded main weights (host memory) are never the model buffer's slice, even for
    no_shard at equal dtypes; on a CPU mesh persistent strategies fingerprint them where they
    live (``weight_watch.watch_mode``): every kind of write must still be seen."""
    _assert_all_seen(run_ranks(_offloaded, 2), "CPU offload, float64")


def _world_size_one(rank, ws):
    return [r for s in ("optim_grads", "optim", "no_shard")
            for r in _run(rank, ws, s, torch.float32, torch.bfloat16, False)]


def test_writes_are_seen_at_world_size_one():
    """The issue's reproducer: one rank, bf16 compute, persistent weights."""
    _assert_all_seen(run_ranks(_world_size_one, 1), "world size 1, bf16 compute")


@pytest.mark.parametrize("strategy", ["optim_grads", "no_shard"])
def test_announced_writes_are_seen_without_the_content_check(strategy):
    """``set_detect_data_writes(False)`` (no host read per forward) + ``mark_weights_changed()``."""
    _assert_all_seen(run_ranks(_run, 2, strategy, torch.float64, None, False, False), f"{strategy}, announced")


def _unannounced(rank, ws):
    template = build("net").to(torch.float64)
    model = _shard(copy.deepcopy(template), ws, "optim_grads", MixedPrecisionPolicy())
    model.set_detect_data_writes(False)
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with torch.no_grad():
        model(x)
        for p in model.parameters():
            p.data.add_(0.25)
        got = model(x)
    want = _reference_output(model, template, x, None, False)
    return ((got - want).abs().max() / want.abs().max()).item()


def test_without_the_content_check_an_unannounced_data_write_is_not_seen():
    """What the switch trades (and proof that it switches the comparison off): the forward after
    an unannounced ``.data`` write computes with other ranks' old rows (this rank's own rows are
    the persistent buffer's slice, written in place)."""
    errs = run_ranks(_unannounced, 2)
    assert all(e > 1e-3 for e in errs), errs


# -- the policy of devices whose reads synchronise (CUDA), forced on the CPU ----------------------
def _accelerator_policy(rank, ws, offload):
    """Every case of ``_run`` with ``weight_watch.set_host_read_synchronises(True)``: persistent
    groups re-gather at a forward without a common fact instead of comparing content."""
    from mfsdp2.groups import weight_watch

    prev = weight_watch.set_host_read_synchronises(True)
    try:
        out = []
        for s in STRATEGIES:
            for dtype, compute in ((torch.float64, None), (torch.float32, torch.bfloat16)):
                if offload and compute is not None:
                    continue
                out += [(f"{s} {compute}: {case}", ok, err)
                        for case, ok, err in _run(rank, ws, s, dtype, compute, False, offload=offload)]
        for s in ("optim_grads", "no_shard"):  # set_detect_data_writes(False) keeps its meaning
            out += [(f"{s} announced: {case}", ok, err)
                    for case, ok, err in _run(rank, ws, s, torch.float64, None, False, False, offload=offload)]
        return out
    finally:
        weight_watch.set_host_read_synchronises(prev)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "cpu_offload"])
def test_writes_are_seen_under_the_accelerator_policy(offload):
    _assert_all_seen(run_ranks(_accelerator_policy, 2, offload), f"accelerator policy, offload={offload}")


def _unannounced_accelerator_policy(rank, ws):
    from mfsdp2.groups import weight_watch

    prev = weight_watch.set_host_read_synchronises(True)
    try:
        return _unannounced(rank, ws)
    finally:
        weight_watch.set_host_read_synchronises(prev)


def test_without_the_content_check_the_accelerator_policy_trusts_host_facts():
    """``set_detect_data_writes(False)`` means the same under the accelerator's policy: no
    re-gather without a fact, so an unannounced ``.data`` write is not seen."""
    errs = run_ranks(_unannounced_accelerator_policy, 2)
    assert all(e > 1e-3 for e in errs), errs
