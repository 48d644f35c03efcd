"""Every command of docs/BRING_YOUR_OWN.md's walk-through and of the README's GPU recipe, run as written on CPU.

Substitutions (and nothing else): ``hacrl-fed`` / ``python`` are this interpreter (``-m hacrl_fed.cli``); the
walk-through's ``/models/my-model`` is the zoo agent ``qwen-char``'s folder and ``/data/my-problems.parquet`` a
Parquet file of ``tests/data/gsm8k_sample.jsonl`` (columns renamed); its ``pip install`` installs the local package
it names into a temporary ``--target`` (offline, no dependencies: the extras are already installed, checked here);
the GPU recipe runs in a folder whose ``configs/recipes/qwen3-1.7b+qwen3-4b.yaml`` is the real recipe with zoo
agents on CPU and a tiny budget in place of the GPU models and settings, on two free ports.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "BRING_YOUR_OWN.md"
RECIPE = ROOT / "configs" / "recipes" / "qwen3-1.7b+qwen3-4b.yaml"


def block_after(text: str, marker: str) -> str:
    """The fenced code block that follows the HTML comment ``<!-- marker ... -->``."""
    m = re.search(rf"<!-- {re.escape(marker)}[^>]*-->\s*```\w*\n(.*?)```", text, re.S)
    assert m, f"no block after <!-- {marker} -->"
    return m.group(1)


def _cli(line: str) -> str:
    cli = f"{shlex.quote(sys.executable)} -m hacrl_fed.cli "
    line = re.sub(r"(^|(?<=\s))hacrl-fed ", lambda m: m.group(1) + cli, line)
    return re.sub(r"^python ", shlex.quote(sys.executable) + " ", line)


def _env(tmp_path: Path, *paths: Path) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true")
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(ROOT)])
    return env


def _run(cmd: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _parquet(path: Path) -> Path:
    datasets = pytest.importorskip("datasets", reason="the `datasets` extra is not installed")
    rows = [json.loads(line) for line in (ROOT / "tests" / "data" / "gsm8k_sample.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list([{"problem": r["question"], "solution": r["answer"]} for r in rows]).to_parquet(path)
    return path


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_bring_your_own_walkthrough_runs_as_written(tmp_path):
    from hacrl_fed.models.catalog import resolve_zoo

    pytest.importorskip("wandb", reason="the `wandb` extra is not installed")
    text = DOC.read_text()
    work, site = tmp_path / "lab", tmp_path / "site"
    work.mkdir()
    # 1. the install line: local paths into a --target (the extras it names are importable already)
    (install,) = [ln for ln in block_after(text, "walkthrough: install").splitlines() if ln.strip()]
    words = shlex.split(install)
    assert words[:2] == ["pip", "install"] and "hacrl-fed[datasets,wandb]" in words
    for word in words[2:]:
        if word.startswith("./"):
            copy = tmp_path / "src" / Path(word).name  # a copy: the build leaves nothing in the repository
            shutil.copytree(ROOT / word, copy)
            _run(f"{shlex.quote(sys.executable)} -m pip install -q --no-deps --no-build-isolation --no-index "
                 f"--target {shlex.quote(str(site))} {shlex.quote(str(copy))}", tmp_path, dict(os.environ))
    assert (site / "my_task" / "rewards.py").is_file() and list(site.glob("my_task-*.dist-info/entry_points.txt"))
    # 2. the config, with the lab's model folder and data file
    config = block_after(text, "walkthrough: byo.yaml")
    config = config.replace("/models/my-model", str(resolve_zoo("qwen-char")))
    config = config.replace("/data/my-problems.parquet", str(_parquet(tmp_path / "problems.parquet")))
    (work / "byo.yaml").write_text(config)
    # 3. every command, in order
    env = _env(tmp_path, site)
    for line in block_after(text, "walkthrough: commands").splitlines():
        if line.strip():
            _run(_cli(line), work, env)
    records = [json.loads(x) for x in (work / "runs" / "byo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2] and records[-1]["round/lab/rollouts_accepted"] > 0
    assert list((work / "runs" / "byo" / "wandb").glob("offline-run-*"))
    info = json.loads((work / "exported" / "lab" / "hacrl_export.json").read_text())
    assert info["org"] == "lab" and info["round"] == 2
    metrics = json.loads((work / "exported" / "lab-eval.json").read_text())
    from hacrl_fed.tasks import get_task

    held_out = get_task("dataset", yaml.safe_load(config)["task"]["params"] | {"reward_fn": None}).size("test")
    assert metrics["eval/prompts"] == min(4, held_out) and metrics["eval/accuracy"] == pytest.approx(records[-1]["eval/lab/accuracy"])


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _cpu_recipe(folder: Path) -> None:
    """The recipe with zoo agents on CPU and a tiny budget (same org ids, name, transport and algorithm)."""
    data = yaml.safe_load(RECIPE.read_text())
    zoo = {"qwen3-1.7b": "micro-qwen-char", "qwen3-4b": "micro-gpt2-bpe"}
    data["orgs"] = [{"id": o["id"], "model": {"zoo": zoo[o["id"]], "device": "cpu"}} for o in data["orgs"]]
    data["trainer"].update(precision="model", gradient_checkpointing=False, minibatch_size=16, micro_batch_size=8)
    data["generation"] = {"num_samples": 2, "max_new_tokens": 8, "eval_max_new_tokens": 8}
    data["task"] = {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 2}
    data["federation"].update(rounds=1, prompts_per_round=2, eval_every=1, round_timeout_s=300, checkpoint_every=1)
    (folder / "configs" / "recipes").mkdir(parents=True)
    (folder / "configs" / "recipes" / RECIPE.name).write_text(yaml.safe_dump(data))


def _recipe_script(block: str, ports: list[int]) -> str:
    for old, new in zip(("50051", "50052"), map(str, ports)):
        assert old in block
        block = block.replace(old, new)
    lines = [_cli(line) for line in block.splitlines()]
    return "set -e\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + "\n".join(lines) + "\n"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_gpu_recipe_runs_as_written_on_cpu(tmp_path):
    block = block_after((ROOT / "README.md").read_text(), "gpu-recipe")
    _cpu_recipe(tmp_path)
    _run(_recipe_script(block, _free_ports(2)), tmp_path, _env(tmp_path), timeout=800)
    run_dir = tmp_path / "runs" / "qwen3-1.7b+qwen3-4b"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1]
    assert records[1]["round/qwen3-1.7b/rollouts_accepted"] > 0 and records[1]["round/qwen3-4b/rollouts_accepted"] > 0
    assert not any(v for k, v in records[1].items() if "bad_signature" in k)
    assert json.loads((tmp_path / "exported" / "qwen3-4b" / "hacrl_export.json").read_text())["org"] == "qwen3-4b"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hand_started_workers_with_their_own_keys_are_refused_before_round_1(tmp_path):
    """The recipe without the roster (``$K``) and without the shared run dir: each worker provisions its own keys;
    the coordinator says so, naming the org and the fix, before any round (no metrics written)."""
    block = block_after((ROOT / "README.md").read_text(), "gpu-recipe")
    block = "\n".join(ln for ln in block.splitlines() if not ln.startswith("hacrl-fed export"))  # keys: the link secrets
    block = block.replace(" $K", "").replace(" --run-dir $D", "")
    _cpu_recipe(tmp_path)
    proc = subprocess.run(["bash", "-c", _recipe_script(block, _free_ports(2))], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=800)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("hacrl-fed run:")]  # one line (workers log too)
    assert re.search(r"hacrl-fed run: error: org 'qwen3-(1\.7|4)b': the worker at 127\.0\.0\.1:\d+ signs with a key "
                     r"the coordinator's roster \(.*\) does not pin", line), line
    assert "hacrl-fed keys --out KEYS" in line and "security.roster_file=" in line
    run_dir = tmp_path / "runs" / "qwen3-1.7b+qwen3-4b"
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
