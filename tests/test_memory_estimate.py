"""The memory preflight (hacrl_fed/memory_estimate.py): each org's estimate moves with the settings that drive it,
and a plan that cannot fit is refused before any worker starts with one line naming the org, phase and fields."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers import LlamaConfig

from hacrl_fed import memory_estimate as mem
from hacrl_fed.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"
# SmolLM2-135M's shape (no weights needed): 30 layers, 576 wide, 49,152-token vocabulary, 134.5 M parameters
SMOL = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                   num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)


def _estimate(**sets):
    cfg = load_config(SMOKE, overrides=[f"{k}={v}" for k, v in sets.items()])
    return cfg, mem.estimate_org(cfg, "acme", SMOL, mem.count_parameters(SMOL), 4)


def test_the_estimate_moves_with_what_drives_it():
    _, base = _estimate(**{"trainer.outcome_guard.enabled": "false"})
    assert 134e6 < base.resident["weights"] / 4 < 135e6  # the meta-device count: SmolLM2's 134.5 M
    assert base.resident["optimizer"] == 2 * base.resident["weights"] and base.resident["outcome guard"] == 0
    _, guarded = _estimate()
    assert guarded.resident["outcome guard"] == 0  # issue 44: its reference and shadow live in files
    _, wide = _estimate(**{"trainer.micro_batch_size": 64})
    assert wide.phases["train"]["activations"] == pytest.approx(2 * base.phases["train"]["activations"])
    _, ckpt = _estimate(**{"trainer.gradient_checkpointing": "true"})
    assert ckpt.phases["train"]["activations"] < base.phases["train"]["activations"] / 5
    _, longer = _estimate(**{"generation.max_new_tokens": 272})  # L = 128 + 272 = 400, from 144
    assert longer.phases["generate"]["KV cache"] == pytest.approx(400 / 144 * base.phases["generate"]["KV cache"])


def test_a_plan_that_cannot_fit_is_one_line_naming_org_phase_and_fields():
    cfg, org = _estimate()
    other = mem.estimate_org(cfg, "globex", SMOL, mem.count_parameters(SMOL), 4)
    one = mem.host_peak([org, other], one_process=True)
    apart = mem.host_peak([org, other], one_process=False)
    assert one < apart == pytest.approx(2 * (mem.PROCESS_BYTES + org.peak()))
    assert mem.refusal(cfg, [org, other], True, one) is None
    line = mem.refusal(cfg, [org, other], True, one - 1)
    assert line is not None and "\n" not in line
    assert line.startswith(f"memory: org 'acme' needs an estimated {org.peak() / mem.GIB:.2f} GiB in phase train (")
    assert "orgs[0].trainer.micro_batch_size" in line and "orgs[0].trainer.gradient_checkpointing: true" in line
    assert "orgs[0].trainer.outcome_guard.counterfactual" in line and "in one process" in line


def test_hacrl_fed_run_refuses_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    from hacrl_fed import cli

    monkeypatch.setattr(mem, "available_bytes", lambda: 2**20)  # 1 MiB free: nothing fits
    rc = cli.main(["run", str(SMOKE), "--run-dir", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "more than the 0.00 GiB available: lower orgs[" in err, err
    assert re.search(r"memory: org '(acme|globex)' needs an estimated \d\.\d\d GiB in phase (train|generate) \(", err)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match=r"^memory: org '(acme|globex)'"):
        mem.check_memory(load_config(SMOKE), ["acme", "globex"], one_process=False)
