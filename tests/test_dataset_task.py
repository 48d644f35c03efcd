"""The ``dataset`` task: local Parquet / Arrow / JSON(L) / save_to_disk data read with ``datasets``, the same rows,
splits and ids as ``jsonl`` on the same data, errors naming the file and column, and a short federation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hacrl_fed.tasks import get_task

datasets = pytest.importorskip("datasets", reason="the `datasets` extra is not installed")

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "tests" / "data" / "gsm8k_sample.jsonl"


def _rows() -> list[dict]:
    return [json.loads(line) for line in GSM8K.read_text().splitlines() if line.strip()]


def _renamed() -> list[dict]:
    return [{"problem": r["question"], "solution": r["answer"], "extra": 1} for r in _rows()]


def _write(tmp_path: Path, kind: str, rows: list[dict]) -> Path:
    table = datasets.Dataset.from_list(rows)
    if kind == "parquet":
        path = tmp_path / "data.parquet"
        table.to_parquet(str(path))
    elif kind == "json":
        path = tmp_path / "data.jsonl"
        table.to_json(str(path))
    else:
        path = tmp_path / "disk"
        table.save_to_disk(str(path))
        if kind == "arrow":
            path = next(path.glob("*.arrow"))
    return path


@pytest.mark.parametrize("kind", ["parquet", "json", "arrow", "disk"])
def test_every_format_gives_jsonl_s_rows_splits_and_ids(tmp_path, kind):
    path = _write(tmp_path, kind, _renamed())
    params = {"question_field": "problem", "answer_field": "solution", "test_fraction": 0.3}
    got = get_task("dataset", {"path": str(path), **params}, seed=4)
    ref = get_task("jsonl", {"path": str(GSM8K), "test_fraction": 0.3}, seed=4)
    for split in ("train", "test"):
        assert got.size(split) == ref.size(split) > 0
        ids = range(ref.size(split))
        assert got.prompts(split, ids) == ref.prompts(split, ids)
        assert [got.sft_target(split, i) for i in ids] == [ref.sft_target(split, i) for i in ids]
    assert got.verify("so \\boxed{7}", "7") == 1.0 and got.name == "dataset"


def test_test_path_in_another_format(tmp_path):
    rows = _renamed()
    train = _write(tmp_path, "parquet", rows)
    (tmp_path / "t").mkdir()
    test = _write(tmp_path / "t", "json", rows[:2])
    task = get_task("dataset", {"path": str(train), "test_path": str(test), "question_field": "problem",
                                "answer_field": "solution"})
    assert task.size("test") == 2 and task.size("train") == len(rows) - 2


def test_missing_column_names_the_file_the_column_and_the_param(tmp_path):
    path = _write(tmp_path, "parquet", _renamed())
    with pytest.raises(ValueError, match=rf"^{path}: no column 'question' \(task\.params\.question_field\); "
                                         r"columns: \['problem', 'solution', 'extra'\]"):
        get_task("dataset", {"path": str(path), "answer_field": "solution"})


def test_bad_values_name_the_file_and_row(tmp_path):
    rows = _renamed()
    rows[2]["solution"] = None
    path = _write(tmp_path, "parquet", rows)
    with pytest.raises(ValueError, match=rf"^{path} row 3: field 'solution' must be a string or number"):
        get_task("dataset", {"path": str(path), "question_field": "problem", "answer_field": "solution"})


@pytest.mark.parametrize(
    "make, params, match",
    [
        (lambda d: d / "missing.parquet", {}, r"^task\.params\.path: file not found: .*missing\.parquet"),
        (lambda d: d / "x.csv", {}, r"^task\.params\.path: cannot tell the format of .*x\.csv"),
        (lambda d: d / "bad.parquet", {}, r"^task\.params\.path: cannot read .*bad\.parquet as parquet: "),
        (lambda d: d / "bad.parquet", {"format": "feather"}, r"task\.params\.format"),
    ],
)
def test_file_errors_are_one_line_naming_the_param(tmp_path, make, params, match):
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=match) as info:
        get_task("dataset", {"path": str(make(tmp_path)), **params})
    assert "\n" not in str(info.value)


def test_missing_datasets_package_names_the_extra(tmp_path, monkeypatch):
    path = _write(tmp_path, "parquet", _renamed())
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ValueError, match=r"pip install 'hacrl-fed\[datasets\]'"):
        get_task("dataset", {"path": str(path)})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_parquet_dataset_runs_a_short_federation(tmp_path):
    path = _write(tmp_path, "parquet", _renamed())
    data = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    data["task"] = {"name": "dataset", "eval_size": 2, "params": {
        "path": str(path), "question_field": "problem", "answer_field": "solution", "test_fraction": 0.3,
        "system_prompt": None}}
    data["federation"].update(rounds=1, eval_every=1, prompts_per_round=2)
    data["generation"].update(max_new_tokens=8, eval_max_new_tokens=8)
    config = tmp_path / "parquet.yaml"
    config.write_text(yaml.safe_dump(data))
    proc = subprocess.run([sys.executable, "-m", "hacrl_fed.cli", "run", str(config), "--run-dir",
                           str(tmp_path / "run"), "--no-progress"], capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1]
    assert records[1]["round/acme/rollouts_accepted"] > 0 and "round/globex/accuracy" in records[1]
