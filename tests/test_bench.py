"""The benchmark machinery (BENCHMARKS.md), not the benchmarks: nothing here is timed.

- one tiny learning cell (micro agents, two rounds, one of them a bench agent built on the spot) through
  ``hacrl-fed bench learning`` into a temp results dir: its JSON fields, a rerun that skips it, the report;
- the real matrix plans (every setting config validates, GSPO x2 doubles G, missing knobs are skipped by name);
- the pure aggregation functions of the learning report, the system benchmark and the peer comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hacrl_fed.cli import main as cli_main
from hacrl_tools import code_path
from hacrl_tools.bench import learning, report, system, trl_compare
from hacrl_tools.bench import matrix as bench_matrix
from tests.helpers_tiny import PAPER_ALGORITHM, PAPER_TRAINER

TINY = {
    "name": "tiny", "seed": 0, "algorithm": {"name": "hacpo", **PAPER_ALGORITHM},  # pinned like configs/bench/
    "trainer": {"lr": 1.0e-4, "minibatch_size": 64, "micro_batch_size": 32, **PAPER_TRAINER},
    "generation": {"num_samples": 4, "max_new_tokens": 16, "eval_max_new_tokens": 16},
    "task": {"name": "arithmetic", "params": {"difficulty": 2}, "eval_size": 8},
    "orgs": [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}],
    "federation": {"rounds": 2, "prompts_per_round": 4, "eval_every": 1, "min_orgs": 1},
}


def _tiny_matrix(tmp_path: Path) -> Path:
    cfg = dict(TINY)
    # globex: a bench agent (micro recipe, built into the temp dir on first use: seconds)
    cfg["orgs"] = [*TINY["orgs"], {"id": "globex", "model": {"path": str(tmp_path / "agents" / "micro-qwen-char-b")}}]
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    matrix = {
        "settings": {"tiny": {"config": "tiny.yaml", "about": "micro agents"}},
        "methods": {"gspo": {"set": {"algorithm.name": "gspo"}},
                    "hacpo": {"set": {"algorithm.name": "hacpo"}},
                    "alpha1": {"same_as": "hacpo"},
                    "per_byte": {"set": {"algorithm.name": "hacpo", "algorithm.no_such_knob": "x"}}},
        "groups": {"main": {"settings": ["tiny"], "methods": ["gspo", "hacpo"]},
                   "ablations": {"settings": ["tiny"], "methods": ["alpha1", "per_byte"]}},
        "seeds": [0],
    }
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(matrix))
    return path


def test_learning_cell_runs_skips_on_rerun_and_reports(tmp_path, capsys):
    matrix = _tiny_matrix(tmp_path)
    results = tmp_path / "results"
    args = ["bench", "learning", "--matrix", str(matrix), "--results", str(results), "--only", "tiny/hacpo"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 cells: 0 done, 1 to run, 0 skipped")
    path = results / "tiny" / "hacpo" / "seed0.json"
    data = json.loads(path.read_text())
    assert (data["setting"], data["method"], data["seed"], data["rounds"]) == ("tiny", "hacpo", 0, 2)
    assert data["config"]["algorithm"]["name"] == "hacpo" and data["config_hash"]
    assert data["machine"]["cpus"] >= 1 and "commit" in data["code"]
    assert set(data["agents"]) == {"acme", "globex"}
    for org, a in data["agents"].items():
        assert a["accuracy_before"] is not None and a["accuracy_after"] is not None, org
        assert [c[0] for c in a["curve"]] == [0, 1, 2]
        assert a["curve"][-1][1] == a["rollouts_generated"] == 2 * 4 * 4  # rounds x B x G
        assert a["sequences_trained"] == a["self_sequences_trained"] + a["cross_sequences_trained"]
        assert a["cross_sequences_trained"] > 0 and a["time_calls_s"] > 0
        for key in ("hacpo/cross_ratio_mean", "hacpo/cross_in_band_frac", "hacpo/cross_clip_low_frac",
                    "hacpo/self_clip_low_frac", "train/grad_norm"):
            assert set(a["stats"][key]) >= {"mean", "min", "max", "late_mean"}, key
    assert sorted(p.name for p in results.iterdir()) == ["REPORT.md", "curves", "tiny"]  # no run dirs left here
    mtime = path.stat().st_mtime_ns

    assert cli_main(args) == 0  # rerun: the finished cell is skipped
    assert "1 done, 0 to run" in capsys.readouterr().out
    assert path.stat().st_mtime_ns == mtime

    assert cli_main([*args[:-2], "--only", "tiny/hacpo", "--set", "trainer.lr=2e-4", "--list"]) == 0
    assert "stale" in capsys.readouterr().out  # another config: it would rerun

    text = (results / "REPORT.md").read_text()
    assert "## tiny" in text and "| `hacpo` | 1 |" in text and "acme (micro-qwen-char)" in text
    assert "At equal generated rollouts" in text and "cross s̄" in text
    assert "`tiny/per_byte`: needs knob algorithm.no_such_knob" in text
    assert (results / "curves" / "tiny.png").stat().st_size > 1000
    assert cli_main(["bench", "report", "--results", str(results), "--matrix", str(matrix), "--no-plots"]) == 0


def test_a_cell_finished_meanwhile_by_another_run_is_not_rerun(tmp_path, capsys, monkeypatch):
    matrix = _tiny_matrix(tmp_path)
    calls = []

    def status(cell, results):  # planned as todo, then found done when its turn comes (a parallel run wrote it)
        calls.append(cell.key)
        return "todo" if len(calls) == 1 else "done"

    def run_cell(*a, **k):
        raise AssertionError("a finished cell must not run again")

    monkeypatch.setattr(learning, "cell_status", status)
    monkeypatch.setattr(learning, "run_cell", run_cell)
    args = ["bench", "learning", "--matrix", str(matrix), "--results", str(tmp_path / "r"), "--only", "tiny/gspo"]
    assert cli_main([*args, "--no-report"]) == 0
    assert "done tiny/gspo/seed0 (by another run meanwhile)" in capsys.readouterr().out


def test_the_matrix_plans_every_cell():
    matrix = bench_matrix.load_matrix()
    assert set(matrix.settings) >= {"state", "size", "model", "three"}
    cells = bench_matrix.plan_cells(matrix)
    main = [c for c in cells if c.group == "main"]
    assert {c.method for c in main} == {"gspo", "gspo_x2", "naive", "hacpo"}
    assert {c.method for c in cells if c.group == "grpo"} == {"grpo"}
    assert all(c.skip is None and c.config is not None for c in main), [c.skip for c in main if c.skip]
    assert len({c.seed for c in main}) >= 3
    assert len({c.hash for c in main}) == len(main)  # every cell its own config
    by = {(c.setting, c.method, c.seed): c for c in cells}
    gspo, x2 = by[("model", "gspo", 0)].config, by[("model", "gspo_x2", 0)].config
    assert x2.generation.num_samples == 2 * gspo.generation.num_samples
    assert x2.trainer.minibatch_size == 2 * gspo.trainer.minibatch_size
    assert x2.algorithm.name == "gspo" and x2.seed == 0
    assert len(by[("three", "hacpo", 1)].config.orgs) == 3
    assert [a.name for a in by[("state", "hacpo", 0)].agents] == ["qwen-char-b"]
    assert by[("model", "alpha1", 0)].same_as == "hacpo"
    # every ablation and the per-byte cells have their knobs now: nothing is skipped but the retired methods
    assert not [c.key for c in cells if c.skip and not c.same_as and not c.skip.startswith("retired: ")]
    assert by[("model", "hacpo_per_byte", 2)].config.algorithm.logprob_norm == "per_byte"
    assert by[("model", "no_cross_clip", 0)].config.algorithm.cross_clip is False
    sel = by[("three", "hacpo_per_byte_peer_sample", 0)].config
    assert sel.trainer.selection.rule == "peer_sample" and sel.trainer.selection.budget_multiple == 1.0
    assert sel.algorithm.logprob_norm == "per_byte"
    retired = by[("three", "hacpo_per_byte_max_variance", 0)]  # its rule is gone (issue 42): never run
    assert retired.config is None and retired.skip == (
        "retired: rule max_variance removed (issue 42); its cells ran at commit a07fdd6 (rerun there)"
    )
    assert by[("state", "hacpo_successes", 1)].config.trainer.selection.rule == "successes"
    assert by[("state", "hacpo", 0)].config.trainer.selection.rule == "all"
    assert by[("model", "hacpo_screen", 3)].config.trainer.likelihood_screen.enabled
    assert len(by[("count8", "hacpo_per_byte", 0)].config.orgs) == 8
    assert {a.name for a in by[("count8", "gspo", 0)].agents} >= {"qwen-char-c", "gpt2-bpe-b", "llama-bpe-b"}
    assert len({c.seed for c in main}) == 5 and by[("model", "gspo", 0)].config.task.eval_size == 1000
    quick = bench_matrix.plan_cells(matrix, quick=True)
    assert quick and all(c.config.federation.rounds < gspo.federation.rounds for c in quick)
    assert all(c.config.federation.rounds == 5 for c in bench_matrix.plan_cells(matrix, only=["model/hacpo"], rounds=5))
    assert bench_matrix.field_exists("algorithm.alpha") and bench_matrix.field_exists("task.params.difficulty")
    assert bench_matrix.field_exists("algorithm.logprob_norm") and not bench_matrix.field_exists("algorithm.no_such_knob")


def test_accuracy_at_equal_rollouts_interpolates():
    curve = [[0, 0, 0.2], [10, 1280, 0.3], [20, 2560, 0.5]]
    assert report.acc_at_rollouts(curve, 2560) == 0.5
    assert report.acc_at_rollouts(curve, 1920) == pytest.approx(0.4)
    assert report.acc_at_rollouts(curve, 5000) is None
    assert report.fmt_acc([0.5, 0.7], [0.4, 0.4]) == "0.600 ± 0.141 (+20.0)"
    assert report.fmt_acc([None], [0.1]) == "–"


def test_summarize_cell_from_records():
    from hacrl_fed.config import load_config

    cfg = load_config({**TINY, "orgs": [{"id": "a", "model": {"zoo": "micro-qwen-char"}}]})
    records = [{"round": 0, "eval/a/accuracy": 0.25},
               {"round": 1, "round/a/rollouts_received": 16.0, "a/train/num_rows": 32.0, "a/train/num_self": 16.0,
                "a/train/num_cross": 16.0, "a/hacpo/cross_ratio_mean": 0.8, "time/call/generate/a": 1.0,
                "time/round": 2.0, "a/select/b/offered": 16.0, "a/select/b/selected": 6.0,
                "a/select/b/dropped_rule": 10.0, "a/select/selected": 6.0},
               {"round": 2, "round/a/rollouts_received": 16.0, "a/train/num_rows": 32.0, "a/train/num_self": 16.0,
                "a/train/num_cross": 16.0, "a/hacpo/cross_ratio_mean": 0.9, "eval/a/accuracy": 0.5,
                "time/call/train/a": 0.5, "time/round": 4.0, "a/select/b/offered": 16.0, "a/select/b/selected": 4.0,
                "a/select/b/dropped_rule": 12.0, "a/select/selected": 4.0}]
    s = learning.summarize_cell(cfg, records)
    a = s["agents"]["a"]
    assert (a["accuracy_before"], a["accuracy_after"], a["gain"]) == (0.25, 0.5, 0.25)
    assert a["curve"] == [[0, 0, 0.25], [2, 32, 0.5]]
    assert (a["rollouts_generated"], a["sequences_trained"], a["cross_sequences_trained"]) == (32, 64, 32)
    assert a["stats"]["hacpo/cross_ratio_mean"]["mean"] == pytest.approx(0.85)
    assert a["stats"]["hacpo/cross_ratio_mean"]["late_mean"] == pytest.approx(0.9)
    assert a["time_calls_s"] == pytest.approx(1.5)
    assert s["rounds"] == 2 and s["round_time_s"]["mean"] == 3.0
    assert a["selection"] == {"select/b/dropped_rule": 22, "select/b/offered": 32, "select/b/selected": 10,
                              "select/selected": 10}


def test_an_asynchronous_cell_has_a_clock_curve_and_a_lock_step_one_none():
    from hacrl_fed.config import load_config

    cfg = load_config({**TINY, "orgs": [{"id": "a", "model": {"zoo": "micro-qwen-char"}}]})
    records = [{"round": 0, "eval/a/accuracy": 0.25},
               {"round": 1, "async/a/trained_at_s": 8.0},
               {"round": 2, "async/a/trained_at_s": 12.0, "eval/a/accuracy": 0.5}]
    a = learning.summarize_cell(cfg, records)["agents"]["a"]
    assert a["clock_curve"] == [[0, 0.0, 0.25], [2, 12.0, 0.5]]
    lock_step = [{k: v for k, v in rec.items() if not k.startswith("async/")} for rec in records]
    assert "clock_curve" not in learning.summarize_cell(cfg, lock_step)["agents"]["a"]


def test_a_guarded_cell_keeps_the_guard_s_verdicts_and_an_unguarded_one_none():
    from hacrl_fed.config import load_config

    cfg = load_config({**TINY, "orgs": [{"id": "a", "model": {"zoo": "micro-qwen-char"}}]})
    records = [{"round": 0, "eval/a/accuracy": 0.25},
               {"round": 4, "a/outcome/validated": 1.0, "a/outcome/val_accuracy": 0.5, "a/outcome/rollback": 1.0,
                "a/outcome/b/quarantined_until": 12.0, "a/outcome/adopted": 0.0, "a/outcome/shadow_accuracy": 0.4},
               {"round": 5, "a/outcome/validated": 0.0, "a/outcome/b/quarantined": 1.0},
               {"round": 8, "a/outcome/validated": 1.0, "a/outcome/val_accuracy": 0.6, "a/outcome/adopted": 1.0,
                "a/outcome/shadow_accuracy": 0.7, "a/outcome/b/blamed_counterfactual": 1.0,
                "a/outcome/b/quarantined_until": 24.0, "eval/a/accuracy": 0.5, "a/outcome/final_accuracy": 0.55,
                "a/outcome/shadow_final_accuracy": 0.65}]
    out = learning.summarize_cell(cfg, records)["agents"]["a"]["outcome"]
    assert out == {"rollbacks": [4], "spared": [], "adopted": [8], "validations": [[4, 0.5, 0.4], [8, 0.6, 0.7]],
                   "blamed": {"b": [4, 8]}, "final": [8, 0.55, 0.65]}
    assert "outcome" not in learning.summarize_cell(cfg, records[:1])["agents"]["a"]


def _round(t: int, wall: float, **extra) -> dict:
    rec = {"round": t, "time/round": wall, "time/generate": wall / 2, "time/train": wall / 4,
           "round/a/rollouts_received": 8.0, "round/b/rollouts_received": 8.0,
           "a/time/generate": 0.2, "b/time/generate": 0.3, "a/time/verify": 0.01, "b/time/verify": 0.01,
           "a/time/score": 0.05, "a/time/train": 0.1, "b/time/train": 0.1, "a/time/trust": 0.01,
           "time/trust/a": 0.002, "time/trust/b": 0.002, "time/exchange/generate/a": 0.03,
           "time/call/generate/a": 0.25, "a/train/foreign_received": 8.0, "b/train/foreign_received": 8.0,
           "a/perf/train/peak_rss_mb": 300.0 + t}
    rec.update(extra)
    return rec


def test_system_aggregation():
    records = [{"round": 0, "time/eval": 1.0}, _round(1, 4.0), _round(2, 1.0, **{"bytes/generate/total": 1600.0,
                                                                                   "bytes/train/total": 3200.0}),
               _round(3, 2.0, **{"bytes/generate/total": 1600.0, "bytes/train/total": 3200.0})]
    rows = system.phase_rows(records)
    assert [r["round"] for r in rows] == [1, 2, 3]
    r = rows[0]
    assert r["orgs"] == 2 and r["generate"] == pytest.approx(0.5) and r["train"] == pytest.approx(0.2)
    assert r["trust"] == pytest.approx(0.014) and r["exchange"] == pytest.approx(0.03)
    assert r["coordinator"] == pytest.approx(4.0 - 2.0 - 1.0) and r["rollouts"] == 16.0 and r["foreign"] == 16.0
    assert r["org/a/peak_rss_mb"] == 301.0
    assert r["train_share"] == pytest.approx(0.25) and r["org/a/generate"] == pytest.approx(0.2)
    assert r["org/a/train"] == pytest.approx(0.16) and r["org/a/update"] == pytest.approx(0.1)
    assert r["org/a/screen"] == pytest.approx(0.01)
    warm = system.warm(rows)
    assert [w["round"] for w in warm] == [2, 3]  # the first round of a run is left out
    s = system.summarize_rows(warm)
    assert s["wall"] == 1.5 and s["n_rounds"] == 2 and s["org/a/peak_rss_mb"] == 303.0
    ratios = system.overhead({"inprocess": {"wall": 1.5}, "grpc": {"wall": 1.8}})
    assert ratios == {"inprocess": 1.0, "grpc": pytest.approx(1.2)}
    w = system.wire_bytes(s, text_bytes_per_rollout=20.0)
    assert w["generate_bytes_per_rollout"] == 100.0 and w["train_bytes_per_foreign_rollout"] == 200.0
    assert w["generate_vs_text"] == 5.0 and w["train_vs_text"] == 10.0
    text = system.format_tables({"transports": {"rounds": 3, "repeats": 1, "summary": {"grpc": s},
                                                "overhead_vs_inprocess": {"grpc": 1.2}, "wire": {"grpc": w}}})
    assert "| grpc | 1.500 | 1.20 |" in text and "| grpc | 100 | 200 | 20.0 | 5.0 | 10.0 |" in text
    # a spec states the whole budget whatever the defaults: none, or a multiple pooled unless it names the split
    assert system.selection_overrides("successes:1") == ["trainer.selection.rule=successes",
                                                       "trainer.selection.budget_multiple=1.0",
                                                       "trainer.selection.budget_split=pooled"]
    assert system.selection_overrides("successes:0.5:per_source")[1:] == ["trainer.selection.budget_multiple=0.5",
                                                                         "trainer.selection.budget_split=per_source"]
    assert system.selection_overrides("all") == ["trainer.selection.rule=all", "trainer.selection.budget_multiple=null"]
    from hacrl_fed.config import load_config

    for spec in ("all", "successes", "successes:1", "peer_sample:1", "successes:0.5:per_source"):
        sel = load_config(TINY, system.selection_overrides(spec)).trainer.selection
        multiple = spec.split(":")[1] if ":" in spec else None
        assert sel.budget_multiple == (float(multiple) if multiple else None)
        assert sel.budget_split == ("per_source" if spec.endswith("per_source") else "pooled")
    row = {"round_wall_s": 2.0, "coordinator_s_per_round": 0.1, "train_share": 0.5, "per_org_call_s": 0.3,
           "per_org_compute_s": 0.2, "per_org_generate_s": 0.05, "per_org_train_s": 0.125, "per_org_screen_s": 0.02,
           "per_org_update_s": 0.1, "per_org_generate_cpu_s": 0.04, "per_org_train_cpu_s": 0.1,
           "per_org_screen_cpu_s": 0.01, "per_org_update_cpu_s": 0.08, "cpu_train_share": 0.6,
           "coordinator_cpu_s_per_round": 0.2, "loadavg_before": [1.5, 1, 1], "loadavg_after": [2.25, 1, 1],
           "per_org_foreign_selected": 16.0, "coordinator_peak_rss_mb": 500.0, "worker_peak_rss_mb": {"a": None}}
    runs = [{"transport": "inprocess", "rounds": 4, "variants": {"successes:1": {"set": [], "orgs": {"32": row}}}}]
    text = system.format_tables({"scaling": runs})
    assert "over inprocess, selection successes:1" in text
    assert ("| 32 | 16 | 2.000 | 0.050 | 0.040 | 0.125 | 0.100 | 0.010 | 0.080 | 0.60 | 0.100 | 0.200 | 500 | – "
            "| 1.5 / 2.2 |") in text
    assert system.format_tables({"scaling": runs[0]}) == text  # an older result: one transport, a dict
    assert system.parse_scale_transport("grpc:16") == ("grpc", 16)
    assert system.parse_scale_transport("inprocess") == ("inprocess", None)
    for bad in ("flower", "grpc:x"):
        with pytest.raises(ValueError, match="grpc"):
            system.parse_scale_transport(bad)


def test_system_cpu_columns_and_scaling_point():
    """The workers' own CPU seconds (<org>/cpu/...) per org and round, and one org count's medians."""
    cpu = {"a/cpu/generate": 0.2, "b/cpu/generate": 0.4, "a/cpu/train": 0.3, "b/cpu/train": 0.1,
           "a/cpu/trust": 0.05, "a/cpu/update": 0.2}
    rows = system.phase_rows([_round(t, 1.0 + t, **cpu) for t in (1, 2, 3)])
    r = rows[0]
    assert r["generate_cpu"] == pytest.approx(0.6) and r["train_cpu"] == pytest.approx(0.4)
    assert r["cpu_train_share"] == pytest.approx(0.4) and r["org/a/screen_cpu"] == 0.05
    assert r["org/a/update_cpu"] == 0.2 and "org/b/update_cpu" not in r
    res = {"rows": rows, "info": {"coordinator_peak_rss_mb": 400.0, "run_cpu_s": 6.0, "setup_s": 1.0},
           "loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [2.0, 1.0, 1.0]}
    p = system.scaling_point(res, rounds=3)
    assert p["per_org_train_cpu_s"] == pytest.approx(0.2)  # median over orgs a (0.3) and b (0.1)
    assert p["per_org_generate_cpu_s"] == pytest.approx(0.3) and p["per_org_screen_cpu_s"] == 0.05
    assert p["cpu_train_share"] == pytest.approx(0.4) and p["coordinator_cpu_s_per_round"] == 2.0
    assert p["round_wall_s"] == 3.5 and p["rounds"] == 2.0  # rounds 2 and 3: the first is left out
    assert p["loadavg_after"] == [2.0, 1.0, 1.0]


def test_trl_summary():
    runs = [{"side": "ours", "batch_s": [9.0, 1.0, 1.0, 2.0], "completions_per_batch": 128, "peak_rss_mb": 500.0,
             "import_s": 2.0, "setup_s": 1.0},
            {"side": "trl", "batch_s": [9.0, 2.0, 2.0], "completions_per_batch": 128, "peak_rss_mb": 800.0,
             "import_s": 5.0, "setup_s": 2.0}]
    s = trl_compare.compare(runs)
    assert s["ours"]["completions_per_s"] == 128.0 and s["trl"]["completions_per_s"] == 64.0
    assert s["throughput_ratio_ours_over_trl"] == 2.0 and s["peak_rss_ratio_ours_over_trl"] == 0.625
    assert "| ours | 128.0 |" in trl_compare.format_summary(s)
    runs[0]["phases"] = {"generate": [5.0, 0.25, 0.25, 0.5], "update": [4.0, 0.75, 0.75, 1.5]}
    s = trl_compare.compare(runs)
    assert s["ours"]["generate_s"] == 0.25 and s["ours"]["update_s"] == 0.75 and "generate_s" not in s["trl"]
    assert "| ours | 128.0 | 1.000 | 1.333 | 0.250 | 0.750 |" in trl_compare.format_summary(s)
    assert "| trl | 64.0 | 2.000 | 2.000 | – | – |" in trl_compare.format_summary(s)


STAND_IN_TRL = """
import json, sys
import hacrl_fed.tasks.arithmetic as ours
print(json.dumps({"trl": __file__, "hacrl_fed": ours.__file__, "path": sys.path}))
raise SystemExit(0)
"""


def test_the_trl_child_imports_the_peers_trl_never_a_module_of_ours(tmp_path):
    """The TRL side's child, started as ``bench trl`` starts it (command and environment), imports ``trl`` from the
    peer venv (a stand-in here: it reports where it and ``hacrl_fed`` were found, then exits) and our answer check
    from this checkout. Before, the runner's own folder came first on ``sys.path`` and its sibling
    ``hacrl_tools/bench/trl.py`` stood in for TRL (``cannot import name 'GRPOConfig' from 'trl'``)."""
    import site
    import subprocess
    import sys

    venv = tmp_path / "peer"
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    (packages,) = venv.glob("lib/python3*/site-packages")
    (packages / "trl").mkdir()
    (packages / "trl" / "__init__.py").write_text(STAND_IN_TRL)
    # torch and transformers, which the runner imports before trl, from the test's own environment, after the venv's
    (packages / "ours.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    (tmp_path / "spec.json").write_text("{}")
    cmd = trl_compare.peer_command(venv / "bin" / "python", tmp_path / "spec.json", tmp_path / "out.json")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=trl_compare.child_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(found["trl"]) == packages / "trl" / "__init__.py"
    repo = Path(code_path())
    assert Path(found["hacrl_fed"]).is_relative_to(repo / "hacrl_fed")
    runner_dir = str(Path(trl_compare.__file__).parent)
    assert runner_dir not in found["path"] and found["path"][-1] == str(repo)  # ours last, after the peer's


@pytest.mark.slow
def test_system_runs_every_transport_kind_once(tmp_path, capsys):
    """`hacrl-fed bench system` end to end on the micro smoke config: in-process, gRPC workers and the Flower
    simulation, one short run each (the numbers are not checked: nothing here is timed)."""
    out = tmp_path / "system"
    rc = cli_main(["bench", "system", "--config", "configs/smoke.yaml", "--transports", "inprocess", "grpc", "flower",
                   "--rounds", "2", "--repeats", "1", "--eval-size", "4", "--scale-orgs",
                   "--deploy-rounds", "0", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "system.json").read_text())
    summary = result["transports"]["summary"]
    assert set(summary) == {"inprocess", "grpc", "flower"}
    for kind in ("inprocess", "grpc", "flower"):
        assert summary[kind]["wall"] > 0, kind
    assert "| transport |" in capsys.readouterr().out


def _git(repo: Path, *args: str) -> str:
    import subprocess

    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def test_report_tells_commits_with_the_same_training_code_apart(tmp_path):
    """On a git repository this test builds (no history of the checkout needed): a change under hacrl_fed/bench
    (where the benchmark scripts lived) is not a training-code change; one in hacrl_fed is."""
    repo = tmp_path / "repo"
    (repo / "hacrl_fed" / "bench").mkdir(parents=True)
    (repo / "hacrl_fed" / "trainer.py").write_text("LR = 1\n")
    (repo / "hacrl_fed" / "bench" / "learning.py").write_text("A = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "first")
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "hacrl_fed" / "bench" / "learning.py").write_text("A = 2\n")
    (repo / "README.md").write_text("docs\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "bench and docs only")
    bench_only = _git(repo, "rev-parse", "HEAD")
    (repo / "hacrl_fed" / "trainer.py").write_text("LR = 2\n")
    _git(repo, "commit", "-qam", "training code")
    head = _git(repo, "rev-parse", "HEAD")
    assert report.same_training_code([first, bench_only], repo) is True
    assert report.training_code_diff([first, bench_only], repo) == []
    assert report.same_training_code([first, bench_only, head], repo) is False
    assert report.training_code_diff([first, head], repo) == ["hacrl_fed/trainer.py"]
    assert report.same_training_code([head, "0" * 40], repo) is None  # an unknown commit: git cannot tell
    assert report.same_training_code([head, "?"], repo) is None
    assert report.same_training_code([first, head], tmp_path) is None  # not a checkout


def test_paired_differences_pair_by_seed_and_agent():
    def cell(seed, **acc):
        return {"seed": seed, "agents": {o: {"accuracy_after": a} for o, a in acc.items()}}

    by_method = {
        "gspo": [cell(0, a=0.50, b=0.30), cell(1, a=0.60, b=0.20)],
        "hacpo": [cell(0, a=0.56, b=0.40), cell(1, a=0.60, b=0.30), cell(2, a=0.9, b=0.9)],  # seed 2: no pair
    }
    d = report.paired_differences(by_method, ["gspo", "hacpo"], "gspo")
    assert list(d) == ["hacpo"]
    # differences: a +6, +0; b +10, +10 -> mean 6.5, sample std sqrt(67 / 3) = 4.7258, se 2.3629
    assert d["hacpo"]["pairs"] == 4
    assert d["hacpo"]["mean"] == pytest.approx(6.5)
    assert d["hacpo"]["se"] == pytest.approx((67 / 3) ** 0.5 / 2)
    assert d["hacpo"]["per_agent"] == pytest.approx({"a": 3.0, "b": 10.0})
    table = report.paired_table(by_method, ["gspo", "hacpo"], "gspo")
    assert "| `hacpo` | 4 | +6.5 ± 2.4 | +3.0 | +10.0 |" in table


def test_summary_table_rows_per_setting_and_method():
    def cell(seed, **acc):
        return {"seed": seed, "agents": {o: {"accuracy_after": a, "accuracy_before": 0.2} for o, a in acc.items()}}

    data = {
        ("s", "gspo"): [cell(0, a=0.30, b=0.40), cell(1, a=0.50, b=0.40)],
        ("s", "hacpo"): [cell(0, a=0.40, b=0.40), cell(1, a=0.50, b=0.60)],
        ("t", "hacpo"): [cell(0, a=0.25)],
    }
    lines = report.summary_table(data, ["s", "t"], ["gspo", "hacpo"])
    assert "| setting | method | a | b | mean gain | Δ vs `gspo` |" in lines
    assert "| `s` | `gspo` | 0.400 | 0.400 | +20.0 | – |" in lines
    # hacpo - gspo per (seed, org): +10, 0, 0, +20 -> +7.5, sample std 9.574, se 4.787
    assert "| `s` | `hacpo` | 0.450 | 0.500 | +27.5 | +7.5 ± 4.8 |" in lines
    assert "| `t` | `hacpo` | 0.250 | – | +5.0 | – |" in lines


def test_rule_comparison_pairs_each_agent_with_gspo_x2_and_states_only_resolved_verdicts():
    def cell(seed, **acc):
        return {"seed": seed, "agents": {o: {"accuracy_after": a} for o, a in acc.items()}}

    by_method = {
        "gspo": [cell(0, a=0.1, b=0.1), cell(1, a=0.1, b=0.1)],
        "gspo_x2": [cell(0, a=0.60, b=0.30), cell(1, a=0.62, b=0.30)],  # a is the strongest
        "naive": [cell(0, a=0.61, b=0.32), cell(1, a=0.63, b=0.31)],
        # a: -5, -5.2 -> -5.1 +- 0.1 (below); b: +10, +2 -> +6.0 +- 4.0 (not resolved)
        "hacpo_r": [cell(0, a=0.55, b=0.40), cell(1, a=0.568, b=0.32)],
    }
    lines = report.rule_comparison(by_method)
    assert "the strongest agent is a" in lines[0]
    assert lines[2] == ("| method | seeds | Δ a vs GSPO×2 | Δ b vs GSPO×2 | Δ vs naive (all agents) | a vs GSPO×2 | "
                        "every agent ≥ GSPO×2 |")
    # vs naive per (seed, agent): -6, +8, -6.2, +1 -> mean -0.8, std 6.73, se 3.37: not resolved
    assert "| `hacpo_r` | 2 | -5.1 ± 0.1 | +6.0 ± 4.0 | -0.8 ± 3.4 (not resolved) | below | no: a below |" in lines
    assert "| `naive` | 2 | +1.0 ± 0.0 | +1.5 ± 0.5 | – | above | no agent resolved below |" in lines
    assert not any("`gspo`" in line or "`gspo_x2`" in line for line in lines)
    assert report.rule_comparison({"hacpo": by_method["hacpo_r"]}) == []


def test_the_bench_pins_the_papers_hacpo_and_hacpo_defended_split_runs_the_defaults(tmp_path):
    from hacrl_fed.config import AlgorithmConfig, SelectionConfig, TrainerConfig

    matrix = bench_matrix.load_matrix()
    by = {(c.setting, c.method): c.config for c in bench_matrix.plan_cells(matrix, seeds=[0])}
    for setting in ("state", "size", "model", "three"):
        paper, defended = by[(setting, "hacpo")], by[(setting, "hacpo_defended")]
        off = by[(setting, "hacpo_defended_no_screen")]
        split = bench_matrix.build_cell(matrix, setting, "hacpo_defended_split", 0, "budget_split").config
        assert paper.algorithm.logprob_norm == "per_token" and paper.trainer.selection.rule == "all"
        assert paper.algorithm.baseline_rows == "joint"  # the paper's (the default since issue 42: in_band)
        assert paper.trainer.selection.budget_multiple is None and not paper.trainer.likelihood_screen.enabled
        # the defaults since issue 27: hacpo_defended_split; hacpo_defended: the same without a budget
        assert split.algorithm == AlgorithmConfig(name="hacpo", baseline_rows="joint")
        today = bench_matrix.build_cell(matrix, setting, "hacpo_defended_split_guard_gate_inband", 0, "inband_guard")
        assert today.config.algorithm == AlgorithmConfig()  # the defaults since issue 42
        assert split.trainer.selection == TrainerConfig().selection
        assert split.trainer.likelihood_screen == TrainerConfig().likelihood_screen
        assert defended.trainer.selection == SelectionConfig(budget_multiple=None, budget_split="pooled")
        assert defended.model_dump(exclude={"trainer", "name"}) == split.model_dump(exclude={"trainer", "name"})
        assert defended.trainer.model_dump(exclude={"selection"}) == split.trainer.model_dump(exclude={"selection"})
        assert off.model_dump(exclude={"trainer", "name"}) == defended.model_dump(exclude={"trainer", "name"})
        assert off.trainer.model_dump(exclude={"likelihood_screen"}) == defended.trainer.model_dump(
            exclude={"likelihood_screen"}
        )
        assert not off.trainer.likelihood_screen.enabled
    assert matrix.groups["defended"]["ref"] == "hacpo_defended_no_screen"
    raw = yaml.safe_load((Path.cwd() / "configs" / "bench" / "matrix.yaml").read_text())
    raw["groups"]["defended"]["ref"] = "gspo"  # not one of the group's methods
    bad = tmp_path / "configs" / "bench" / "matrix.yaml"
    bad.parent.mkdir(parents=True)
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(bench_matrix.MatrixError, match=r"groups.defended.ref: 'gspo' is not one of the group"):
        bench_matrix.load_matrix(bad)


def test_a_groups_own_seeds_add_to_the_seeds_other_groups_run_of_the_same_pair(tmp_path):
    three = str(Path.cwd() / "configs" / "bench" / "three.yaml")
    data = {
        "settings": {"three": {"config": three}},
        "methods": {"a": {"set": {"trainer.lr": 1.0e-4}}, "b": {"set": {"trainer.lr": 2.0e-4}}},
        "groups": {
            "g": {"settings": ["three"], "methods": ["a"]},
            "more": {"settings": ["three"], "methods": ["a", "b"], "seeds": [7, 0]},
        },
        "seeds": [0, 1],
    }
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(data))
    matrix = bench_matrix.load_matrix(path)
    planned = [(c.method, c.seed, c.group) for c in bench_matrix.plan_cells(matrix)]
    assert planned == [("a", 0, "g"), ("a", 1, "g"), ("a", 7, "g"), ("b", 7, "more"), ("b", 0, "more")]
    assert [(c.method, c.seed) for c in bench_matrix.plan_cells(matrix, only=["more"])] == [
        ("a", 7), ("a", 0), ("b", 7), ("b", 0)]
    assert [c.seed for c in bench_matrix.plan_cells(matrix, only=["three/a"], seeds=[3])] == [3]
    data["groups"]["more"]["seed"] = [1]  # a misspelt key is refused, not ignored
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(bench_matrix.MatrixError, match=r"groups.more: unknown keys \['seed'\]"):
        bench_matrix.load_matrix(path)


def test_group_tables_compare_every_variant_with_hacpo():
    shown = ["no_adv_calibration", "hacpo (= alpha1)", "hacpo_per_byte", "hacpo"]
    assert report.group_variants(shown) == ["no_adv_calibration", "hacpo_per_byte"]


def test_ratio_summary_splits_the_band_shares_by_source_with_three_orgs():
    shares = {"hacpo/cross_in_band_frac": 0.5, "hacpo/cross_in_band_frac/globex": 0.25,
              "hacpo/cross_in_band_frac/initech": 0.75, "hacpo/cross_clip_low_frac/globex": 0.75,
              "hacpo/cross_clip_low_frac/initech": 0.25, "hacpo/cross_clip_high_frac/globex": 0.0,
              "hacpo/cross_clip_high_frac/initech": 0.0, "hacpo/cross_grad_frac/globex": 0.2,
              "hacpo/cross_grad_frac/initech": 0.7}
    cell = {"config": {"algorithm": {"name": "hacpo"}}, "agents": {"acme": {"shares": shares, "stats": {}}}}
    text = report.ratio_summary([cell], "acme")
    assert "per source in band/below/above/with gradient: globex 0.25/0.75/0.00/0.20, initech 0.75/0.25/0.00/0.70" in text
    two = {k: v for k, v in shares.items() if not k.endswith("/initech")}
    cell2 = {"config": {"algorithm": {"name": "hacpo"}}, "agents": {"acme": {"shares": two, "stats": {}}}}
    assert "per source" not in report.ratio_summary([cell2], "acme")  # one source: the pair is the whole line


def test_a_cell_is_done_when_its_stored_config_holds_what_the_cell_runs(tmp_path):
    from hacrl_fed.config import load_config

    agent = tmp_path / "elsewhere" / "benchmarks" / "agents" / "qwen-char-b"  # another checkout's copy
    here = Path.cwd() / "benchmarks" / "agents" / "qwen-char-b"
    raw = {**TINY, "orgs": [*TINY["orgs"], {"id": "globex", "model": {"path": str(here)}}]}
    cfg = load_config(raw)
    stored = json.loads(json.dumps(cfg.model_dump(mode="json")))
    stored["orgs"][1]["model"]["path"] = str(agent)
    stored["name"], stored["run_dir"] = "another-name", "/tmp/elsewhere"
    assert bench_matrix.same_run_config(stored, cfg)
    # a field the cell's JSON predates, at its default here: the same run
    older = json.loads(json.dumps(stored))
    del older["trainer"]["gradient_checkpointing"], older["wandb"]
    assert bench_matrix.same_run_config(older, cfg)
    # ... but not once that field is set away from its default (e.g. a default changed under the cell)
    assert not bench_matrix.same_run_config(older, load_config(raw, {"trainer.gradient_checkpointing": True}))
    # pinning a field at the value the cell ran with is the same run, a different value is not
    assert bench_matrix.same_run_config(stored, load_config(raw, {"trainer.selection": {"rule": "all"}}))
    assert not bench_matrix.same_run_config(stored, load_config(raw, {"algorithm.alpha": 3.0}))
    assert not bench_matrix.same_run_config(stored, load_config(raw, {"seed": 1}))
    # a stored field the schema no longer has, or another org list, is another run
    assert not bench_matrix.same_run_config({**stored, "gone": 1}, cfg)
    assert not bench_matrix.same_run_config({**stored, "orgs": stored["orgs"][:1]}, cfg)


def test_a_field_whose_default_changed_after_it_was_added_is_compared_with_what_its_absence_ran():
    # trainer.selection.budget_split came in pooled and became per_source (issue 27): a cell stored before the
    # field existed ran pooled, whatever today's default
    from hacrl_fed.config import load_config

    pooled = {"trainer.selection": {"rule": "successes", "budget_multiple": 1.0, "budget_split": "pooled"}}
    stored = json.loads(json.dumps(load_config(TINY, pooled).model_dump(mode="json")))
    del stored["trainer"]["selection"]["budget_split"]
    assert bench_matrix.same_run_config(stored, load_config(TINY, pooled))
    per_source = {"trainer.selection": {"rule": "successes", "budget_multiple": 1.0}}  # today's default split
    assert load_config(TINY, per_source).trainer.selection.budget_split == "per_source"
    assert not bench_matrix.same_run_config(stored, load_config(TINY, per_source))


def test_a_cell_from_before_the_outcome_guard_ran_with_it_off_whatever_the_default():
    # trainer.outcome_guard came in off and became on by default (issue 27): a cell stored before the section existed
    # ran without a guard, so it is the run with the guard off (any other field of the section), not with it on
    from hacrl_fed.config import load_config

    raw = {**TINY, "trainer": {k: v for k, v in TINY["trainer"].items() if k != "outcome_guard"}}
    assert load_config(raw).trainer.outcome_guard.enabled is True
    off = {"trainer.outcome_guard.enabled": False}
    stored = json.loads(json.dumps(load_config(raw, off).model_dump(mode="json")))
    del stored["trainer"]["outcome_guard"]
    assert bench_matrix.same_run_config(stored, load_config(raw, off))
    assert bench_matrix.same_run_config(stored, load_config(raw, {**off, "trainer.outcome_guard.every": 8}))
    assert not bench_matrix.same_run_config(stored, load_config(raw))  # today's default: the guard on
    assert not bench_matrix.same_run_config(stored, load_config(raw, {"trainer.outcome_guard.enabled": True}))
    # a section off in both runs is the same run whatever its other fields (a field added later, another value)
    older = json.loads(json.dumps(load_config(raw, off).model_dump(mode="json")))
    del older["trainer"]["outcome_guard"]["final_size"]
    older["trainer"]["outcome_guard"]["val_size"] = 64
    assert bench_matrix.same_run_config(older, load_config(raw, off))


def test_a_field_measured_and_removed_is_today_s_run_only_at_the_value_that_stayed():
    # issue 42 removed the guard's older rules, the decoupled loss and teach from the run config: a cell that stored
    # one of those fields at the value that is today's only behaviour ran today's config; at another value it ran
    # the removed feature (a retired method's cell, which names its commit)
    from hacrl_fed.config import load_config

    cfg = load_config(TINY, {"trainer.outcome_guard.enabled": True})  # a guard off is the same whatever its rules
    stored = json.loads(json.dumps(cfg.model_dump(mode="json")))
    stored["trainer"]["outcome_guard"].update(struck_bar="slack", shadow_gate=True)
    stored["algorithm"].update(cross_staleness="band", cross_weight_mode="filter")
    stored["trainer"]["teach"] = {"enabled": False, "lr": None}
    assert bench_matrix.same_run_config(stored, cfg)
    for path, value in (("struck_bar", "no_worse"), ("shadow_gate", False)):
        other = json.loads(json.dumps(stored))
        other["trainer"]["outcome_guard"][path] = value
        assert not bench_matrix.same_run_config(other, cfg)
    other = json.loads(json.dumps(stored))
    other["algorithm"]["cross_staleness"] = "decoupled"
    assert not bench_matrix.same_run_config(other, cfg)
    other = json.loads(json.dumps(stored))
    other["trainer"]["teach"]["enabled"] = True
    assert not bench_matrix.same_run_config(other, cfg)
    other = json.loads(json.dumps(stored))
    other["trainer"]["some_field_never_measured"] = 1  # a field no table knows: a difference
    assert not bench_matrix.same_run_config(other, cfg)


def test_every_field_removed_from_the_run_config_is_known_at_the_value_that_stayed():
    # a config section's removed_fields (issue 42's field count) are the bench's REMOVED_FIELDS too: a committed cell
    # that stored one at today's fixed value ran today's code
    from test_config import _removed_fields

    removed = {f"{section}.{name}".lstrip(".") for section, name in _removed_fields()}
    assert removed and removed <= set(bench_matrix.REMOVED_FIELDS)
    assert bench_matrix.REMOVED_FIELDS["algorithm.adv_eps"] == 1e-6  # the old defaults, now module constants
    assert bench_matrix.REMOVED_FIELDS["samples.own_per_round"] == 4


def test_every_committed_cell_is_still_done_with_the_config_it_ran():
    # a default change must leave every finished cell done (pin the value it ran with in its setting or method):
    # each JSON under benchmarks/results/ is planned by the matrix and its stored config is the cell's config, or is
    # a cell of a retired method (its feature removed, issue 42: the matrix's `retired:` entries, the one list of
    # them), never rerun, which ran at the last commit with its code or before it
    results = Path.cwd() / "benchmarks" / "results"
    files = sorted(results.glob("*/*/seed*.json"))
    assert len(files) >= 238  # the cells committed when this test was written
    matrix = bench_matrix.load_matrix()
    retired = bench_matrix.retired_methods(matrix)
    old = {p: retired[p.parent.name] for p in files if p.parent.name in retired}
    ran_at = {p: json.loads(p.read_text())["code"]["commit"] for p in old}
    assert len(old) == 170 and all(len(c) == 40 for c in ran_at.values())  # 50 of methods still in a group
    assert {c[:7] for c in ran_at.values()} >= {"a07fdd6", "2995b0d", "674c870", "3787974"}
    for commit in {(ran_at[p], c) for p, c in old.items()}:  # the commit it ran at has the method's code
        assert _git(Path.cwd(), "merge-base", "--is-ancestor", *commit) == "", commit
    files = [p for p in files if p not in old]
    cells = {c.path(results): c for c in bench_matrix.plan_cells(matrix, only=sorted({
        f"{p.parent.parent.name}/{p.parent.name}" for p in files}))}  # fmt: skip
    not_done = [str(p.relative_to(results)) for p in files if p not in cells or (
        bench_matrix.cell_status(cells[p], results) != "done")]  # fmt: skip
    assert not_done == []


def test_cell_status_compares_configs_and_falls_back_to_the_hash(tmp_path):
    cell = bench_matrix.plan_cells(bench_matrix.load_matrix(), only=["model/hacpo"], seeds=[0])[0]
    path = cell.path(tmp_path)
    path.parent.mkdir(parents=True)
    assert bench_matrix.cell_status(cell, tmp_path) == "todo"
    path.write_text(json.dumps({"config": cell.config.model_dump(mode="json"), "config_hash": "other"}))
    assert bench_matrix.cell_status(cell, tmp_path) == "done"
    changed = cell.config.model_dump(mode="json")
    changed["algorithm"]["alpha"] = 3.0
    path.write_text(json.dumps({"config": changed, "config_hash": cell.hash}))
    assert bench_matrix.cell_status(cell, tmp_path) == "stale"
    path.write_text(json.dumps({"config_hash": cell.hash}))
    assert bench_matrix.cell_status(cell, tmp_path) == "done"
    path.write_text("{not json")
    assert bench_matrix.cell_status(cell, tmp_path) == "stale"
