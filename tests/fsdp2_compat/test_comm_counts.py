"""Collective counts per training step equal torch FSDP2's (the contract its comm-count tests
check): all-gathers and reduce-scatters for the default schedule, with the root resharded too
(``reshard_after_forward=True`` passed to it), without reshard after forward,
with gradient accumulation (sync on the last micro-batch only), with the tuned accumulation
(no reshard after backward between micro-batches), with a grouped unit ``fully_shard([a, b])``
(gathered and reduced once per pass, not once per module), and with ``set_reshard_after_forward``
called after ``fully_shard`` (on every unit, and with ``recurse=False`` on the root alone). FSDP2's are counted at the
``torch.distributed`` functions it calls, in the same process; ours with
:data:`mfsdp2.comm.communicator.comm_stats` (on gloo our reduce-scatter is point-to-point sends, which a count
at ``torch.distributed`` would not see as one collective).

Nothing beyond FSDP2's: the gradient-presence agreement (``mfsdp2.runtime.grad_presence``) is one small
all-reduce per step only where ``set_reduce_scatter_unused_params(True)`` asks for it
(tests/runtime/test_grad_presence.py counts both).

One documented difference: on gloo a small unit's reduce-scatter is an all-reduce of its whole
flat gradient, so such units share bucketed all-reduces (``mfsdp2.groups.grad_buckets``, 25 MiB like
DDP's). FSDP2's contract is checked with the buckets off (``set_all_reduce_bucket_cap_mb(0)``),
and the bucketed counts beside it: the same all-gathers, no reduce-scatter, one all-reduce for all
of this small model's units.
"""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh
import torch.distributed as dist

from mfsdp2.base import compat
from mfsdp2 import fully_shard as mfsdp2_shard
from mfsdp2.comm.communicator import comm_stats

from .._dist import run_ranks
from ..models import F64, batch, build, loss_fn, make_opt

WS, GB = 2, 8
SCHEDULES = ["default", "root_resharded", "no_reshard_after_forward", "accumulate", "accumulate_tuned", "grouped",
             "setter_no_reshard", "setter_root_only"]


def _step(model, opt, rank, ws, schedule, step):
    x, y = batch(step, GB, model.inp.in_features, dtype=F64)
    micro = 2 if schedule.startswith("accumulate") else 1
    n = GB // (ws * micro)
    for i in range(micro):
        last = i == micro - 1
        model.set_requires_gradient_sync(last)
        if schedule == "accumulate_tuned":
            model.set_reshard_after_backward(last)
        lo = (rank * micro + i) * n
        loss_fn(model(x[lo : lo + n]), y[lo : lo + n]).backward()
    opt.step()
    opt.zero_grad()


class _counting:
    """Count calls of the torch.distributed collectives FSDP2 issues (patched for the block)."""

    NAMES = (compat.all_gather_name(), compat.reduce_scatter_name(), "all_reduce")

    def __enter__(self):
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.saved = {n: getattr(dist, n) for n in self.NAMES}
        for n, f in self.saved.items():
            setattr(dist, n, self._wrap(n, f))
        return self.counts

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(dist, n, f)


def _counts(rank, ws, schedule):
    from torch.distributed.fsdp import fully_shard as torch_shard

    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, shard in (("fsdp2", torch_shard), ("mfsdp2", mfsdp2_shard), ("mfsdp2_bucketed", mfsdp2_shard)):
        model = build("net", dtype=F64)
        # default: FSDP2's None (True below the root, False for it); root_resharded: True given
        # to the root too (one more all-gather, in backward)
        raf = {"no_reshard_after_forward": False, "root_resharded": True}.get(schedule)
        if schedule == "grouped":  # fully_shard([a, b]): one unit, gathered and reduced once per pass
            shard(model.blocks[0], mesh=mesh)
            shard([model.blocks[1], model.blocks[2]], mesh=mesh)
        else:
            for b in model.blocks:
                shard(b, mesh=mesh, reshard_after_forward=raf)
        shard(model, mesh=mesh, reshard_after_forward=raf)
        if schedule == "setter_no_reshard":  # after fully_shard, on every unit
            model.set_reshard_after_forward(False)
        elif schedule == "setter_root_only":  # after fully_shard, on the root alone
            model.set_reshard_after_forward(True, recurse=False)
        if name == "mfsdp2":
            model.set_all_reduce_bucket_cap_mb(0)  # every unit reduces alone, as in FSDP2
        opt = make_opt("adamw", model.parameters())
        _step(model, opt, rank, ws, schedule, 0)  # warm-up (lazy init)
        per_step = []
        for step in (1, 2):
            comm_stats.reset()
            with _counting() as c:
                _step(model, opt, rank, ws, schedule, step)
            if name == "fsdp2":
                per_step.append(tuple(c[n] for n in _counting.NAMES))
            else:
                per_step.append((comm_stats.all_gather_calls, comm_stats.reduce_scatter_calls,
                                 comm_stats.all_reduce_calls, comm_stats.reduce_scatters_in_buckets))
        out[name] = per_step
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_collective_counts_match_fsdp2(schedule):
    for out in run_ranks(_counts, WS, schedule):
        for (ag1, rs1, ar1), (ag2, rs2, ar2, _) in zip(out["fsdp2"], out["mfsdp2"]):
            assert (ag2, rs2) == (ag1, rs1), (f"{schedule}: mfsdp2 all-gathers/reduce-scatters {(ag2, rs2)}, "
                                              f"FSDP2 {(ag1, rs1)}")
            assert ar2 == ar1, f"{schedule}: {ar2} all-reduces, FSDP2 {ar1}"
        for (ag1, rs1, ar1), (ag3, rs3, ar3, in_buckets) in zip(out["fsdp2"], out["mfsdp2_bucketed"]):
            # Every unit of this model is below the gloo all-reduce threshold: one bucket per step,
            # holding as many unit reductions as FSDP2 issues reduce-scatters.
            got = (ag3, rs3, ar3, in_buckets)
            assert rs1 > 0 and got == (ag1, 0, ar1 + 1, rs1), (schedule, got, (ag1, rs1, ar1))
