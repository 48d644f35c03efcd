"""The tiny agent zoo: recipes, SFT helpers, build -> save -> load round trip, resolution, CLI, shipped agents."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hacrl_fed.config import BuildError, ModelConfig
from hacrl_fed.models import load_model_and_tokenizer, render_prompt
from hacrl_fed.cli.zoo import main as zoo_main
from hacrl_fed.models import catalog, zoo
from hacrl_fed.models.sft import IGNORE, SFTRecipe, collate, encode_example, greedy_accuracy, lr_at, run_sft
from hacrl_fed.models.tokenizers import build_tokenizer
from hacrl_fed.tasks import get_task

DEMO = ("qwen-char", "gpt2-bpe", "llama-bpe")
MICRO = ("micro-qwen-char", "micro-gpt2-bpe")


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No shipped assets and a private cache root."""
    monkeypatch.setattr(catalog, "ASSETS_DIR", tmp_path / "assets")
    monkeypatch.setenv("HACRL_FED_CACHE", str(tmp_path / "cache"))
    return tmp_path


@pytest.fixture(scope="module")
def task():
    return get_task("arithmetic", {"difficulty": 2}, seed=0)


# ---- entries and recipe hashes -----------------------------------------------------------------------------


def test_zoo_has_heterogeneous_demo_agents():
    entries = [catalog.get_entry(n) for n in DEMO]
    assert len({e.arch for e in entries}) == 3 and {e.tokenizer for e in entries} == {"char", "bpe"}
    assert all(e.target_accuracy for e in entries)
    assert catalog.get_entry("zoo:qwen-char") is catalog.ZOO["qwen-char"]
    with pytest.raises(BuildError, match="not a zoo agent.*qwen-char"):
        catalog.get_entry("gpt5")


def test_recipe_hash_is_stable_and_tracks_every_field():
    entry = catalog.ZOO["micro-qwen-char"]
    assert entry.recipe_hash() == catalog.ZOO["micro-qwen-char"].recipe_hash()
    assert len(entry.recipe_hash()) == 12
    changed = [
        dataclasses.replace(entry, sft=dataclasses.replace(entry.sft, seed=99)),
        dataclasses.replace(entry, arch_kwargs={**entry.arch_kwargs, "hidden_size": 64}),
        dataclasses.replace(entry, task_params={"difficulty": 1}),
        dataclasses.replace(entry, tokenizer="bpe"),
    ]
    assert len({entry.recipe_hash(), *(e.recipe_hash() for e in changed)}) == 5


def test_build_config_per_arch():
    tok = build_tokenizer("char")
    for name, cls in (("micro-qwen-char", "Qwen3Config"), ("micro-gpt2-bpe", "GPT2Config"),
                      ("llama-bpe", "LlamaConfig")):
        cfg = zoo.build_config(catalog.ZOO[name], tok)
        assert type(cfg).__name__ == cls and cfg.vocab_size == 100 and cfg.eos_token_id == 1
    bad = dataclasses.replace(catalog.ZOO["micro-qwen-char"], arch="mamba")
    with pytest.raises(ValueError, match="arch='mamba'"):
        zoo.build_config(bad, tok)


# ---- SFT helpers --------------------------------------------------------------------------------------------


def test_encode_example_masks_prompt_and_appends_eos():
    tok = build_tokenizer("char")
    ids, labels = encode_example(tok, "Q: 1+2\nA: ", "1+2=3 #### 3")
    assert len(ids) == len(labels) == 10 + 12 + 1  # prompt chars + response chars + EOS
    assert labels[:10] == [IGNORE] * 10 and labels[10:] == ids[10:]
    assert ids[-1] == tok.eos_token_id and tok.decode(ids[10:-1]) == "1+2=3 #### 3"


def test_collate_pads_right_with_positions():
    batch = collate([([5, 6, 7], [IGNORE, 6, 7]), ([8], [8])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]


def test_lr_schedule_warmup_then_cosine():
    r = SFTRecipe(steps=110, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, r) == pytest.approx(0.1) and lr_at(9, r) == pytest.approx(1.0)
    assert lr_at(10, r) == pytest.approx(1.0) and lr_at(60, r) == pytest.approx(0.55)
    assert lr_at(110, r) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="sft.steps=0"):
        SFTRecipe(steps=0)


def test_sft_lowers_the_response_loss(task):
    from transformers import AutoModelForCausalLM

    entry = catalog.ZOO["micro-qwen-char"]
    tok = build_tokenizer("char")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(zoo.build_config(entry, tok))
    stats = run_sft(model, tok, task, SFTRecipe(steps=40, lr=1e-2, batch_size=16, warmup_steps=5))
    assert stats["loss_last"] < stats["loss_first"] - 1.0
    assert not model.training


def test_sft_stops_at_the_wanted_validation_accuracy(task, monkeypatch):
    """Training stops at the first check that reaches the threshold; validation ids are never trained on."""
    from transformers import AutoModelForCausalLM

    import hacrl_fed.models.sft as sft

    tok = build_tokenizer("char")
    model = AutoModelForCausalLM.from_config(zoo.build_config(catalog.ZOO["micro-qwen-char"], tok))
    checks, trained = [], set()
    real_batch = sft._batch_examples

    def batch(task_, tok_, split, ids):
        trained.update(ids)
        return real_batch(task_, tok_, split, ids)

    def fake_accuracy(model_, tok_, task_, split, ids, max_new_tokens):
        checks.append(list(ids))
        return {"accuracy": 0.1 * len(checks)}

    monkeypatch.setattr(sft, "_batch_examples", batch)
    monkeypatch.setattr(sft, "greedy_accuracy", fake_accuracy)
    recipe = SFTRecipe(steps=50, lr=1e-3, batch_size=4, check_every=3, val_size=5, stop_at_accuracy=0.2)
    small = get_task("arithmetic", {"difficulty": 2, "train_size": 40}, seed=0)
    stats = run_sft(model, tok, small, recipe)
    assert stats["steps_done"] == 6 and stats["val_accuracy"] == pytest.approx(0.2)
    assert checks == [[35, 36, 37, 38, 39]] * 2 and max(trained) < 35
    with pytest.raises(ValueError, match="sft.val_size=40"):
        run_sft(model, tok, small, dataclasses.replace(recipe, val_size=40))


# ---- build -> save -> load round trip -----------------------------------------------------------------------


@pytest.mark.parametrize("name", MICRO)
def test_build_load_round_trip(name, isolated, task):
    out = zoo.build_agent(name, isolated / "out" / name)
    rec = catalog.read_recipe(out)
    entry = catalog.get_entry(name)
    assert rec["recipe_hash"] == entry.recipe_hash() and rec["recipe"]["name"] == name
    assert rec["saved_dtype"] == "float32" and rec["num_params"] > 0
    assert 0.0 <= rec["accuracy"] <= 1.0 and rec["eval"]["num_prompts"] == entry.eval_size
    assert not list(out.parent.glob(f".{name}-*"))  # temp dir renamed away

    model, tok = load_model_and_tokenizer(ModelConfig(path=str(out), device="cpu"))
    fresh = build_tokenizer(entry.tokenizer, zoo._bpe_corpus(task, entry.bpe_corpus_size), entry.bpe_vocab_size)
    prompt = task.prompts("test", [0])[0]
    assert tok.get_vocab() == fresh.get_vocab()
    assert render_prompt(tok, prompt.messages) == render_prompt(fresh, prompt.messages)
    ids = tok(render_prompt(tok, prompt.messages) + "1+1=2", add_special_tokens=False, return_tensors="pt")
    logits = model(**ids).logits
    again, _ = load_model_and_tokenizer(ModelConfig(path=str(out), device="cpu"))
    assert torch.equal(again(**ids).logits, logits)
    measured = greedy_accuracy(model, tok, task, "test", range(entry.eval_size), entry.eval_max_new_tokens)
    assert measured["accuracy"] == rec["accuracy"] and measured["stop_rate"] == rec["stop_rate"]


def test_saved_weights_match_the_trained_model(tmp_path, task):
    """float32 save/load is exact; float16 save loads as float32 within fp16 rounding."""
    from transformers import AutoModelForCausalLM

    entry = catalog.ZOO["micro-gpt2-bpe"]
    tok = build_tokenizer("bpe", zoo._bpe_corpus(task, 200), 300)
    model = AutoModelForCausalLM.from_config(zoo.build_config(entry, tok))
    run_sft(model, tok, task, SFTRecipe(steps=5, lr=1e-2, batch_size=4, warmup_steps=1))
    ids = tok(render_prompt(tok, task.prompts("test", [3])[0].messages), return_tensors="pt")
    with torch.no_grad():
        want = model(**ids).logits
        for dtype, atol in (("float32", 0.0), ("float16", 5e-2)):
            model.to(getattr(torch, dtype)).save_pretrained(tmp_path / dtype)
            tok.save_pretrained(tmp_path / dtype)
            model.to(torch.float32)
            loaded, _ = load_model_and_tokenizer(ModelConfig(path=str(tmp_path / dtype), device="cpu"))
            assert next(loaded.parameters()).dtype == torch.float32
            torch.testing.assert_close(loaded(**ids).logits, want, atol=atol, rtol=0)


def test_build_replace_or_keep_existing(isolated):
    out = isolated / "agent"
    out.mkdir()
    (out / catalog.RECIPE_FILE).write_text(json.dumps({"recipe_hash": "someone else's"}))
    zoo.build_agent("micro-qwen-char", out, replace=False)
    assert catalog.read_recipe(out) == {"recipe_hash": "someone else's"}
    assert not list(isolated.glob(".agent-*"))
    zoo.build_agent("micro-qwen-char", out)
    assert catalog.read_recipe(out)["recipe_hash"] == catalog.ZOO["micro-qwen-char"].recipe_hash()
    junk = isolated / "junk"
    (junk / "partial").mkdir(parents=True)  # no recipe: an interrupted copy, replaced even with replace=False
    zoo.build_agent("micro-qwen-char", junk, replace=False)
    assert catalog.read_recipe(junk) is not None and not (junk / "partial").exists()


def test_build_is_reproducible_bit_for_bit(isolated):
    a = zoo.build_agent("micro-gpt2-bpe", isolated / "a", dtype="float16")
    b = zoo.build_agent("micro-gpt2-bpe", isolated / "b", dtype="float16")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_build_rejects_bad_dtype(isolated):
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        zoo.build_agent("micro-qwen-char", isolated / "x", dtype="bfloat16")


# ---- resolution -----------------------------------------------------------------------------------------------


def test_resolve_never_builds_and_uses_a_cached_build(isolated, monkeypatch):
    build = zoo.build_agent
    monkeypatch.setattr(zoo, "build_agent", lambda *a, **k: pytest.fail("loading a model started a build"))
    with pytest.raises(BuildError, match=r"model.zoo='micro-qwen-char': it is neither shipped nor built; build it "
                                         r"with `hacrl-fed zoo build micro-qwen-char --ship`"):
        catalog.resolve_zoo("zoo:micro-qwen-char")
    with pytest.raises(BuildError, match="hacrl-fed zoo build micro-qwen-char --ship"):
        load_model_and_tokenizer(ModelConfig(zoo="micro-qwen-char", device="cpu"))
    entry = catalog.ZOO["micro-qwen-char"]
    path = build("micro-qwen-char", catalog.cached_dir("micro-qwen-char"))  # the explicit build step
    assert path == isolated / "cache" / "zoo" / f"micro-qwen-char-{entry.recipe_hash()}"
    monkeypatch.setattr(zoo, "build_agent", lambda *a, **k: pytest.fail("rebuilt a cached agent"))
    assert catalog.resolve_zoo("micro-qwen-char") == path
    model, tok = load_model_and_tokenizer(ModelConfig(zoo="micro-qwen-char", device="cpu"))
    assert tok.chat_template and not model.training
    model, _ = load_model_and_tokenizer(ModelConfig(path="zoo:micro-qwen-char", device="cpu"))


def test_resolve_prefers_matching_shipped_copy_and_refuses_a_stale_one(isolated, monkeypatch, capsys):
    shipped = catalog.shipped_dir("micro-gpt2-bpe")
    shipped.mkdir(parents=True)
    entry = catalog.ZOO["micro-gpt2-bpe"]
    (shipped / catalog.RECIPE_FILE).write_text(json.dumps({"recipe_hash": entry.recipe_hash()}))
    assert catalog.resolve_zoo("micro-gpt2-bpe") == shipped
    (shipped / catalog.RECIPE_FILE).write_text(json.dumps({"recipe_hash": "stale"}))
    monkeypatch.setattr(zoo, "build_agent", lambda *a, **k: pytest.fail("loading a model started a build"))
    with pytest.raises(BuildError, match=rf"shipped weights were built from another recipe \(stale, the code's "
                                         rf"recipe is {entry.recipe_hash()}\); build it with `hacrl-fed zoo build "
                                         rf"micro-gpt2-bpe --ship`"):
        catalog.resolve_zoo("micro-gpt2-bpe")
    assert zoo_main(["list"]) == 0
    assert "stale: hacrl-fed zoo build micro-gpt2-bpe --ship" in capsys.readouterr().out
    cached = catalog.cached_dir("micro-gpt2-bpe")  # a cached build of the current recipe is used
    cached.mkdir(parents=True)
    (cached / catalog.RECIPE_FILE).write_text(json.dumps({"recipe_hash": entry.recipe_hash()}))
    assert catalog.resolve_zoo("micro-gpt2-bpe") == cached


# ---- CLI ------------------------------------------------------------------------------------------------------


def test_main_zoo_build_out_and_list(isolated, capsys):
    assert zoo_main(["build", "micro-qwen-char", "--out", str(isolated / "o"), "--dtype", "float16"]) == 0
    rec = catalog.read_recipe(isolated / "o" / "micro-qwen-char")
    assert rec["saved_dtype"] == "float16"
    assert "micro-qwen-char: params=" in capsys.readouterr().out
    assert zoo_main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in catalog.ZOO)
    with pytest.raises(SystemExit) as exc:
        zoo_main(["build", "nope"])
    assert exc.value.code == 2


# ---- shipped demo agents -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DEMO + MICRO)
def test_shipped_agent_is_current_small_and_fp16(name):
    path = catalog.ASSETS_DIR / name
    rec = catalog.read_recipe(path)
    assert rec is not None, f"{name} is not shipped: run `hacrl-fed zoo build {name} --ship`"
    assert rec["recipe_hash"] == catalog.get_entry(name).recipe_hash(), f"{name} is stale: rebuild with --ship"
    assert catalog.resolve_zoo(name) == path
    assert rec["saved_dtype"] == "float16"
    assert sum(f.stat().st_size for f in path.iterdir()) < 2_000_000
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        f.name for f in path.iterdir()}


@pytest.mark.parametrize("name", DEMO)
def test_shipped_demo_agent_loads_offline_with_recorded_accuracy(name, task, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(zoo, "build_agent", lambda *a, **k: pytest.fail("shipped agent was rebuilt"))
    entry = catalog.get_entry(name)
    rec = catalog.read_recipe(catalog.ASSETS_DIR / name)
    low, high = entry.target_accuracy
    assert low <= rec["accuracy"] <= high and rec["stop_rate"] > 0.9
    model, tok = load_model_and_tokenizer(ModelConfig(zoo=name, device="cpu", dtype="auto"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    got = greedy_accuracy(model, tok, task, entry.eval_split, range(entry.eval_size), entry.eval_max_new_tokens)
    assert abs(got["accuracy"] - rec["accuracy"]) <= 0.02  # bit-exact here; slack for other CPUs' kernels
