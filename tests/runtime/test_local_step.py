"""torch's elementwise optimizers step the DTensor parameters' local tensors
(``mfsdp2.runtime.local_step``) and give torch's DTensor step's bits.

The reference is the same training with the local path turned off (every optimizer then steps
through DTensor's dispatch, as under torch FSDP2): for each optimizer of
``local_step.ELEMENTWISE`` with the options that change its arithmetic, at two ranks, on a
ZeRO-3 model whose rows do not divide evenly and on a no_shard one, the parameters, every
optimizer state (values, DTensor or not, placements) and ``optimizer.state_dict()`` are equal bit
for bit, and the local path ran on every step after the first. The cases that must keep torch's
path keep it (a closure, a step hook of the optimizer's own, a subclass, torch FSDP2's
parameters), an
exception inside the step leaves the parameters and the state as they were, and an LR scheduler
built before the first step still sees its optimizer's steps.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard

from .._dist import run_ranks

STEPS = 3
LATE = ("adamw", "sgd_nesterov", "adagrad", "rprop")

CONFIGS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.01)),
    "adam_foreach": (torch.optim.Adam, dict(lr=1e-2, foreach=True)),
    "adam_fused": (torch.optim.Adam, dict(lr=1e-2, fused=True)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw_maximize_foreach": (torch.optim.AdamW, dict(lr=1e-2, maximize=True, foreach=True)),
    "adamw_fused": (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2, lr_decay=0.01, weight_decay=0.01)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.9, centered=True)),
    "adamax": (torch.optim.Adamax, dict(lr=1e-2)),
    "nadam": (torch.optim.NAdam, dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01)),
    "radam": (torch.optim.RAdam, dict(lr=1e-2)),
    "asgd": (torch.optim.ASGD, dict(lr=1e-2, t0=1)),
    "rprop": (torch.optim.Rprop, dict(lr=1e-2)),
}


def _model(strategy: str, mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    # 7 output rows over 2 ranks: uneven ZeRO-3 shards (one rank holds 4 rows, the other 3).
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    fully_shard(model[0], mesh=mesh, sharding_strategy=strategy)
    fully_shard(model[2], mesh=mesh, sharding_strategy=strategy)
    return fully_shard(model, mesh=mesh, sharding_strategy=strategy)


def _snapshot(model, opt) -> dict:
    from torch.distributed.tensor import DTensor

    out = {"params": {n: p.full_tensor() for n, p in model.named_parameters()}, "state": {}}
    for n, p in model.named_parameters():
        assert type(p) is DTensor, n
        for k, v in opt.state.get(p, {}).items():
            if type(v) is DTensor:
                out["state"][(n, k)] = ("dtensor", v.placements, v.full_tensor())
            else:
                out["state"][(n, k)] = (type(v).__name__, None, v.clone() if isinstance(v, torch.Tensor) else v)
    sd = opt.state_dict()
    out["state_dict"] = {(i, k): (type(v).__name__, v.full_tensor() if hasattr(v, "full_tensor") else v)
                         for i, st in sd["state"].items() for k, v in st.items()}
    return out


def _train(strategy: str, name: str, mesh, rank: int, how: str = "plain") -> tuple:
    import mfsdp2.runtime.local_step as local_step

    cls, kw = CONFIGS[name]
    model = _model(strategy, mesh)
    opt = cls(model.parameters(), **kw)
    seen = []
    if how == "own_hook":
        opt.register_step_pre_hook(lambda o, a, k: seen.append(type(o.param_groups[0]["params"][0]).__name__))
    torch.manual_seed(1 + rank)
    before = local_step.steps_taken()
    for step in range(STEPS):
        x = torch.randn(4, 5)

        def closure():
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss

        if how == "closure":
            opt.step(closure)
        elif how == "none_closure":  # Accelerate's optimizer wrapper calls step(closure) with None
            closure()
            opt.step(None)
        else:
            closure()
            if how == "late" and step == 0:
                model[2].bias.grad = None  # its state is created by a later step, the local path's
            opt.step()
    return _snapshot(model, opt), local_step.steps_taken() - before, seen


def _equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, tuple):
            if x[:-1] != y[:-1] or not _equal({0: x[-1]}, {0: y[-1]}):
                return False
        elif isinstance(x, dict):
            if not _equal(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _compare_all(rank: int, ws: int, strategy: str) -> dict:
    import mfsdp2.runtime.local_step as local_step

    mesh = init_device_mesh("cpu", (ws,))
    result = {}
    for key in list(CONFIGS) + [f"{n}:late" for n in LATE]:
        name, _, how = key.partition(":")
        on, taken, _ = _train(strategy, name, mesh, rank, how or "plain")
        saved, local_step.ELEMENTWISE = local_step.ELEMENTWISE, ()
        try:
            off, taken_off, _ = _train(strategy, name, mesh, rank, how or "plain")
        finally:
            local_step.ELEMENTWISE = saved
        result[key] = (_equal(on, off), taken, taken_off, sorted({v[0] for v in on["state"].values()}))
    return result


@functools.lru_cache(maxsize=None)
def _compared(strategy: str) -> dict:
    return run_ranks(_compare_all, 2, strategy)[0]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
@pytest.mark.parametrize("name", list(CONFIGS) + [f"{n}:late" for n in LATE])
def test_local_step_gives_the_dtensor_steps_bits(strategy, name):
    """``name:late``: one parameter has no gradient at the first step, so its state is created
    by a local step and must come out as the DTensor torch's step would have made."""
    equal, taken, taken_off, kinds = _compared(strategy)[name]
    assert taken == STEPS - 1 and taken_off == 0, (taken, taken_off)  # the first step is torch's path
    assert equal, (strategy, name)
    if name != "sgd":  # plain SGD keeps no state
        assert "dtensor" in kinds, kinds


def _scheduled_steps(model, opt, sched, n: int) -> tuple:
    """``n`` steps with ``sched`` stepped after each: (local steps taken, the scheduler's warnings)."""
    import mfsdp2.runtime.local_step as local_step

    before = local_step.steps_taken()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            model(torch.randn(4, 5)).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    return local_step.steps_taken() - before, [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]


def _fallbacks(rank: int, ws: int) -> dict:
    import mfsdp2.runtime.local_step as local_step
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    ref, _, _ = _train("optim_grads_params", "adamw", mesh, rank)
    snap, taken, _ = _train("optim_grads_params", "adamw", mesh, rank, how="closure")
    out["closure"] = (taken, _equal(snap, ref))
    snap, taken, _ = _train("optim_grads_params", "adamw", mesh, rank, how="none_closure")
    out["none_closure"] = (taken, _equal(snap, ref))
    snap, taken, seen = _train("optim_grads_params", "adamw", mesh, rank, how="own_hook")
    out["own_hook"] = (taken, _equal(snap, ref), seen)

    # A subclass may compute anything: torch's path.
    class MyAdamW(torch.optim.AdamW):
        pass

    model = _model("optim_grads_params", mesh)
    opt = MyAdamW(model.parameters(), lr=1e-2)
    before = local_step.steps_taken()
    for _ in range(2):
        model(torch.randn(4, 5)).sum().backward()
        opt.step()
    out["subclass"] = local_step.steps_taken() - before

    # torch FSDP2's parameters in the same process: torch's path (the tests' reference).
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    torch_fully_shard(model[0], mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = local_step.steps_taken()
    for _ in range(3):
        model(torch.randn(4, 5)).sum().backward()
        opt.step()
    out["fsdp2"] = local_step.steps_taken() - before

    # An exception inside the step: the parameters and the state are as they were.
    model = _model("optim_grads_params", mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()  # torch's path: creates the state
    model(torch.randn(4, 5)).sum().backward()
    opt.param_groups[0]["lr"] = "not a number"
    raised = False
    try:
        opt.step()
    except Exception:
        raised = True
    opt.param_groups[0]["lr"] = 1e-2
    params_ok = all(type(p) is DTensor for g in opt.param_groups for p in g["params"])
    state_ok = all(type(p) is DTensor and type(st["exp_avg"]) is DTensor for p, st in opt.state.items())
    locals_clear = all(p._local_tensor.grad is None for p in model.parameters())
    out["exception"] = (raised, params_ok, state_ok, locals_clear, len(opt.state))

    # An LR scheduler built before the first step keeps seeing the steps (no order warning).
    model = _model("optim_grads_params", mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    out["scheduler"] = _scheduled_steps(model, opt, sched, 3) + (opt.param_groups[0]["lr"],)

    # ... and one built after the first step (it wraps the optimizer's step wrapper).
    model = _model("optim_grads_params", mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    opt.zero_grad()
    moments = {p: opt.state[p]["exp_avg"] for p in model.parameters()}
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    out["scheduler_after"] = _scheduled_steps(model, opt, sched, 2)
    # The state objects are the ones torch made (a reference taken earlier sees the updates).
    out["same_state"] = all(opt.state[p]["exp_avg"] is m for p, m in moments.items())
    return out


def test_cases_that_keep_torchs_path_and_a_step_that_raises():
    out = run_ranks(_fallbacks, 2)[0]
    assert out["closure"] == (0, True), out["closure"]  # a closure's backward runs inside the step
    assert out["none_closure"] == (STEPS - 1, True), out["none_closure"]
    taken, equal, seen = out["own_hook"]
    assert taken == 0 and equal and seen == ["DTensor"] * STEPS, out["own_hook"]
    assert out["subclass"] == 0
    assert out["fsdp2"] == 0
    raised, params_ok, state_ok, locals_clear, n_state = out["exception"]
    assert raised and params_ok and state_ok and locals_clear and n_state == 4, out["exception"]
    taken, warned, lr = out["scheduler"]
    assert taken == 2 and warned == [] and lr == pytest.approx(1e-2 * 0.5 ** 3), out["scheduler"]
    assert out["scheduler_after"] == (2, []), out["scheduler_after"]
    assert out["same_state"]



def _mismatches(rank, ws):
    """What ``_collect`` decides for gradients and states made with another spec: an equal mesh
    that is another object swaps; other placements (of a gradient, or of a state) keep torch's
    path."""
    import mfsdp2.runtime.local_step as local_step
    from torch.distributed.tensor import DTensor, Replicate

    def respec(t, mesh, placements):
        return DTensor.from_local(t._local_tensor, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())

    mesh = init_device_mesh("cpu", (ws,))
    model = _model("optim_grads_params", mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()  # torch's path: creates the state
    model(torch.randn(4, 5)).sum().backward()
    out = {"plain": local_step._collect(opt) is not None}
    p = next(model.parameters())
    g = p.grad
    p.grad = respec(g, init_device_mesh("cpu", (ws,)), g.placements)  # equal mesh, another object
    out["equal_mesh"] = local_step._collect(opt) is not None and p.grad.device_mesh is not p.device_mesh
    p.grad = respec(g, mesh, [Replicate()])
    out["grad_placements"] = local_step._collect(opt) is not None
    p.grad = g
    st = opt.state[p]
    m = st["exp_avg"]
    st["exp_avg"] = respec(m, mesh, [Replicate()])
    out["state_placements"] = local_step._collect(opt) is not None
    st["exp_avg"] = m
    out["restored"] = local_step._collect(opt) is not None
    return out


def test_specs_that_rule_the_local_step_out():
    out = run_ranks(_mismatches, 2)[0]
    assert out == {"plain": True, "equal_mesh": True, "grad_placements": False, "state_placements": False,
                   "restored": True}, out
