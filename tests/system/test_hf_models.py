"""Hugging Face `transformers` models from tiny configs built in the test: Llama and Mixtral (MoE),
`fully_shard` per decoder layer + root at world size 2, gradient checkpointing on, trained against
the same model unsharded in one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard

from .._dist import run_ranks

transformers = pytest.importorskip("transformers")

STEPS = 4
BATCH, SEQ, VOCAB = 4, 12, 96


def _model(kind: str, tied: bool = False):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=tied)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    return model


def _data(step):
    g = torch.Generator().manual_seed(50 + step % 2)  # two batches, repeated: the loss falls
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _train(rank, ws, kind, tied=False, wrap_embed=False):
    model = _model(kind, tied)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if ws:
        mesh = init_device_mesh("cpu", (ws,))
        if wrap_embed:  # the tied weight is first sharded by this unit; the root takes it over
            fully_shard(model.model.embed_tokens, mesh=mesh)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if tied:
            assert model.lm_head.weight is model.model.embed_tokens.weight  # one DTensor, two users
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        ids = _data(step)
        if ws:
            n = BATCH // ws
            ids = ids[rank * n : (rank + 1) * n]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if ws:
            dist.all_reduce(t)
            t /= ws
        losses.append(t.item())
    params = {k: (p.full_tensor() if ws else p.detach().clone()) for k, p in model.named_parameters()}
    return losses, params


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_hf_model_with_checkpointing_matches_unsharded(kind):
    torch.set_num_threads(1)
    ref_losses, ref_params = _train(0, 0, kind)
    assert ref_losses[-1] < ref_losses[0]
    for losses, params in run_ranks(_train, 2, kind):
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{kind} step {i}: {a} vs {b}"
        assert set(params) == set(ref_params)
        for k, r in ref_params.items():
            torch.testing.assert_close(params[k], r, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{kind} {k}: {m}")


@pytest.mark.parametrize("ws,wrap_embed", [(2, False), (2, True), (4, True)])
def test_tied_embeddings_match_unsharded(ws, wrap_embed):
    """lm_head.weight is embed_tokens.weight: one parameter used by two modules, owned by their
    lowest common unit (the root), even when the embedding was wrapped on its own first."""
    torch.set_num_threads(1)
    ref_losses, ref_params = _train(0, 0, "llama", True)
    assert ref_losses[-1] < ref_losses[0]
    for losses, params in run_ranks(_train, ws, "llama", True, wrap_embed):
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= 1e-5 * abs(b), f"ws {ws} step {i}: {a} vs {b}"
        assert set(params) == set(ref_params)
        for k, r in ref_params.items():
            torch.testing.assert_close(params[k], r, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
