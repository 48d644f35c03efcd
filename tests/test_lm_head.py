"""The chunked head (hacrl_fed/models/lm_head.py): log-probs and gradients equal to the whole log-softmax, and no
``[rows, tokens, vocab]`` logits tensor in the forward or kept for backward, on the zoo's architectures and a tiny
Gemma 3 (tied embeddings, final logit soft-capping, sliding-window layers)."""

from __future__ import annotations

import pytest
import torch
from helpers_tiny import ARCHS, tiny_bpe_tokenizer, tiny_model
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from hacrl_fed import scoring
from hacrl_fed.models import lm_head
from hacrl_fed.models.native import unsupported_reason
from hacrl_fed.scoring import build_scoring_batch_from_ids, token_log_probs


@pytest.fixture(scope="module")
def bpe():
    return tiny_bpe_tokenizer()


def tiny_gemma(vocab: int, softcap: float | None = 3.0) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=softcap,
        tie_word_embeddings=True,
        initializer_range=0.2,
        pad_token_id=0,
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


def _rows(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 7, 5, 7)]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (6, 0, 9, 2)]
    return prompts, responses


def _models(bpe):
    return [(arch, tiny_model(arch, bpe, seed=2)) for arch in ARCHS] + [("gemma3", tiny_gemma(len(bpe)))]


def _both(model, batch, monkeypatch, native: bool):
    """(whole-tensor log-probs, chunked log-probs), each with its gradients of every parameter."""
    out = []
    for one_pass in (10**9, 0):
        monkeypatch.setattr(scoring, "ONE_PASS_MAX_VOCAB", one_pass)
        model.zero_grad()
        lp, mask = token_log_probs(model, batch, native=native)
        (lp * torch.linspace(0.5, 1.5, lp.shape[1])).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        out.append((lp.detach(), mask, grads))
    return out


def test_every_known_architecture_has_its_head_split_off(bpe):
    for arch, model in _models(bpe):
        parts = lm_head.head_parts(model)
        assert parts is not None, arch
        assert parts.softcap == (3.0 if arch == "gemma3" else None)
    assert lm_head.head_parts(torch.nn.Linear(2, 2)) is None


def test_chunked_log_probs_and_gradients_equal_the_whole_log_softmax(bpe, monkeypatch):
    monkeypatch.setattr(lm_head, "HEAD_CHUNK_BYTES", 3 * 4 * len(bpe))  # 3 tokens a chunk: several chunks
    prompts, responses = _rows(len(bpe))
    batch = build_scoring_batch_from_ids(prompts, responses, bpe.pad_token_id)
    for arch, model in _models(bpe):
        for native in [False] + ([True] if unsupported_reason(model) is None else []):
            (whole, mask, g_whole), (chunked, mask2, g_chunked) = _both(model, batch, monkeypatch, native)
            assert torch.equal(mask, mask2)
            assert (chunked[mask == 0] == 0).all()
            assert (chunked - whole).abs().max() <= 1e-6, (arch, native)
            assert len(g_whole) == len(g_chunked) == len(list(model.parameters()))
            for a, b in zip(g_whole, g_chunked):
                assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (arch, native)


def test_no_rows_tokens_vocab_logits_in_forward_or_backward(bpe, monkeypatch):
    """Every head output is at most one chunk of tokens, and what autograd keeps for backward of vocabulary width
    is at most one chunk in all (each chunk checkpointed: its logits are recomputed in backward, not kept)."""
    monkeypatch.setattr(scoring, "ONE_PASS_MAX_VOCAB", 0)
    monkeypatch.setattr(lm_head, "HEAD_CHUNK_BYTES", 2 * 4 * len(bpe))  # 2 tokens a chunk
    prompts, responses = _rows(len(bpe))
    batch = build_scoring_batch_from_ids(prompts, responses, bpe.pad_token_id)
    for arch, model in _models(bpe):
        heads: list[int] = []
        kept: list[int] = []
        hook = model.get_output_embeddings().register_forward_hook(
            lambda _m, _i, out, heads=heads: heads.append(out.numel() // out.shape[-1])
        )

        def keep(t: torch.Tensor, kept: list[int] = kept) -> torch.Tensor:
            if t.dim() and t.shape[-1] == len(bpe):
                kept.append(t.numel() // t.shape[-1])
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            lp, mask = token_log_probs(model, batch)
        lp.sum().backward()
        hook.remove()
        assert len(heads) == 2 * 9 and max(heads) <= 2, (arch, heads)  # 17 scored tokens: 9 chunks, twice
        assert sum(kept) <= 2, (arch, kept)
        assert model.get_output_embeddings().weight.grad.abs().sum() > 0


def test_an_unknown_architecture_keeps_its_own_forward(bpe, monkeypatch):
    model = tiny_model("llama", bpe, seed=2)
    monkeypatch.setattr(model.config, "model_type", "llama_with_a_logit_scale")
    assert lm_head.head_parts(model) is None
    monkeypatch.setattr(scoring, "ONE_PASS_MAX_VOCAB", 0)
    prompts, responses = _rows(len(bpe))
    with torch.no_grad():
        lp, mask = token_log_probs(model, build_scoring_batch_from_ids(prompts, responses, bpe.pad_token_id))
    assert lp.shape == mask.shape and torch.isfinite(lp).all()
