"""The learner's side of asynchronous rounds (hacrl_fed/worker/late_rounds.py): which late rows may join, the plan
each is checked against, the late groups' baselines and each row's round, age and capability figures."""

from __future__ import annotations

from collections import Counter

import pytest

from helpers_fake_workers import FakeTask, fake_config
from hacrl_fed.trainer import TrainRow
from hacrl_fed.types import Rollout, TrainRequest
from hacrl_fed.worker.intake import OwnRound
from hacrl_fed.worker.late_rounds import (
    LateRounds,
    RecentRounds,
    baseline_rows,
    group_round,
    late_group,
    row_figures,
    screen_late,
    set_rounds,
    split_rounds,
)
from hacrl_fed.worker.ledger import Ledger

TASK = FakeTask()
G = 4  # fake_config: num_samples


def _own(round, ids=(1, 2, 3), rewards=(1.0, 0.0, 0.0, 0.0)):
    prompts = tuple(TASK.prompts("train", ids))
    rows = [TrainRow([9], [5, 6], rewards[i], p, 0, True, -1.0) for p in ids for i in range(G)]
    return OwnRound("run", round, "fake", prompts, 8, {p: [100 + p] for p in ids}, rows)


def _batch(src, round, ids=(1, 2, 3), wins=1):
    return [
        Rollout(src, round, p, i, str(p) if i < wins else "no", "stop", 1.0 if i < wins else 0.0, -1.0, 3)
        for p in ids
        for i in range(G)
    ]


def _request(own_round, rows, **kw):
    return TrainRequest("run", own_round, "a", (), tuple(rows), {"a": 1.0, "b": 1.0, "c": 1.0}, **kw)


def test_late_groups_are_unique_and_invertible():
    assert late_group(2, 7) < 0 and late_group(2, 7) != late_group(3, 7) != late_group(2, 8)
    assert group_round(late_group(5, 123), 9) == (5, 123) and group_round(123, 9) == (9, 123)


def test_rows_outside_the_window_or_reused_are_refused_and_counted():
    cfg = fake_config(staleness=1, window=2)
    recent = RecentRounds(2)
    for r in (2, 3):
        recent.keep(_own(r))
    rows = _batch("b", 3) + _batch("b", 2) + _batch("c", 1) + _batch("c", 4)
    ledger = Ledger()
    current, late = split_rounds(cfg, "a", _request(3, rows), _own(3), recent, ledger)
    assert {(r.org_id, r.round) for r in current.foreign} == {("b", 3)}
    assert {r: set(srcs) for r, srcs in late.items()} == {2: {"b"}}
    metrics = ledger.trust_metrics()
    assert metrics["trust/c/rejected/beyond_window"] == metrics["trust/c/rejected/future_round"] == 3 * G
    again = Ledger()  # the same (source, round) offered in a later request
    recent.keep(_own(4))
    _, late = split_rounds(cfg, "a", _request(4, _batch("b", 3)), _own(4), recent, again)
    assert late == {} and again.trust_metrics()["trust/b/rejected/already_used"] == 3 * G
    forgotten = RecentRounds(2)
    forgotten.keep(_own(3))  # round 2 was never generated here
    missing = Ledger()
    _, late = split_rounds(cfg, "a", _request(3, _batch("c", 2)), _own(3), forgotten, missing)
    assert late == {} and missing.trust_metrics()["trust/c/rejected/not_generated"] == 3 * G
    flood = Ledger()
    split_rounds(cfg, "a", _request(3, _batch("b", 3) * 5), _own(3), recent, flood)  # > W rounds' worth
    assert flood.trust_metrics()["trust/*/rejected/too_many_foreign"] == 5 * 3 * G


def test_a_late_batch_is_checked_against_the_plan_of_its_own_round():
    cfg = fake_config(staleness=1, window=2)
    recent = RecentRounds(2)
    recent.keep(_own(2, ids=(1, 2, 3)))
    recent.keep(_own(3, ids=(4, 5, 6)))
    ok = _batch("b", 2, ids=(1, 2, 3))
    wrong_prompts = _batch("c", 2, ids=(4, 5, 6))  # round 3's prompts claimed for round 2
    ledger = Ledger()
    out = screen_late(cfg, "a", _request(3, ()), {2: {"b": ok, "c": wrong_prompts}}, recent, TASK.verify, ledger)
    assert {r.org_id for r in out} == {"b"} and len(out) == 3 * G
    assert {r.prompt_id for r in out} == {late_group(2, p) for p in (1, 2, 3)}
    assert ledger.trust_metrics()["trust/c/accepted"] == 0
    liar = [Rollout(r.org_id, r.round, r.prompt_id, r.sample_index, "no", "stop", 1.0, -1.0, 3) for r in ok]
    excluded = Ledger()
    assert screen_late(cfg, "a", _request(3, ()), {2: {"b": liar}}, recent, TASK.verify, excluded) == []
    assert excluded.trust_metrics()["trust/b/excluded"] == 1.0


def test_late_groups_count_the_learner_s_own_rewards_and_the_rows_it_took_before():
    recent = RecentRounds(2)
    recent.keep(_own(2, ids=(1, 2), rewards=(1.0, 1.0, 0.0, 0.0)))
    recent.keep(_own(3, ids=(4,)))
    agents = ["a", "b", "c"]
    taken = TrainRow([9], [5], 0.5, 1, 1, False, -1.0)  # b's row of prompt 1 admitted when round 2 was current
    recent.note_admitted([taken], agents, 2)
    late = [Rollout("c", 2, late_group(2, 1), 0, "1", "stop", 1.0, -1.0, 3)]
    base = baseline_rows([r.prompt_id for r in late], recent, 0, agents)
    own = [r for r in base if r.is_self]
    assert [r.reward for r in own] == [1.0, 1.0, 0.0, 0.0]  # prompt 1 only, the learner's round-2 rewards
    assert all(
        r.group == late_group(2, 1) and r.response_ids == [] and r.source == (0 if r.is_self else 1) for r in base
    )
    assert [(r.source, r.reward) for r in base if not r.is_self] == [(1, 0.5)]


def test_each_row_gets_its_round_age_and_the_figures_of_its_round():
    rows = [
        TrainRow([9], [5], 1.0, 4, 0, True, -1.0),
        TrainRow([9], [5], 1.0, 4, 1, False, -1.0),
        TrainRow([9], [5], 1.0, late_group(2, 1), 2, False, -1.0),
    ]
    table = {3: {"a": 0.5, "b": 0.25, "c": 1.0}, 2: {"a": 0.2, "b": 0.4, "c": 0.8}}
    request = _request(3, (), round_capability=table, tags=(("b", 3, 2), ("c", 2, 1)), version=2)
    set_rounds(rows, request, 3, ["a", "b", "c"])
    assert [(r.round, r.age) for r in rows] == [(3, 0), (3, 0), (2, 1)]
    assert row_figures(rows, request, 3, ["a", "b", "c"], 0) == ([0.5, 0.5, 0.2], [0.5, 0.25, 0.8])


@pytest.mark.parametrize("window", [1, 3])
def test_recent_rounds_forget_what_no_request_may_reach(window):
    recent = RecentRounds(window)
    for r in range(1, 6):
        recent.keep(_own(r))
    assert sorted(recent.rounds) == list(range(6 - window, 6))


def _intake(cfg):
    from hacrl_fed.config import LikelihoodScreenConfig, SelectionConfig
    from hacrl_fed.worker.intake import Intake
    from tests.helpers_tiny import tiny_char_tokenizer

    tok = tiny_char_tokenizer()
    return Intake(
        cfg,
        "a",
        selection=SelectionConfig(rule="all"),
        screen=LikelihoodScreenConfig(enabled=False),
        uses_cross=True,
        task=TASK,
        tokenizer=tok,
        eos_id=tok.eos_token_id,
    )


def test_admit_late_end_to_end_baselines_rounds_and_at_most_once():
    """Two steps of learner a (W = 3): the late rows join their round's group with a's own round-2 rewards (and, the
    second time, b's round-2 rows a took before), never as their own baseline; a reused batch is refused."""
    from hacrl_fed.worker.intake import Scoring

    cfg = fake_config(staleness=2)
    intake, recent = _intake(cfg), RecentRounds(3)
    scoring = Scoring(lambda rows: [-1.0] * len(rows), None, {})
    own = {r: _own(r, ids=(1, 2, 3) if r == 2 else (3 + r, 4 + r, 5 + r)) for r in (2, 3, 4)}
    table = {2: {"a": 0.5, "b": 0.25, "c": 1.0}, 3: {"a": 0.5, "b": 0.5, "c": 0.5}, 4: {"a": 1.0, "b": 1.0, "c": 1.0}}
    recent.keep(own[2])
    recent.keep(own[3])
    rows = _batch("b", 2, ids=(1, 2, 3)) + _batch("c", 3, ids=(6, 7, 8))
    req = _request(3, rows, round_capability=table, tags=(("b", 2, 1), ("c", 3, 2)), version=2)
    first = intake.admit(
        req, own[3], seed=0, opener=None, scoring=scoring, late=LateRounds(intake, req, own[3], recent, opener=None)
    )
    late = [r for r in first.rows if r.group < 0]
    assert {(r.is_self, bool(r.response_ids), r.round) for r in late} == {(False, True, 2), (True, False, 2)}
    assert sum(r.is_self for r in late) == 3 * G and sum(not r.is_self for r in late) == 3 * G
    assert {r.age for r in first.rows if not r.is_self} == {1, 0}  # b's round-2 batch of version 1: age 2 - 1
    lc, sc = first.row_capability
    assert {(r.round, r.is_self, l, s) for r, l, s in zip(first.rows, lc, sc) if not r.is_self} == {
        (2, False, 0.5, 0.25),
        (3, False, 0.5, 0.5),
    }
    recent.keep(own[4])
    again = _batch("b", 2, ids=(1, 2, 3)) + _batch("c", 2, ids=(1, 2, 3))
    req4 = _request(4, again, round_capability=table, tags=(("c", 2, 1),), version=3)
    late4 = LateRounds(intake, req4, own[4], recent, opener=None)
    second = intake.admit(req4, own[4], seed=0, opener=None, scoring=scoring, late=late4)
    assert second.ledger.trust_metrics()["trust/b/rejected/already_used"] == 3 * G
    late = [r for r in second.rows if r.group < 0]
    trained = [r for r in late if r.response_ids]
    assert len(trained) == 3 * G and {r.source for r in trained} == {second.agents.index("c")}
    no_tokens = Counter((r.is_self, second.agents[r.source]) for r in late if not r.response_ids)
    assert no_tokens == {(True, "a"): 3 * G, (False, "b"): 3 * G}  # a's own and b's taken rows, not c's own copy
