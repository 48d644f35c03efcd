"""RunLogger (JSONL + TensorBoard), eval curves and plot, and the final table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hacrl_fed.metrics import RunLogger, eval_curves, format_table, plot_accuracy, read_metrics
from hacrl_fed.results import OrgSummary, RunSummary


def test_jsonl_lines_have_round_wall_time_and_strict_json(tmp_path):
    with RunLogger(tmp_path, tensorboard=False) as logger:
        logger.log(0, {"eval/a/accuracy": 0.5})
        logger.log(1, {"loss": math.nan, "n": 3, "big": math.inf})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)  # strict parser would choke on NaN tokens
    assert first["round"] == 0 and first["eval/a/accuracy"] == 0.5 and first["wall_time"] > 1.6e9
    assert second == {"round": 1, "wall_time": second["wall_time"], "loss": None, "n": 3.0, "big": None}
    assert "NaN" not in lines[1] and "Infinity" not in lines[1]
    assert not (tmp_path / "tb").exists()


def test_non_numeric_metric_is_rejected_by_name(tmp_path):
    logger = RunLogger(tmp_path, tensorboard=False)
    with pytest.raises(TypeError, match="metric 'status'"):
        logger.log(1, {"status": "ok"})
    with pytest.raises(TypeError, match="metric 'flag'"):
        logger.log(1, {"flag": True})


def test_tensorboard_scalars_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with RunLogger(tmp_path) as logger:
        logger.log(1, {"capability/a": 0.25, "skip": math.nan})
        logger.log(2, {"capability/a": 0.5})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["capability/a"]
    assert [(e.step, e.value) for e in acc.Scalars("capability/a")] == [(1, 0.25), (2, 0.5)]


def test_logger_appends_across_instances(tmp_path):
    RunLogger(tmp_path, tensorboard=False).log(1, {"x": 1})
    RunLogger(tmp_path, tensorboard=False).log(2, {"x": 2})
    assert [r["x"] for r in read_metrics(tmp_path)] == [1.0, 2.0]
    assert read_metrics(tmp_path / "missing") == []


def test_eval_curves_sorted_and_later_duplicate_wins():
    records = [{"round": 2, "eval/b/accuracy": 0.3, "eval/a/accuracy": 0.1},
               {"round": 0, "eval/a/accuracy": 0.0, "round/a/accuracy": 0.9},
               {"round": 2, "eval/a/accuracy": 0.2, "eval/b/accuracy": None}]
    assert eval_curves(records) == {"a": [(0, 0.0), (2, 0.2)], "b": [(2, 0.3)]}


def test_plot_accuracy_writes_png_with_and_without_evals(tmp_path):
    empty = plot_accuracy(tmp_path)
    assert empty == tmp_path / "accuracy.png" and empty.read_bytes()[:4] == b"\x89PNG"
    with RunLogger(tmp_path, tensorboard=False) as logger:
        for t in (0, 5, 10):
            logger.log(t, {"eval/a/accuracy": 0.1 * t / 5, "eval/b/accuracy": 0.5})
    out = plot_accuracy(tmp_path)
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 5000


def test_format_table_columns_and_missing_values():
    summary = RunSummary(
        run_id="demo-1234abcd", run_dir=Path("/tmp/x"), rounds_completed=10, skipped_rounds=1,
        orgs={"alpha": OrgSummary(0.25, 0.5, 480, 960, 12.34),
              "b": OrgSummary(None, 0.1, 0, 12, 0.0)},
        eval_history={}, capability={}, wall_time_s=99.0)
    text = format_table(summary)
    lines = text.splitlines()
    assert lines[0].split()[0] == "org" and set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["alpha", "0.250", "->", "0.500", "+0.250", "480", "960", "12.3"]
    assert lines[3].split() == ["b", "n/a", "->", "0.100", "n/a", "0", "12", "0.0"]
    assert lines[-1] == "run demo-1234abcd: 10 rounds (1 skipped), 99.0 s"
    assert len({len(line) for line in lines[:4]}) == 1  # aligned columns
