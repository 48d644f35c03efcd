"""hacrl_tools.bench.clock_check (scripts/async_grpc_check.py): a real run's steps read from hand-made metric
records, the virtual clock's prediction from their mean durations, and the comparison, all hand-computed."""

from __future__ import annotations

import pytest

from hacrl_fed.coordinator.async_schedule import ScheduleSpec, simulate
from hacrl_tools.bench.clock_check import (
    call_seconds,
    compare,
    leads,
    predict,
    spread,
    step_durations,
    step_ends,
    step_starts,
)
from tests.helpers_scripts import load_script


def _records():
    """R = 2, K = 1; org a (about 1 s a step) waits 0.2 s before its step planning 2; s (about 2 s) never waits.
    Real ends: a 0.8, 2.2, 3.1 (its last step, train only); s 1.5, 4.0, 6.5."""
    def org(name, clock, idle, step, trained):
        return {f"async/{name}/clock_s": clock, f"async/{name}/idle_s": idle, f"async/{name}/step_s": step,
                f"async/{name}/trained_at_s": trained}

    return [
        {"round": 0},
        {"round": 1, **org("a", 0.8, 0.0, 0.7, 2.2), **org("s", 1.5, 0.0, 1.4, 4.0)},
        {"round": 2, **org("a", 2.2, 0.2, 1.1, 3.1), **org("s", 4.0, 0.0, 2.4, 6.5)},
    ]


def test_steps_read_from_the_records():
    recs = _records()
    assert step_ends(recs, "a", 2) == [0.8, 2.2, 3.1]
    assert step_starts(recs, "a", 2) == pytest.approx([0.0, 1.0])  # 0.8 + the 0.2 s idle
    assert step_durations(recs, "a", 2) == pytest.approx([0.8, 1.2])
    assert step_durations(recs, "s", 2) == pytest.approx([1.5, 2.5])
    assert call_seconds(recs, "s", 2) == [1.4, 2.4]
    assert spread([1.0, 2.0, 3.0]) == {"mean": 2.0, "sd": 1.0, "cv": 0.5, "min": 1.0, "median": 2.0, "max": 3.0}


def test_predict_counts_idle_through_the_start_of_the_step_planning_the_last_round():
    """K = 1, a 1 s, s 3 s, R = 3: a runs [0,1] [1,2], waits for s's round 1 (at 3) for [3,4], then for its round 2
    (at 6) for its last step [6,7]; s runs 3 s steps end to end. Idle through a's step planning 3: 1 s (the 2 s
    before its last step are not logged by the driver, so not counted)."""
    guess = predict({"a": 1.0, "s": 3.0}, 3, 1, None)
    assert guess["ends"] == {"a": [1.0, 2.0, 4.0, 7.0], "s": [3.0, 6.0, 9.0, 12.0]}
    assert guess["idle"] == {"a": 1.0, "s": 0.0}
    assert simulate(ScheduleSpec({"a": 1.0, "s": 3.0}, 3, 1)).idle["a"] == 3.0
    # a's lead over s at a's finish (7): s has published round 2 -> 1; at its publication of round 2 (t=2): 2 - 0
    assert leads(guess["ends"], "s", 3) == {"a": {"at_finish": 1, "max": 2}, "s": {"at_finish": 0, "max": 0}}


def test_compare_sets_the_prediction_against_the_run():
    """Mean durations a 1.0, s 2.0 -> the virtual clock: a [0,1] [1,2] [2,3] (s's round 1 is out at 2), s [0,2]
    [2,4] [4,6]; against the real ends a 0.8 2.2 3.1, s 1.5 4.0 6.5."""
    out = compare(_records(), ["a", "s"], 2, 1, None, "s")
    assert out["durations_s"] == pytest.approx({"a": 1.0, "s": 2.0}) and out["run_s"] == 6.5
    a, s = out["orgs"]["a"], out["orgs"]["s"]
    assert a["finish_s"] == pytest.approx({"real": 3.1, "predicted": 3.0, "error_pct": -100 * 0.1 / 3.1})
    assert s["finish_s"] == pytest.approx({"real": 6.5, "predicted": 6.0, "error_pct": -100 * 0.5 / 6.5})
    assert a["lead_at_finish"] == {"real": 1, "predicted": 1} and a["max_lead"] == {"real": 1, "predicted": 1}
    assert s["lead_at_finish"] == {"real": 0, "predicted": 0}
    assert a["idle_s"] == pytest.approx({"real": 0.2, "predicted": 0.0, "error_pct": -100 * 0.2 / 6.5})
    assert a["step_s"]["mean"] == pytest.approx(1.0) and s["call_s"]["mean"] == pytest.approx(1.9)
    assert out["step_ends_s"]["s"] == {"real": [1.5, 4.0, 6.5], "predicted": [2.0, 4.0, 6.0]}
    # |0.8-1| + |2.2-2| + |3.1-3| + |1.5-2| + |4-4| + |6.5-6| = 1.5 over 6 step ends
    assert out["step_end_mae_s"] == pytest.approx(0.25) and out["step_end_mae_pct"] == pytest.approx(25 / 6.5)
    call = compare(_records(), ["a", "s"], 2, 1, None, "s", basis="call")
    assert call["durations_s"] == pytest.approx({"a": 0.9, "s": 1.9})
    # a 0.9 s: [0,.9] [.9,1.8], waits for s's round 1 (1.9) for its last step: finishes at 2.8
    assert call["orgs"]["a"]["finish_s"]["predicted"] == pytest.approx(2.8)


def test_the_script_prints_one_line_per_arm_and_org():
    script = load_script("async_grpc_check")
    arm = {"schedule": compare(_records(), ["a", "s"], 2, 1, None, "s"),
           "call": compare(_records(), ["a", "s"], 2, 1, None, "s", basis="call")}
    lines = script.table({"k1": arm}).splitlines()
    assert len(lines) == 2 + 2 + 1
    assert lines[2].split()[:2] == ["k1", "a"] and "3.10/   3.00 ( -3.2%)" in lines[2]
    assert "MAE 0.250 s = 3.8% of the 6.5 s run" in lines[4]
    cfg = script.run_config("x", 16, 1000, 17)
    assert cfg["federation"]["transport"] == "grpc" and script.SLOWDOWN_ENV == "HACRL_FED_BENCH_SLOWDOWN"
    from hacrl_fed.config import load_config

    assert load_config(cfg).federation.effective_window == 17  # a valid run config
