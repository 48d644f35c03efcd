"""scripts/equal_numbers.py: which keys it sets aside, and its comparison (exact, record by record) on small
hand-made files; ``--check`` fails on one changed value. Nothing here runs a federation."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.helpers_scripts import load_script

eq = load_script("equal_numbers")


def _file(path: Path, runs: dict[str, list[dict[str, Any]]]) -> Path:
    path.write_text(json.dumps({"schema": 1, "commit": "abc", "runs": {n: {"rows": r} for n, r in runs.items()}}))
    return path


ROWS = [
    {"round": 0, "eval/acme/accuracy": 0.375},
    {"round": 1, "acme/train/loss": 0.125, "acme/train/num_cross": 7.0, "round/acme/messages": 1.0},
]


def test_cost_keys_are_set_aside_and_learning_keys_kept(tmp_path):
    assert all(
        eq.ignored(k)
        for k in (
            "wall_time",
            "time/round",
            "acme/time/train",
            "eval/acme/time/eval",
            "acme/cpu/generate",
            "bytes/step/acme",
            "acme/perf/train/tokens",
            "acme/perf/generate/peak_rss_mb",
        )
    )
    assert not any(
        eq.ignored(k)
        for k in (
            "round",
            "acme/train/loss",
            "eval/acme/accuracy",
            "acme/gen/mean_tokens",
            "round/acme/messages",
            "acme/outcome/validated",
            "acme/hacpo/cross_ratio_mean",
        )
    )
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"round": 1, "wall_time": 5.0, "acme/time/train": 2.0, "acme/train/loss": 0.5}) + "\n")
    assert eq.read_values(path) == [{"round": 1, "acme/train/loss": 0.5}]


def test_coverage_names_the_phases_no_record_reached():
    assert eq.missing_coverage(ROWS, ["eval/acme/accuracy", "/train/num_cross", "/outcome/adopted"]) == [
        "/outcome/adopted"
    ]
    assert eq.missing_coverage([{"acme/train/num_cross": 0.0}], ["/train/num_cross"]) == ["/train/num_cross"]


def test_identical_rows_compare_equal_and_nan_equals_nan():
    rows = [*ROWS, {"round": 2, "acme/train/kl": math.nan}]
    c = eq.compare_rows(rows, json.loads(json.dumps(rows)))
    assert not c.failed(strict_keys=True)
    assert (c.rows_compared, c.keys_compared, c.values_compared, c.differing) == (3, 6, 8, [])


def test_exact_equality_catches_the_last_bit_and_a_value_gone_from_one_record():
    changed = json.loads(json.dumps(ROWS))
    changed[1]["acme/train/loss"] = math.nextafter(0.125, 1.0)  # one ulp
    del changed[1]["round/acme/messages"]
    changed.append({"round": 1, "round/acme/messages": 1.0})  # the key still exists elsewhere: absent here differs
    c = eq.compare_rows(ROWS, changed)
    assert [(i, k) for i, _, k, _, _ in c.differing] == [(1, "acme/train/loss"), (1, "round/acme/messages")]
    assert c.differing[1][4] == eq.MISSING
    assert c.rows_only_current == 1 and c.failed(strict_keys=False)
    assert not eq.same(1.0, True) and eq.same(1, 1.0) and not eq.same(None, 0.0)


def test_keys_only_on_one_side_are_added_or_removed_and_fail_only_when_strict():
    current = [dict(r) for r in ROWS]
    current[1]["acme/train/new_metric"] = 3.0
    del current[1]["acme/train/num_cross"]
    c = eq.compare_rows(ROWS, current)
    assert (c.added, c.removed, c.differing) == (["acme/train/new_metric"], ["acme/train/num_cross"], [])
    assert not c.failed(strict_keys=False) and c.failed(strict_keys=True)


def test_check_exits_1_on_a_changed_value_and_0_when_equal(tmp_path, capsys):
    base = _file(tmp_path / "base.json", {"inprocess-fused": ROWS, "bench-gspo": ROWS})
    same = _file(tmp_path / "same.json", {"inprocess-fused": ROWS, "bench-gspo": ROWS})
    assert eq.main(["--check", str(base), "--against", str(same)]) == 0
    assert "equal: every value compared is identical" in capsys.readouterr().out
    changed = json.loads(json.dumps(ROWS))
    changed[0]["eval/acme/accuracy"] = 0.4375
    other = _file(tmp_path / "changed.json", {"inprocess-fused": ROWS, "bench-gspo": changed})
    assert eq.main(["--check", str(base), "--against", str(other)]) == 1
    out = capsys.readouterr().out
    assert "bench-gspo: record 0 (round 0) eval/acme/accuracy: baseline 0.375, now 0.4375" in out
    assert "DIFFERENT" in out
    # --only narrows the comparison to the runs named: the changed run left out, the rest is equal
    assert eq.main(["--check", str(base), "--against", str(other), "--only", "inprocess-fused"]) == 0


def test_check_runs_then_compares(tmp_path, monkeypatch, capsys):
    """``--check`` without ``--against`` runs each baseline run (here a stand-in for the federation) and fails on
    a changed value."""
    base = _file(tmp_path / "base.json", {"grpc": ROWS})
    changed = json.loads(json.dumps(ROWS))
    changed[1]["acme/train/loss"] = 0.25

    def fake_run_one(run, work, timeout_s):
        assert run.name == "grpc"
        return changed, 0.1

    monkeypatch.setattr(eq, "run_one", fake_run_one)
    assert eq.main(["--check", str(base)]) == 1
    assert "grpc: record 1 (round 1) acme/train/loss: baseline 0.125, now 0.25" in capsys.readouterr().out
    saved = tmp_path / "saved.json"
    assert eq.main(["--save", str(saved), "--only", "grpc"]) == 0
    assert json.loads(saved.read_text())["runs"]["grpc"]["rows"] == changed


@pytest.mark.parametrize("name", sorted(eq.RUNS))
def test_every_run_is_a_command_the_cli_parses_on_one_thread(name, tmp_path):
    """Each run's command parses with the CLI's own parser, its overrides name fields the config has, it writes
    under its own run dir, and it runs on one torch thread with a fixed hash seed."""
    from hacrl_fed.cli import bench, run, simulate
    from hacrl_fed.config import load_config

    argv = eq.RUNS[name].argv(tmp_path)
    if argv[0] == "bench":
        from hacrl_tools.bench import learning

        args = bench.learning_parser(learning).parse_args(argv[2:])
        assert args.threads == 1 and args.keep_runs == tmp_path / "keep"
        assert eq.RUNS[name].metrics(tmp_path).is_relative_to(args.keep_runs)
    else:
        args = {"run": run, "simulate": simulate}[argv[0]].build_parser().parse_args(argv[1:])
        assert Path(args.run_dir) == tmp_path / "run" == eq.RUNS[name].metrics(tmp_path).parent
        assert getattr(args, "num_cpus", 1) == 1
        cfg = load_config(eq.ROOT / args.config, list(args.overrides))
        assert (cfg.federation.rounds, cfg.federation.eval_every, cfg.trainer.outcome_guard.every) == (3, 2, 2)
    env = eq.run_env(tmp_path)
    assert (env["OMP_NUM_THREADS"], env["PYTHONHASHSEED"]) == ("1", "0")
