"""Training with collectives that run late (``tests/_slow_collectives.py``): the buffer-reuse rule
and the prefetch / reduction order hold when every collective reads its inputs and writes its
outputs tens of milliseconds after it was issued (gloo on CPU finishes small ones at once, and a
GPU stream usually finishes before anyone looks, so these bugs would otherwise pass by luck).

On the CPU: two gloo ranks, float64. On CUDA: two ranks -- and four for one configuration -- on
*one* GPU (NCCL refuses that; gloo with CUDA tensors does not), each collective enqueued on the
launching stream behind a device-side gate that the harness opens after the delay. By default the
harness presents the group as stream-ordered, so mfsdp2 runs its NCCL path (``async_op=False``
inside its side streams, an event after each collective, ``wait()`` = the current stream waits):
the path production GPUs run, which a world-size-1 NCCL job never exercises (every collective is
short-circuited there). Configurations marked ``gloo`` run mfsdp2's path for backends that are not
stream-ordered (``async_op=True``, the work waited); one run uses the real gloo with CUDA tensors
and no harness at all.

* Parity: float64 training equals the single-process unsharded reference within REL_F64 (CPU and
  CUDA); every run -- float32, bf16 compute (MixedPrecisionPolicy), FP8 all-gathers, float64 --
  equals bit for bit the same run with the delay at 0 (only timing differs, so nothing else
  may): caching and trace-pool allocators, prefetch depth 0, 1 and 2, gradient accumulation
  without sync, activation checkpointing, CPU offload, HSDP (a 2 x 2 mesh, four ranks), and a
  gradient divide factor reduced with PREMUL_SUM (gloo has none: the harness presents the group
  as having it, and the run equals the runtime's own pre-scaled SUM bit for bit). Collectives
  read their inputs late too, and every block the runtime's allocator takes back is poisoned
  (NaN) where it is freed: a block handed to another buffer, freed or overwritten before the
  collective that used it ended -- the buffer-reuse rule: "allocator blocks are reused only
  after the wait of the collective that used them" -- or a gathered weight read before the
  gather wrote it, gives wrong numbers here.
* Order: the runtime's event log (gathers issued, forward/backward begin/end, reductions issued
  and finished) is the same with slow collectives as without delay -- the schedule never depends
  on timing -- and with prefetch the next unit's gather is issued before this unit's forward ends.
* The delay mattered: on the stream path the host issued later collectives before earlier ones
  moved their data (``overtaken``), on gloo's path waits came before the data (``waited_early``).
* The harness can fail: a runtime that takes its all-gathers as finished when issued (no wait,
  no stream wait), one that frees a reduce-scatter's input right after issuing it, and one that
  overwrites an all-gather's input right after issuing it train to different numbers under slow
  collectives, on CPU and on CUDA; the real runtime trains right.
* gloo with CUDA tensors does not block the host: a gather issued while the GPU is busy returns
  before the GPU could have run it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from torch.distributed.fsdp import CPUOffloadPolicy

from mfsdp2 import FSDPModule, MixedPrecisionPolicy, fully_shard
from mfsdp2.base.profiling import event_log

from .._dist import run_ranks, world_mesh
from .._slow_collectives import SlowCollectives
from ..models import F64, REL_F64, Block, assert_close_rel, batch, build, loss_fn, make_opt

STEPS, GB, DELAY = 3, 8, 0.02
E4M3 = torch.float8_e4m3fn
# (allocator, prefetch depth, mode, dtype, path): path "stream" = mfsdp2's NCCL path, "gloo" =
# its path for backends that are not stream-ordered, "real" = real gloo on CUDA, no harness.
# Modes beyond the training loop's own ("plain", "accumulate", "checkpoint"): "hsdp" (a 2-D
# mesh, replicas x shards), "offload" (CPUOffloadPolicy), "premul" (a gradient divide factor the
# reduce plan gives NCCL's PREMUL_SUM for: the harness presents the group as having it, see
# _slow_collectives). dtype "fp8": bf16 compute, float8 all-gathers (docs/precision.md).
CPU_CONFIGS = [
    ("caching", 1, "plain", "fp64", "gloo"),
    ("trace_pool", 2, "plain", "fp64", "gloo"),
    ("caching", 0, "accumulate", "fp64", "gloo"),
    ("trace_pool", 1, "checkpoint", "fp64", "gloo"),
    ("caching", 1, "offload", "fp64", "gloo"),
    ("trace_pool", 1, "plain", "fp8", "gloo"),
    ("caching", 1, "premul", "fp32", "gloo"),
]
CPU4_CONFIGS = [("caching", 1, "hsdp", "fp64", "gloo")]
CUDA_CONFIGS = [
    ("caching", 1, "plain", "fp64", "stream"),
    ("trace_pool", 2, "plain", "fp32", "stream"),
    ("caching", 0, "accumulate", "fp32", "stream"),
    ("trace_pool", 1, "checkpoint", "fp32", "stream"),
    ("caching", 2, "plain", "bf16", "stream"),
    ("trace_pool", 0, "accumulate", "bf16", "stream"),
    ("caching", 1, "checkpoint", "bf16", "stream"),
    ("trace_pool", 1, "plain", "fp64", "gloo"),
    ("caching", 2, "accumulate", "bf16", "gloo"),
    ("caching", 1, "offload", "fp32", "stream"),
    ("trace_pool", 1, "plain", "fp8", "stream"),
    ("caching", 1, "premul", "fp32", "stream"),
]
CUDA4_CONFIGS = [("trace_pool", 1, "plain", "fp64", "stream"), ("caching", 1, "accumulate", "bf16", "stream"),
                 ("trace_pool", 1, "hsdp", "fp64", "stream")]
_RUNS = ([("cpu", 2, c) for c in CPU_CONFIGS] + [("cpu", 4, c) for c in CPU4_CONFIGS]
         + [("cuda", 2, c) for c in CUDA_CONFIGS] + [("cuda", 4, c) for c in CUDA4_CONFIGS])
PREMUL_FACTOR = 4.0  # neither 1 nor the shard group's size: FSDP2's PREMUL_SUM case
# One launch of ranks per (device, world size) serves all its cases: under pytest -n
# --dist loadgroup its cases stay on one worker.
CASES = [pytest.param(d, ws, c, id=f"{d}{ws}-" + "-".join(map(str, c)),
                      marks=[pytest.mark.xdist_group(f"slow-{d}{ws}")] + ([pytest.mark.cuda] if d == "cuda" else []))
         for d, ws, c in _RUNS]
needs_cuda = pytest.mark.cuda  # two ranks share the one GPU


class _CkptBlock(Block):
    """A block whose forward is recomputed in backward (non-reentrant checkpoint inside the unit)."""

    def forward(self, x):
        return checkpoint(functools.partial(Block.forward, self), x, use_reentrant=False)


def _micro_batches(mode: str, rank: int, ws: int) -> list[tuple[int, int]]:
    """Row ranges of the global batch this rank back-propagates, one backward each."""
    n = GB // ws
    a, b = rank * n, (rank + 1) * n
    return [(a, a + n // 2), (a + n // 2, b)] if mode == "accumulate" else [(a, b)]


@functools.lru_cache(maxsize=None)
def _reference(mode: str, ws: int):
    if mode not in ("plain", "accumulate", "checkpoint"):  # hsdp, offload: the same arithmetic as plain
        return _reference("plain", ws)
    return _unsharded_reference(mode, ws)


def _unsharded_reference(mode: str, ws: int):
    """Unsharded float64: every rank's micro-batches, each loss divided by the world size (the
    sharded run averages the ranks' gradients and sums the micro-batches')."""
    torch.set_num_threads(1)
    model = build("net", dtype=F64)
    opt = make_opt("adamw", model.parameters())
    for step in range(STEPS):
        x, y = batch(step, GB, 12, dtype=F64)
        for r in range(ws):
            for a, b in _micro_batches(mode, r, ws):
                (loss_fn(model(x[a:b]), y[a:b]) / ws).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _full(p) -> torch.Tensor:
    if len(p.placements) > 1:  # HSDP: replicated over the first dimension
        return p.full_tensor().detach().clone()
    (pl,) = p.placements
    return pl._to_replicate_tensor(p._local_tensor.detach(), p.device_mesh, 0, p.shape).clone()


_DTYPES = {"fp64": (F64, None), "fp32": (torch.float32, None),
           "bf16": (torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
           "fp8": (torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                       all_gather_dtype=E4M3))}


def _mesh(device: str, mode: str, ws: int):
    """The world as one shard group, or (hsdp) as 2 replicas x ws/2 shards -- on gloo, checked as
    :func:`world_mesh` checks the 1-D one (two ranks share the one GPU)."""
    if mode != "hsdp":
        return world_mesh(device)
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp2.comm.devices import group_backend

    mesh = init_device_mesh(device, (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    for dim in range(2):
        backend = group_backend(mesh.get_group(dim), device)
        if backend != "gloo":
            raise RuntimeError(f"the HSDP mesh's dimension {dim} runs its {device} collectives on {backend!r}")
    return mesh


def _harness(delay: float, device: str, path: str, mode: str) -> SlowCollectives:
    return SlowCollectives(delay, device, stream_ordered=path == "stream", premul_sum=mode == "premul")


def _train(rank: int, ws: int, device: str, allocator: str, depth: int, mode: str, dtype: str = "fp64",
           keep: list | None = None, harness=None, keep_gathered: bool = False) -> tuple[dict, list]:
    """Train under ``harness`` (a SlowCollectives, or None), then gather the parameters once it
    has ended: the gathers are DTensor's own collectives, which the harness does not see, and
    issued while its worker still holds collectives, the ranks could issue them in another order.
    ``keep``: gets the model, so that its buffers outlive collectives nobody waited for.
    ``keep_gathered``: no unit reshards (after forward or backward)."""
    with harness if harness is not None else contextlib.nullcontext():
        model, log = _fit(rank, ws, device, allocator, depth, mode, dtype, keep, keep_gathered)
    if keep_gathered:  # every collective has ended: the sharded parameters again
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
    if device == "cuda":
        torch.cuda.synchronize()
    return {k: _full(p).cpu() for k, p in model.named_parameters()}, log


def _fit(rank: int, ws: int, device: str, allocator: str, depth: int, mode: str, dtype: str, keep,
         keep_gathered: bool = False):
    mesh = _mesh(device, mode, ws)  # gloo asserted: two ranks share the one GPU
    param_dtype, mp = _DTYPES[dtype]
    model = build("net", dtype=param_dtype).to(device)
    if keep is not None:
        keep.append(model)
    if mode == "checkpoint":
        for b in model.blocks:
            b.__class__ = _CkptBlock
    kw = {"mp_policy": mp} if mp is not None else {}
    if mode == "offload":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device == "cuda")
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, allocator=allocator, **kw)
    model.set_prefetch_depth(depth)
    if mode == "premul":
        model.set_gradient_divide_factor(PREMUL_FACTOR, recurse=True)
    if keep_gathered:
        model.set_reshard_after_forward(False)
        model.set_reshard_after_backward(False)
    opt = make_opt("adamw", model.parameters())
    event_log.clear()
    event_log.enabled = True
    try:
        for step in range(STEPS):
            x, y = batch(step, GB, 12, dtype=param_dtype)
            parts = _micro_batches(mode, rank, ws)
            for i, (a, b) in enumerate(parts):
                model.set_requires_gradient_sync(i == len(parts) - 1)
                loss_fn(model(x[a:b].to(device)), y[a:b].to(device)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        event_log.enabled = False
    return model, list(event_log.events)


def _setup(device: str) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def _runs(rank: int, ws: int, device: str, configs: list) -> dict:
    _setup(device)
    out = {}
    for cfg in configs:
        *train_cfg, path = cfg
        if path == "real":
            params, log = _train(rank, ws, device, *train_cfg)
            out[cfg] = {"params": params, "log": log}
            continue
        mode = cfg[2]
        fast = _train(rank, ws, device, *train_cfg, harness=_harness(0.0, device, path, mode))
        slow = _harness(DELAY, device, path, mode)
        params, log = _train(rank, ws, device, *train_cfg, harness=slow)
        out[cfg] = {"params": params, "log": log, "fast_params": fast[0], "fast_log": fast[1], "issued": slow.issued,
                    "waited_early": slow.waited_early, "overtaken": slow.overtaken, "poisoned": slow.poisoned,
                    "premul": slow.premul_issued, "gate": getattr(slow.streams, "gate_name", "")}
        if mode == "premul":  # the same reduction with the backend's own arithmetic (a pre-scale, SUM)
            own = SlowCollectives(0.0, device, stream_ordered=path == "stream")
            out[cfg]["prescaled_params"] = _train(rank, ws, device, *train_cfg, harness=own)[0]
    if device == "cuda" and ws == 2:
        # mfsdp2's gloo path with the real gloo on CUDA tensors (no harness)
        real = ("caching", 1, "plain", "fp64", "real")
        out[real] = {"params": _train(rank, ws, device, *real[:4])[0]}
        out["host_not_blocked"] = _gloo_cuda_does_not_block(rank, ws)
    return out


_CACHE: dict = {}


def _results(device: str, ws: int) -> list:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (two ranks share it)")
    key = (device, ws)
    if key not in _CACHE:
        configs = [c for d, w, c in _RUNS if (d, w) == key]
        _CACHE[key] = run_ranks(_runs, ws, device, configs, timeout=600)
    return _CACHE[key]


@pytest.mark.slow
@pytest.mark.parametrize("device, ws, cfg", CASES)
def test_training_with_slow_collectives_matches_the_reference_and_the_undelayed_run(device, ws, cfg):
    runs = _results(device, ws)
    ref = _reference(cfg[2], ws) if cfg[3] == "fp64" else None
    for rank, r in enumerate(runs):
        c = r[cfg]
        assert c["issued"] > 0, c
        assert c["poisoned"] > 0, "no block the runtime freed was poisoned"
        if cfg[2] == "premul":  # the PREMUL_SUM path ran, and equals the pre-scaled SUM bit for bit
            assert c["premul"] > 0, "the reduce plan did not take PREMUL_SUM"
            for name, v in c["params"].items():
                assert torch.equal(v, c["prescaled_params"][name]), f"rank {rank} {cfg} {name}: PREMUL_SUM"
        # the delay was there, and it mattered: the host went on (stream path) or waited early (gloo)
        assert (c["overtaken"] if cfg[4] == "stream" else c["waited_early"]) > 0, {
            k: c[k] for k in ("issued", "waited_early", "overtaken")}
        for name, v in c["params"].items():
            assert torch.equal(v, c["fast_params"][name]), f"rank {rank} {cfg} {name}: depends on collective timing"
        if ref is not None:
            for name, v in ref.items():
                assert_close_rel(c["params"][name].to(F64), v, f"rank {rank} {cfg} {name}", REL_F64)


def _forward_prefetched(log: list) -> bool:
    """In the last step (the first one records the order the prefetch follows), for each unit but
    the last: the next unit's gather is issued before this unit's forward ends."""
    start = max(i for i, e in enumerate(log) if e == ("ag_issue", "root"))  # the root's gather opens a step
    log = log[start:]
    fwd = [u for kind, u in log if kind == "forward_begin"]
    order = list(dict.fromkeys(fwd))
    for k, u in enumerate(order[:-1]):
        end = log.index(("forward_end", u)) if ("forward_end", u) in log else len(log)
        if ("ag_issue", order[k + 1]) not in log[:end]:
            return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("device, ws, cfg", CASES)
def test_event_order_does_not_depend_on_collective_speed(device, ws, cfg):
    for r in _results(device, ws):
        c = r[cfg]
        assert c["log"] == c["fast_log"]
        assert c["log"], "no events recorded"
        if cfg[1] >= 1:
            assert _forward_prefetched(c["log"]), c["log"]


@pytest.mark.slow
@needs_cuda
@pytest.mark.xdist_group("slow-cuda2")
def test_real_gloo_with_cuda_tensors_trains_like_the_reference_without_blocking_the_host():
    runs = _results("cuda", 2)
    ref = _reference("plain", 2)
    real = ("caching", 1, "plain", "fp64", "real")
    for rank, r in enumerate(runs):
        for name, v in ref.items():
            assert_close_rel(r[real]["params"][name], v, f"rank {rank} real gloo {name}", REL_F64)
        issue_s, gpu_s = r["host_not_blocked"]
        assert issue_s < gpu_s / 4, (f"rank {rank}: the gather took {issue_s:.3f} s of host time, "
                                     f"the GPU was busy {gpu_s:.3f} s")


@needs_cuda
@pytest.mark.parametrize("gate", ["memop", "hostfunc"])
def test_cuda_gate_holds_the_stream_until_opened(gate):
    """The device-side gate of the harness, alone, in a subprocess (a gate the device never sees
    opening would leave its stream stuck). A gate the driver refuses to arm is skipped; the
    harness then uses the other (and at least one must work)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "tests._late_streams", gate], capture_output=True, text=True,
                         timeout=60, cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    if not r["armed"]:
        other = "hostfunc" if gate == "memop" else "memop"
        pytest.skip(f"the driver refuses the {gate} gate ({r['error']}); the harness uses {other}")
    assert r["held"] and r["stale_without_wait"], r
    assert r["released"], r


def _gloo_cuda_does_not_block(rank: int, ws: int) -> tuple[float, float]:
    """Host time of ``Communicator.all_gather`` of CUDA tensors over gloo while the current
    stream sleeps ~0.2 s first, and that sleep's length (measured)."""
    import torch.distributed as dist

    from mfsdp2.comm.communicator import Communicator

    dev = torch.device("cuda", 0)
    comm = Communicator(dist.group.WORLD, dev)
    assert not comm.stream_ordered and comm.backend == "gloo"
    inp = torch.ones(1 << 16, device=dev)
    out = torch.empty(ws << 16, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(300_000_000)
    torch.cuda.synchronize()
    gpu_s = time.perf_counter() - t0
    torch.cuda._sleep(300_000_000)
    t0 = time.perf_counter()
    h = comm.all_gather(out, inp, "probe")
    issue_s = time.perf_counter() - t0
    h.wait()
    torch.cuda.synchronize()
    assert bool((out == 1).all())
    return issue_s, gpu_s


def _no_wait(rank: int, ws: int, device: str) -> tuple[dict, dict | None]:
    from mfsdp2.comm.communicator import CommHandle, Communicator

    _setup(device)
    # On the CPU a resharded unit's gathered bytes can go back to torch's allocator, which hands
    # them to malloc: without storage swapping (torch 2.11) ``storage.resize_(0)`` frees them, and
    # the caching allocator returns blocks it will not reuse soon. A gather landing after that
    # writes freed heap memory (glibc aborts the rank: "corrupted size vs. prev_size in
    # fastbins", "corrupted double-linked list"), which ``keep`` cannot prevent. So on the CPU the
    # units stay gathered: every late gather lands in memory that stays the unit's, and is read
    # before it landed all the same. (A CUDA write-back is stream-ordered before any reuse.)
    keep_gathered = device == "cpu"
    real = Communicator.all_gather

    def all_gather_reported_done(self, out, inp, label=""):
        real(self, out, inp, label)  # still runs, late, on the backend (or its stream)
        return CommHandle(label=label)  # a runtime that takes the gather as finished at once

    Communicator.all_gather = all_gather_reported_done
    alive: list = []  # the late gathers write the model's blocks: keep them until they ended
    try:
        params, _ = _train(rank, ws, device, "caching", 1, "plain", keep=alive, harness=SlowCollectives(DELAY, device),
                           keep_gathered=keep_gathered)
    finally:
        Communicator.all_gather = real
    # The units-kept-gathered configuration trains right when the runtime does wait (the parity
    # test runs the other one): only the missing wait makes the run above wrong.
    waited = _train(rank, ws, device, "caching", 1, "plain", harness=SlowCollectives(DELAY, device),
                    keep_gathered=True)[0] if keep_gathered else None
    return params, waited


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_a_runtime_that_does_not_wait_trains_wrong_under_slow_collectives(device):
    """The harness can fail: gathered weights used before the (late) gather wrote them."""
    ref = _reference("plain", 2)
    for rank, (params, waited) in enumerate(run_ranks(_no_wait, 2, device, timeout=600)):
        wrong = [k for k, v in ref.items() if not torch.allclose(params[k].to(F64), v, rtol=REL_F64, atol=0)]
        assert wrong, "the slow collectives did not expose a missing wait"
        if waited is not None:
            for name, v in ref.items():
                assert_close_rel(waited[name].to(F64), v, f"rank {rank} units kept gathered, waiting {name}", REL_F64)


def _early_inputs(rank: int, ws: int, device: str) -> dict:
    """Runtimes that give up a collective's *input* right after launching it, without waiting:

    * ``rs_freed``: each group's flat gradient (the reduce-scatter's input, an allocator block)
      goes back to the allocator as soon as the reduce-scatter is issued -- the missing
      ``record_stream`` / missing event class of bug;
    * ``ag_overwritten``: the all-gather's input (this rank's shard, staged in its slice of the
      gathered buffer) is overwritten (zeroed) as soon as the gather is issued.

    And the real runtime in the ``rs_freed`` configuration. On the CPU, gloo's reduce-scatter
    runs as the collective it is (``MFSDP2_GLOO_P2P_REDUCE_SCATTER=0``): the default small
    reductions share a bucketed all-reduce whose input is the bucket, not the group's block."""
    from mfsdp2.comm.communicator import Communicator
    from mfsdp2.groups.grad_reduction import GradientReduction
    from mfsdp2.memory.allocator import BufferRole

    _setup(device)
    os.environ["MFSDP2_GLOO_P2P_REDUCE_SCATTER"] = "0"
    out: dict = {}
    real_reduce, real_gather = GradientReduction.reduce_grads, Communicator.all_gather
    count = [0]

    def frees_input_at_launch(self, allocator, key, label="", buckets=None):
        bucketed = real_reduce(self, allocator, key, label, buckets)
        if allocator.is_live((BufferRole.GRAD, key)):
            allocator.free((BufferRole.GRAD, key))  # no wait: the reduce-scatter has not read it yet
            count[0] += 1
        return bucketed

    def overwrites_input_at_launch(self, out_, inp, label=""):
        handle = real_gather(self, out_, inp, label)
        inp.zero_()  # no wait: the gather has not read it yet
        count[0] += 1
        return handle

    for case, attr, broken in (("rs_freed", "reduce_grads", frees_input_at_launch),
                               ("ag_overwritten", "all_gather", overwrites_input_at_launch)):
        owner = GradientReduction if attr == "reduce_grads" else Communicator
        real = getattr(owner, attr)
        setattr(owner, attr, broken)
        count[0] = 0
        try:
            params = _train(rank, ws, device, "caching", 1, "plain", harness=SlowCollectives(DELAY, device))[0]
        finally:
            setattr(owner, attr, real)
        out[case] = (params, count[0])
    out["real"] = _train(rank, ws, device, "caching", 1, "plain", harness=SlowCollectives(DELAY, device))[0]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_a_runtime_that_gives_up_a_collective_input_early_trains_wrong_under_slow_collectives(device):
    """The harness can fail on inputs: a reduce-scatter input freed, or an all-gather input
    overwritten, right after the launch is read at the collective's late turn -- poisoned
    (the freed block) or zero -- every time; the real runtime, waiting first, trains right."""
    ref = _reference("plain", 2)
    for rank, r in enumerate(run_ranks(_early_inputs, 2, device, timeout=600)):
        for case in ("rs_freed", "ag_overwritten"):
            params, given_up = r[case]
            assert given_up > 0, f"{case}: the broken runtime never ran"
            wrong = [k for k, v in ref.items() if not torch.allclose(params[k].to(F64), v, rtol=REL_F64, atol=0)]
            assert wrong, f"rank {rank}: the slow collectives did not expose {case}"
        for name, v in ref.items():
            assert_close_rel(r["real"][name].to(F64), v, f"rank {rank} real runtime {name}", REL_F64)
