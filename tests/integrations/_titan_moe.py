"""torchtitan 0.3.0's Qwen3-MoE trainer, small enough for CPU ranks (used by ``_titan.py``).

The model is torchtitan's ``debugmodel_moe`` flavour (its own config builders, its router,
token dispatcher, ``GroupedExperts`` and load-balancing hook) with smaller sizes: 2 layers,
dim 64, 4 heads of 16, experts of hidden size 32, top-2 routing. ``experts`` picks the number of
routed experts, which decides the placement torchtitan's ``apply_fsdp_to_decoder`` gives them:
with more shard ranks than experts it returns ``Shard(1)`` from its ``shard_placement_fn``, else
it shards them on dim 0; with expert parallelism > 1 its ``shard_placement_fn`` returns
``ShardPlacementResult`` (experts on the ``efsdp`` mesh, the rest on ``fsdp``).

One change to torchtitan's code, made for both runtimes alike: torch 2.13's CPU backward of
``torch._grouped_mm`` fails ("Invalid strides/sizes"), and torchtitan has no switch to avoid the
grouped GEMM, so ``GroupedExperts._grouped_mm`` -- torchtitan's own override seam for it -- is
replaced by :func:`per_expert_mm`, a loop of plain matmuls over the same per-expert offsets (the
same math: rows ``offs[e-1]:offs[e]`` of ``A`` times expert ``e``'s matrix; rows after the last
offset are zero, as the grouped GEMM leaves them unwritten and the dispatcher never reads them).
An expert with no tokens gets an empty matmul, so its weights still get a (zero) gradient.
"""

from __future__ import annotations

import os

import torch

DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS, TOP_K = 64, 4, 2, 16, 32, 2, 2


def per_expert_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(A, B_t, offs=offs)`` as one matmul per expert (see the module docstring)."""
    ends = offs.tolist()
    pieces, start = [], 0
    for e, end in enumerate(ends):
        pieces.append(A[start:end] @ B_t[e])
        start = end
    if start < A.shape[0]:
        pieces.append(A.new_zeros(A.shape[0] - start, B_t.shape[-1]))
    return torch.cat(pieces)


def install_per_expert_mm() -> None:
    from torchtitan.models.common.moe import GroupedExperts

    GroupedExperts._grouped_mm = per_expert_mm


def moe_model_spec(experts: int):
    """torchtitan's Qwen3 ``debugmodel_moe`` spec with the small sizes above and SDPA attention
    (FlexAttention has no backward on CPU)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers, model_registry

    spec = model_registry("debugmodel_moe")
    cfg = spec.model
    cfg.dim = DIM
    cfg.norm.normalized_shape = DIM
    cfg.tok_embeddings.embedding_dim = DIM
    cfg.lm_head.in_features = DIM
    cfg.layers = _build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        moe_hidden_dim=HIDDEN, num_experts=experts, top_k=TOP_K, attn_backend="flex",
        rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=4096, theta=1000000.0), moe_comm_backend="standard",
    )
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return spec


def moe_config(root: str, name: str, experts: int, ep: int):
    """torchtitan's ``qwen3_moe_debug`` trainer config on :func:`moe_model_spec`; the caller sets
    what every run shares (``_titan._config``). Expert parallelism > 1 needs
    ``--training.disable-cuda-graphs`` (torchtitan's config check), which the shared settings set."""
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    cfg = qwen3_moe_debug()
    cfg.model_spec = moe_model_spec(experts)
    cfg.parallelism.expert_parallel_degree = ep  # [--parallelism.expert-parallel-degree]
    cfg.activation_checkpoint = None  # torchtitan's parallelize_qwen3 then applies none
    cfg.lr_scheduler.warmup_steps = 1
    cfg.checkpoint.export_dtype = "float32"
    return cfg


def seed_key(experts: int) -> str:
    """The seed checkpoint folder of a model with ``experts`` routed experts."""
    return f"seed-moe{experts}"


def seed_path(root: str, experts: int) -> str:
    return os.path.join(root, "runs", seed_key(experts), "checkpoint", "step-0")
