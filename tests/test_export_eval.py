"""``hacrl-fed export`` and ``hacrl-fed eval`` on short real runs: the exported folder loads with plain
``transformers`` (offline) and gives the checkpoint's logits, for a char-level and a BPE zoo agent and for a LoRA
run (merged, and the adapter alone over the base); ``eval`` scores it with the task's verifier and its greedy
accuracy equals the coordinator's held-out evaluation of the same weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from hacrl_fed.cli import main
from hacrl_fed.export import find_checkpoint, load_trained, run_config
from hacrl_fed.models.chat import render_prompt
from hacrl_fed.models.catalog import resolve_zoo
from hacrl_fed.tasks import get_task

ORGS = {"acme": "qwen-char", "globex": "gpt2-bpe"}  # a char-level and a byte-level BPE tokenizer


def _config(tmp_path: Path, *, lora: bool = False) -> Path:
    data = {
        "name": "export", "seed": 3, "run_dir": str(tmp_path / "runs"),
        "trainer": {"lr": 1e-3, "minibatch_size": 32, "micro_batch_size": 16,
                    **({"lora": {"enabled": True, "r": 4, "alpha": 8.0}} if lora else {})},
        "generation": {"num_samples": 4, "max_new_tokens": 12, "eval_max_new_tokens": 12, "temperature": 0.9},
        "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 6},
        "orgs": [{"id": org, "model": {"zoo": zoo}} for org, zoo in ORGS.items()],
        "federation": {"rounds": 1, "prompts_per_round": 4, "eval_every": 1, "min_orgs": 1},
    }
    path = tmp_path / "export.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, lora in (("full", False), ("lora", True)):
        tmp = tmp_path_factory.mktemp(name)
        run_dir = tmp / "run"
        assert main(["run", str(_config(tmp, lora=lora)), "--run-dir", str(run_dir), "--no-progress"]) == 0
        out[name] = run_dir
    return out


def _batch(tokenizer, n: int = 4):
    task = get_task("arithmetic", {"difficulty": 1}, seed=3)
    texts = [render_prompt(tokenizer, p.messages) + " 12+3=15" for p in task.prompts("test", range(n))]
    return tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits.float()


@pytest.mark.parametrize("org", sorted(ORGS))
def test_export_reloads_with_the_checkpoints_logits(runs, tmp_path, org):
    run_dir = runs["full"]
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--org", org, "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    zoo = AutoTokenizer.from_pretrained(resolve_zoo(ORGS[org]), local_files_only=True)
    assert tokenizer.chat_template == zoo.chat_template and tokenizer.get_vocab() == zoo.get_vocab()
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_token_id and gen["pad_token_id"] == tokenizer.pad_token_id
    assert gen["temperature"] == 0.9 and gen["max_new_tokens"] == 12
    info = json.loads((out / "hacrl_export.json").read_text())
    assert info["org"] == org and info["round"] == 1 and info["weights"] == "full"

    cfg = run_config(run_dir)
    _, checkpoint = find_checkpoint(run_dir, org)
    trained, trained_tok = load_trained(cfg, org, checkpoint)
    batch = _batch(tokenizer)
    assert torch.equal(batch["input_ids"], _batch(trained_tok)["input_ids"])
    torch.testing.assert_close(_logits(model, batch), _logits(trained, batch), rtol=0, atol=1e-6)
    # ... and they are the trained weights, not the zoo agent's
    base = AutoModelForCausalLM.from_pretrained(resolve_zoo(ORGS[org]), local_files_only=True, dtype=torch.float32)
    assert not torch.allclose(_logits(base.eval(), batch), _logits(model, batch), atol=1e-5)


def test_lora_run_exports_merged_weights_and_the_adapter_alone(runs, tmp_path):
    peft = pytest.importorskip("peft")
    run_dir, org = runs["lora"], "acme"
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert main(["export", str(run_dir), "--org", org, "--out", str(merged)]) == 0
    assert main(["export", str(run_dir), "--org", org, "--out", str(adapter), "--adapter-only"]) == 0
    assert not list(merged.glob("adapter_*")) and (adapter / "adapter_config.json").is_file()
    cfg = run_config(run_dir)
    _, checkpoint = find_checkpoint(run_dir, org)
    trained, tokenizer = load_trained(cfg, org, checkpoint)
    batch = _batch(tokenizer)
    want = _logits(trained, batch)
    got = AutoModelForCausalLM.from_pretrained(merged, local_files_only=True).eval()
    # merged W + (alpha/r)·BA rounds once where the adapter path adds two products: float32 rounding only
    torch.testing.assert_close(_logits(got, batch), want, rtol=1e-4, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(resolve_zoo(ORGS[org]), local_files_only=True, dtype=torch.float32)
    base_logits = _logits(base.eval(), batch)
    assert not torch.allclose(base_logits, want, atol=1e-5)  # the adapters trained
    over_base = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    torch.testing.assert_close(_logits(over_base, batch), want, rtol=1e-4, atol=1e-5)


def test_export_errors_name_the_argument(runs, tmp_path, capsys):
    run_dir = runs["full"]
    cases = [
        (["export", str(tmp_path / "nope"), "--org", "acme", "--out", str(tmp_path / "o")], "run_dir: no such"),
        (["export", str(run_dir), "--org", "initech", "--out", str(tmp_path / "o")], "org: 'initech' is not"),
        (["export", str(run_dir), "--org", "acme", "--out", str(tmp_path / "o"), "--round", "7"],
         "round: org 'acme' has no checkpoint of round 7 in run .*; have \\[1\\]"),
        (["export", str(run_dir), "--org", "acme", "--out", str(tmp_path / "o"), "--adapter-only"],
         "--adapter-only: org 'acme' did not train LoRA"),
    ]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").touch()
    cases.append((["export", str(run_dir), "--org", "acme", "--out", str(tmp_path / "full")], "out: .* not empty"))
    for argv, match in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(match, err[0]), err


def test_eval_scores_an_export_and_a_checkpoint_alike(runs, tmp_path, capsys):
    run_dir = runs["full"]
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--org", "acme", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", str(out), "--k", "4", "--json", str(tmp_path / "m.json"), "--device", "cpu"]) == 0
    folder = json.loads(capsys.readouterr().out)
    assert folder == json.loads((tmp_path / "m.json").read_text())
    assert main(["eval", "--run-dir", str(run_dir), "--org", "acme", "--k", "4"]) == 0
    checkpoint = json.loads(capsys.readouterr().out)
    assert folder == pytest.approx(checkpoint)
    assert folder["eval/prompts"] == 6 and folder["eval/samples"] == 4
    assert 0 <= folder["eval/pass@1"] <= folder["eval/pass@4"] <= 1
    # greedy accuracy: the coordinator's held-out evaluation after round 1 of the same weights and prompts
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert folder["eval/accuracy"] == pytest.approx(last["eval/acme/accuracy"])
    assert main(["eval", str(out), "--config", str(tmp_path / "missing.yaml")]) == 2
    assert main(["eval"]) == 2 and "give exactly one of MODEL_DIR or --run-dir" in capsys.readouterr().err


def test_pass_at_is_the_unbiased_estimator():
    from hacrl_fed.evaluate import pass_at

    assert pass_at(4, 0, 1) == 0.0 and pass_at(4, 4, 4) == 1.0 and pass_at(4, 1, 4) == 1.0
    assert pass_at(4, 1, 1) == pytest.approx(0.25) and pass_at(5, 2, 2) == pytest.approx(1 - 3 / 10)
    with pytest.raises(ValueError):
        pass_at(2, 3, 1)


def test_run_names_with_a_plus_make_valid_run_ids(tmp_path):
    """The GPU recipes' names (qwen3-1.7b+qwen3-4b) are valid run names, so their run ids are valid checkpoint
    folders (they were refused as bad_run_id, failing every request of the recipe)."""
    from hacrl_fed.config import RunConfig
    from hacrl_fed.worker.checkpoint import run_checkpoint_root

    name = RunConfig.model_validate({"name": "qwen3-1.7b+qwen3-4b", "orgs": [{"id": "a", "model": {"zoo": "x"}}]}).name
    assert run_checkpoint_root(tmp_path, f"{name}-ac862fa4-9ab6c2") == tmp_path / f"{name}-ac862fa4-9ab6c2"
    for bad in ("+x", "../x", "a/b", ".x"):
        with pytest.raises(ValueError, match="not a plain name"):
            run_checkpoint_root(tmp_path, bad)


def test_eval_of_a_lora_checkpoint_matches_its_merged_export(runs, tmp_path, capsys):
    run_dir = runs["lora"]
    assert main(["export", str(run_dir), "--org", "globex", "--out", str(tmp_path / "m")]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "m"), "--k", "2", "--device", "cpu"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert main(["eval", "--run-dir", str(run_dir), "--org", "globex", "--k", "2"]) == 0
    adapters = json.loads(capsys.readouterr().out)
    assert merged["eval/accuracy"] == adapters["eval/accuracy"]  # greedy: the same argmax tokens
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert merged["eval/accuracy"] == pytest.approx(last["eval/globex/accuracy"])
