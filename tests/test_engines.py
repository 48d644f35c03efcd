"""Generation engines: published source log-probs equal a fresh recompute, finish reasons, seeding, batching,
cross-tokenizer scoring of generated text, and the vLLM engine's import gate."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers_tiny import ARCHS, render, tiny_bpe_tokenizer, tiny_char_tokenizer, tiny_model

from hacrl_fed.engines import Generation, build_engine, split_response
from hacrl_fed.scoring import build_scoring_batch, build_scoring_batch_from_ids, token_log_probs

QUESTIONS = ["What is 12 + 7?", "Hi", "Compute the sum of the first ten positive integers, then add 3."]
SAMPLING = dict(num_samples=3, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12)


@pytest.fixture(scope="module")
def bpe():
    return tiny_bpe_tokenizer()


@pytest.fixture(scope="module")
def char():
    return tiny_char_tokenizer()


def prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


def recompute(model, tokenizer, prompts: list[str], gens: list[list[Generation]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Published per-token log-probs vs a fresh scoring pass, both ``[N, T]`` (0-padded), N = prompts × samples."""
    p_ids = prompt_ids(tokenizer, prompts)
    flat_p = [p_ids[i] for i, row in enumerate(gens) for _ in row]
    flat_g = [g for row in gens for g in row]
    batch = build_scoring_batch_from_ids(flat_p, [g.token_ids for g in flat_g], tokenizer.pad_token_id)
    with torch.no_grad():
        fresh, _ = token_log_probs(model, batch)
    published = torch.zeros_like(fresh)
    for i, g in enumerate(flat_g):
        published[i, : g.token_count] = torch.tensor(g.token_log_probs)
    return published, fresh


def unpadded(model, prompt: list[int], response: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float().log_softmax(-1)
    return [logits[len(prompt) - 1 + j, tok].item() for j, tok in enumerate(response)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("from_generation", [False, True])
def test_published_log_probs_equal_recompute(arch, from_generation, bpe):
    model = tiny_model(arch, bpe, seed=0, eos_logit_bias=3.0)
    engine = build_engine("hf", model, bpe, batch_size=4, logprobs_from_generation=from_generation)
    prompts = [render(bpe, q) for q in QUESTIONS]  # mixed prompt lengths
    # temperature / top-k / top-p change sampling, never the published temperature-1 log-probs
    gens = engine.generate(prompts, **{**SAMPLING, "temperature": 0.7, "top_k": 40, "top_p": 0.95}, seed=1)
    assert [len(row) for row in gens] == [3, 3, 3]
    published, fresh = recompute(model, bpe, prompts, gens)
    assert (published - fresh).abs().max() < 1e-4
    p_ids = prompt_ids(bpe, prompts)
    for i, row in enumerate(gens):
        for g in row:
            ref = unpadded(model, p_ids[i], g.token_ids)
            assert abs(g.logprob_sum - sum(ref)) < 1e-4
            assert g.token_count == len(g.token_ids) == len(g.token_log_probs)


def test_finish_reasons_text_and_eos(bpe):
    model = tiny_model("qwen3", bpe, seed=2, eos_logit_bias=3.5)
    engine = build_engine("hf", model, bpe)
    gens = [g for row in engine.generate([render(bpe, q) for q in QUESTIONS], **SAMPLING, seed=3) for g in row]
    eos = bpe.eos_token_id
    reasons = {g.finish_reason for g in gens}
    assert reasons == {"stop", "length"}, "the EOS bias is tuned to give both kinds"
    for g in gens:
        if g.finish_reason == "stop":
            assert g.token_ids[-1] == eos and eos not in g.token_ids[:-1]
            body = g.token_ids[:-1]
        else:
            assert len(g.token_ids) == SAMPLING["max_new_tokens"] and eos not in g.token_ids
            body = g.token_ids
        assert g.text == bpe.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_immediate_eos_gives_empty_stop_response(char):
    model = tiny_model("llama", char, seed=4, eos_logit_bias=60.0)
    engine = build_engine("hf", model, char)
    for row in engine.generate([render(char, q) for q in QUESTIONS], **SAMPLING, seed=5):
        for g in row:
            assert (g.text, g.finish_reason, g.token_ids) == ("", "stop", [char.eos_token_id])
            assert -1e-3 < g.logprob_sum <= 0


def test_same_seed_same_generations_and_global_rng_untouched(bpe):
    model = tiny_model("gpt2", bpe, seed=6, eos_logit_bias=2.0)
    engine = build_engine("hf", model, bpe, batch_size=5)
    prompts = [render(bpe, q) for q in QUESTIONS]
    state = torch.get_rng_state()
    a = engine.generate(prompts, **SAMPLING, seed=11)
    assert torch.equal(state, torch.get_rng_state())
    b = engine.generate(prompts, **SAMPLING, seed=11)
    c = engine.generate(prompts, **SAMPLING, seed=12)
    assert a == b
    assert [g.token_ids for row in a for g in row] != [g.token_ids for row in c for g in row]


def test_batch_size_caps_generate_calls(bpe):
    model = tiny_model("llama", bpe, seed=7, eos_logit_bias=2.0)
    sizes: list[int] = []
    original = model.generate

    def recording_generate(*args, **kwargs):
        sizes.append(kwargs["input_ids"].shape[0])
        return original(*args, **kwargs)

    model.generate = recording_generate
    engine = build_engine("hf", model, bpe, batch_size=4)
    gens = engine.generate([render(bpe, q) for q in QUESTIONS], **SAMPLING, seed=0)
    assert sizes == [4, 4, 1] and sum(len(row) for row in gens) == 9


def test_greedy_is_argmax_and_deterministic(char):
    model = tiny_model("qwen3", char, seed=8, eos_logit_bias=2.0)
    engine = build_engine("hf", model, char, batch_size=2)
    prompts = [render(char, q) for q in QUESTIONS]
    first = engine.greedy(prompts, max_new_tokens=8)
    assert first == engine.greedy(prompts, max_new_tokens=8)
    for p, g in zip(prompt_ids(char, prompts), first):
        with torch.no_grad():
            logits = model(torch.tensor([p + g.token_ids])).logits[0]
        argmax = logits[len(p) - 1 : len(p) - 1 + g.token_count].argmax(-1).tolist()
        assert argmax == g.token_ids
        assert abs(g.logprob_sum - sum(unpadded(model, p, g.token_ids))) < 1e-4


@pytest.mark.parametrize("source_learner", [("bpe", "char"), ("char", "bpe")])
def test_generated_text_scored_by_another_tokenizer(source_learner, bpe, char):
    toks = {"bpe": bpe, "char": char}
    src, dst = toks[source_learner[0]], toks[source_learner[1]]
    source = build_engine("hf", tiny_model("gpt2", src, seed=9, eos_logit_bias=3.0), src)
    gens = [g for row in source.generate([render(src, q) for q in QUESTIONS], **SAMPLING, seed=2) for g in row]
    assert {g.finish_reason for g in gens} == {"stop", "length"}
    learner = tiny_model("llama", dst, seed=10)
    prompts = [render(dst, q) for q in QUESTIONS for _ in range(3)]
    batch = build_scoring_batch(dst, prompts, [g.text for g in gens], [g.finish_reason for g in gens])
    for i, g in enumerate(gens):
        text_ids = dst(g.text, add_special_tokens=False)["input_ids"]
        assert dst.decode(text_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == g.text
        assert int(batch.response_lengths[i]) == len(text_ids) + (g.finish_reason == "stop")
    with torch.no_grad():
        lp, mask = token_log_probs(learner, batch)
    assert torch.isfinite(lp).all() and torch.equal(mask.sum(-1).long(), batch.response_lengths)


def test_split_response_drops_padding_after_eos():
    assert split_response([5, 6, 2, 0, 0], frozenset({2})) == ([5, 6, 2], "stop")
    assert split_response([5, 6, 7], frozenset({2, 9})) == ([5, 6, 7], "length")
    assert split_response([9], frozenset({2, 9})) == ([9], "stop")


def test_bad_arguments_are_named(bpe):
    engine = build_engine("hf", tiny_model("gpt2", bpe, seed=0), bpe)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(["x"], **{**SAMPLING, "temperature": 0.0}, seed=0)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(["x"], **{**SAMPLING, "top_p": 1.5}, seed=0)
    with pytest.raises(ValueError, match=r"prompt_texts\[1\]"):
        engine.generate(["x", ""], **SAMPLING, seed=0)
    with pytest.raises(ValueError, match="unknown generation engine 'tgi'"):
        build_engine("tgi", None, bpe)
    assert engine.generate([], **SAMPLING, seed=0) == []
    with pytest.raises(ValueError, match="token_log_probs"):
        Generation("", "stop", [1, 2], [0.0])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_engine_without_vllm_explains_install(bpe):
    with pytest.raises(ImportError, match=r"hacrl-fed\[vllm\]"):
        build_engine("vllm", tiny_model("gpt2", bpe, seed=0), bpe)


@pytest.mark.vllm
def test_vllm_engine_matches_hf_scoring(tmp_path, bpe):
    """vLLM samples, its logprobs=0 values match a transformers recompute, and sync_weights takes new weights."""
    model = tiny_model("qwen3", bpe, seed=0).to("cuda")
    model.save_pretrained(tmp_path)
    bpe.save_pretrained(tmp_path)
    engine = build_engine(
        "vllm", model, bpe, model_path=str(tmp_path), dtype="float32", max_model_len=256, enforce_eager=True
    )
    prompts = [render(bpe, q) for q in QUESTIONS]
    gens = engine.generate(prompts, **SAMPLING, seed=1)
    assert engine.generate(prompts, **SAMPLING, seed=1) == gens
    published, fresh = recompute(model, bpe, prompts, gens)
    assert (published - fresh).abs().max() < 1e-3
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    engine.sync_weights(model)
    published, fresh = recompute(model, bpe, prompts, engine.generate(prompts, **SAMPLING, seed=1))
    assert (published - fresh).abs().max() < 1e-3
