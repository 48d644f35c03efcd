"""The ``fast`` engine: recorded log-probs equal the scoring pass (every zoo architecture and tokenizer kind, left
padding, temperature != 1, top-k / top-p, both decoders), no second forward pass (spies), stop ids and
max_new_tokens, seeding, greedy identical to the ``hf`` engine, the sampler's restrictions, the fallback decoder for
models the hand-written one does not cover, and the engine's registry / config choice."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from helpers_tiny import (
    ARCHS,
    assert_stops_and_lengths,
    render,
    tiny_bpe_tokenizer,
    tiny_char_tokenizer,
    tiny_model,
)
from transformers import AutoModelForCausalLM, MistralConfig

from hacrl_fed import scoring
from hacrl_fed.config import GenerationConfig, ModelConfig, load_config
from hacrl_fed.engines import EngineOptions, FastEngine, build_engine
from hacrl_fed.engines import fast as fast_engine
from hacrl_fed.models.chat import render_prompt
from hacrl_fed.models.loading import load_model_and_tokenizer
from hacrl_fed.scoring import build_scoring_batch_from_ids, token_log_probs
from hacrl_fed.tasks import get_task

QUESTIONS = ["What is 12 + 7?", "Hi", "Compute the sum of the first ten positive integers, then add 3."]
SAMPLING = dict(num_samples=3, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12)
SHAPED = {**SAMPLING, "temperature": 0.7, "top_k": 40, "top_p": 0.95}
ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-4  # the hf engine's tolerance for published vs recomputed log-probs (tests/test_engines.py)


@pytest.fixture(scope="module")
def toks():
    return {"bpe": tiny_bpe_tokenizer(), "char": tiny_char_tokenizer()}


@pytest.fixture(params=["native", "model"])
def decoder(request, monkeypatch):
    """Run each test with the hand-written decoder and with the fallback over the model's own forward."""
    if request.param == "model":
        monkeypatch.setattr(fast_engine, "_unsupported_reason", lambda model: "forced by the test")
    return request.param


def _ids(tokenizer, prompts):
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


def assert_scored_alike(model, tokenizer, prompts, gens):
    """Every published per-token log-prob equals a fresh left-padded scoring pass and an unpadded forward."""
    p_ids = _ids(tokenizer, prompts)
    flat_p = [p_ids[i] for i, row in enumerate(gens) for _ in row]
    flat = [g for row in gens for g in row]
    batch = build_scoring_batch_from_ids(flat_p, [g.token_ids for g in flat], tokenizer.pad_token_id)
    with torch.no_grad():
        fresh, mask = token_log_probs(model, batch)
    for i, g in enumerate(flat):
        assert g.token_count == len(g.token_ids) == len(g.token_log_probs) == int(mask[i].sum())
        assert torch.allclose(torch.tensor(g.token_log_probs), fresh[i, : g.token_count], atol=TOL, rtol=0)
        with torch.no_grad():
            logits = model(torch.tensor([flat_p[i] + g.token_ids])).logits[0].float().log_softmax(-1)
        start = len(flat_p[i]) - 1
        alone = [logits[start + j, tok].item() for j, tok in enumerate(g.token_ids)]
        assert abs(g.logprob_sum - sum(alone)) < TOL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tok_kind", ["bpe", "char"])
def test_recorded_log_probs_equal_the_scoring_pass(arch, tok_kind, toks, decoder):
    tok = toks[tok_kind]
    model = tiny_model(arch, tok, seed=0, eos_logit_bias=3.0)
    assert fast_engine.decoder_kind(model) == decoder
    engine = build_engine("fast", model, tok, batch_size=4)
    prompts = [render(tok, q) for q in QUESTIONS]  # mixed prompt lengths: left padding
    for sampling in (SHAPED, {**SAMPLING, "temperature": 1.6, "top_p": 0.8}):
        gens = engine.generate(prompts, **sampling, seed=1)
        assert [len(row) for row in gens] == [3, 3, 3]
        assert_scored_alike(model, tok, prompts, gens)


def test_zoo_agents_record_the_scoring_log_probs_and_greedy_matches_hf():
    """The demo's three agents (Qwen3 + char, GPT-2 + BPE, Llama + BPE) on arithmetic prompts, one batch."""
    task = get_task("arithmetic", {"difficulty": 2}, seed=0)
    for name in ("qwen-char", "gpt2-bpe", "llama-bpe"):
        model, tok = load_model_and_tokenizer(ModelConfig(zoo=name))
        assert fast_engine.decoder_kind(model) == "native", name
        prompts = [render_prompt(tok, p.messages) for p in task.prompts("train", list(range(6)))]
        engine = build_engine("fast", model, tok, batch_size=64)
        gens = engine.generate(prompts, **{**SAMPLING, "max_new_tokens": 24}, seed=3)
        assert_scored_alike(model, tok, prompts, gens)
        fast = engine.greedy(prompts, max_new_tokens=24)
        hf = build_engine("hf", model, tok, batch_size=64).greedy(prompts, max_new_tokens=24)
        assert [(g.token_ids, g.text, g.finish_reason) for g in fast] == [
            (g.token_ids, g.text, g.finish_reason) for g in hf
        ], name


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_is_identical_to_the_hf_engine(arch, toks, decoder):
    for kind, tok in toks.items():
        model = tiny_model(arch, tok, seed=8, eos_logit_bias=2.0)
        prompts = [render(tok, q) for q in QUESTIONS]
        fast = build_engine("fast", model, tok, batch_size=2).greedy(prompts, max_new_tokens=10)
        hf = build_engine("hf", model, tok, batch_size=2).greedy(prompts, max_new_tokens=10)
        assert [(g.token_ids, g.text, g.finish_reason) for g in fast] == [
            (g.token_ids, g.text, g.finish_reason) for g in hf
        ], kind
        for a, b in zip(fast, hf):
            assert torch.allclose(torch.tensor(a.token_log_probs), torch.tensor(b.token_log_probs), atol=TOL)


def test_no_second_forward_pass_for_the_log_probs(toks, monkeypatch):
    """Spies: the native decoder never calls the model's forward and never scores; the fallback calls forward
    once for the prompts and once per further token, always with its cache, one new column each."""

    def no_scoring(*args, **kwargs):
        raise AssertionError("the fast engine must not run a scoring pass for float32 models")

    monkeypatch.setattr(scoring, "token_log_probs", no_scoring)
    monkeypatch.setattr(fast_engine, "per_token_log_probs", no_scoring)
    tok = toks["bpe"]
    model = tiny_model("qwen3", tok, seed=2, eos_logit_bias=2.5)
    calls: list[tuple[int, bool]] = []
    original = model.forward

    def spy(*args, **kwargs):
        calls.append((kwargs["input_ids"].shape[1], kwargs.get("cache", kwargs.get("past_key_values")) is not None))
        return original(*args, **kwargs)

    model.forward = spy
    prompts = [render(tok, q) for q in QUESTIONS]
    engine = build_engine("fast", model, tok, batch_size=16)
    gens = engine.generate(prompts, **SAMPLING, seed=4)
    longest = max(g.token_count for row in gens for g in row)
    assert calls == [] and engine.steps == longest  # prefill + one step per token after the first
    monkeypatch.setattr(fast_engine, "_unsupported_reason", lambda model: "forced by the test")
    engine.steps = 0
    again = engine.generate(prompts, **SAMPLING, seed=4)
    longest = max(g.token_count for row in again for g in row)
    assert engine.steps == len(calls) == longest
    assert calls[0] == (max(len(p) for p in _ids(tok, prompts)), False)
    assert all(c == (1, True) for c in calls[1:])


def test_stop_ids_and_max_new_tokens(toks, decoder):
    tok = toks["bpe"]
    model = tiny_model("llama", tok, seed=2, eos_logit_bias=3.5)
    other = tok.convert_tokens_to_ids("<|im_start|>")
    model.generation_config.eos_token_id = [tok.eos_token_id, other]  # a second stop id, as Llama 3's eot
    engine = build_engine("fast", model, tok)
    assert engine.stop_ids == {tok.eos_token_id, other}
    gens = [g for row in engine.generate([render(tok, q) for q in QUESTIONS], **SAMPLING, seed=3) for g in row]
    assert {g.finish_reason for g in gens} == {"stop", "length"}
    assert_stops_and_lengths(gens, engine.stop_ids, SAMPLING["max_new_tokens"], tok)


def test_finished_rows_leave_the_batch_without_changing_the_rest(toks, monkeypatch):
    """Rows that stop are dropped from the cache (spy); the others' tokens and log-probs are what a batch that
    never drops rows gives, and equal the scoring pass."""
    tok = toks["char"]
    model = tiny_model("gpt2", tok, seed=2, eos_logit_bias=2.0)  # greedy lengths 9, 16 and 1
    prompts = [render(tok, q) for q in QUESTIONS]
    selects = collections.Counter()
    original = fast_engine._Native.select

    def counting(self, rows):
        selects["calls"] += 1
        return original(self, rows)

    monkeypatch.setattr(fast_engine._Native, "select", counting)
    engine = build_engine("fast", model, tok, batch_size=9)
    gens = engine.greedy(prompts * 3, max_new_tokens=16)
    assert selects["calls"] > 0
    one_by_one = build_engine("fast", model, tok, batch_size=1).greedy(prompts * 3, max_new_tokens=16)
    assert [g.token_ids for g in gens] == [g.token_ids for g in one_by_one]
    assert_scored_alike(model, tok, prompts * 3, [[g] for g in gens])


def test_same_seed_same_samples_and_the_callers_rng_untouched(toks, decoder):
    tok = toks["bpe"]
    model = tiny_model("gpt2", tok, seed=6, eos_logit_bias=2.0)
    engine = build_engine("fast", model, tok, batch_size=5)
    prompts = [render(tok, q) for q in QUESTIONS]
    state = torch.get_rng_state()
    a = engine.generate(prompts, **SHAPED, seed=11)
    assert torch.equal(state, torch.get_rng_state())
    assert a == engine.generate(prompts, **SHAPED, seed=11)
    c = engine.generate(prompts, **SHAPED, seed=12)
    assert [g.token_ids for row in a for g in row] != [g.token_ids for row in c for g in row]


def test_sampler_keeps_to_top_k_and_top_p_and_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]]).repeat(20000, 1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        free = fast_engine.sample_tokens(logits, 1.0, 0, 1.0)
        top2 = fast_engine.sample_tokens(logits, 1.0, 2, 1.0)
        nucleus = fast_engine.sample_tokens(logits, 1.0, 0, 0.6)  # p = .53 .19 .12 .03 .07: the first two reach .6
        hot = fast_engine.sample_tokens(logits, 0.5, 0, 1.0)
    freq = torch.bincount(free, minlength=5).float() / len(free)
    assert (freq - logits[0].softmax(-1)).abs().max() < 0.015
    assert set(top2.tolist()) == {0, 1} and set(nucleus.tolist()) == {0, 1}
    hot_freq = torch.bincount(hot, minlength=5).float() / len(hot)
    assert (hot_freq - (logits[0] / 0.5).softmax(-1)).abs().max() < 0.015


def test_top_k_one_and_a_tiny_top_p_sample_the_greedy_tokens(toks, decoder):
    tok = toks["char"]
    model = tiny_model("qwen3", tok, seed=9, eos_logit_bias=2.0)
    engine = build_engine("fast", model, tok, batch_size=8)
    prompts = [render(tok, q) for q in QUESTIONS]
    greedy = [g.token_ids for g in engine.greedy(prompts, max_new_tokens=10)]
    for shaped in ({"top_k": 1}, {"top_p": 1e-6}):
        gens = engine.generate(prompts, **{**SAMPLING, "max_new_tokens": 10, **shaped}, seed=0)
        assert [[g.token_ids for g in row] for row in gens] == [[ids] * 3 for ids in greedy]


def test_models_the_hand_written_decoder_does_not_cover_use_their_own_forward(toks):
    tok = toks["bpe"]
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.2,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    others = {"mistral": AutoModelForCausalLM.from_config(config).eval()}
    hooked = tiny_model("llama", tok, seed=1)
    hooked.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 0.5)
    others["hooked"] = hooked
    try:
        from peft import LoraConfig, get_peft_model

        lora = get_peft_model(tiny_model("qwen3", tok, seed=1), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)  # a trained adapter: the base weights alone would give other log-probs
        others["lora"] = lora
    except ImportError:  # peft is an optional extra; the other two cover the fallback
        pass
    prompts = [render(tok, q) for q in QUESTIONS]
    for name, model in others.items():
        assert fast_engine.decoder_kind(model) == "model", name
        gens = build_engine("fast", model, tok, batch_size=4).generate(prompts, **SHAPED, seed=2)
        assert_scored_alike(model, tok, prompts, gens)


def test_half_precision_models_publish_the_scoring_pass(toks):
    tok = toks["bpe"]
    model = tiny_model("qwen3", tok, seed=3, eos_logit_bias=2.0).to(torch.bfloat16)
    prompts = [render(tok, q) for q in QUESTIONS]
    gens = build_engine("fast", model, tok, batch_size=4).generate(prompts, **SAMPLING, seed=1)
    p_ids = _ids(tok, prompts)
    flat_p = [p_ids[i] for i, row in enumerate(gens) for _ in row]
    flat = [g for row in gens for g in row]
    expected = scoring.per_token_log_probs(
        model, build_scoring_batch_from_ids(flat_p, [g.token_ids for g in flat], tok.pad_token_id), 4
    )
    assert [g.token_log_probs for g in flat] == expected


def test_registry_config_and_options(toks, tmp_path):
    tok = toks["char"]
    model = tiny_model("llama", tok)
    engine = build_engine("fast", model, tok, EngineOptions.from_config(GenerationConfig(batch_size=7), seed=3))
    assert isinstance(engine, FastEngine) and engine.batch_size == 7
    assert GenerationConfig(engine="fast").engine == "fast"
    assert GenerationConfig().engine == "hf"  # the default stays hf (bench cells hash the resolved config)
    assert load_config(ROOT / "configs" / "demo.yaml").generation.engine == "fast"
    with pytest.raises(ValueError, match="engine"):
        GenerationConfig(engine="turbo")
