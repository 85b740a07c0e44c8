"""mfsdp2.optim.AdamW on sharded models at world size 2, against torch's AdamW.

* Equivalence with the unsharded model: every strategy (ZeRO-3/2/1, no_shard, HSDP, CPU offload)
  steps the same gradients as an unsharded model stepped by ``torch.optim.AdamW``, and the
  weights and states must be the same bits (NaNs as NaN). The gradients are written into
  mfsdp2's gradient views after one real backward (so every rank steps its rows of one known
  full gradient), with NaN written into the flat main gradients' padding (never stepped: the
  padding of the main weights must stay zero). Hypothesis draws the hyper-parameters, param
  groups that cut through units, non-finite gradients, parameters skipped in some steps, plain
  (``ignored_params``) parameters in the same optimizer, float32 / float64. Each case runs three
  ways: the native kernel, torch's arithmetic on the flat pieces (``native.reference_only()``:
  the build without the extension), and ``fused=True`` (the accelerator code path, on the CPU;
  against ``torch.optim.AdamW(fused=True)`` on the same sharded parameters).
* Training parity: real forward / backward / ``zero_grad`` cycles with an LR scheduler, frozen
  parameters and ranks holding no rows of some parameters, against ``torch.optim.AdamW`` on the
  same mfsdp2 model: same losses, weights and states, bit for bit.
* FSDP x TP at (dp 2 x tp 2): the same bits as torch AdamW on the same model.
* Fallbacks and refusals: FSDP2's parameters, a gradient the user assigned, growing param
  groups, state entries replaced between steps, GradScaler (skipped steps included);
  ``differentiable=True``, ``capturable=True`` on the CPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from mfsdp2 import RowShard, fully_shard
from mfsdp2.precision import native
from mfsdp2.optim import AdamW

from .._dist import run_ranks
from .._optional import given, HealthCheck, Phase, settings, st
from ..models import F64, batch, build, loss_fn, sharded_train_step

LAYOUTS = ("optim_grads_params", "optim_grads", "optim", "no_shard", "hsdp", "offload")
F32 = torch.float32


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().flatten(), b.detach().flatten()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# -- helpers run inside the ranks ------------------------------------------------------------
def _meshes():
    return {"dp": init_device_mesh("cpu", (2,)),
            "hsdp": init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))}


def _shard(model, layout: str, meshes, ignored=()):
    kw = {}
    if layout in ("optim_grads", "optim", "no_shard"):
        kw["sharding_strategy"] = layout
    if layout == "offload":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    mesh = meshes["hsdp" if layout == "hsdp" else "dp"]
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, ignored_params=set(ignored), **kw)
    return model


def _param_groups(named, case):
    """Param groups by name: one, weights vs norms and biases (cutting through every unit), or
    by block (whole units and parts of the root)."""
    main = dict(lr=case["lr"], betas=case["betas"], eps=case["eps"], weight_decay=case["wd"],
                amsgrad=case["amsgrad"], maximize=case["maximize"])
    other = dict(lr=case["lr"] * 0.5, betas=(0.5, 0.9), eps=1e-6, weight_decay=0.0,
                 amsgrad=not case["amsgrad"], maximize=False)
    if case["split"] == "one":
        return [dict(params=[p for _, p in named], **main)]
    if case["split"] == "decay":
        pick = lambda n, p: p.dim() >= 2
    else:
        pick = lambda n, p: n.startswith("blocks.1") or n.startswith("inp")
    return [dict(params=[p for n, p in named if pick(n, p)], **main),
            dict(params=[p for n, p in named if not pick(n, p)], **other)]


def _rows(p) -> slice:
    start = 0
    for dim, pl in enumerate(p.placements):
        if isinstance(pl, RowShard):
            start = pl.starts[p.device_mesh.get_local_rank(dim)]
    n = p._local_tensor.shape[0] if p.dim() else 1
    return slice(start, start + n)


def _groups_of(model):
    return [g for m in model.modules() if getattr(m, "_mfsdp2_state", None) is not None for g in m._mfsdp2_state.groups]


def _padding(g) -> torch.Tensor:
    """Positions of the group's shard holding no parameter rows."""
    mask = torch.ones(g.layout.shard_numel, dtype=torch.bool)
    for i in range(len(g.dist_params)):
        pc = g.layout.piece(i, g.rank)
        mask[pc.shard_offset:pc.shard_offset + pc.numel] = False
    return mask


def _step_grads(case, step: int, named):
    """The full gradients of one step (None: the parameter is skipped this step)."""
    gen = torch.Generator().manual_seed(case["seed"] * 100 + step)
    out = {}
    for k, (n, p) in enumerate(named):
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 10.0 ** float(torch.randint(-4, 1, (), generator=gen))
        if case["nonfinite"] and step == 1 and k % 3 == 0:
            g.view(-1)[0] = float("nan")
            g.view(-1)[-1] = float("inf") if k % 2 else -float("inf")
        skip = case["skip"] and step > 0 and (k + step) % 4 == 0
        out[n] = None if skip else g
    return out


def _watch_fallbacks(opt) -> list:
    """Record the parameters an optimizer of ours hands to torch's per-tensor code."""
    seen, inner = [], opt._torch_step

    def torch_step(group, params):
        seen.extend(params)
        inner(group, params)

    opt._torch_step = torch_step
    return seen


def _inject(model, views, grads) -> None:
    """Each parameter's gradient := this rank's rows of ``grads[name]`` (None: no gradient)."""
    for n, p in model.named_parameters():
        g = grads[n]
        if g is None:
            p.grad = None
        elif isinstance(p, DTensor):
            p.grad = views[n]
            p.grad._local_tensor.copy_(g[_rows(p)] if p.dim() else g)
        else:
            p.grad = g.clone()


def _step_nan_padded(opt, groups, variant: str) -> None:
    """NaN into the padding of the groups' main gradients (never stepped: the weights' padding
    must stay zero), then ``opt.step()``; without the native kernel for ``variant == "reference"``."""
    for grp in groups:
        grp.main_grad[_padding(grp)] = float("nan")
    with native.reference_only() if variant == "reference" else contextlib.nullcontext():
        opt.step()


def _equivalence_case(rank, case, meshes, variant: str):
    """``variant``: "native", "reference" (no native kernel) against the unsharded model with
    ``torch.optim.AdamW(foreach=False)``; "fused" against ``torch.optim.AdamW(fused=True)`` on
    the same sharded parameters (torch's fused CPU kernel rounds a tensor's vector body and its
    tail differently, so its bits depend on how a tensor is split: sharded vs unsharded differ
    in torch itself)."""
    dtype = F64 if case["dtype"] == "float64" else F32
    fused = variant == "fused"
    models = []
    for k in range(2):
        model = build("net", dtype=dtype)
        if k == 0 or fused:
            # torch's fused step refuses plain tensors and DTensors in one group: no ignored params there
            _shard(model, case["layout"], meshes, [model.head.bias] if case["ignored"] and not fused else [])
            x, y = batch(0, 4, 12, dtype=dtype)
            loss_fn(model(x), y).backward()  # main gradients exist; .grad are their views
        models.append(model)
    kw = {"fused": True} if fused else {"foreach": False}
    opt = AdamW(_param_groups(list(models[0].named_parameters()), case), **kw)
    ropt = torch.optim.AdamW(_param_groups(list(models[1].named_parameters()), case), **kw)
    views = [{n: p.grad for n, p in m.named_parameters()} for m in models]
    groups = _groups_of(models[0])
    fallbacks = _watch_fallbacks(opt)
    for s in range(3):
        grads = _step_grads(case, s, list(build("net", dtype=dtype).named_parameters()))
        for m, v in zip(models, views):
            _inject(m, v, grads)
        _step_nan_padded(opt, groups, variant)
        ropt.step()
    what = f"{variant} {case}"
    assert all(not isinstance(p, DTensor) for p in fallbacks), f"{what}: mfsdp2 parameters left the flat step"
    # fused: both sharded alike, compare local pieces; else the full tensors with the unsharded model
    get = (lambda t: t.to_local() if isinstance(t, DTensor) else t) if fused else full
    for (n, p), rp in zip(models[0].named_parameters(), models[1].parameters()):
        assert same_bits(get(p), get(rp)), f"{what}: weight {n}"
        st, rst = opt.state.get(p, {}), ropt.state.get(rp, {})
        assert sorted(st) == sorted(rst), f"{what}: state keys of {n}: {sorted(st)} vs {sorted(rst)}"
        for k in rst:
            if k == "step":
                assert st[k].item() == rst[k].item() and st[k].dtype == rst[k].dtype, f"{what}: step of {n}"
            else:
                assert isinstance(st[k], DTensor) == isinstance(p, DTensor), f"{what}: {k} of {n} is not like the param"
                if isinstance(p, DTensor):
                    assert st[k].placements == p.placements and st[k].shape == p.shape
                assert same_bits(get(st[k]), get(rst[k])), f"{what}: {k} of {n}"
    for grp in groups:
        assert bool((grp.main_weight[_padding(grp)] == 0).all()), f"{what}: padding of {grp.name} was stepped"


def _equivalence(rank, ws, cases):
    torch.manual_seed(0)
    meshes = _meshes()
    for case in cases:
        for variant in ("native", "reference", "fused"):
            _equivalence_case(rank, case, meshes, variant)
    return True


@st.composite
def _case(draw, layout):
    return dict(
        layout=layout, dtype=draw(st.sampled_from(["float32", "float64"])),
        lr=draw(st.sampled_from([0.0, 1e-3, 3e-2])),
        betas=draw(st.sampled_from([(0.9, 0.999), (0.3, 0.6), (0.0, 0.5), (0.95, 0.0)])),
        eps=draw(st.sampled_from([1e-8, 1e-3, 0.0])), wd=draw(st.sampled_from([0.0, 1e-2, 0.5])),
        amsgrad=draw(st.booleans()), maximize=draw(st.booleans()),
        split=draw(st.sampled_from(["one", "decay", "blocks"])),
        nonfinite=draw(st.booleans()), skip=draw(st.booleans()), ignored=draw(st.booleans()),
        seed=draw(st.integers(0, 9999)),
    )


@pytest.mark.slow
@settings(max_examples=2, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
@given(cases=st.tuples(*[_case(layout) for layout in LAYOUTS]))
def test_every_strategy_equals_unsharded_torch_adamw(cases):
    """All six layouts in one launch per example (three ways each)."""
    assert run_ranks(_equivalence, 2, list(cases)) == [True, True]


# -- training parity ----------------------------------------------------------------------------
def _train_pair(rank, ws, layouts):
    meshes = _meshes()
    out = {}
    for layout, kind in layouts:
        runs = {}
        for who in ("ours", "torch"):
            model = _shard(build(kind, dtype=F32), layout, meshes)
            named = list(model.named_parameters())
            groups = [dict(params=[p for n, p in named if p.dim() >= 2 and p.requires_grad]),
                      dict(params=[p for n, p in named if p.dim() < 2 and p.requires_grad], weight_decay=0.0,
                           amsgrad=True)]
            opt = (AdamW if who == "ours" else torch.optim.AdamW)(groups, lr=1e-2, weight_decay=0.1,
                                                                  **({} if who == "ours" else {"foreach": False}))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            fallbacks = _watch_fallbacks(opt) if who == "ours" else []
            losses = []
            for s in range(4):
                losses.append(sharded_train_step(model, opt, s, rank, ws, 8))
                sched.step()
            assert not fallbacks, (layout, kind, "parameters left the flat step")
            runs[who] = (model, opt, losses)
        (m1, o1, l1), (m2, o2, l2) = runs["ours"], runs["torch"]
        assert l1 == l2, (layout, kind, l1, l2)
        for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
            assert same_bits(p.to_local(), q.to_local()), (layout, kind, n)
            s1, s2 = o1.state.get(p, {}), o2.state.get(q, {})
            assert sorted(s1) == sorted(s2), (layout, kind, n)
            for k in s2:
                assert same_bits(s1[k].to_local() if k != "step" else s1[k],
                                 s2[k].to_local() if k != "step" else s2[k]), (layout, kind, n, k)
        out[(layout, kind)] = l1
    return out


@pytest.mark.slow
def test_training_parity_with_torch_adamw():
    """ZeRO-3 with frozen parameters, ZeRO-1 and no_shard on "tiny" (ranks holding no rows of
    some parameters: empty pieces), CPU offload: 4 steps with zero_grad and an LR schedule."""
    layouts = [("optim_grads_params", "frozen"), ("optim", "tiny"), ("no_shard", "net"), ("offload", "tiny")]
    res = run_ranks(_train_pair, 2, layouts)
    assert res[0] == res[1]
    for key, losses in res[0].items():
        assert losses[-1] < losses[0], key


# -- fallbacks and refusals ---------------------------------------------------------------------
def _fallbacks(rank, ws):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    meshes = _meshes()
    out = {}
    # FSDP2's DTensors: torch's own per-tensor step, the same bits as torch.optim.AdamW
    for amsgrad in (False, True):
        models = [build("net") for _ in range(2)]
        for m in models:
            for b in m.blocks:
                torch_fully_shard(b, mesh=meshes["dp"])
            torch_fully_shard(m, mesh=meshes["dp"])
        opts = [AdamW(models[0].parameters(), lr=1e-2, amsgrad=amsgrad),
                torch.optim.AdamW(models[1].parameters(), lr=1e-2, amsgrad=amsgrad, foreach=False)]
        for s in range(3):
            for m, o in zip(models, opts):
                sharded_train_step(m, o, s, rank, ws, 8)
        for p, q in zip(*(m.parameters() for m in models)):
            assert same_bits(p.to_local(), q.to_local())
        out[f"fsdp2 {amsgrad}"] = True

    # A gradient the user assigned (not the group's view) and a growing optimizer.
    models = [_shard(build("net"), "optim_grads_params", meshes) for _ in range(2)]
    named = [list(m.named_parameters()) for m in models]
    opts = [AdamW([p for n, p in named[0] if n.startswith("blocks.0.fc")], lr=1e-2),
            torch.optim.AdamW([p for n, p in named[1] if n.startswith("blocks.0.fc")], lr=1e-2, foreach=False)]
    for s in range(4):
        if s == 2:  # the rest of the model joins: blocks.0's flat state grows to the whole shard
            for (o, nm) in zip(opts, named):
                o.add_param_group({"params": [p for n, p in nm if not n.startswith("blocks.0.fc")], "lr": 3e-3})
        for m, o in zip(models, opts):
            x, y = batch(s, 8, 12)
            loss_fn(m(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
            if s == 1:
                for n, p in m.named_parameters():
                    if n == "blocks.0.fc1.weight":
                        p.grad = p.grad * 3.0  # a new DTensor: stepped by torch's per-tensor code
            o.step()
            o.zero_grad()
    for (n, p), q in zip(named[0], models[1].parameters()):
        assert same_bits(p.to_local(), q.to_local()), n
        for k, v in opts[1].state.get(q, {}).items():
            mine = opts[0].state[p][k]
            assert same_bits(mine.to_local() if k != "step" else mine, v.to_local() if k != "step" else v), (n, k)
    out["assigned grad, add_param_group"] = True

    # State entries replaced between steps (as a loader or the user may): adopted at the next step.
    models = [_shard(build("net"), "optim", meshes) for _ in range(2)]
    opts = [AdamW(models[0].parameters(), lr=1e-2, amsgrad=True),
            torch.optim.AdamW(models[1].parameters(), lr=1e-2, amsgrad=True, foreach=False)]
    for s in range(4):
        if s == 2:
            for o, m in zip(opts, models):
                for k, p in enumerate(m.parameters()):
                    st = o.state[p]
                    if k % 3 == 0:
                        st["step"] = torch.tensor(float(7 + k))
                    if k % 3 == 1:
                        st["exp_avg"] = st["exp_avg"] * 0.5
                    if k % 3 == 2:
                        st["max_exp_avg_sq"] = st["max_exp_avg_sq"] * 2.0
        for m, o in zip(models, opts):
            sharded_train_step(m, o, s, rank, ws, 8)
    for p, q in zip(*(m.parameters() for m in models)):
        assert same_bits(p.to_local(), q.to_local())
        for k, v in opts[1].state[q].items():
            mine = opts[0].state[p][k]
            assert same_bits(mine.to_local() if k != "step" else mine, v.to_local() if k != "step" else v), k
    out["replaced state entries"] = True

    # GradScaler: it unscales the gradients itself (our step takes no grad_scale) and skips a step
    models = [_shard(build("net"), "optim_grads_params", meshes) for _ in range(2)]
    opts = [AdamW(models[0].parameters(), lr=1e-2),
            torch.optim.AdamW(models[1].parameters(), lr=1e-2, foreach=False)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)]
    for s in range(3):
        for m, o, sc in zip(models, opts, scalers):
            x, y = batch(s, 8, 12)
            loss = loss_fn(m(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4])
            sc.scale(loss * (float("inf") if s == 1 else 1.0)).backward()  # step 1: skipped
            sc.step(o)
            sc.update()
            o.zero_grad()
    assert scalers[0].get_scale() == scalers[1].get_scale() < 2.0 ** 10
    for p, q in zip(*(m.parameters() for m in models)):
        assert same_bits(p.to_local(), q.to_local())
    out["GradScaler"] = True

    # Refusals
    m = _shard(build("net"), "optim_grads_params", meshes)
    with pytest.raises(ValueError, match="differentiable"):
        AdamW(m.parameters(), differentiable=True)
    opt = AdamW(m.parameters(), capturable=True)
    x, y = batch(0, 8, 12)
    loss_fn(m(x), y).backward()
    with pytest.raises((AssertionError, RuntimeError), match="capturable"):
        opt.step()
    out["refusals"] = True
    return out


@pytest.mark.slow
def test_fallbacks_and_refusals():
    for r in run_ranks(_fallbacks, 2):
        assert all(r.values()) and len(r) == 6, r


# -- FSDP x TP -------------------------------------------------------------------------------------
def _dp_tp(rank, ws):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    runs = []
    for cls in (AdamW, torch.optim.AdamW):
        model = build("net", dtype=F64)
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True,
                  **({} if cls is AdamW else {"foreach": False}))
        fallbacks = _watch_fallbacks(opt) if cls is AdamW else []
        losses = [sharded_train_step(model, opt, s, rank, ws, 8, dp=(mesh.get_local_rank(0), 2)) for s in range(3)]
        assert not fallbacks, "TP parameters left the flat step"
        runs.append((model, opt, losses))
    (m1, o1, l1), (m2, o2, l2) = runs
    assert l1 == l2, (l1, l2)
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert p.placements == q.placements and same_bits(p.to_local(), q.to_local()), n
        for k, v in o2.state[q].items():
            mine = o1.state[p][k]
            if k != "step":
                assert mine.placements == v.placements, (n, k)
            assert same_bits(mine.to_local() if k != "step" else mine, v.to_local() if k != "step" else v), (n, k)
    return l1


@pytest.mark.slow
def test_fsdp_x_tp_parity_with_torch_adamw():
    """(dp 2 x tp 2): TP parameters' flat pieces and their (tp, dp)-mesh state DTensors."""
    res = run_ranks(_dp_tp, 4)
    assert all(r == res[0] for r in res)
