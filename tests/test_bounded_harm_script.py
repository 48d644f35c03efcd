"""scripts/bounded_harm.py: honest orgs against isolated GSPO, grouped by attack and protocol; one row per run."""

from __future__ import annotations

import json

from tests.helpers_scripts import load_script


def _script():
    return load_script("bounded_harm")


def _run(seed, protocol, globex, initech, **extra):
    return {
        "config": "configs/bench/three.yaml", "variant": "utility", "screen": "on", "protocol": protocol,
        "rounds": 40, "seed": seed, "attacker": "acme", "victim": "globex", "set": [], "duty": None,
        "accuracy": {"acme": 0.6, "globex": globex, "initech": initech}, "doctored_rows": 100,
        "trace": [{"round": 16, "rollback": 1.0}, {"round": 20, "adopted": 1.0}, {"round": 24}],
        "counters": {"globex/outcome/acme/dropped_quarantine": 64.0},
        "drops": {"globex<-acme": {"dropped_low_likelihood": 2.0, "dropped_claim_outlier": 1.0}},
        "commit": "abcdef123456", "adoption": {"no_marker_share": 0.05, "trigger_share": 0.25}, **extra,
    }


def test_honest_orgs_are_paired_with_gspo_by_seed_and_protocols_stay_apart(tmp_path, capsys):
    results = tmp_path / "results"
    for seed, (g, i) in enumerate([(0.30, 0.25), (0.32, 0.27)]):
        cell = results / "three" / "gspo" / f"seed{seed}.json"
        cell.parent.mkdir(parents=True, exist_ok=True)
        agents = {org: {"curve": [[40, 0, acc], [60, 0, acc + 0.1]]} for org, acc in
                  {"acme": 0.6, "globex": g, "initech": i}.items()}
        cell.write_text(json.dumps({"agents": agents}))
    runs = tmp_path / "runs.jsonl"
    lines = [_run(0, "fused", 0.31, 0.25), _run(1, "fused", 0.30, 0.27), _run(0, "two_message", 0.26, 0.25)]
    runs.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "table.json"
    assert _script().main([str(runs), "--results", str(results), "--json", str(out), "--per-run"]) == 0
    printed = capsys.readouterr().out
    assert "| 0 | `three` | utility, by acme | globex 0.310 (+1.0), initech 0.250 (+0.0) | 5.0 % / 25.0 % | 16 / 20 | 64 | 3 of 100 |" \
        in printed
    assert printed.count("Every run (screen on):") == 1  # the runs' common screen and overrides, said once
    rows = {(r["attack"], r["org"]): r for r in json.loads(out.read_text())}
    fused, two = rows[("utility, by acme", "globex")], rows[("utility, by acme, two_message", "globex")]
    assert fused["seeds"] == [0, 1] and abs(fused["diff"] - (0.01 - 0.02) / 2) < 1e-9  # paired at round 40
    assert two["seeds"] == [0] and abs(two["diff"] + 0.04) < 1e-9
    assert ("utility, by acme", "acme") not in rows  # the attacker is not an honest org


def test_an_attacks_label_names_its_throttles():
    from tests.helpers_scripts import load_script

    label = load_script("bounded_harm")._attack
    run = {"variant": "utility", "attacker": "acme", "duty": None, "protocol": "fused"}
    assert label(run) == "utility, by acme"
    throttled = label({**run, "duty": "3/4", "fraction": 0.25})
    assert throttled == "utility, by acme, doctoring 3/4 rounds, doctoring 0.25 of its rows"
    assert label({**run, "protocol": "two_message", "fraction": None}) == "utility, by acme, two_message"
