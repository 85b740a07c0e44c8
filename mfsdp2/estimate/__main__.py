"""``python -m mfsdp2.estimate``: the per-rank memory of a training step, before launch.

    python -m mfsdp2.estimate --llama 8B --mesh 64 --param-dtype bf16 --reduce-dtype fp32 --batch 1 --seq 8192
    python -m mfsdp2.estimate --model mypkg.models:build --kwargs '{"layers": 48}' --units mypkg.models:Block \\
        --mesh 8,128 --batch 2 --seq 4096 --json
    python -m mfsdp2.estimate --moe qwen3-30b-a3b --mesh 64 --expert-parallel 8 --param-dtype bf16 --batch 1 --seq 4096

The model is built under ``torch.device("meta")`` (no memory): ``--llama NAME`` for a Llama-3
geometry (8B, 70B, 405B) or the demo decoder (``demo``) of ``mfsdp2.models.llama``, or
``--model module:callable`` (with ``--kwargs``) for your own, or ``--moe NAME`` for a
mixture-of-experts decoder of ``mfsdp2.models.moe`` (``tiny``, ``bench``, or a Qwen3-30B-A3B-like
geometry: 48 blocks of 128 experts, top-8, 16 heads of 128). ``--units`` names the class whose
instances ``fully_shard`` wraps before the root (``module:Class``, or a class name found in the
model); the Llama presets wrap each ``TransformerBlock``, the MoE presets each ``MoEBlock``, with
the experts sharded as torchtitan shards them: ``--expert-parallel N`` splits them over ``N``
ranks and shards each rank's local experts over the other ``shard / N`` (their own mesh), on dim
1 when those ranks times ``N`` outnumber the experts. Input: ``--batch`` per rank and
``--seq`` for token ids (else floats for the first ``nn.Linear``). Prints the table, or the JSON
form with ``--json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Optional

import torch

MOE = {
    "qwen3-30b-a3b": dict(vocab_size=151936, dim=2048, n_layers=48, n_heads=16, n_kv_heads=4, max_seq_len=4096,
                          experts=128, top_k=8, expert_dim=768, shared_expert_dim=0),
}
LLAMA3 = {
    "8B": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "70B": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "405B": dict(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248),
}
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}


def _load(spec: str):
    mod, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"expected module:name, got {spec!r}")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in DTYPES:
        raise SystemExit(f"unknown dtype {name!r}; one of {sorted(DTYPES)}")
    return DTYPES[name]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mfsdp2.estimate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--llama", choices=sorted(LLAMA3) + ["demo"], help="a Llama-3 geometry or the demo decoder")
    src.add_argument("--model", metavar="MODULE:CALLABLE", help="a factory of your model (built on meta)")
    src.add_argument("--moe", choices=["tiny", "bench"] + sorted(MOE),
                     help="a mixture-of-experts decoder (mfsdp2.models.moe)")
    p.add_argument("--expert-parallel", type=int, default=1,
                   help="--moe: expert-parallel degree (a divisor of the shard size)")
    p.add_argument("--kwargs", default="{}", help="JSON keyword arguments for --model")
    p.add_argument("--units", metavar="CLASS",
                   help="module:Class or a class name in the model: the units wrapped before the root")
    p.add_argument("--mesh", default="1", help="N, or R,S for HSDP (replicate, shard); default 1")
    p.add_argument("--strategy", default="optim_grads_params",
                   choices=["optim_grads_params", "optim_grads", "optim", "no_shard"])
    p.add_argument("--param-dtype", help="compute dtype (MixedPrecisionPolicy.param_dtype)")
    p.add_argument("--reduce-dtype", help="reduction dtype")
    p.add_argument("--main-dtype", default="fp32", help="main weights and gradients (default fp32)")
    p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy: main state in host memory")
    p.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, sgd_momentum, adagrad, rmsprop, ..., "
                   "mfsdp2_adamw, mfsdp2_adamw_bf16 (mfsdp2.optim.AdamW, float32 / bfloat16 moments)")
    p.add_argument("--optimizer-impl", default="auto", choices=["auto", "single", "foreach", "fused"])
    p.add_argument("--prefetch", type=int, default=1, help="prefetch depth (default 1)")
    p.add_argument("--reshard-after-forward", default="true", help="true, false or an int (ranks per block)")
    p.add_argument("--batch", type=int, help="batch per rank")
    p.add_argument("--seq", type=int, help="sequence length (token ids)")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"], help="where it will train (default cuda)")
    p.add_argument("--allocator", default="caching", choices=["caching", "trace_pool", "dynamic"])
    p.add_argument("--no-hold-between-steps", action="store_true",
                   help="CachingAllocator(hold_between_steps=False): keep no block through the optimizer step")
    p.add_argument("--storage-swap", default="auto", choices=["auto", "on", "off"],
                   help="gathered weights in the allocator's blocks (torch >= 2.13) or torch's own memory "
                        "(off: torch 2.11-2.12, MFSDP2_NO_STORAGE_SWAP=1); default: what this torch does")
    p.add_argument("--rank", type=int, help="report this rank (default: the one holding most)")
    p.add_argument("--json", action="store_true", help="print the JSON form")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from mfsdp2.precision.mixed_precision import MixedPrecisionPolicy

    from . import estimate_memory

    a = parse_args(argv)
    with torch.device("meta"):
        if a.llama:
            from mfsdp2.models.llama import LlamaConfig, Transformer, TransformerBlock

            cfg = LlamaConfig.demo() if a.llama == "demo" else LlamaConfig(**LLAMA3[a.llama])
            if a.seq is not None and a.seq > cfg.max_seq_len:
                cfg.max_seq_len = a.seq
            model = Transformer(cfg)
            units = TransformerBlock
        elif a.moe:
            from mfsdp2.models.moe import MoEBlock, MoEConfig, MoETransformer

            cfg = getattr(MoEConfig, a.moe)() if a.moe in ("tiny", "bench") else MoEConfig(**MOE[a.moe])
            if a.seq is not None and a.seq > cfg.max_seq_len:
                cfg.max_seq_len = a.seq
            model = MoETransformer(cfg)
            units = MoEBlock
        else:
            model = _load(a.model)(**json.loads(a.kwargs))
            units = None
    if a.units:
        if ":" in a.units:
            units = _load(a.units)
        else:
            found = {type(m) for m in model.modules() if type(m).__name__ == a.units}
            if not found:
                raise SystemExit(f"no module of class {a.units!r} in the model")
            units = tuple(found)
    raf = a.reshard_after_forward.lower()
    raf = True if raf == "true" else False if raf == "false" else int(raf)
    mp = MixedPrecisionPolicy(param_dtype=_dtype(a.param_dtype), reduce_dtype=_dtype(a.reduce_dtype),
                              main_params_dtype=_dtype(a.main_dtype), main_grads_dtype=_dtype(a.main_dtype))
    moe = {}
    if a.moe:
        shard = int(a.mesh.split(",")[-1])

        def is_expert(fqn: str, p) -> bool:
            return ".moe.experts." in fqn

        # torchtitan's apply_fsdp_to_decoder: Shard(1) when the expert-sharding ranks outnumber the experts
        dim = 1 if shard > model.cfg.experts else 0
        moe = dict(experts=is_expert, expert_parallel=a.expert_parallel,
                   shard_dims=lambda fqn, p: dim if is_expert(fqn, p) else 0)
    elif a.expert_parallel != 1:
        raise SystemExit("--expert-parallel applies to --moe models")
    est = estimate_memory(
        model, units=units, mesh_shape=[int(x) for x in a.mesh.split(",")], sharding_strategy=a.strategy,
        mp_policy=mp, offload=a.offload, optimizer=a.optimizer, optimizer_impl=a.optimizer_impl,
        prefetch_depth=a.prefetch, reshard_after_forward=raf, batch_size=a.batch, seq_len=a.seq,
        device=a.device, allocator=a.allocator, hold_between_steps=not a.no_hold_between_steps, rank=a.rank,
        storage_swap=None if a.storage_swap == "auto" else a.storage_swap == "on", **moe,
    )
    sys.stdout.write(f"{est.to_json() if a.json else est}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
