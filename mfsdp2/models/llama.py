"""A small Llama-style decoder in plain PyTorch, plus a synthetic token source.

The model is deliberately ordinary ``torch.nn`` code so that it can be wrapped
by ``mfsdp2.fully_shard`` (or by ``torch.distributed.fsdp.fully_shard``) one
``TransformerBlock`` at a time and then at the root:

* ``RMSNorm``        -- one ``weight`` parameter.
* ``Attention``      -- ``wq``/``wk``/``wv``/``wo`` bias-free ``Linear`` layers,
  grouped-query attention (``n_kv_heads`` <= ``n_heads``), rotary position
  embeddings computed on the fly (no buffers), and
  ``F.scaled_dot_product_attention(..., is_causal=True)``.
* ``FeedForward``    -- SwiGLU: ``w2(silu(w1(x)) * w3(x))``.
* ``TransformerBlock`` -- pre-norm residual block (``attn_norm``, ``attn``,
  ``ffn_norm``, ``ffn``).
* ``Transformer``    -- ``tok_embeddings``, ``layers`` (``nn.ModuleList``),
  ``norm`` and an untied ``output`` projection; ``forward(tokens) -> logits``.

The rotary tables are recomputed from ``(seq_len, head_dim, rope_theta)`` in
every forward, so nothing the sharding runtime touches (parameters) is needed
to build them and there is no state outside the parameters.

``SyntheticTokens`` makes token batches with a learnable structure that depend
only on ``(seed, step)``, so every rank can build the same global batch and take
its own slice of it with ``rank_slice``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LlamaConfig",
    "RMSNorm",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Transformer",
    "SyntheticTokens",
    "rank_slice",
    "rotary_tables",
    "apply_rotary",
    "count_params",
]


@dataclass
class LlamaConfig:
    """Shape of a Llama-style decoder."""

    vocab_size: int = 2048
    dim: int = 384
    n_layers: int = 8
    n_heads: int = 6
    n_kv_heads: int = 2
    ffn_dim: int = 1024
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def tiny(cls) -> "LlamaConfig":
        """About 23k parameters: for unit tests."""
        return cls(
            vocab_size=64,
            dim=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=64,
            max_seq_len=16,
        )

    @classmethod
    def demo(cls) -> "LlamaConfig":
        """About 14.2M parameters.

        One AdamW step on a global batch of 8 x 128 tokens takes about 0.65 s
        in plain torch on 2 CPU cores (2 threads), or on one core per rank
        with 4 x 128 tokens each.
        """
        return cls(
            vocab_size=2048,
            dim=384,
            n_layers=8,
            n_heads=6,
            n_kv_heads=2,
            ffn_dim=1024,
            max_seq_len=128,
        )


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learnable per-channel ``weight``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables of shape ``(seq_len, head_dim)`` (half-rotation layout)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # (S, head_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (S, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, H, S, D)`` by tables of shape ``(S, D)``."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        q = self.wq(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)

        cos, sin = rotary_tables(seq_len, self.head_dim, self.rope_theta, x.device, q.dtype)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)

        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)

        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(bsz, seq_len, self.n_heads * self.head_dim)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: attention then a feed-forward, each with a residual.

    The feed-forward is SwiGLU, registered as ``ffn``; a subclass gives another one
    (:meth:`make_ffn`) under its own name (``ffn_name``: the parameters' names, which sharding
    plans and checkpoints use), e.g. a mixture of experts."""

    ffn_name = "ffn"

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.add_module(self.ffn_name, self.make_ffn(cfg))

    def make_ffn(self, cfg: LlamaConfig) -> nn.Module:
        return FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x))
        return h + self._modules[self.ffn_name](self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama-style decoder: ``forward(tokens[B, S]) -> logits[B, S, vocab]``.

    ``block_cls``: the decoder block each layer is (a subclass swaps it, e.g. for mixtures of
    experts, and keeps the embedding, norm, head and forward)."""

    block_cls: type = TransformerBlock

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(self.block_cls(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.init_weights()

    #: the residual-stream output projections, by the end of their module names
    residual_outputs: tuple = ("attn.wo", "ffn.w2")

    def init_weights(self) -> None:
        """Deterministic (given ``torch.manual_seed``) GPT-style normal init.

        Embedding and all linears ~ N(0, 0.02); the residual-stream output
        projections (``residual_outputs``) are scaled by ``1/sqrt(2*n_layers)``;
        norm weights are ones.  Parameters are visited in registration order.
        """
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, module in self.named_modules():
                self.init_module(name, module, std, out_std)

    def init_module(self, name: str, module: nn.Module, std: float, out_std: float) -> None:
        """One module's share of :meth:`init_weights` (a subclass adds its own kinds)."""
        if isinstance(module, RMSNorm):
            module.reset_parameters()
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Linear):
            s = out_std if name.endswith(self.residual_outputs) else std
            nn.init.normal_(module.weight, mean=0.0, std=s)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[-1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[-1]} exceeds max_seq_len={self.cfg.max_seq_len}"
            )
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return self.output(h)


def count_params(model: nn.Module) -> int:
    """Number of parameter elements (of the unsharded model)."""
    return sum(p.numel() for p in model.parameters())


def rank_slice(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of ``tensor`` along dim 0.

    The leading dimension must be divisible by ``world_size``.
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"bad rank={rank} for world_size={world_size}")
    n = tensor.shape[0]
    if n % world_size != 0:
        raise ValueError(f"batch of {n} is not divisible by world_size={world_size}")
    per = n // world_size
    return tensor[rank * per : (rank + 1) * per]


class SyntheticTokens:
    """Deterministic token batches with a learnable order-2 structure.

    A seeded random subset of ``n_active`` tokens of the vocabulary is used
    (``active``), indexed ``0..n_active-1``.  A fixed random permutation
    ``perm`` of those indices and a small table of ``n_offsets`` offsets define
    the rule on indices::

        i[t] = perm[(i[t-1] + offset[i[t-2] % n_offsets]) % n_active]
        x[t] = active[i[t]]

    With probability ``noise`` a position instead takes a uniformly random
    active token; the first two tokens of each sequence are uniform over the
    active set.  The structure is learnable in stages: which tokens occur at
    all (loss from ``ln(vocab)`` to ``ln(n_active)``), then the previous token
    narrows the next one to ``n_offsets`` candidates, and attending one token
    further back settles it (the floor is about the noise entropy).

    ``batch(step, batch_size, seq_len)`` depends only on ``(seed, step,
    batch_size, seq_len)`` and the constructor arguments: every process gets
    the same global batch for the same step, and takes its part with
    ``rank_slice``.
    """

    def __init__(
        self,
        vocab_size: int,
        seed: int = 1234,
        noise: float = 0.1,
        n_offsets: int = 4,
        n_active: int | None = 64,
    ) -> None:
        if vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")
        if not 0.0 <= noise <= 1.0:
            raise ValueError("noise must be in [0, 1]")
        self.vocab_size = vocab_size
        self.seed = seed
        self.noise = noise
        self.n_active = vocab_size if n_active is None else max(2, min(n_active, vocab_size))
        g = torch.Generator().manual_seed(seed)
        self.active = torch.randperm(vocab_size, generator=g)[: self.n_active]
        self.perm = torch.randperm(self.n_active, generator=g)
        self.offsets = torch.randint(0, self.n_active, (max(1, n_offsets),), generator=g)

    def _generator(self, step: int) -> torch.Generator:
        # Mix seed and step into one 63-bit seed (deterministic, process independent).
        mixed = (self.seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) % (2**63 - 1)
        return torch.Generator().manual_seed(mixed)

    def sequences(self, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """``(batch_size, seq_len + 1)`` int64 token sequences for ``step``."""
        n = seq_len + 1
        k = self.n_active
        g = self._generator(step)
        rand = torch.randint(0, k, (batch_size, n), generator=g)
        noisy = torch.rand((batch_size, n), generator=g) < self.noise
        idx = torch.empty((batch_size, n), dtype=torch.long)
        idx[:, : min(2, n)] = rand[:, : min(2, n)]
        n_off = self.offsets.numel()
        for t in range(2, n):
            prev1, prev2 = idx[:, t - 1], idx[:, t - 2]
            nxt = self.perm[(prev1 + self.offsets[prev2 % n_off]) % k]
            idx[:, t] = torch.where(noisy[:, t], rand[:, t], nxt)
        return self.active[idx]

    def batch(self, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``(batch_size, seq_len)``; targets are inputs shifted by one."""
        seqs = self.sequences(step, batch_size, seq_len)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    @staticmethod
    def rank_slice(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """Same as the module-level :func:`rank_slice`."""
        return rank_slice(tensor, rank, world_size)
