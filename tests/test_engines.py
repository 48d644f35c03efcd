"""Generation engines: published source log-probs equal a fresh recompute, finish reasons, seeding, batching,
cross-tokenizer scoring of generated text, engine options, and the vLLM engine: its import gate and version range
(pyproject), and — with a fake ``vllm`` module standing in (tests/helpers_fake_vllm.py) — every point of its
contract: options forwarded, raw log-probs, the worker's exact stop set, no detokenization, checked in-process
weight sync, the multiprocess refusal, sleep/wake around training. The real engine is the opt-in ``vllm`` test."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import tomllib
from pathlib import Path

import helpers_fake_vllm
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
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers import AutoModelForCausalLM, Qwen3Config

from hacrl_fed.config import GenerationConfig
from hacrl_fed.engines import EngineOptions, Generation, HFEngine, build_engine, split_response
from hacrl_fed.engines import vllm as vllm_engine
from hacrl_fed.scoring import build_scoring_batch, build_scoring_batch_from_ids, token_log_probs

ROOT = Path(__file__).resolve().parent.parent

QUESTIONS = ["What is 12 + 7?", "Hi", "Compute the sum of the first ten positive integers, then add 3."]
SAMPLING = dict(num_samples=3, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12)


@pytest.fixture(scope="module")
def bpe():
    return tiny_bpe_tokenizer()


@pytest.fixture(scope="module")
def char():
    return tiny_char_tokenizer()


def prompt_token_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


def recompute(model, tokenizer, prompts: list[str], gens: list[list[Generation]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Published per-token log-probs vs a fresh scoring pass, both ``[N, T]`` (0-padded), N = prompts × samples."""
    p_ids = prompt_token_ids(tokenizer, prompts)
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
    p_ids = prompt_token_ids(bpe, prompts)
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
    for p, g in zip(prompt_token_ids(char, prompts), first):
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


def test_engine_options_from_config_reach_the_factory(bpe):
    gen = GenerationConfig(batch_size=7, gpu_memory_utilization=0.3, max_model_len=512, dtype="float16",
                           sleep_during_train=True, vllm_kwargs={"swap_space": 2, "enforce_eager": True})
    opts = EngineOptions.from_config(gen, seed=99, model_path="/m", tokenizer_path="/t", extra_stop_ids=[9, 4])
    assert (opts.batch_size, opts.seed, opts.gpu_memory_utilization, opts.max_model_len, opts.dtype) == (
        7, 99, 0.3, 512, "float16")
    assert (opts.sleep_level, opts.llm_kwargs, opts.model_path, opts.tokenizer_path) == (
        1, {"swap_space": 2, "enforce_eager": True}, "/m", "/t")
    # the hf engine takes only what it knows (batch_size, seed_per_batch, extra_stop_ids); explicit keyword
    # arguments win
    assert opts.kwargs_for(HFEngine) == {"batch_size": 7, "seed_per_batch": False, "extra_stop_ids": (4, 9)}
    engine = build_engine("hf", tiny_model("gpt2", bpe, seed=0), bpe, opts, logprobs_from_generation=True)
    assert engine.batch_size == 7 and engine.logprobs_from_generation and {4, 9} <= engine.stop_ids
    assert set(opts.kwargs_for(vllm_engine.VLLMEngine)) == {
        "batch_size", "seed", "model_path", "tokenizer_path", "dtype", "gpu_memory_utilization", "max_model_len",
        "sleep_level", "llm_kwargs", "extra_stop_ids"}


# --- vLLM: version range ----------------------------------------------------------------------------------------

# torch pinned by each vLLM release (from the wheels' metadata)
VLLM_TORCH = {
    "0.8.5": "2.6.0", "0.9.2": "2.7.0", "0.10.0": "2.7.1", "0.10.1": "2.7.1", "0.10.2": "2.8.0", "0.11.0": "2.8.0",
    "0.11.2": "2.9.0", "0.12.0": "2.9.0", "0.13.0": "2.9.0", "0.14.0": "2.9.1", "0.16.0": "2.9.1",
    "0.17.0": "2.10.0", "0.19.0": "2.10.0", "0.20.0": "2.11.0", "0.26.0": "2.11.0", "0.27.0": "2.13.0",
    "0.32.0": "2.13.0", "0.33.0": "2.14.0",
}
LOGPROBS_MODE_SINCE = Version("0.10")


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_vllm_extra_range_is_exactly_the_releases_with_raw_logprobs_and_our_torch():
    project = _pyproject()["project"]
    (extra,) = project["optional-dependencies"]["vllm"]
    assert Requirement(extra).specifier == SpecifierSet(vllm_engine.SUPPORTED_VLLM)
    (torch_req,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    for release, torch_pin in VLLM_TORCH.items():
        wanted = Version(release) >= LOGPROBS_MODE_SINCE and Version(torch_pin) in torch_req.specifier
        assert (Version(release) in SpecifierSet(vllm_engine.SUPPORTED_VLLM)) == wanted, release
        assert vllm_engine.version_supported(release) == wanted, release
    assert vllm_engine.version_supported("0.20.1.dev3+gabcdef") and not vllm_engine.version_supported("nonsense")


@pytest.mark.parametrize("version", ["0.9.2", "0.33.0"])
def test_vllm_release_outside_the_range_is_refused(monkeypatch, version, bpe):
    helpers_fake_vllm.install(monkeypatch, version=version)
    with pytest.raises(ImportError, match=r"vllm>=0.10,<0.33"):
        build_engine("vllm", tiny_model("gpt2", bpe, seed=0), bpe, model_path="/nowhere")


# --- vLLM engine against the fake module ---------------------------------------------------------------------


@pytest.fixture
def fake_vllm(monkeypatch):
    """The fake ``vllm`` module; engines also keep the SamplingParams of their last call as ``_last_params``."""
    original = vllm_engine.VLLMEngine._collect

    def collect(self, requests, params):
        self._last_params = params
        return original(self, requests, params)

    monkeypatch.setattr(vllm_engine.VLLMEngine, "_collect", collect)
    return helpers_fake_vllm.install(monkeypatch)


def _saved(tmp_path, model, tokenizer, folder_eos=None) -> str:
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    if folder_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": folder_eos}))
    return str(tmp_path)


def _vllm(model, tokenizer, path, **kw):
    return build_engine("vllm", model, tokenizer, EngineOptions(model_path=path, **kw))


def test_vllm_forwards_every_option_and_sets_raw_logprobs(fake_vllm, tmp_path, bpe):
    model = tiny_model("qwen3", bpe, seed=0)
    path = _saved(tmp_path, model, bpe)
    opts = EngineOptions(batch_size=12, seed=4321, model_path=path, tokenizer_path=path, dtype="float16",
                         gpu_memory_utilization=0.35, max_model_len=300, sleep_level=1,
                         llm_kwargs={"swap_space": 1, "enforce_eager": True})
    engine = build_engine("vllm", model, bpe, opts)
    (llm,) = fake_vllm.LLM.instances
    assert llm.kwargs == dict(model=path, tokenizer=path, dtype="float16", gpu_memory_utilization=0.35, seed=4321,
                              enforce_eager=True, logprobs_mode="raw_logprobs", generation_config="vllm",
                              max_model_len=300, max_num_seqs=12, enable_sleep_mode=True, swap_space=1)
    assert engine.llm is llm
    # float32 weights run as bfloat16 by default; float32 is refused; the engine's own arguments cannot be overridden
    build_engine("vllm", model, bpe, EngineOptions(model_path=path))
    assert fake_vllm.LLM.instances[-1].kwargs["dtype"] == "bfloat16"
    assert "enable_sleep_mode" not in fake_vllm.LLM.instances[-1].kwargs
    with pytest.raises(ValueError, match="float32"):
        build_engine("vllm", model, bpe, EngineOptions(model_path=path, dtype="float32"))
    with pytest.raises(ValueError, match="logprobs_mode"):
        build_engine("vllm", model, bpe, EngineOptions(model_path=path, llm_kwargs={"logprobs_mode": "x"}))
    with pytest.raises(ValueError, match="sleep_level"):
        build_engine("vllm", model, bpe, EngineOptions(model_path=path, sleep_level=2))


def test_vllm_publishes_raw_log_probs_equal_to_a_recompute(fake_vllm, tmp_path, bpe):
    model = tiny_model("qwen3", bpe, seed=0)
    engine = _vllm(model, bpe, _saved(tmp_path, model, bpe))
    prompts = [render(bpe, q) for q in QUESTIONS]
    # temperature / top-k / top-p change sampling, never the published temperature-1 log-probs
    gens = engine.generate(prompts, **{**SAMPLING, "temperature": 0.7, "top_k": 40, "top_p": 0.95}, seed=1)
    assert [len(row) for row in gens] == [3, 3, 3]
    published, fresh = recompute(model, bpe, prompts, gens)
    assert (published - fresh).abs().max() < 1e-4
    # what the engine asked vLLM for: the sampled token's log-prob, ids only, per-request seeds
    params = engine._last_params
    assert all(p.kwargs["logprobs"] == 0 and p.kwargs["detokenize"] is False for p in params)
    assert len({p.kwargs["seed"] for p in params}) == 9
    # same seed, same outputs; another seed, other outputs
    assert engine.generate(prompts, **{**SAMPLING, "temperature": 0.7, "top_k": 40, "top_p": 0.95}, seed=1) == gens
    other = engine.generate(prompts, **{**SAMPLING, "temperature": 0.7, "top_k": 40, "top_p": 0.95}, seed=2)
    assert [g.token_ids for row in other for g in row] != [g.token_ids for row in gens for g in row]


def test_without_raw_logprobs_mode_the_fake_returns_processed_ones(fake_vllm, tmp_path, bpe):
    """The fake is strict: were logprobs_mode not set, published log-probs would be the processed ones."""
    model = tiny_model("qwen3", bpe, seed=0)
    path = _saved(tmp_path, model, bpe)
    llm = fake_vllm.LLM(model=path, tokenizer=path)
    sp = fake_vllm.SamplingParams(temperature=0.7, logprobs=0, max_tokens=6, seed=3)
    ids = bpe(render(bpe, QUESTIONS[0]), add_special_tokens=False)["input_ids"]
    comp = llm.generate([{"prompt_token_ids": ids}], [sp])[0].outputs[0]
    lps = [step[t].logprob for t, step in zip(comp.token_ids, comp.logprobs)]
    assert max(abs(a - b) for a, b in zip(lps, unpadded(model, ids, comp.token_ids))) > 1e-2


def _frequent_tokens(gens, exclude):
    counts = collections.Counter(t for row in gens for g in row for t in g.token_ids[:-1] if t not in exclude)
    return [t for t, _ in counts.most_common()]


def test_vllm_stops_on_exactly_the_worker_stop_set(fake_vllm, tmp_path, bpe):
    model = tiny_model("qwen3", bpe, seed=0)
    prompts = [render(bpe, q) for q in QUESTIONS]
    probe = _vllm(model, bpe, _saved(tmp_path / "probe", model, bpe))
    y, x = _frequent_tokens(probe.generate(prompts, **SAMPLING, seed=5), {bpe.eos_token_id})[:2]
    # the worker stops on its EOS and y (the model's in-memory generation config); the folder also lists x
    model.generation_config.eos_token_id = [bpe.eos_token_id, y]
    path = _saved(tmp_path / "model", model, bpe, folder_eos=[bpe.eos_token_id, y, x])
    engine = _vllm(model, bpe, path)
    assert engine.stop_ids == frozenset({bpe.eos_token_id, y})
    gens = [g for row in engine.generate(prompts, **SAMPLING, seed=5) for g in row]
    for p in engine._last_params:
        assert p.kwargs["ignore_eos"] is True and p.kwargs["stop_token_ids"] == sorted({bpe.eos_token_id, y})
    assert {g.finish_reason for g in gens} == {"stop", "length"}
    assert any(x in g.token_ids for g in gens), "x is sampled but never ends a response"
    hf = build_engine("hf", model, bpe)
    # text decoded by the worker's tokenizer (vLLM was asked for ids only), as the hf engine does
    assert_stops_and_lengths(gens, engine.stop_ids, SAMPLING["max_new_tokens"], bpe)
    assert hf.stop_ids == engine.stop_ids
    # a vLLM that stopped on a token outside the worker's set is caught, not relabelled
    engine.llm.honor_ignore_eos, engine.llm.folder_eos = False, {x}
    with pytest.raises(RuntimeError, match="outside the worker's stop set"):
        engine.generate(prompts, **SAMPLING, seed=5)


def test_vllm_greedy_is_argmax_with_ids_only(fake_vllm, tmp_path, char):
    model = tiny_model("llama", char, seed=8)
    engine = _vllm(model, char, _saved(tmp_path, model, char))
    prompts = [render(char, q) for q in QUESTIONS]
    first = engine.greedy(prompts, max_new_tokens=8)
    assert all(p.kwargs["temperature"] == 0.0 and p.kwargs["detokenize"] is False for p in engine._last_params)
    assert first == engine.greedy(prompts, max_new_tokens=8) and engine.greedy([], max_new_tokens=8) == []
    for p, g in zip(prompt_token_ids(char, prompts), first):
        with torch.no_grad():
            logits = model(torch.tensor([p + g.token_ids])).logits[0]
        assert logits[len(p) - 1 : len(p) - 1 + g.token_count].argmax(-1).tolist() == g.token_ids


def test_vllm_sync_weights_loads_every_parameter_and_resets_the_prefix_cache(fake_vllm, tmp_path, bpe):
    model = tiny_model("qwen3", bpe, seed=0)
    engine = _vllm(model, bpe, _saved(tmp_path, model, bpe))
    prompts = [render(bpe, q) for q in QUESTIONS]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    engine.llm.calls.clear()
    engine.sync_weights(model)
    assert engine.llm.calls == [("apply_model",), ("reset_prefix_cache",)]
    for name, p in engine.llm.model.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[name])
    published, fresh = recompute(model, bpe, prompts, engine.generate(prompts, **SAMPLING, seed=1))
    assert (published - fresh).abs().max() < 1e-4
    # a partial sync (a weight the engine's model did not take) is an error, not stale weights
    engine.llm.drop_names = {"model.norm.weight"}
    with pytest.raises(RuntimeError, match=r"1 of \d+ engine parameters were not loaded.*model.norm.weight"):
        engine.sync_weights(model)
    engine.llm.drop_names, engine.llm.load_returns_none = set(), True
    with pytest.raises(RuntimeError, match="did not report"):
        engine.sync_weights(model)


def test_vllm_refuses_the_multiprocess_engine(fake_vllm, monkeypatch, tmp_path, bpe):
    model = tiny_model("qwen3", bpe, seed=0)
    path = _saved(tmp_path, model, bpe)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING='1'.*separate process"):
        _vllm(model, bpe, path)
    assert fake_vllm.LLM.instances == []
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    engine = _vllm(model, bpe, path)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # set for vLLM when unset
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(RuntimeError, match="separate process"):
        engine.sync_weights(model)


def test_vllm_sleeps_only_when_asked(fake_vllm, tmp_path, bpe):
    model = tiny_model("qwen3", bpe, seed=0)
    path = _saved(tmp_path, model, bpe)
    awake = _vllm(model, bpe, path)
    with awake.released():
        assert not awake.llm.asleep
    assert not [c for c in awake.llm.calls if c[0] in ("sleep", "wake_up")]
    sleepy = _vllm(model, bpe, path, sleep_level=1)
    with pytest.raises(ZeroDivisionError):
        with sleepy.released():
            assert sleepy.llm.asleep
            1 / 0
    assert not sleepy.llm.asleep and sleepy.llm.calls[-2:] == [("sleep", 1), ("wake_up",)]


def _vllm_shaped_model(tokenizer, seed: int = 0):
    """A 2-layer Qwen3 with head_dim 64 (a size vLLM's attention back-ends accept), bfloat16, on CUDA."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      initializer_range=0.1, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to("cuda").eval()


@pytest.mark.vllm
def test_vllm_engine_matches_hf_scoring(tmp_path, bpe):
    """Real vLLM: token ids reproducible exactly for a seed, log-probs within bf16 tolerance of a transformers
    recompute, stops on the worker's EOS, sleep/wake around an update, and sync_weights takes new weights."""
    model = _vllm_shaped_model(bpe)
    path = _saved(tmp_path, model, bpe)
    engine = build_engine("vllm", model, bpe, EngineOptions(model_path=path, dtype="bfloat16", max_model_len=256,
                                                            gpu_memory_utilization=0.3, sleep_level=1,
                                                            llm_kwargs={"enforce_eager": True}))
    prompts = [render(bpe, q) for q in QUESTIONS]
    gens = engine.generate(prompts, **SAMPLING, seed=1)
    again = engine.generate(prompts, **SAMPLING, seed=1)
    assert [g.token_ids for row in again for g in row] == [g.token_ids for row in gens for g in row]

    def check(generations):
        published, fresh = recompute(model, bpe, prompts, generations)
        err = (published - fresh).abs()
        assert err.max() < 0.15 and err.sum() / max(1, sum(g.token_count for r in generations for g in r)) < 0.03
        for g in (g for row in generations for g in row):
            assert (g.finish_reason == "stop") == (g.token_ids[-1:] == [bpe.eos_token_id])

    check(gens)
    with engine.released():
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
    engine.sync_weights(model)
    check(engine.generate(prompts, **SAMPLING, seed=1))
