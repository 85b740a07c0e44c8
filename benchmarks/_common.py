"""Shared pieces of the CPU benchmarks, the one namespace the scripts import (``import _common as C``).

They live by concept in ``_ranks`` (spawned gloo ranks; where the checkout is), ``_wire`` (the
collective counter, traffic summaries, the comm-only replay), ``_models`` (the benchmark models,
their batches and precision configs, torch FSDP2 as shipped and tuned, one training step),
``_machine`` (memory probes, other load on the machine, the record of the machine) and
``_measure`` (mfsdp2's byte counts, statistics and tables); :func:`run_cases` (the rank body of the
side-by-side benchmarks) is here.

Nothing here imports mfsdp2 at module level, so ``benchmarks/gpu.py --help`` works anywhere.

Conventions (see docs/benchmarks.md):

* Byte counts are the size of each collective's *full* buffer on one rank: the output of an
  all-gather, the input of a reduce-scatter, the tensor of an all-reduce / broadcast. That is the
  quantity ``mfsdp2.comm.communicator.comm_stats`` counts too; what a ring moves per rank is ``(N-1)/N`` of it
  (x2 for gloo's reduce-scatter, which gloo runs as an all-reduce).
* Times are per step, the max over ranks of each rank's wall time for the step (every step starts
  after a barrier), and are summarised by the median and p10/p90 over the timed steps.
"""

from __future__ import annotations

import time
from typing import Callable

import torch.distributed as dist

from _ranks import REPO, free_port, run_ranks  # noqa: F401
from _wire import CollectiveCounter, summarize_records, wire_summary, CommReplay  # noqa: F401
from _models import (  # noqa: F401
    MLPBlock, Stack, MODELS, build_model, units, GLOBAL_BATCH, LLAMA_SEQ, make_batch, loss_fn,
    items_per_step, CONFIGS, config_options, FSDP2_TUNINGS, FSDP2_TUNED, TUNING_JSON,
    FRAMEWORKS, fsdp2_tuned, fsdp2_tuning_name, tune_fsdp2, set_accumulation_flags, shard,
    make_optimizer, train_step, ComputeFloor
)
from _machine import (  # noqa: F401
    malloc_trim, rss_bytes, reset_peak_rss, peak_rss_bytes, machine_busy_s, process_cpu_s,
    wait_until_quiet, machine_info, now_iso
)
from _measure import (  # noqa: F401
    mfsdp2_groups, mfsdp2_persistent_bytes, mfsdp2_padding, quantile, summarize_times,
    max_over_ranks, fmt_bytes, print_table
)


def run_cases(rank: int, ws: int, specs: list[dict], run_case: Callable, label_key: str) -> list[dict]:
    """The rank body of the side-by-side benchmarks: one CollectiveCounter installed before any
    model is built, then ``run_case(rank, ws, spec, counter)`` per spec, each optionally after
    waiting (on rank 0, the others in a barrier) for the machine to be quiet."""
    counter = CollectiveCounter().install()
    out = []
    for spec in specs:
        if spec.get("wait_quiet", 0) > 0:
            if rank == 0:
                f = wait_until_quiet(spec["wait_quiet"])
                if f >= 0.15:
                    print(f"  warning: other processes use {f:.0%} of the CPUs; timings will be noisy", flush=True)
            dist.barrier()
        t0 = time.time()
        out.append(run_case(rank, ws, spec, counter))
        out[-1]["case_wall_s"] = time.time() - t0
        if rank == 0:
            ph = ", ".join(f"{k} {v:.0f}s" for k, v in out[-1]["phase_s"].items())
            print(f"  [{spec['model']}/{spec[label_key]}] done in {out[-1]['case_wall_s']:.0f}s ({ph})", flush=True)
    return out
