"""A steady-state training step makes no host synchronisation in the runtime; a forward without
a fact every rank shares (a micro-batch of gradient accumulation, an eval pass with no step since
the last gather) makes one host read for persistent weights on a CPU mesh only.

What counts (CPU runs, where there is no device to wait for, so the rule is structural): a call
of ``Tensor.item / tolist / cpu / numpy / __bool__ / __float__ / __int__ / __index__`` made
*directly from code in the mfsdp2 package* (the caller's frame is in ``mfsdp2/``), on any tensor
except those the runtime marks as host metadata (``_mfsdp2_host_metadata``: tensors created on
the CPU from facts the host already knows, agreed over a gloo group, e.g. which parameters had a
gradient). On a GPU each counted call would be a device-to-host copy that waits for the stream;
calls made inside torch (the optimizer's step counter, DTensor's metadata) are not the runtime's
and are not counted. The CUDA variant below checks the real thing with
``torch.cuda.set_sync_debug_mode``.

Expected per steady-state step (forward, backward, optimizer step): 0 for every strategy. The
forward after an optimizer step re-gathers persistent weights (ZeRO-1/2, no_shard) on that
common fact, with nothing to compare or agree (``weight_watch.agree_on_gathers``).

Expected per forward without such a fact (``test_forwards_without_a_step``): on a CPU mesh,
ZeRO-1/2 and no_shard with a compute dtype other than the main weights' compare the content: one
all-reduce of the flags and one read (a plain read of host memory there); under the policy of
devices whose reads synchronise (``weight_watch.set_host_read_synchronises(True)``: CUDA, forced
on the CPU here) and under offload on such devices, no read and no blocking collective: the
persistent groups re-gather (their all-gathers are counted). ``set_detect_data_writes(False)``:
neither, under both.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import mfsdp2
from mfsdp2 import MixedPrecisionPolicy, fully_shard

from .._dist import run_ranks
from ..models import batch, build, loss_fn

_PKG = os.path.dirname(os.path.abspath(mfsdp2.__file__)) + os.sep
_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
WARMUP, MEASURED = 3, 2


class HostReads:
    """Counts host reads of tensors made directly from mfsdp2 code while installed."""

    def __init__(self):
        self.calls: list[str] = []
        self._saved = {}

    def __enter__(self):
        for name in _METHODS:
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def wrapper(t, *args, _orig=orig, _name=name, **kwargs):
                caller = sys._getframe(1)
                if caller.f_code.co_filename.startswith(_PKG) and not getattr(t, "_mfsdp2_host_metadata", False):
                    where = os.path.relpath(caller.f_code.co_filename, _PKG)
                    self.calls.append(f"{_name} in {where}:{caller.f_lineno} ({caller.f_code.co_name})")
                return _orig(t, *args, **kwargs)

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)


CONFIGS = {
    # name: (mesh shape, strategy, mixed precision, host reads expected per step)
    "zero3": ((4,), "optim_grads_params", MixedPrecisionPolicy(), 0),
    "fp8": ((4,), "optim_grads_params",
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather_dtype=torch.float8_e4m3fn), 0),
    "hsdp": ((2, 2), "optim_grads_params", MixedPrecisionPolicy(), 0),
    # Persistent weights: the forward after a step re-gathers on that common fact, no read.
    "zero2": ((4,), "optim_grads", MixedPrecisionPolicy(), 0),
    "zero1": ((4,), "optim", MixedPrecisionPolicy(param_dtype=torch.bfloat16), 0),
    # no_shard computes with the main weights' own memory (equal dtypes, a shard group of one
    # rank): nothing to fingerprint or re-gather.
    "no_shard": ((4,), "no_shard", MixedPrecisionPolicy(), 0),
    "no_shard_bf16": ((4,), "no_shard", MixedPrecisionPolicy(param_dtype=torch.bfloat16), 0),
    # set_detect_data_writes(False): host facts only.
    "zero2_no_content_check": ((4,), "optim_grads", MixedPrecisionPolicy(), 0),
    "no_shard_no_content_check": ((4,), "no_shard", MixedPrecisionPolicy(), 0),
}


def _wrap(model, mesh, name, strategy, mp):
    for b in model.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp, sharding_strategy=strategy)
    fully_shard(model, mesh=mesh, mp_policy=mp, sharding_strategy=strategy)
    if name.endswith("no_content_check"):
        model.set_detect_data_writes(False)
    return model


def _step(model, opt, step, rank, ws):
    n = 8 // ws
    x, y = batch(step, 8, 12)
    out = model(x[rank * n : (rank + 1) * n])
    loss_fn(out.float(), y[rank * n : (rank + 1) * n]).backward()
    opt.step()
    opt.zero_grad()


def _count(rank, ws, device="cpu"):
    out = {}
    for name, (shape, strategy, mp, _) in CONFIGS.items():
        mesh = init_device_mesh(device, shape if ws > 1 else (1,) * len(shape))
        model = _wrap(build("net").to(device), mesh, name, strategy, mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(WARMUP):
            _step(model, opt, step, rank, ws)
        with HostReads() as reads:
            for step in range(WARMUP, WARMUP + MEASURED):
                _step(model, opt, step, rank, ws)
        out[name] = reads.calls
    return out


def test_steady_state_steps_make_no_host_reads():
    results = run_ranks(_count, 4)
    for rank, per_config in enumerate(results):
        for name, calls in per_config.items():
            expected = CONFIGS[name][3] * MEASURED
            assert len(calls) == expected, (f"rank {rank}, {name}: {len(calls)} host reads in {MEASURED} steps, "
                                            f"expected {expected}: {calls}")


def _cuda_sync_warnings(rank, ws):
    torch.cuda.set_device(0)
    out = {}
    for name, (shape, strategy, mp, _) in CONFIGS.items():
        mesh = init_device_mesh("cuda", (1,) * len(shape))
        model = _wrap(build("net").cuda(), mesh, name, strategy, mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        x, y = batch(0, 8, 12)
        x, y = x.cuda(), y.cuda()

        def step():
            loss_fn(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()

        for _ in range(WARMUP):
            step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out[name] = sync_warnings([str(w.message) for w in caught])
    return out


# torch.cuda.set_sync_debug_mode("warn") announces itself once with a warning of its own, which
# mentions synchronisation but is none.
_DEBUG_MODE_NOTICE = "Synchronization debug mode is a prototype feature"


def sync_warnings(messages: list[str]) -> list[str]:
    """The first lines of the warnings that report a synchronising CUDA call."""
    return [m.splitlines()[0] for m in messages if "synchroniz" in m.lower() and not m.startswith(_DEBUG_MODE_NOTICE)]


def test_sync_warning_filter():
    """The CUDA check's harness: torch's notice about the debug mode is not a synchronisation;
    each real report is (the messages as torch 2.11 words them)."""
    notice = ("Synchronization debug mode is a prototype feature and does not yet detect all "
              "synchronizing operations (see https://github.com/pytorch/pytorch/issues/64883 for more details)")
    real = "called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:119.)"
    assert sync_warnings([notice]) == []
    assert sync_warnings([notice, real, "some other warning", real]) == [real, real]


@pytest.mark.cuda
def test_cuda_steady_state_step_synchronises_only_where_documented():
    """One GPU, world size 1: a steady-state step makes no synchronising CUDA call at all, for
    every strategy."""
    (result,) = run_ranks(_cuda_sync_warnings, 1)
    for name, syncs in result.items():
        expected = CONFIGS[name][3]
        assert len(syncs) == expected, f"{name}: {len(syncs)} synchronising calls, expected {expected}: {syncs}"


# -- forwards without a common fact ------------------------------------------------------------
# name: (strategy, mixed precision, offload, detect data writes,
#        host reads per forward on a CPU mesh, whether persistent groups re-gather there)
NO_FACT = {
    "zero2": ("optim_grads", MixedPrecisionPolicy(), False, True, 1, False),
    "zero1_bf16": ("optim", MixedPrecisionPolicy(param_dtype=torch.bfloat16), False, True, 1, False),
    "no_shard_bf16": ("no_shard", MixedPrecisionPolicy(param_dtype=torch.bfloat16), False, True, 1, False),
    "zero2_offload": ("optim_grads", MixedPrecisionPolicy(), True, True, 1, False),
    "zero2_no_content_check": ("optim_grads", MixedPrecisionPolicy(), False, False, 0, False),
}


class Collectives:
    """Counts the all-reduces and all-gathers mfsdp2's communicators issue while installed."""

    def __init__(self):
        from mfsdp2.comm.communicator import Communicator

        self._cls = Communicator
        self.all_reduce = self.all_gather = 0

    def __enter__(self):
        cls = self._cls
        self._saved = (cls.all_reduce, cls.all_gather)
        orig_ar, orig_ag = self._saved

        def all_reduce(comm, *args, **kwargs):
            self.all_reduce += 1
            return orig_ar(comm, *args, **kwargs)

        def all_gather(comm, *args, **kwargs):
            self.all_gather += comm.world_size > 1
            return orig_ag(comm, *args, **kwargs)

        cls.all_reduce, cls.all_gather = all_reduce, all_gather
        return self

    def __exit__(self, *exc):
        self._cls.all_reduce, self._cls.all_gather = self._saved


def _no_fact_forwards(rank, ws, synchronising):
    """Per configuration: host reads, all-reduces and all-gathers of the forwards of two
    accumulation micro-batches after the first (no step in between) and of an eval pass, and
    the same for the first micro-batch after a step (a common fact)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from mfsdp2.groups import weight_watch

    prev = weight_watch.set_host_read_synchronises(synchronising)
    out = {}
    try:
        for name, (strategy, mp, offload, detect, _, _) in NO_FACT.items():
            mesh = init_device_mesh("cpu", (ws,))
            kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
            model = build("net")
            for b in model.blocks:
                fully_shard(b, mesh=mesh, mp_policy=mp, sharding_strategy=strategy, **kw)
            fully_shard(model, mesh=mesh, mp_policy=mp, sharding_strategy=strategy, **kw)
            model.set_detect_data_writes(detect)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x, y = batch(0, 8, 12)
            x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
            counts = {}
            for step in range(WARMUP):
                for j in range(3):
                    model.set_requires_gradient_sync(j == 2)
                    phase = "after_step" if j == 0 else "micro_batch"
                    with HostReads() as reads, Collectives() as coll:
                        y_hat = model(x)
                    if step == WARMUP - 1:
                        counts[phase] = counts.get(phase, []) + [(len(reads.calls), coll.all_reduce, coll.all_gather)]
                    loss_fn(y_hat.float(), y).backward()
                opt.step()
                opt.zero_grad()
            model(x).sum().backward()  # one step more, then two eval passes without a step
            opt.step()
            opt.zero_grad()
            for i in range(2):
                with torch.no_grad(), HostReads() as reads, Collectives() as coll:
                    model(x)
                counts.setdefault("eval", []).append((len(reads.calls), coll.all_reduce, coll.all_gather))
            out[name] = counts
    finally:
        weight_watch.set_host_read_synchronises(prev)
    return out


@pytest.mark.parametrize("synchronising", [False, True], ids=["cpu_policy", "accelerator_policy"])
def test_forwards_without_a_step(synchronising):
    for rank, per_config in enumerate(run_ranks(_no_fact_forwards, 2, synchronising)):
        for name, counts in per_config.items():
            reads_cpu = NO_FACT[name][4]
            detect = NO_FACT[name][3]
            where = f"rank {rank}, {name}: {counts}"
            # The forward after a step: a common fact, no read, no collective but the gathers.
            ((r, ar, ag),) = counts["after_step"]
            assert r == 0 and ar == 0, where
            gathers_after_step = ag
            # micro-batches, and the eval pass after the first (the first follows a step)
            for r, ar, ag in counts["micro_batch"] + counts["eval"][1:]:
                if not detect:  # host facts only: nothing read, agreed or gathered
                    assert (r, ar, ag) == (0, 0, 0), where
                elif synchronising:  # re-gather: no read, no blocking collective
                    assert r == 0 and ar == 0 and ag == gathers_after_step, where
                else:  # content check: one all-reduce of the flags (none within one rank), one read
                    assert r == reads_cpu and ar == (NO_FACT[name][0] != "no_shard") and ag == 0, where
            r, ar, _ = counts["eval"][0]
            assert r == 0 and ar == 0, where


# -- the fingerprint a gather takes, predicted from the common facts -----------------------------
def _fingerprint_prediction(rank, ws):
    """ZeRO-2 on a CPU mesh (the content check's policy): after each forward, how many groups
    hold a fingerprint, the all-reduces and all-gathers of the forward, and its output's error
    against the unsharded model with the current weights. Five training steps, then four
    micro-batches without a step (a ``.data`` write before the second and third), then a step
    and two eval passes (a write before the second)."""
    model = build("net").to(torch.float64)
    mesh = init_device_mesh("cpu", (ws,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, sharding_strategy="optim_grads")
    fully_shard(model, mesh=mesh, sharding_strategy="optim_grads")
    groups = [g for m in model.modules() if getattr(m, "_mfsdp2_state", None) is not None
              for g in m._mfsdp2_state.groups]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = batch(0, 8, 12)
    x, y = x.double()[rank * 4 : rank * 4 + 4], y.double()[rank * 4 : rank * 4 + 4]

    def forward(write: bool, grad: bool):
        if write:
            with torch.no_grad():
                for p in model.parameters():
                    p.data.mul_(0.5)  # bumps no version counter: only a content check or a re-gather sees it
        ref = build("net").to(torch.float64)
        ref.load_state_dict({k: p.full_tensor() for k, p in model.named_parameters()})
        with torch.set_grad_enabled(grad), Collectives() as coll:
            out = model(x)
        with torch.no_grad():
            err = (out - ref(x)).abs().max().item()
        seen.append((sum(g.has_baseline for g in groups), coll.all_reduce, coll.all_gather, err))
        return out

    seen: list = []
    for _ in range(5):
        loss_fn(forward(False, True), y).backward()
        opt.step()
        opt.zero_grad()
    for write in (False, True, True, False):
        loss_fn(forward(write, True), y).backward()
    opt.step()
    opt.zero_grad()
    forward(False, False)
    forward(True, False)
    return seen, len(groups)


def test_fingerprints_follow_the_forwards_that_read_them():
    """A gather fingerprints the main shards only for a later forward without a common fact;
    with one grad-enabled forward per optimizer step none comes. From the third such forward
    in a row the gathers take none. The first micro-batch after the last of them (a fact: it
    re-gathers) takes none either; the second (no fact) finds none, re-gathers with no
    agreement (no all-reduce), sees the ``.data`` write, and takes the fingerprints the later
    ones compare with (one all-reduce of the flags each): the third sees the next write, the
    fourth that nothing changed (no gather). An eval pass (no_grad) after a step takes them, so
    the next eval pass compares and sees a write."""
    for rank, (seen, n) in enumerate(run_ranks(_fingerprint_prediction, 2)):
        where = f"rank {rank}: (fingerprints held, all-reduces, all-gathers, error) per forward {seen}"
        assert n > 1 and all(err < 1e-12 for *_, err in seen), where
        held = [h for h, *_ in seen]
        assert held == [n, n, 0, 0, 0, 0, n, n, n, n, n], where
        gathers = seen[1][2]  # one bucket (the first forward, with no recorded order, one per unit)
        assert gathers >= 1 and all(ag == gathers for _, _, ag, _ in seen[1:8]), where
        assert [ar for _, ar, _, _ in seen[:8]] == [0] * 7 + [1], where
        assert seen[8][1:3] == (1, 0), where  # compares, nothing changed: no gather
        assert seen[9][1:3] == (0, gathers), where  # after a step: a fact
        assert seen[10][1:3] == (1, gathers), where  # compares, sees the write


def _explicit_unshards(rank, ws):
    """ZeRO-2 on a CPU mesh, the blocks unsharded explicitly before each forward (a user's
    prefetch) from the fifth step: the elements each forward all-gathers, and its error against
    the current weights."""
    from mfsdp2.comm.communicator import Communicator

    gathered = [0]
    orig = Communicator.all_gather

    def counting(comm, out_, inp, *a, **k):
        gathered[0] += out_.numel() if comm.world_size > 1 else 0
        return orig(comm, out_, inp, *a, **k)

    model = build("net").to(torch.float64)
    mesh = init_device_mesh("cpu", (ws,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, sharding_strategy="optim_grads")
    fully_shard(model, mesh=mesh, sharding_strategy="optim_grads")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = batch(0, 8, 12)
    x, y = x.double()[rank * 4 : rank * 4 + 4], y.double()[rank * 4 : rank * 4 + 4]
    out = []
    for step in range(7):
        ref = build("net").to(torch.float64)
        ref.load_state_dict({k: p.full_tensor() for k, p in model.named_parameters()})
        if step >= 4:  # after a run of steps whose forwards took no fingerprints
            for b in model.blocks:
                b.unshard()
        gathered[0] = 0
        Communicator.all_gather = counting
        try:
            y_hat = model(x)
        finally:
            Communicator.all_gather = orig
        with torch.no_grad():
            err = (y_hat - ref(x)).abs().max().item()
        out.append((gathered[0], err))
        loss_fn(y_hat, y).backward()
        opt.step()
        opt.zero_grad()
    return out


def test_a_gather_between_forwards_takes_its_fingerprint():
    """An explicit ``unshard()`` after a step gathers the stepped weights and consumes the step's
    fact, so the forward after it compares content: the gather takes its fingerprint even after
    a run of forwards that took none, and that forward gathers nothing more for the blocks (the
    first such step as the later ones: fewer elements than the forwards that gather them)."""
    for rank, out in enumerate(run_ranks(_explicit_unshards, 2)):
        assert all(err < 1e-12 for _, err in out), (rank, out)
        elements = [n for n, _ in out]
        assert elements[4] == elements[5] == elements[6] < elements[3] == elements[2], (rank, elements)
