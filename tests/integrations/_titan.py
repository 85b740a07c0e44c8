"""torchtitan's own trainer driving mfsdp2 or torch FSDP2, run inside the test's ranks.

What is torchtitan's and what is ours:

* torchtitan's code runs unchanged: its ``Trainer`` (meta-device build, ``parallelize_llama``,
  ``to_empty`` + ``init_weights``, seed-checkpoint load, data loader, losses,
  ``clip_grad_norm_``, optimizer and LR-scheduler containers, DCP ``CheckpointManager``, and
  its ``train()`` loop).
* The only thing swapped for mfsdp2 is what ``torchtitan.distributed.fsdp`` imported from
  torch: the names ``fully_shard`` and ``FSDPModule`` (the latter is what torchtitan's
  ``disable_fsdp_gradient_division`` tests before it sets the divide factor to 1.0; mfsdp2 units
  are not torch ``FSDPModule`` instances, docs/design.md says why). ``ChunkedLossWrapper``
  imports torch's ``FSDPModule`` inside its call, so with mfsdp2 it takes its non-FSDP path
  (the lm_head unit is gathered and reduced by our hooks for every chunk), as a user's swap
  would.
* For the reference, torch's ``fully_shard`` is wrapped to call
  ``set_force_sum_reduction_for_comms(True)``: torchtitan's divide factor 1.0 becomes a
  ``PREMUL_SUM`` reduce-scatter in FSDP2, which gloo lacks.
* The environment, not the trainer: torchtitan picks its device at import
  (``torch._utils._get_available_device_type() or "cuda"``) and calls CUDA-style memory
  queries on its device module, so "cpu" is answered with a small ``torch.cpu`` stand-in;
  torch 2.13 lacks ``torch.distributed.set_timeout`` (torchtitan 0.3.0 calls it after step 1),
  so torch's private ``_set_pg_timeout`` is bound there; attention is SDPA (FlexAttention has
  no backward on CPU), set the way torchtitan's own graph_trainer tests do it; the tokenizer and
  the data set are made here (the wheel ships neither, and tests have no network); rank 0's 2 s
  sleep at the end of ``train()`` is skipped.
* Observation only: the trainer object's ``train_step``, ``forward_backward_step`` and metrics
  ``log`` are wrapped to record step times, the full gradients after each backward (before
  clipping) and the logged loss and gradient norm; a forward hook on ``lm_head`` records, in
  chunked-loss runs, the magnitudes the error bound of its gradient sum needs.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .. import _reduce_order
from . import _titan_moe

VOCAB = 2048  # the debug model's
SEQ_LEN = 64
LOCAL_BATCH = 2
N_WORDS = 500
# torchtitan's default max_norm (1.0) clips every step of this model (norms ~1.1): the clip
# coefficient then depends on the last bit of the gradient norm, which FSDP2 and mfsdp2 sum
# over different row splits (one ulp apart now and then), and the updates would differ by
# rounding from there on. Above the norms the clip path still runs (norm computed, gradients
# multiplied by 1.0) and everything before and after it is comparable bit for bit.
MAX_NORM = 1e3
COMPILE_BACKEND = "aot_eager"


def make_assets(root: str) -> None:
    """A word-level tokenizer and a small corpus (json lines) under ``root``.

    The text comes from a sparse random bigram chain over ``N_WORDS`` words, so the model has
    something to learn (the loss falls within a few steps, and a skipped update shows)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(0)
    words = [f"w{i}" for i in range(N_WORDS)]
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    vocab.update({w: i + 3 for i, w in enumerate(words)})
    tok_dir = os.path.join(root, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)

    successors = [rng.sample(range(N_WORDS), 4) for _ in words]
    data_dir = os.path.join(root, "data")
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        for _ in range(400):
            w = rng.randrange(N_WORDS)
            doc = []
            for _ in range(rng.randrange(20, 120)):
                doc.append(words[w])
                w = rng.choice(successors[w])
            f.write(json.dumps({"text": " ".join(doc)}) + "\n")


@dataclass
class Run:
    """One torchtitan training run: which ``fully_shard``, which loss / optimizer / compile,
    and where it starts (``resume_from``: the checkpoint another run saved at ``resume_step``,
    full training state; else the model-only seed checkpoint)."""

    name: str
    impl: str  # "mfsdp2" or "fsdp2"
    loss: str = "ce"  # "ce" or "chunked" (torchtitan's ChunkedLossWrapper, 8 chunks)
    optimizer: str = "foreach"  # torchtitan's optimizer.implementation
    compile: bool = False  # torchtitan's per-block compile
    steps: int = 4
    save_every: Optional[int] = None
    resume_from: Optional[str] = None
    resume_step: Optional[int] = None
    experts: int = 0  # > 0: torchtitan's Qwen3-MoE with this many routed experts (_titan_moe.py)
    ep: int = 1  # expert-parallel degree (MoE)
    # FSDP2 runs: "gloo" (FSDP2's own reduce-scatter) or "rank" (summed in rank order, as mfsdp2
    # does: _reduce_order.py); record_reductions keeps step 1's reduce-scatter inputs and outputs
    reduce_order: str = "gloo"
    record_reductions: bool = False

    @property
    def seed(self) -> str:
        """The seed checkpoint's run folder: one per model."""
        return _titan_moe.seed_key(self.experts) if self.experts else "seed"


@dataclass
class Result:
    steps: list = field(default_factory=list)
    losses: list = field(default_factory=list)  # torchtitan's logged loss, per step
    grad_norms: list = field(default_factory=list)  # torchtitan's logged gradient norm
    grad_digests: list = field(default_factory=list)  # full gradients before clipping
    grad_param_digests: list = field(default_factory=list)  # the same, {name: digest}
    grad_norms_f64: list = field(default_factory=list)  # their norm in float64
    param_digest: str = ""  # full parameters after the last step
    step_times: list = field(default_factory=list)  # seconds, train_step as torchtitan runs it
    comm: list = field(default_factory=list)  # mfsdp2 runs: comm_stats of each step
    compiled_graphs: int = 0  # graphs dynamo compiled during the run
    reductions: list = field(default_factory=list)  # Run.record_reductions: step 1's (ranks, input, output)
    placements: dict = field(default_factory=dict)  # {name: (mesh dim names, placements)} after the build
    error: Optional[str] = None


def _cpu_device_module() -> types.SimpleNamespace:
    """``torch.cpu`` with the CUDA-style calls torchtitan's trainer makes on its device module
    (device name and capacity for its memory monitor, peak-memory stats): CPU answers."""
    props = types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return types.SimpleNamespace(
        set_device=lambda device: None,
        current_device=lambda: 0,
        device_count=lambda: 1,
        synchronize=torch.cpu.synchronize,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: props,
        memory_stats=lambda device=None: {},
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
    )


def _prepare_process(rank: int, root: str) -> None:
    """Before torchtitan is imported (see the module docstring); Hugging Face's caches (the
    data set's) go under the test's folder."""
    import torch._utils
    from torch.distributed.distributed_c10d import _set_pg_timeout

    # torchtitan asks torch once, when torchtitan.tools.utils is imported; torch's own callers
    # get torch's answers again afterwards
    saved = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda t: _cpu_device_module() if t == "cpu" else saved[1](t)
    try:
        import torchtitan.tools.utils as tt_utils
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = saved
    assert tt_utils.device_type == "cpu", "torchtitan.tools.utils was imported before the test set its device"
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = _set_pg_timeout
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["HF_HOME"] = os.path.join(root, "hf")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["WANDB_MODE"] = "disabled"
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    _quiet()

    import torchtitan.trainer as tt_trainer

    shim = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    shim.sleep = lambda seconds: None
    tt_trainer.time = shim


def _quiet() -> None:
    """torchtitan logs its progress through the root logger and trips deprecation warnings of
    torch and torchdata: both dropped in the ranks (mfsdp2's own warnings still show)."""
    import logging
    import warnings

    class NotTorchtitan(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return f"{os.sep}torchtitan{os.sep}" not in record.pathname

    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(NotTorchtitan())
    logging.getLogger().addHandler(handler)
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torchtitan|torchdata|torch)(\.|$)")
    torch._logging.set_logs(dynamo=logging.ERROR)
    # the observation's full_tensor() of a gradient on a 2-D (ep, efsdp) mesh gathers one dim at a
    # time, which DTensor logs as suboptimal for every call
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _fsdp2_fully_shard(reduce_scatter):
    from torch.distributed.fsdp import fully_shard

    def shard(module, **kwargs):
        out = fully_shard(module, **kwargs)
        for m in module if isinstance(module, list) else [module]:
            m.set_force_sum_reduction_for_comms(True)
        # FSDP2's set_custom_reduce_scatter refuses units with several parameter groups (a
        # per-parameter mesh), so the object goes on each group as that method would put it
        for group in fully_shard.state(out if not isinstance(out, list) else out[0])._fsdp_param_groups:
            group._reduce_scatter_comm = reduce_scatter
        return out

    return shard


def _bind(impl: str, reduce_scatter=None) -> None:
    """Point torchtitan's FSDP call sites at ``impl``: the one import a user changes,
    ``fully_shard`` in torchtitan's ``distributed.fsdp``. Its ``isinstance(m, FSDPModule)`` checks
    (the gradient divide factor, the chunked loss's lm_head) keep testing torch's class."""
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    assert tt_fsdp.FSDPModule is TorchFSDPModule, "torchtitan's FSDPModule is not torch's"
    if impl == "mfsdp2":
        import mfsdp2

        tt_fsdp.fully_shard = mfsdp2.fully_shard
    elif impl == "fsdp2":
        tt_fsdp.fully_shard = _fsdp2_fully_shard(reduce_scatter)
    else:
        raise ValueError(f"unknown implementation {impl!r}")


def _config(root: str, run: Run, seed_checkpoint: bool = False):
    """torchtitan's ``llama3_debugmodel`` config with what CPU needs and the run's choices
    (the CLI flags in brackets)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    if run.experts:
        cfg = _titan_moe.moe_config(root, run.name, run.experts, run.ep)
    else:
        cfg = llama3_debugmodel()
        for layer in cfg.model_spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg.hf_assets_path = os.path.join(root, "tokenizer")
    cfg.dump_folder = os.path.join(root, "runs", run.name)
    cfg.dataloader.dataset_path = os.path.join(root, "data")  # read with the "c4_test" loader
    cfg.training.local_batch_size = LOCAL_BATCH
    cfg.training.seq_len = SEQ_LEN
    cfg.training.steps = run.steps
    cfg.training.max_norm = MAX_NORM
    cfg.training.dtype = "float32"
    cfg.training.mixed_precision_param = "float32"  # [--training.mixed-precision-param float32]
    cfg.training.disable_cuda_graphs = True
    cfg.parallelism.spmd_backend = "partial_dtensor"  # [--parallelism.spmd-backend partial_dtensor]
    cfg.debug.seed = 0  # [--debug.seed 0]
    cfg.metrics.log_freq = 1
    cfg.optimizer.implementation = run.optimizer  # [--optimizer.implementation]
    if run.loss == "ce":
        cfg.loss = CrossEntropyLoss.Config(global_vocab_size=VOCAB)
    elif run.loss != "chunked":  # the debug model's default: ChunkedLossWrapper over CE
        raise ValueError(f"unknown loss {run.loss!r}")
    cfg.compile.enable = run.compile  # [--compile.enable --compile.components model]
    cfg.compile.components = ["model"]
    cfg.compile.backend = COMPILE_BACKEND
    ck = cfg.checkpoint
    ck.enable = True
    ck.keep_latest_k = 0
    if seed_checkpoint:  # [--checkpoint.create-seed-checkpoint]
        ck.create_seed_checkpoint = True
        ck.last_save_model_only = False
        return cfg
    ck.interval = run.save_every or 10**6
    ck.last_save_model_only = True
    ck.initial_load_path = os.path.join(root, "runs", run.seed, "checkpoint", "step-0")
    return cfg


def _seed_checkpoint(root: str, experts: int = 0) -> None:
    """torchtitan's seed checkpoint, as ``--checkpoint.create-seed-checkpoint`` writes it: the
    unsharded model initialised from ``--debug.seed``, saved at step 0. Every run starts from
    it, so FSDP2 and mfsdp2 start from the same weights."""
    cfg = _config(root, Run(Run("", "fsdp2", experts=experts).seed, "fsdp2", experts=experts), seed_checkpoint=True)
    trainer = cfg.build()
    try:
        trainer.checkpointer.save(curr_step=0, last_step=True)
    finally:
        trainer.close()


def _take_checkpoint(root: str, run: Run) -> None:
    """A resumed run starts as torchtitan does after a restart: its own checkpoint folder holds
    the step to resume from (here a copy of another run's), which torchtitan loads (model,
    optimizer, LR schedulers, data loader, train state) instead of the seed."""
    if dist.get_rank() == 0:
        src = os.path.join(root, "runs", run.resume_from, "checkpoint", f"step-{run.resume_step}")
        dst = os.path.join(root, "runs", run.name, "checkpoint", f"step-{run.resume_step}")
        shutil.copytree(src, dst)
    dist.barrier()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _digests(model, grads: bool) -> tuple[str, float, dict]:
    """SHA-256 of the full parameters (or gradients) in parameter order, their sum of squares
    in float64, and each one's own digest. Equal digests: bit-identical tensors."""
    whole = hashlib.sha256()
    sumsq = 0.0
    per_param = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None:
            whole.update(f"{name}:None".encode())
            per_param[name] = None
            continue
        t = _full(t).contiguous()
        raw = t.view(torch.uint8).numpy().tobytes()
        whole.update(name.encode())
        whole.update(raw)
        per_param[name] = hashlib.sha256(raw).hexdigest()[:16]
        sumsq += float(t.double().square().sum())
    return whole.hexdigest(), sumsq, per_param


def _train(root: str, run: Run) -> Result:
    import mfsdp2

    reduce_scatter = None
    if run.impl == "fsdp2":
        reduce_scatter = (_reduce_order.RankOrderReduceScatter() if run.reduce_order == "rank"
                          else _reduce_order.GlooReduceScatter())
    _bind(run.impl, reduce_scatter)
    if run.resume_from is not None:
        _take_checkpoint(root, run)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    res = Result()
    trainer = _config(root, run).build()
    model = trainer.model_parts[0]
    res.placements = {
        n: (tuple(p.device_mesh.mesh_dim_names or ()), tuple(p.placements)) for n, p in model.named_parameters()
        if hasattr(p, "placements")
    }
    try:
        log = trainer.metrics_processor.log

        def record(step, loss, max_loss, grad_norm, *args, **kwargs):
            res.steps.append(step)
            res.losses.append(float(loss))
            res.grad_norms.append(float(grad_norm))
            return log(step, loss, max_loss, grad_norm, *args, **kwargs)

        train_step = trainer.train_step

        def timed(data_iterator):
            mfsdp2.comm_stats.reset()
            recording = run.record_reductions and not res.step_times
            if recording:
                reduce_scatter.records = res.reductions
            t0 = time.perf_counter()
            train_step(data_iterator)
            res.step_times.append(time.perf_counter() - t0)
            if recording:
                reduce_scatter.records = None
            if run.impl == "mfsdp2":
                res.comm.append(mfsdp2.comm_stats.as_dict())

        forward_backward = trainer.forward_backward_step

        def grads_after_backward(**kwargs):
            out = forward_backward(**kwargs)
            digest, sumsq, per_param = _digests(model, grads=True)
            res.grad_digests.append(digest)
            res.grad_param_digests.append(per_param)
            res.grad_norms_f64.append(sumsq**0.5)
            return out

        trainer.metrics_processor.log = record
        trainer.train_step = timed
        trainer.forward_backward_step = grads_after_backward
        trainer.train()
        res.param_digest = _digests(model, grads=False)[0]
        res.compiled_graphs = counters["stats"]["unique_graphs"]
    finally:
        trainer.close()
    return res


def worker(rank: int, world_size: int, root: str, runs: list) -> dict:
    """Every run of ``runs`` in order in this rank (one process group, one torchtitan import,
    one seed checkpoint for all); results by run name. A run that raises is recorded with its
    error and the others still run."""
    _prepare_process(rank, root)
    if any(r.experts for r in runs):
        _titan_moe.install_per_expert_mm()
    for experts in sorted({r.experts for r in runs}):
        _seed_checkpoint(root, experts)
    dist.barrier()
    out = {}
    for run in runs:
        if run.resume_from is not None and out[run.resume_from].error is not None:
            out[run.name] = Result(error=f"not run: {run.resume_from}, whose checkpoint it resumes, failed")
            continue
        try:
            out[run.name] = _train(root, run)
        except Exception:
            out[run.name] = Result(error=traceback.format_exc())
            print(f"rank {rank}, run {run.name}:\n{out[run.name].error}", file=sys.stderr, flush=True)
        # a run that failed on one rank only counts as failed on both (the next runs' skips agree)
        failed = torch.tensor([out[run.name].error is not None], dtype=torch.int32)
        dist.all_reduce(failed)
        if failed.item() and out[run.name].error is None:
            out[run.name] = Result(error="failed on the other rank")
    return out
