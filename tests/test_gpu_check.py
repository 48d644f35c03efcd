"""scripts/gpu_check.sh --dry-run: the prepared GPU check runs end to end on CPU (so it cannot rot unnoticed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hacrl_tools import gpu_check

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_check_dry_run_end_to_end(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = results["steps"]
    assert results["ok"] and results["dry_run"]
    assert steps["build"]["status"] == "passed" and steps["build"]["params"] > 0
    # the gpu tests were collected and ran (skipped: no CUDA here)
    assert steps["gpu tests"]["status"] == "skipped" and steps["gpu tests"]["skipped"] > 0
    assert steps["gpu tests"]["failed"] == 0
    rounds = steps["rounds (hf)"]
    assert rounds["status"] == "passed" and len(rounds["round_time_s"]) == 2 and rounds["rounds_trained"] == [2, 2]
    for org in ("big", "tiny"):
        last = rounds["perf"][org]["round2"]
        for phase in ("generate", "score", "train"):
            rate = last[f"{phase}/tokens"] / last[f"{phase}/seconds"]
            assert last[f"{phase}/tokens_per_s"] == pytest.approx(rate) and last[f"{phase}/peak_rss_mb"] > 0
        assert last["generate/tokens_per_s"] > 0 and last["train/tokens_per_s"] > 0
        err = rounds["logprob_error"][org]
        assert err["ok"] and err["tokens"] > 0 and err["max_abs"] <= err["tolerance"]["max_abs"]
    assert rounds["logprob_error"]["big"]["dtype"] == "bfloat16"
    assert steps["vllm tests"]["status"] == steps["rounds (vllm)"]["status"] == "skipped"
    assert "rounds (hf)" in proc.stdout and "tokens/s" in proc.stdout and "OK" in proc.stdout


def test_gpu_check_settings_and_table():
    full, dry = gpu_check.Settings.for_run(False), gpu_check.Settings.for_run(True)
    assert full.device == "cuda" and full.shape["num_hidden_layers"] == 24 and full.shape["hidden_size"] == 896
    assert full.shape["hidden_size"] // full.shape["num_attention_heads"] == 64  # a head size vLLM accepts
    assert dry.device == "cpu" and dry.rounds == full.rounds == 2
    cfg = gpu_check.run_config(Path("/m"), full, "vllm")
    big, tiny = cfg["orgs"]
    assert big["generation"]["engine"] == "vllm" and big["generation"]["sleep_during_train"]
    assert tiny["generation"].get("engine", "hf") == "hf"  # one vLLM engine per process
    from hacrl_fed.config import load_config

    load_config(cfg)  # a valid run config
    table = gpu_check.format_table({"steps": {"build": {"status": "failed", "error": "boom", "seconds": 1.0}},
                                    "total_seconds": 1.0, "ok": False})
    assert "build" in table and "boom" in table and "FAILED" in table
