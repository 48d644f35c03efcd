"""scripts/guard_cost.py: the guard's honest cost paired by seed, a stand-in cell only where no guard rolled back."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers_scripts import load_script


def _script():
    return load_script("guard_cost")


def _cell(root: Path, method: str, seed: int, acme: float, globex: float, rollbacks=()) -> None:
    agents = {"acme": {"accuracy_after": acme}, "globex": {"accuracy_after": globex}}
    if method != "ref":
        agents["globex"]["outcome"] = {"rollbacks": list(rollbacks)}
    path = root / "count4" / method / f"seed{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"setting": "count4", "method": method, "seed": seed, "agents": agents}))


def test_a_stand_in_counts_only_where_no_guard_rolled_back(tmp_path, capsys):
    for seed, (acme, globex) in enumerate([(0.60, 0.30), (0.62, 0.32), (0.64, 0.34)]):
        _cell(tmp_path, "ref", seed, acme, globex)
    _cell(tmp_path, "gate", 0, 0.61, 0.29)  # the method's own cell: +1, -1
    _cell(tmp_path, "old", 1, 0.62, 0.34)  # no rollback: the same run under the gate, +0, +2
    _cell(tmp_path, "old", 2, 0.50, 0.20, rollbacks=[16])  # rolled back: not a stand-in, the seed is missing
    out = tmp_path / "rows.json"
    args = ["--results", str(tmp_path), "--method", "gate", "--ref", "ref", "--same-as", "old", "--json", str(out)]
    assert _script().main(args) == 0
    rows = json.loads(out.read_text())["count4"]
    assert rows["seeds"] == ["0:gate", "1:old"] and rows["missing"] == [2]
    by_org = {r["org"]: r for r in rows["orgs"]}
    assert [round(d, 6) for d in by_org["acme"]["per_seed"]] == [1.0, 0.0]
    assert [round(d, 6) for d in by_org["globex"]["per_seed"]] == [-1.0, 2.0]
    assert abs(by_org["globex"]["mean"] - 0.5) < 1e-9 and abs(by_org["globex"]["se"] - 1.5) < 1e-9
    captured = capsys.readouterr()
    assert "| `count4` | 0:gate, 1:old | globex | +0.5 ± 1.5 | -1.0, +2.0 | within one SE |" in captured.out
    assert "seeds [2] have only cells where a guard rolled back" in captured.err


def test_one_nonzero_seed_among_zeros_is_within_one_standard_error():
    verdict = _script()._verdict
    diffs = [-0.1] + [0.0] * 9  # |mean| == se exactly: 0.01 and 0.01 up to float round-off
    mean, se = sum(diffs) / 10, (sum((d + 0.01) ** 2 for d in diffs) / 9) ** 0.5 / 10**0.5
    assert verdict(mean, se) == "within one SE"
    assert verdict(-0.03, 0.02) == "not resolved" and verdict(-0.05, 0.02) == "below" and verdict(0.1, None) == "one seed"
