"""hacrl_tools.bench.async_clock and scripts/async_bench.py: hand-computed clocks, times and pairings."""

from __future__ import annotations

import json

import pytest

from hacrl_tools.bench.async_clock import accuracy_at, lock_step_clock, round_step_s, time_to
from tests.helpers_scripts import load_script


def test_a_lock_step_curve_runs_on_the_slowest_step():
    curve = [[0, 0, 0.2], [10, 1280, 0.3], [20, 2560, 0.5]]
    assert round_step_s({"acme": 4.0}, ["acme", "globex"]) == 4.0
    assert round_step_s({"globex": 0.5}, ["acme", "globex"]) == 1.0  # an org the map does not name: 1
    assert lock_step_clock(curve, 4.0) == [[0, 0.0, 0.2], [10, 44.0, 0.3], [20, 84.0, 0.5]]


def test_time_to_and_accuracy_at_read_linearly_between_evaluations():
    curve = [[0, 0.0, 0.2], [10, 44.0, 0.3], [20, 84.0, 0.5]]
    assert time_to(curve, 0.4) == pytest.approx(64.0)  # halfway from 0.3 at 44 to 0.5 at 84
    assert time_to(curve, 0.2) == 0.0 and time_to(curve, 0.1) == 0.0
    assert time_to(curve, 0.51) is None
    assert accuracy_at(curve, 22.0) == pytest.approx(0.25)
    assert accuracy_at(curve, 84.0) == 0.5 and accuracy_at(curve, 500.0) == 0.5


def _cell(setting, method, seed, accs, clock=None, step_s=None):
    agents = {}
    for org, pts in accs.items():
        curve = [[t, t * 128, a] for t, a in pts]
        agents[org] = {"accuracy_after": pts[-1][1], "curve": curve}
        if clock is not None:
            agents[org]["clock_curve"] = [[t, c, a] for (t, a), c in zip(pts, clock[org])]
    fed = {"virtual_step_s": step_s} if step_s else {}
    return {"setting": setting, "method": method, "seed": seed, "agents": agents,
            "config": {"federation": fed, "orgs": [{"id": o} for o in accs]}}


def test_async_bench_pairs_each_org_with_the_synchronous_run_on_its_clock(tmp_path, capsys):
    mod = load_script("async_bench")
    pts = {"acme": [(0, 0.4), (10, 0.5), (20, 0.6)], "globex": [(0, 0.2), (10, 0.3), (20, 0.4)]}
    cells = [
        _cell("model", "hacpo_defended_split", 0, pts),
        _cell("model", "gspo", 0, {"acme": [(0, 0.4), (20, 0.55)], "globex": [(0, 0.2), (20, 0.35)]}),
        # globex runs free: round t at t + 1; acme (4x) at 4 (t + 1); same accuracies
        _cell("model", "async4_free", 0, pts, clock={"acme": [0, 44, 84], "globex": [0, 11, 21]},
              step_s={"acme": 4.0}),
    ]
    for c in cells:
        path = tmp_path / c["setting"] / c["method"] / f"seed{c['seed']}.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(c))
    assert mod.main(["model", "--results", str(tmp_path), "--json", str(tmp_path / "out.json")]) == 0
    rows = {r["org"]: r for r in json.loads((tmp_path / "out.json").read_text())}
    # globex: 95 % of 0.4 = 0.38 at 0.3 + 0.8 * 0.1: sync clock 44 + 0.8 * 40 = 76, async 11 + 0.8 * 10 = 19
    assert rows["globex"]["t95_sync"]["mean"] == pytest.approx(76.0)
    assert rows["globex"]["t95_async"]["mean"] == pytest.approx(19.0)
    assert rows["globex"]["t95_ratio"]["mean"] == pytest.approx(19.0 / 76.0)
    assert rows["globex"]["final_minus_gspo"]["mean"] == pytest.approx(5.0)
    # at globex's finish (21) the synchronous globex is at 0.2 + 21/44 * 0.1
    assert rows["globex"]["equal_clock_minus_sync"]["mean"] == pytest.approx(100 * (0.4 - (0.2 + 21 / 44 * 0.1)))
    assert rows["acme"]["t95_ratio"]["mean"] == pytest.approx(1.0) and rows["acme"]["final_minus_sync"]["mean"] == 0
    assert "| `model` | `async4_free` | globex | 1 | 1 |" in capsys.readouterr().out


def test_a_longer_asynchronous_org_is_read_at_the_synchronous_rounds_and_clock(tmp_path):
    """``federation.org_rounds``: globex runs 40 rounds; equal rollouts reads it at round 20 (the synchronous run's
    last), equal clock where the shorter of the two runs ends."""
    mod = load_script("async_bench")
    acme = [(0, 0.4), (20, 0.5)]
    sync = _cell("model", "hacpo_defended_split", 0, {"acme": acme, "globex": [(0, 0.2), (10, 0.3), (20, 0.4)]})
    gspo = _cell("model", "gspo", 0, {"acme": acme, "globex": [(0, 0.2), (20, 0.35)]})
    long = _cell("model", "async4_open_long", 0, {"acme": acme, "globex": [(0, 0.2), (20, 0.3), (40, 0.5)]},
                 clock={"acme": [0, 84], "globex": [0, 21, 41]}, step_s={"acme": 4.0})
    row = mod.org_row({0: long}, {0: sync}, {0: gspo}, "globex")
    assert row["final_minus_sync"]["mean"] == pytest.approx(100 * (0.3 - 0.4))  # at round 20
    assert row["final_minus_gspo"]["mean"] == pytest.approx(100 * (0.5 - 0.35))
    # the synchronous run ends at (20 + 1) x 4 = 84; globex ends at 41: both at 41
    assert row["equal_clock_minus_sync"]["mean"] == pytest.approx(100 * (0.5 - (0.2 + (41 - 0) / 44 * 0.1)))
    assert row["t95_async"]["mean"] == pytest.approx(21 + (0.38 - 0.3) / 0.2 * 20)
