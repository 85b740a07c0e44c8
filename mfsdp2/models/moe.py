"""A small mixture-of-experts decoder in plain PyTorch, with optional expert parallelism.

The block is torchtitan's MoE layout (DeepSeek-V3 / Qwen3-MoE) reduced to what a sharding
runtime sees: attention (:class:`~mfsdp2.models.llama.Attention`), a token-choice top-k
:class:`Router`, the routed experts as three grouped weights :class:`GroupedExperts`
(``w1``/``w3``: ``(experts, hidden, dim)``, ``w2``: ``(experts, dim, hidden)``), and optionally a
shared SwiGLU expert.

* The experts compute as one matmul per expert over its contiguous tokens (torch's CPU
  ``_grouped_mm`` has no backward in torch 2.13). An expert that gets no tokens runs an empty
  matmul: its weights get a zero gradient, so every rank reduces the same parameters.
* The router adds ``expert_bias`` (a buffer, per rank, used for selection only, as torchtitan's
  load-balancing bias) to the scores before the top-k: ``-inf`` there starves an expert.
* Under fake tensors (a memory estimate's shapes-only step) the routing is taken as balanced:
  token counts are data.
* Expert parallelism (:func:`parallelize_experts`): the expert weights become DTensors
  ``Shard(0)`` on an expert-parallel mesh and tokens are exchanged with two autograd-aware
  ``all_to_all_single`` calls (dispatch, combine), as torchtitan's ``AllToAllTokenDispatcher``.
  ``fully_shard`` then shards each rank's local experts over the expert-data-parallel mesh
  (``shard_placement_fn`` returning ``ShardPlacementResult``).

:func:`expert_shard_placement_fn` builds that ``shard_placement_fn`` the way torchtitan's
``apply_fsdp_to_decoder`` does (``Shard(1)`` when the expert-sharding ranks outnumber the
experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .llama import FeedForward, LlamaConfig, Transformer, TransformerBlock

__all__ = [
    "MoEConfig",
    "Router",
    "GroupedExperts",
    "MoE",
    "MoEBlock",
    "MoETransformer",
    "parallelize_experts",
    "expert_shard_placement_fn",
]


@dataclass
class MoEConfig(LlamaConfig):
    """A decoder whose feed-forwards are mixtures of ``experts`` experts (top-``top_k`` routing)."""

    experts: int = 8
    top_k: int = 2
    expert_dim: int = 256  # each routed expert's hidden size
    shared_expert_dim: int = 0  # 0: no shared expert

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and experts={self.experts}")

    @classmethod
    def tiny(cls) -> "MoEConfig":
        """About 40k parameters: for unit tests."""
        return cls(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
                   experts=8, top_k=2, expert_dim=16, shared_expert_dim=16)

    @classmethod
    def bench(cls) -> "MoEConfig":
        """About 13.2M parameters, 10.6M of them in 8 experts per block (top-2): the benchmark's."""
        return cls(vocab_size=2048, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=128,
                   experts=8, top_k=2, expert_dim=432, shared_expert_dim=256)


class Router(nn.Module):
    """Token-choice top-k: softmax scores over the experts, the ``top_k`` best (by score plus
    ``expert_bias``), their scores renormalised to sum to one."""

    def __init__(self, dim: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(experts), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softmax(self.gate(x).float(), dim=-1)
        _, ids = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)
        weights = scores.gather(-1, ids)
        return ids, (weights / weights.sum(-1, keepdim=True)).type_as(x)


class GroupedExperts(nn.Module):
    """``experts`` SwiGLU experts stored as three grouped weights (torchtitan's layout)."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: tokens grouped by expert, ``counts[e]`` of them for (local) expert ``e``."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        out, start = [], 0
        for e, n in enumerate(counts):
            xe = x[start : start + n]
            start += n
            out.append((F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())) @ w2[e].t())
        return torch.cat(out) if out else x[:0]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class MoE(nn.Module):
    """Routed experts (plus an optional shared expert) on ``(batch, seq, dim)`` inputs."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.experts_n = cfg.experts
        self.top_k = cfg.top_k
        self.router = Router(cfg.dim, cfg.experts, cfg.top_k)
        self.experts = GroupedExperts(cfg.dim, cfg.expert_dim, cfg.experts)
        self.shared = FeedForward(cfg.dim, cfg.shared_expert_dim) if cfg.shared_expert_dim else None
        self.ep_group: Optional[dist.ProcessGroup] = None  # parallelize_experts

    def _run_experts(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_group is None:
            return self.experts(tokens, counts.tolist())
        ep = dist.get_world_size(self.ep_group)
        local = self.experts_n // ep
        send = counts.view(ep, local).sum(1)
        recv_counts = torch.empty_like(counts)  # (source rank, local expert) token counts
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        recv_splits = recv_counts.view(ep, local).sum(1).tolist()
        received = _all_to_all(tokens, recv_splits, send.tolist(), self.ep_group)
        # received rows come by source rank, then expert: group them by local expert
        expert_of_row = torch.arange(local).repeat(ep).repeat_interleave(recv_counts)
        order = torch.argsort(expert_of_row, stable=True)
        out = self.experts(received[order], recv_counts.view(ep, local).sum(0).tolist())
        back = torch.zeros_like(out).index_copy(0, order, out)
        return _all_to_all(back, send.tolist(), recv_splits, self.ep_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        ids, weights = self.router(flat)
        chosen = ids.flatten()
        order = torch.argsort(chosen, stable=True)
        if _is_fake(chosen):
            # Shapes only (mfsdp2.estimate_memory's fake-tensor step): token counts are data, so
            # the routing is taken as balanced, every expert on this rank (no exchange).
            n, e = chosen.numel(), self.experts_n
            routed = self.experts(flat[order // self.top_k], [n // e + (i < n % e) for i in range(e)])
        else:
            counts = torch.bincount(chosen, minlength=self.experts_n)
            routed = self._run_experts(flat[order // self.top_k], counts)
        unsorted = torch.zeros_like(routed).index_copy(0, order, routed)
        out = (unsorted.view(-1, self.top_k, dim) * weights.unsqueeze(-1)).sum(1)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(bsz, seq, dim)


class MoEBlock(TransformerBlock):
    """Pre-norm decoder block: attention, then the mixture of experts (``moe``)."""

    ffn_name = "moe"

    def make_ffn(self, cfg: MoEConfig) -> nn.Module:
        return MoE(cfg)


class MoETransformer(Transformer):
    """MoE decoder: ``forward(tokens[B, S]) -> logits[B, S, vocab]`` (``layers``: MoE blocks)."""

    block_cls = MoEBlock

    residual_outputs = ("attn.wo", "shared.w2")

    def init_module(self, name: str, module: nn.Module, std: float, out_std: float) -> None:
        """As the dense decoder's, and each routed expert's weights ~ N(0, 0.02), its ``w2``
        (a residual output) scaled by ``1/sqrt(2 n_layers)``."""
        if isinstance(module, GroupedExperts):
            for pname, p in module.named_parameters(recurse=False):
                nn.init.normal_(p, mean=0.0, std=out_std if pname == "w2" else std)
        else:
            super().init_module(name, module, std, out_std)


def parallelize_experts(model: nn.Module, ep_mesh) -> None:
    """Expert parallelism over the 1-D mesh ``ep_mesh``: every :class:`MoE`'s expert weights
    become DTensors ``Shard(0)`` on it (each rank keeps ``experts / ep`` experts) and its tokens
    go to their experts' ranks and back by all-to-all. Call before ``fully_shard``."""
    ep = ep_mesh.size()
    for m in model.modules():
        if isinstance(m, MoE):
            if m.experts_n % ep:
                raise ValueError(f"{m.experts_n} experts do not split over an expert-parallel mesh of {ep}")
            for name, p in list(m.experts.named_parameters(recurse=False)):
                dt = distribute_tensor(p.detach(), ep_mesh, [Shard(0)])
                m.experts.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
            m.ep_group = ep_mesh.get_group()


def expert_shard_placement_fn(model: nn.Module, edp_mesh_info=None, shard_ranks: Optional[int] = None) -> Callable:
    """A ``shard_placement_fn`` for ``fully_shard(block, ...)`` as torchtitan's
    ``apply_fsdp_to_decoder`` builds it: the routed experts on ``edp_mesh_info``'s mesh (a torch
    ``FSDPMeshInfo`` / ``HSDPMeshInfo``; None: the unit's mesh), ``Shard(1)`` when
    ``shard_ranks`` (the ranks sharding each expert's weights, times the expert-parallel degree)
    outnumber the experts, else ``Shard(0)``; every other parameter ``None`` (``Shard(0)`` on the
    unit's mesh)."""
    experts = {id(p): m for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    n = next((m.w1.shape[0] for m in model.modules() if isinstance(m, GroupedExperts)), 0)
    placement = Shard(1) if shard_ranks is not None and shard_ranks > n else Shard(0)

    def fn(p: nn.Parameter):
        if id(p) not in experts:
            return None
        if edp_mesh_info is None:
            return placement
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult

        return ShardPlacementResult(placement=placement, mesh_info=edp_mesh_info)

    return fn
