"""mfsdp2's sharding strategies and FP8 all-gather against their torch baselines, in one run.

    python benchmarks/strategies.py [--quick] [--json PATH] [--steps N] [--cases mlp:fp32,llama:bf16,...]
                                    [--accum K]

What is measured. Each rank builds the same seeded model once per *variant* below, trains every
variant with ``AdamW(lr=1e-3, weight_decay=0.01)`` on the same batches, and the timed phase runs
rounds of one step per variant (the order rotated by one each round and reversed every other round,
a barrier before each step), so the machine's drift hits all variants alike. Variants of one case
group share the process and the rounds; the groups of a model run one after the other. torch FSDP2
appears twice: *default* (as shipped) and *tuned* (``_common.FSDP2_TUNED``: the fastest
configuration of its API on this backend, chosen by ``benchmarks/fsdp2_tuning.py``; CPU: async
unshard + explicit forward / backward prefetch of the next unit):

* group ``fp32`` (fp32 params, grads and reduction):

  - ``zero3``       mfsdp2 ``sharding_strategy="optim_grads_params"`` (ZeRO-3, the default)
  - ``fsdp2`` / ``fsdp2_tuned``  torch FSDP2 ``fully_shard(reshard_after_forward=True)`` (root left at its
    default), default / tuned
  - ``zero2``       mfsdp2 ``"optim_grads"`` (ZeRO-2: full weights kept, gathered once per step)
  - ``fsdp2_nr`` / ``fsdp2_nr_tuned``  torch FSDP2 with ``reshard_after_forward=False`` (weights
    kept from forward to backward, freed after backward, gathered again at the next forward)

* group ``ddp`` (fp32):

  - ``no_shard``    mfsdp2 ``"no_shard"`` (DDP-like)
  - ``zero1``       mfsdp2 ``"optim"`` (ZeRO-1: full weights and full gradients, reduce-scattered)
  - ``ddp``         torch ``DistributedDataParallel`` (``gradient_as_bucket_view=True``,
    ``broadcast_buffers=False``, default 25 MiB buckets; the Python ``allreduce_hook`` is
    registered as its comm hook so that its all-reduces go through ``dist.all_reduce`` and are
    counted: it does what the built-in hook does -- divide by the world size, all-reduce the bucket)

* group ``bf16`` (``param_dtype=bf16, reduce_dtype=fp32``, ZeRO-3 / ``reshard_after_forward=True``):

  - ``bf16``       mfsdp2
  - ``bf16_fp8``   mfsdp2 with ``all_gather_dtype=torch.float8_e4m3fn`` (>= 2-D weights gathered as
    float8 with per-parameter scales; norms and biases in bf16)
  - ``fsdp2_bf16`` / ``fsdp2_bf16_tuned``  torch FSDP2, default / tuned

* group ``fp8`` (mfsdp2 only, the bf16 settings above; not in the default cases):

  - ``bf16``, ``bf16_fp8`` as above (a unit's bf16 group rides in its float8 group's all-gather)
  - ``bf16_fp8_sep``  the same FP8 model with each group gathered on its own
    (``mfsdp2.precision.fp8.MERGE_GATHERS = False`` around its steps: ``MFSDP2_FP8_MERGED_GATHER=0``'s path)

Per variant: median step time (max over ranks, p10/p90 over the timed rounds); wire bytes per step
by collective kind (``_common.CollectiveCounter``: each collective's full buffer -- all-gather
output, reduce-scatter input, all-reduce tensor; mfsdp2's gloo reduce-scatter is built from
``isend``/``irecv`` and counts the bytes *sent*, which this script also converts back to the
reduce-scatter buffer, x N/(N-1)); an estimate of the bytes each rank *sends* on a ring (all-gather
and reduce-scatter (N-1)/N of the buffer, all-reduce 2(N-1)/N, p2p as counted); per-rank
persistent bytes, taken once after the timed phase, after backward and ``opt.step()``, before
``zero_grad`` (gradients alive): for mfsdp2 ``model.memory_stats()`` (model + main weights + FP8
shards, main grads) plus the optimizer's state tensors; for torch the local tensors of the
parameters, their ``.grad`` and the optimizer's states (each byte counted once: DDP's gradients
are views of its buckets); mfsdp2's ``transient_peak_bytes`` (its allocator's peak over the timed
steps: gathered weights, flat gradients, main grads) beside it; the loss of every step (mean over
ranks).

The comparisons reported as ratios (variant / baseline; against FSDP2 the headline is tuned FSDP2
and the default is a second column; beside them the *paired* ratio: per timed round, the
variant's step over the baseline's step of the same round -- they ran back to back, so slow
drift in the machine's load cancels -- as median, quartiles and the share of rounds below 1):
ZeRO-3 / FSDP2, ZeRO-2 / FSDP2 no-reshard, no_shard / DDP,
ZeRO-1 / DDP, bf16+FP8 / mfsdp2 bf16, bf16+FP8 / FSDP2 bf16 and mfsdp2 bf16 / FSDP2 bf16.

Cases: ``mlp``, ``llama`` and ``tiny`` of ``_common`` (8 x Linear(1024,4096)-GELU-Linear(4096,1024),
67.1M params, global batch 16; ``LlamaConfig.demo()``, 14.2M params, 8 x 128 tokens; 64 x
Linear(64,64), global batch 16) x groups. World size 2, gloo, one thread per rank. Default: mlp and
llama x fp32 / ddp / bf16, tiny x fp32 / ddp, 2 warm-up + 10 timed rounds (tiny 40); ``--quick``:
mlp:fp32, mlp:bf16 and llama:bf16 (llama for the FP8 loss: the mlp regression on random targets is
chaotic after a few steps), 2 + 4 rounds.

``--accum K`` splits each rank's batch into K micro-batches per optimizer step, the first K-1
without gradient synchronisation: what ZeRO-2 is for (its kept weights are gathered once per
optimizer step). FSDP2 default gathers once per micro-batch (twice with resharding after forward);
tuned FSDP2 keeps its gathered weights after each non-syncing backward
(``set_reshard_after_backward(False)``), and so does mfsdp2 ZeRO-3. The persistent-bytes step is
always one whole batch.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch  # noqa: E402
from compare_fsdp2 import _timed  # noqa: E402

# name -> (framework, _common config, mfsdp2 sharding_strategy, FP8 all-gather). Frameworks: "mfsdp2",
# "ddp", and _common's "fsdp2" (torch's defaults) / "fsdp2_tuned" (its fastest configuration on this
# backend, _common.FSDP2_TUNED).
VARIANTS = {
    "zero3": ("mfsdp2", "fp32", "optim_grads_params", False),
    "fsdp2": ("fsdp2", "fp32", None, False),
    "fsdp2_tuned": ("fsdp2_tuned", "fp32", None, False),
    "zero2": ("mfsdp2", "fp32", "optim_grads", False),
    "fsdp2_nr": ("fsdp2", "fp32_no_reshard", None, False),
    "fsdp2_nr_tuned": ("fsdp2_tuned", "fp32_no_reshard", None, False),
    "zero1": ("mfsdp2", "fp32", "optim", False),
    "no_shard": ("mfsdp2", "fp32", "no_shard", False),
    "ddp": ("ddp", "fp32", None, False),
    "bf16": ("mfsdp2", "bf16", "optim_grads_params", False),
    "bf16_fp8": ("mfsdp2", "bf16", "optim_grads_params", True),
    "bf16_fp8_sep": ("mfsdp2", "bf16", "optim_grads_params", True),
    "fsdp2_bf16": ("fsdp2", "bf16", None, False),
    "fsdp2_bf16_tuned": ("fsdp2_tuned", "bf16", None, False),
}
LABELS = {
    "zero3": "mfsdp2 ZeRO-3 (optim_grads_params)",
    "fsdp2": "FSDP2 default (reshard_after_forward=True)",
    "fsdp2_tuned": "FSDP2 tuned (reshard_after_forward=True)",
    "zero2": "mfsdp2 ZeRO-2 (optim_grads)",
    "fsdp2_nr": "FSDP2 default (reshard_after_forward=False)",
    "fsdp2_nr_tuned": "FSDP2 tuned (reshard_after_forward=False)",
    "zero1": "mfsdp2 ZeRO-1 (optim)",
    "no_shard": "mfsdp2 no_shard",
    "ddp": "torch DDP",
    "bf16": "mfsdp2 bf16",
    "bf16_fp8": "mfsdp2 bf16 + FP8 all-gather",
    "bf16_fp8_sep": "mfsdp2 bf16 + FP8, groups gathered separately",
    "fsdp2_bf16": "FSDP2 bf16 default",
    "fsdp2_bf16_tuned": "FSDP2 bf16 tuned",
}
# Variants of one group share the processes and the alternating rounds. The DDP-like strategies
# are a group of their own: with the sharded ones in one group a rank would hold nine mlp models.
GROUPS = {
    "fp32": ["zero3", "fsdp2", "fsdp2_tuned", "zero2", "fsdp2_nr", "fsdp2_nr_tuned"],
    "ddp": ["no_shard", "zero1", "ddp"],
    "bf16": ["bf16", "bf16_fp8", "fsdp2_bf16", "fsdp2_bf16_tuned"],
    "fp8": ["bf16", "bf16_fp8", "bf16_fp8_sep"],
}
# (label, variant, baseline, second baseline or None): the headline ratio is against the first
# baseline (FSDP2 tuned where FSDP2 is the baseline), the second (FSDP2 default) is reported beside it.
COMPARISONS = [
    ("ZeRO-3 / FSDP2", "zero3", "fsdp2_tuned", "fsdp2"),
    ("ZeRO-2 / FSDP2 no-reshard", "zero2", "fsdp2_nr_tuned", "fsdp2_nr"),
    ("no_shard / DDP", "no_shard", "ddp", None),
    ("ZeRO-1 / DDP", "zero1", "ddp", None),
    ("bf16+FP8 / mfsdp2 bf16", "bf16_fp8", "bf16", None),
    ("bf16+FP8 separate gathers / mfsdp2 bf16", "bf16_fp8_sep", "bf16", None),
    ("bf16+FP8 merged / separate gathers", "bf16_fp8", "bf16_fp8_sep", None),
    ("bf16+FP8 / FSDP2 bf16", "bf16_fp8", "fsdp2_bf16_tuned", "fsdp2_bf16"),
    ("mfsdp2 bf16 / FSDP2 bf16", "bf16", "fsdp2_bf16_tuned", "fsdp2_bf16"),
]
FULL_CASES = [("mlp", "fp32"), ("mlp", "ddp"), ("mlp", "bf16"), ("llama", "fp32"), ("llama", "ddp"), ("llama", "bf16"),
              ("tiny", "fp32"), ("tiny", "ddp")]
QUICK_CASES = [("mlp", "fp32"), ("mlp", "bf16"), ("llama", "bf16")]


# --------------------------------------------------------------------------------------------
# rank side
# --------------------------------------------------------------------------------------------


def build_variant(name: str, ref: torch.nn.Module, mesh) -> torch.nn.Module:
    fw, config, strategy, fp8 = VARIANTS[name]
    model = copy.deepcopy(ref)
    if fw == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, broadcast_buffers=False, gradient_as_bucket_view=True)
        ddp.register_comm_hook(None, allreduce_hook)
        return ddp
    if fw != "mfsdp2":
        return C.shard(model, fw, config, mesh)
    return C.shard(model, "mfsdp2", config, mesh, sharding_strategy=strategy,
                   all_gather_dtype=torch.float8_e4m3fn if fp8 else None)


def merge_fp8_gathers(v: str) -> None:
    """``bf16_fp8_sep`` steps gather each group on its own; every other variant merges (the default)."""
    import mfsdp2.precision.fp8

    mfsdp2.precision.fp8.MERGE_GATHERS = v != "bf16_fp8_sep"


def train_step(v: str, model, opt, name: str, x, y, accum: int) -> torch.Tensor:
    """One optimizer step; with ``accum`` > 1 the rank's batch is split into ``accum`` micro-batches
    and only the last one synchronises gradients (``no_sync()`` for DDP,
    ``set_requires_gradient_sync(False)`` for mfsdp2 and FSDP2, plus
    ``set_reshard_after_backward(False)`` for mfsdp2 and tuned FSDP2: ``_common.set_accumulation_flags``).
    Returns the rank's mean loss."""
    merge_fp8_gathers(v)
    if accum == 1:
        return C.train_step(model, opt, name, x, y)
    total = torch.zeros(())
    for j, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
        last = j == accum - 1
        if VARIANTS[v][0] == "ddp":
            ctx = contextlib.nullcontext() if last else model.no_sync()
        else:
            C.set_accumulation_flags(model, VARIANTS[v][0], last)
            ctx = contextlib.nullcontext()
        with ctx:
            loss = C.loss_fn(name, model(xm), ym) / accum
            loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def distinct_bytes(tensors) -> int:
    """Bytes covered by ``tensors``, each byte once (views of one buffer overlap)."""
    iv = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                for t in tensors if t is not None and t.numel())
    total, end = 0, None
    for lo, hi in iv:
        if end is None or lo >= end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return distinct_bytes(_local(v) for st in opt.state.values() for v in st.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0)


def persistent_bytes(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Per-rank bytes of weights, gradients and optimizer states; call after backward + opt.step(),
    before zero_grad."""
    params = list(model.parameters())
    torch_view = {
        "weights": distinct_bytes(_local(p) for p in params),
        "grads": distinct_bytes(_local(p.grad) for p in params if p.grad is not None),
        "optimizer": optimizer_bytes(opt),
    }
    if VARIANTS[name][0] != "mfsdp2":
        out = dict(torch_view)
    else:
        ms = model.memory_stats()
        out = {
            "weights": ms["persistent_bytes"],  # model + main weights + FP8 shards, each byte once
            "grads": ms["main_grad_bytes"] + ms.get("partial_grad_bytes", 0),
            "optimizer": torch_view["optimizer"],
            "memory_stats": dict(ms),
            "torch_view": torch_view,  # what the torch-side count sees (parameters are shards)
        }
    out["total"] = out["weights"] + out["grads"] + out["optimizer"]
    return out


def run_case(rank: int, ws: int, spec: dict, counter: C.CollectiveCounter) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    name = spec["model"]
    names = GROUPS[spec["group"]]
    steps, warmup, accum = spec["steps"], spec["warmup"], spec["accum"]
    mesh = init_device_mesh("cpu", (ws,))
    ref = C.build_model(name, seed=0)
    n_params = sum(p.numel() for p in ref.parameters())
    t_phase = time.time()
    models = {v: build_variant(v, ref, mesh) for v in names}
    opts = {v: C.make_optimizer(m.parameters()) for v, m in models.items()}
    losses = {v: [] for v in names}
    for w in range(warmup):
        x, y = C.make_batch(name, w, rank, ws)
        for v in names:
            losses[v].append(train_step(v, models[v], opts[v], name, x, y, accum).item())
    for v in names:
        if VARIANTS[v][0] == "mfsdp2":
            models[v].allocator.stats.reset_peak()
    phase_s = {"build_warmup": time.time() - t_phase}
    t_phase = time.time()

    times = {v: [] for v in names}
    records = {v: [] for v in names}
    busy0, own0, wall0 = C.machine_busy_s(), C.process_cpu_s(), time.monotonic()
    for i in range(steps):
        x, y = C.make_batch(name, warmup + i, rank, ws)
        k = i % len(names)
        order = names[k:] + names[:k]
        if i % 2:
            order.reverse()
        for v in order:
            def step(v=v):
                counter.enabled = True
                losses[v].append(train_step(v, models[v], opts[v], name, x, y, accum).item())
                counter.enabled = False
                records[v].extend(counter.take())
            wall, _ = _timed(step)
            times[v].append(wall)
    load = {"machine_busy_s": C.machine_busy_s() - busy0, "own_cpu_s": C.process_cpu_s() - own0,
            "wall_s": time.monotonic() - wall0, "ncpu": os.cpu_count()}
    phase_s["timed"] = time.time() - t_phase

    # -- persistent bytes: one more step per variant (whole batch, no accumulation), measured
    # before zero_grad -------------------------------------------------------------------------
    memory = {}
    x, y = C.make_batch(name, warmup + steps, rank, ws)
    for v in names:
        m, opt = models[v], opts[v]
        transient_peak = m.memory_stats()["transient_peak_bytes"] if VARIANTS[v][0] == "mfsdp2" else None
        merge_fp8_gathers(v)
        loss = C.loss_fn(name, m(x), y)
        loss.backward()
        opt.step()
        memory[v] = persistent_bytes(v, m, opt)
        memory[v]["transient_peak_bytes"] = transient_peak
        opt.zero_grad(set_to_none=True)
        losses[v].append(loss.item())
    counter.take()
    models = opts = None
    gc.collect()
    return {
        "model": name, "group": spec["group"], "params": n_params, "variants": names, "accum": accum,
        "times": times, "losses": losses, "memory": memory, "load": load, "phase_s": phase_s,
        "collectives": {v: C.summarize_records(records[v], steps) for v in names},
    }


def worker(rank: int, ws: int, specs: list[dict]) -> list[dict]:
    return C.run_cases(rank, ws, specs, run_case, "group")


# --------------------------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------------------------


def combine(per_rank: list[dict], ws: int) -> dict:
    r0 = per_rank[0]
    out = {"model": r0["model"], "group": r0["group"], "params": r0["params"], "world_size": ws,
           "accum": r0["accum"], "variants": {}}
    for v in r0["variants"]:
        t = C.max_over_ranks([r["times"][v] for r in per_rank])
        s = C.summarize_times(t)
        losses = [sum(r["losses"][v][i] for r in per_rank) / len(per_rank) for i in range(len(r0["losses"][v]))]
        mem = {k: max(r["memory"][v][k] for r in per_rank) for k in ("weights", "grads", "optimizer", "total")}
        tp = [r["memory"][v]["transient_peak_bytes"] for r in per_rank]
        out["variants"][v] = {
            "label": LABELS[v],
            "step_s_median": s["median"], "step_s_p10": s["p10"], "step_s_p90": s["p90"], "n": s["n"],
            "step_s": t,  # per timed round (max over ranks), in round order: paired_ratio pairs them
            "wire": C.wire_summary(r0["collectives"][v], ws),
            "collectives": r0["collectives"][v],
            "persistent_bytes": mem,
            "persistent_rank0_detail": r0["memory"][v],
            "transient_peak_bytes": None if tp[0] is None else max(tp),
            "losses": losses,
            "final_loss": losses[-1],
        }
    ld = r0["load"]
    foreign = (ld["machine_busy_s"] - sum(r["load"]["own_cpu_s"] for r in per_rank)) / (ld["ncpu"] * ld["wall_s"])
    out["foreign_cpu_fraction"] = max(foreign, 0.0)
    out["phase_s"] = r0["phase_s"]
    return out


def case_name(c: dict) -> str:
    return f"{c['model']}/{c['group']}" + (f" x{c['accum']} micro" if c.get("accum", 1) > 1 else "")


def comparisons(cases: list[dict]) -> list[dict]:
    """Ratios variant / baseline per case; ``step_ratio_second`` is against the second baseline
    (FSDP2 at its defaults where the first is FSDP2 tuned)."""
    rows = []

    def ratio(x, y):
        return x / y if y else None

    def paired(A, B):
        """Median and quartiles over rounds of A's step / B's step in the same round: the two ran
        back to back, so load that drifts over a run (other VMs, thermal) cancels in each pair."""
        if not A.get("step_s") or len(A["step_s"]) != len(B.get("step_s", ())):
            return None
        rs = [a / b for a, b in zip(A["step_s"], B["step_s"]) if b]
        return {"median": C.quantile(rs, 0.5), "q25": C.quantile(rs, 0.25), "q75": C.quantile(rs, 0.75),
                "fraction_below_1": sum(r < 1 for r in rs) / len(rs), "n": len(rs)}

    for c in cases:
        vs = c["variants"]
        for label, a, b, b2 in COMPARISONS:
            if a not in vs or b not in vs:
                continue
            A, B = vs[a], vs[b]
            la, lb = A["losses"], B["losses"]
            B2 = vs.get(b2) if b2 else None
            rows.append({
                "case": case_name(c), "comparison": label, "variant": a, "baseline": b,
                "second_baseline": b2 if B2 else None,
                "step_s": (A["step_s_median"], B["step_s_median"]),
                "step_ratio": ratio(A["step_s_median"], B["step_s_median"]),
                "step_ratio_second": ratio(A["step_s_median"], B2["step_s_median"]) if B2 else None,
                "paired_step_ratio": paired(A, B),
                "wire_buffer_ratio": ratio(A["wire"]["buffer_bytes"], B["wire"]["buffer_bytes"]),
                "wire_sent_ratio": ratio(A["wire"]["ring_sent_bytes"], B["wire"]["ring_sent_bytes"]),
                "all_gather_ratio": ratio(A["wire"]["buffer_bytes_by_kind"]["all_gather"],
                                          B["wire"]["buffer_bytes_by_kind"]["all_gather"]),
                "persistent_ratio": ratio(A["persistent_bytes"]["total"], B["persistent_bytes"]["total"]),
                "weights_ratio": ratio(A["persistent_bytes"]["weights"], B["persistent_bytes"]["weights"]),
                "grads_ratio": ratio(A["persistent_bytes"]["grads"], B["persistent_bytes"]["grads"]),
                "final_loss": (A["final_loss"], B["final_loss"]),
                "loss_max_rel_diff": max((abs(x - y) / abs(y) for x, y in zip(la, lb) if y), default=0.0),
            })
    return rows


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def _r(x, nd=3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _paired(p) -> str:
    return "--" if p is None else f"{p['median']:.3f} ({p['q25']:.3f}-{p['q75']:.3f}), {p['fraction_below_1']:.0%}"


def markdown(out: dict) -> str:
    m = out["machine"]
    lines = [f"`{out['command']}` -- {out['date']}, {m['cpu']} ({m['cores']} cores), gloo, torch {m['torch']}, "
             f"1 thread/rank, world size {out['world_size']}, {out['warmup']} warm-up + {out['steps']} timed rounds, "
             f"{out['accum']} micro-batch(es) per optimizer step, mfsdp2 {m['mfsdp2_commit']}; "
             f"wall {out['wall_s']:.0f} s.", ""]
    hdr = ["case", "variant", "step ms median (p10-p90)", "all-gather MiB", "reduce-scatter MiB", "all-reduce MiB",
           "collectives (+p2p)/step", "sent/rank MiB (ring est.)", "weights MiB", "grads MiB", "optimizer MiB",
           "persistent MiB", "mfsdp2 transient peak MiB", "final loss"]
    lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for c in out["cases"]:
        for v, d in c["variants"].items():
            w, p = d["wire"], d["persistent_bytes"]
            bk = w["buffer_bytes_by_kind"]
            coll = d["collectives"]
            cs = (f"{coll['collectives_per_step']:g}"
                  + (f" + {coll['p2p_ops_per_step']:g}" if coll["p2p_ops_per_step"] else ""))
            lines.append("| " + " | ".join([
                case_name(c), d["label"],
                f"{d['step_s_median']*1e3:.0f} ({d['step_s_p10']*1e3:.0f}-{d['step_s_p90']*1e3:.0f})",
                _mib(bk["all_gather"]), _mib(bk["reduce_scatter"]), _mib(bk["all_reduce"]), cs,
                _mib(w["ring_sent_bytes"]), _mib(p["weights"]), _mib(p["grads"]), _mib(p["optimizer"]),
                _mib(p["total"]), _mib(d["transient_peak_bytes"]), f"{d['final_loss']:.5f}",
            ]) + " |")
    lines.append("")
    hdr = ["case", "ratio (variant / baseline)", "step time (vs tuned FSDP2 / DDP)", "step time vs FSDP2 default",
           "paired per round: median (q25-q75), share < 1", "wire (buffers)", "wire (sent/rank)", "all-gather bytes",
           "persistent", "weights", "grads", "final loss (variant, baseline)", "max rel. loss diff", "other load"]
    lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    load = {case_name(c): c["foreign_cpu_fraction"] for c in out["cases"]}
    for r in out["comparisons"]:
        lines.append("| " + " | ".join([
            r["case"], r["comparison"], f"**{_r(r['step_ratio'])}**",
            "--" if r["step_ratio_second"] is None else _r(r["step_ratio_second"]), _paired(r["paired_step_ratio"]),
            _r(r["wire_buffer_ratio"]),
            _r(r["wire_sent_ratio"]), _r(r["all_gather_ratio"]), f"**{_r(r['persistent_ratio'])}**",
            _r(r["weights_ratio"]), _r(r["grads_ratio"]),
            f"{r['final_loss'][0]:.5f}, {r['final_loss'][1]:.5f}", f"{r['loss_max_rel_diff']:.1e}",
            f"{load[r['case']]:.0%}",
        ]) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="mlp:fp32, mlp:bf16, llama:bf16, 2 warm-up + 4 timed rounds (about 3 minutes)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--steps", type=int, default=None, help="timed rounds (default 10, tiny 40; --quick 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    p.add_argument("--cases", default=None,
                   help="comma list of model:group (models: mlp, llama, tiny; groups: fp32, ddp, bf16, fp8); "
                        "default mlp and llama x fp32,ddp,bf16 + tiny x fp32,ddp; --quick mlp:fp32,mlp:bf16,llama:bf16")
    p.add_argument("--accum", type=int, default=1, metavar="K",
                   help="micro-batches per optimizer step (the rank's batch split in K; default 1)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--timeout", type=float, default=None, help="seconds before giving up (default 3600)")
    p.add_argument("--wait-quiet", type=float, default=None, metavar="S",
                   help="before each case wait up to S seconds for other processes to leave the CPUs "
                        "(default 60, --quick 15; 0 = do not wait)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    if args.warmup < 1:
        p.error("--warmup must be >= 1")
    if args.accum < 1:
        p.error("--accum must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cases:
        cases = [tuple(c.split(":")) for c in args.cases.split(",")]
        for m, g in cases:
            if m not in C.MODELS or g not in GROUPS:
                print(f"unknown case {m}:{g}", file=sys.stderr)
                return 2
    else:
        cases = QUICK_CASES if args.quick else FULL_CASES
    steps = args.steps or (4 if args.quick else 10)
    wait = args.wait_quiet if args.wait_quiet is not None else (15.0 if args.quick else 60.0)
    specs = [{"model": m, "group": g, "steps": steps * (4 if m == "tiny" and args.steps is None else 1),
              "warmup": args.warmup, "accum": args.accum, "wait_quiet": wait} for m, g in cases]
    command = "python " + " ".join([os.path.relpath(sys.argv[0], C.REPO)] + sys.argv[1:])
    print(f"strategies: world size {args.world_size}, gloo, 1 thread/rank, cases "
          f"{', '.join(f'{m}/{g}' for m, g in cases)}, {args.warmup} warm-up + {steps} timed rounds, "
          f"{args.accum} micro-batch(es) per step", flush=True)
    t0 = time.time()
    per_rank = C.run_ranks(worker, args.world_size, specs, timeout=args.timeout or 3600.0)
    results = [combine([r[i] for r in per_rank], args.world_size) for i in range(len(specs))]
    wall = time.time() - t0
    out = {"cases": results, "comparisons": comparisons(results), "machine": C.machine_info(),
           "date": C.now_iso(), "command": command, "wall_s": wall, "world_size": args.world_size,
           "steps": steps, "warmup": args.warmup, "accum": args.accum}
    print()
    print(markdown(out))
    print(f"\nwall time {wall:.0f}s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
