"""Loading (device/dtype/errors/pad token), chat rendering, and the two offline tokenizer kinds."""

from __future__ import annotations

import string

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from hacrl_fed.config import BuildError, ModelConfig
from hacrl_fed.models import (
    build_bpe_tokenizer,
    build_char_tokenizer,
    build_tokenizer,
    eos_token_id,
    fallback_render,
    load_model_and_tokenizer,
    render_prompt,
    resolve_device,
    resolve_dtype,
)
from hacrl_fed.tasks import get_task
from hacrl_fed.types import ChatMessage

USER = (ChatMessage("user", "53-93-1"),)
SYSTEM_USER = (ChatMessage("system", "Be exact."), ChatMessage("user", "2+3"))


@pytest.fixture(scope="module")
def task():
    return get_task("arithmetic", {"difficulty": 2}, seed=0)


@pytest.fixture(scope="module")
def task_texts(task):
    prompts = task.prompts("train", range(300))
    texts = [m.content for p in prompts for m in p.messages]
    return texts + [task.sft_target("train", p.prompt_id) for p in prompts]


@pytest.fixture(scope="module")
def bpe(task_texts):
    return build_bpe_tokenizer(task_texts, vocab_size=400)


@pytest.fixture(scope="module")
def char():
    return build_char_tokenizer()


def _tiny_model_dir(path, tokenizer, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, GPT2Config

    cfg = GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=64,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ---- device / dtype ----------------------------------------------------------------------------------------


def test_resolve_device_auto_and_cpu():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device("CPU") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "tpu", ""])
def test_resolve_device_rejects_bad_strings(spec):
    with pytest.raises(ValueError, match="model.device"):
        resolve_device(spec)


def test_resolve_device_cuda_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda:0")


def test_resolve_dtype_auto_and_names(monkeypatch):
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bf16") == torch.bfloat16
    assert resolve_dtype("float16") == torch.float16
    assert resolve_dtype("float32", "cuda") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda:0") == torch.float32


@pytest.mark.parametrize("spec", ["float64", "int8", "fp8", "bf32"])
def test_resolve_dtype_rejects_bad_strings(spec):
    with pytest.raises(ValueError, match=f"model.dtype={spec!r}"):
        resolve_dtype(spec)


# ---- loading ----------------------------------------------------------------------------------------------


def test_load_local_model_conventions(tmp_path, char):
    path = _tiny_model_dir(tmp_path / "m", char)
    model, tok = load_model_and_tokenizer(ModelConfig(path=str(path), device="cpu"))
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert all(p.requires_grad for p in model.parameters())
    assert tok.padding_side == "left" and tok.pad_token == "<pad>"
    assert model.generation_config.pad_token_id == tok.pad_token_id
    frozen, _ = load_model_and_tokenizer(ModelConfig(path=str(path), device="cpu"), for_training=False)
    assert not any(p.requires_grad for p in frozen.parameters())


def test_fp16_weights_load_as_float32_on_cpu_and_dtype_override(tmp_path, char):
    path = _tiny_model_dir(tmp_path / "m16", char, dtype=torch.float16)
    model, _ = load_model_and_tokenizer(ModelConfig(path=str(path), device="cpu", dtype="auto"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    model, _ = load_model_and_tokenizer(ModelConfig(path=str(path), device="cpu", dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_separate_tokenizer_path(tmp_path, char, bpe):
    model_dir = _tiny_model_dir(tmp_path / "m", bpe)
    tok_dir = tmp_path / "tok"
    bpe.save_pretrained(tok_dir)
    _, tok = load_model_and_tokenizer(ModelConfig(path=str(model_dir), tokenizer=str(tok_dir), device="cpu"))
    assert tok.get_vocab() == bpe.get_vocab()
    char_model = _tiny_model_dir(tmp_path / "char_model", char)  # 100 embedding rows < 400 BPE tokens
    with pytest.raises(ValueError, match="does not belong to this model"):
        load_model_and_tokenizer(ModelConfig(path=str(char_model), tokenizer=str(tok_dir), device="cpu"))


@pytest.mark.parametrize(
    "cfg, err, match",
    [
        (dict(path="/nonexistent/model/dir"), BuildError, "model.path='/nonexistent/model/dir'"),
        (dict(path="./not/here"), BuildError, "model.path"),
        (dict(path="some-org/some-model-not-cached"), BuildError, "model.path: could not load tokenizer"),
        (dict(zoo="no-such-agent"), BuildError, "not a zoo agent"),
    ],
)
def test_load_errors(cfg, err, match):
    with pytest.raises(err, match=match):
        load_model_and_tokenizer(ModelConfig(device="cpu", **cfg))


def test_load_errors_bad_device_or_dtype(tmp_path, char):
    path = str(_tiny_model_dir(tmp_path / "m", char))
    with pytest.raises(ValueError, match="model.dtype='double'"):
        load_model_and_tokenizer(ModelConfig(path=path, dtype="double"))
    with pytest.raises(ValueError, match="model.device='npu'"):
        load_model_and_tokenizer(ModelConfig(path=path, device="npu"))


def _bare_tokenizer(with_eos: bool):
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<unk>", "</s>"] + list(string.digits))}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>" if with_eos else None)


@pytest.mark.parametrize("with_eos", [True, False])
def test_pad_token_fallbacks(tmp_path, with_eos):
    tok = _bare_tokenizer(with_eos)
    assert tok.pad_token is None
    path = _tiny_model_dir(tmp_path / "m", tok)
    model, loaded = load_model_and_tokenizer(ModelConfig(path=str(path), device="cpu"))
    if with_eos:
        assert loaded.pad_token == "</s>" and len(loaded) == 12
        assert model.get_input_embeddings().weight.shape[0] == 12
    else:
        assert loaded.pad_token == "<pad>" and loaded.pad_token_id == 12
        assert model.get_input_embeddings().weight.shape[0] == 13
    assert loaded.padding_side == "left"


# ---- chat rendering ----------------------------------------------------------------------------------------


def test_render_prompt_with_templates(char, bpe):
    assert render_prompt(char, USER) == "Q: 53-93-1\nA: "
    assert render_prompt(bpe, USER) == "<|user|>53-93-1<|assistant|>"
    assert render_prompt(char, SYSTEM_USER) == "S: Be exact.\nQ: 2+3\nA: "
    assert render_prompt(bpe, SYSTEM_USER) == "<|system|>Be exact.<|user|>2+3<|assistant|>"
    assert render_prompt(char, USER) == render_prompt(char, USER)  # deterministic
    history = USER + (ChatMessage("assistant", "-41"), ChatMessage("user", "1+1"))
    assert render_prompt(char, history) == "Q: 53-93-1\nA: -41<eos>\nQ: 1+1\nA: "
    ids = bpe(render_prompt(bpe, USER), add_special_tokens=False)["input_ids"]
    assert ids[0] == bpe.convert_tokens_to_ids("<|user|>") and ids[-1] == bpe.convert_tokens_to_ids("<|assistant|>")


def test_render_prompt_fallback_without_template():
    tok = _bare_tokenizer(with_eos=True)
    assert not tok.chat_template
    assert render_prompt(tok, USER) == "User: 53-93-1\nAssistant:"
    assert render_prompt(tok, SYSTEM_USER) == "System: Be exact.\nUser: 2+3\nAssistant:"
    assert fallback_render(USER) == "User: 53-93-1\nAssistant:"


def test_render_prompt_rejects_bad_messages(char):
    with pytest.raises(ValueError, match="at least one"):
        render_prompt(char, ())
    with pytest.raises(ValueError, match=r"messages\[1\].role='tool'"):
        render_prompt(char, (ChatMessage("user", "1"), ChatMessage("tool", "x")))


def test_eos_token_id(char, bpe):
    assert eos_token_id(char) == char.convert_tokens_to_ids("<eos>") == 1
    assert eos_token_id(bpe) == 1
    with pytest.raises(ValueError, match="no eos_token"):
        eos_token_id(_bare_tokenizer(with_eos=False))


# ---- tokenizers ----------------------------------------------------------------------------------------------


def test_char_tokenizer_is_lossless_one_token_per_char(char, task_texts):
    assert len(char) == 100
    ascii_text = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
    for text in task_texts + [ascii_text]:
        ids = char(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)
        assert char.unk_token_id not in ids
        assert char.decode(ids) == text
    assert char.decode(char("1+2", add_special_tokens=False)["input_ids"] + [1, 0], skip_special_tokens=True) == "1+2"


def test_bpe_tokenizer_is_lossless_and_compresses(bpe, task_texts):
    assert len(bpe) == 400
    total_chars = total_ids = 0
    for text in task_texts + ["héllo wörld ∑ 🙂\n\ttabs"]:
        ids = bpe(text, add_special_tokens=False)["input_ids"]
        assert bpe.decode(ids) == text
        total_chars, total_ids = total_chars + len(text), total_ids + len(ids)
    assert total_ids < 0.75 * total_chars  # merges learned on task text
    for marker in ("<|system|>", "<|user|>", "<|assistant|>"):
        assert len(bpe(marker, add_special_tokens=False)["input_ids"]) == 1


def test_bpe_is_deterministic_and_checks_vocab(task_texts):
    a = build_bpe_tokenizer(task_texts, 300)
    b = build_tokenizer("bpe", task_texts, 300)
    assert a.get_vocab() == b.get_vocab()
    with pytest.raises(ValueError, match="vocab_size=200"):
        build_bpe_tokenizer(task_texts, 200)
    with pytest.raises(ValueError, match="tokenizer kind 'word'"):
        build_tokenizer("word")


def test_tokenizers_survive_save_load(tmp_path, char, bpe):
    from transformers import AutoTokenizer

    for name, tok in (("char", char), ("bpe", bpe)):
        tok.save_pretrained(tmp_path / name)
        loaded = AutoTokenizer.from_pretrained(tmp_path / name)
        assert loaded.get_vocab() == tok.get_vocab()
        assert render_prompt(loaded, SYSTEM_USER) == render_prompt(tok, SYSTEM_USER)
        assert loaded.padding_side == "left"
        assert (loaded.pad_token, loaded.eos_token, loaded.bos_token) == ("<pad>", "<eos>", "<bos>")
