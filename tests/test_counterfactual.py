"""The outcome guard's counterfactual (hacrl_fed/algorithm/counterfactual.py, hacrl_fed/worker/shadow.py): the
learner against a shadow that trains on its own rows alone, the adoption of the shadow's weights, the strikes it
gives, and the worker's shadow over a short in-process run of micro agents."""

from __future__ import annotations

import pytest
import torch

from hacrl_fed.algorithm.counterfactual import against_shadow, due
from hacrl_fed.algorithm.outcome_guard import OutcomeGuard, OutcomeParams
from hacrl_fed.config import load_config
from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.metrics import RunLogger, read_metrics
from hacrl_fed.worker import build_worker
from tests.test_docs import documented_keys, key_pattern, undocumented

P = OutcomeParams(every=2, z=2.0, margin=2, probation=4, backoff=2.0)


def vec(right: int, n: int = 100) -> list[bool]:
    return [i < right for i in range(n)]


# ------------------------------------------------------------------------------------------------ pure logic


def test_significantly_worse_than_the_shadow_adopts_it_and_strikes():
    v = against_shadow(vec(60), vec(40), z=2.0, margin=2, last=False, last_z=1.0)  # 20 lost, 0 gained: 20 > 2 * sqrt(20)
    assert (v.comparison.lost, v.comparison.gained, v.adopt, v.strike) == (20, 0, True, True)


def test_within_the_slack_changes_nothing_before_the_last_round_and_adopts_without_strike_at_it():
    before = against_shadow(vec(60), vec(57), z=2.0, margin=2, last=False, last_z=1.0)  # 3 lost: 3 <= max(2 * sqrt(3), 2)
    assert (before.comparison.lost, before.adopt, before.strike) == (3, False, False)
    last = against_shadow(vec(60), vec(57), z=2.0, margin=2, last=True, last_z=1.0)  # 3 > 1 * sqrt(3): the shadow
    assert (last.adopt, last.strike) == (True, False)


def test_at_the_last_round_a_gap_within_last_z_standard_deviations_keeps_the_federated_weights():
    """4 lost, 2 gained (the split's shadow 2 prompts better): 2 <= 1 * sqrt(6) keeps the learner at last_z = 1;
    a lower bar takes the shadow."""
    shadow = [True] * 4 + [False] * 2 + [True] * 10
    current = [False] * 4 + [True] * 2 + [True] * 10
    kept = against_shadow(shadow, current, z=2.5, margin=2, last=True, last_z=1.0)
    assert (kept.comparison.lost, kept.comparison.gained, kept.adopt) == (4, 2, False)
    assert against_shadow(shadow, current, z=2.5, margin=2, last=True, last_z=0.5).adopt  # 2 > 0.5 * sqrt(6)


def test_a_tie_or_a_better_learner_keeps_its_weights_even_at_the_last_round():
    shadow, current = [True, True, False, False], [False, True, True, False]  # 1 lost, 1 gained
    tie = against_shadow(shadow, current, z=2.0, margin=0, last=True, last_z=1.0)
    assert (tie.comparison.lost, tie.comparison.gained, tie.adopt) == (1, 1, False)
    assert not against_shadow(vec(50), vec(70), z=2.0, margin=2, last=True, last_z=1.0).adopt


def test_the_counterfactual_is_due_every_period_and_at_the_last_round():
    assert [t for t in range(1, 11) if due(t, 10, 4)] == [4, 8, 10]


def test_a_slow_climb_is_blamed_on_every_source_since_the_shadow_not_since_the_reference():
    """The learner keeps improving (every validation a new reference, so the guard alone never fires) but falls
    behind its shadow: the adoption strikes every foreign source trained since the start."""
    g = OutcomeGuard(P)
    g.judge(0, vec(40))
    for t, (src, right) in enumerate((("globex", 42), ("initech", 44), ("globex", 46)), start=1):
        g.trained([src])
        assert g.judge(t, vec(right)).new_reference and g.implicated == set()
    assert g.since_shadow == {"globex", "initech"}
    assert against_shadow(vec(60), vec(46), z=P.z, margin=P.margin, last=False, last_z=1.0).strike  # 14 > 2 * sqrt(14)
    assert g.adopt(3, vec(60), strike=True) == {"globex": 7, "initech": 7}  # round 3 + probation 4
    assert g.reference == vec(60) and g.since_shadow == set() and g.strikes == {"globex": 1, "initech": 1}
    g.trained(["hooli"])
    assert g.adopt(4, vec(61), strike=False) == {} and g.strikes == {"globex": 1, "initech": 1}
    assert g.reference == vec(61) and g.since_shadow == set()


def test_a_rollback_and_an_adoption_in_one_validation_strike_once():
    g = OutcomeGuard(P)
    g.judge(0, vec(50))
    g.trained(["globex", "initech"])
    g.judge(2, vec(52))  # initech and globex trained before the reference: both stay blamed by the counterfactual
    g.trained(["globex"])
    assert g.judge(4, vec(20)).quarantined == {"globex": 8}  # the rollback strikes globex: out through 4 + 4
    assert g.adopt(4, vec(70), strike=True) == {"initech": 8}  # globex is not struck twice for one event
    assert g.strikes == {"globex": 1, "initech": 1}


def test_an_attacker_that_keeps_the_learner_within_the_shadows_slack_is_bounded_by_the_shadow():
    """The adaptive attacker of shadow_gate: it knows the shadow's accuracy and each window pulls the learner to 3
    below it (inside the slack: 3 <= max(2 * sqrt(3), 2)), far below the learner's best (60) at first. No verdict
    rolls back or strikes, and the counterfactual leaves the weights until the last round, whose choice takes the
    shadow's (3 > last_z * sqrt(3)). The bound: never more than the slack below training alone, and at the end the
    shadow's weights; its cost: no strike names the attacker, only outcome/<source>/spared."""
    g = OutcomeGuard(P)
    g.judge(0, vec(60))
    spared = []
    for t, shadow in zip(range(2, 24, 2), range(46, 80, 3)):
        g.trained(["acme"])
        verdict = g.judge(t, vec(shadow - 3), shadow=vec(shadow))
        assert not verdict.rollback and verdict.quarantined == {}
        spared += [t] if verdict.spared else []
        cf = against_shadow(vec(shadow), vec(shadow - 3), z=P.z, margin=P.margin, last=t == 22, last_z=1.0)
        assert cf.adopt == (t == 22) and not cf.strike
    assert spared == [2, 4, 6, 8, 10] and g.strikes == {} and g.reference == vec(73)  # 58 is within 60's slack


def test_a_rollback_keeps_the_sources_since_the_shadow():
    """A rollback returns to the best reference, which may itself carry foreign training: the sources stay
    blamed by the counterfactual."""
    g = OutcomeGuard(P)
    g.judge(0, vec(50))
    g.trained(["globex"])
    g.judge(2, vec(52))
    g.trained(["globex"])
    assert g.judge(4, vec(20)).rollback and g.implicated == set() and g.since_shadow == {"globex"}


# ------------------------------------------------------------------------------------------------ the worker


ORGS = [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}, {"id": "globex", "model": {"zoo": "micro-qwen-char"}}]


def _cfg(**guard):
    return load_config({
        "name": "shadow", "seed": 0, "orgs": ORGS, "algorithm": {"name": "hacpo"},
        "trainer": {"lr": 1e-2, "minibatch_size": 64, "micro_batch_size": 32, "selection": {"rule": "all"},
                    "likelihood_screen": {"enabled": False},
                    "outcome_guard": {"enabled": True, "every": 1, "val_size": 8, "probation": 2, **guard}},
        "generation": {"num_samples": 4, "max_new_tokens": 12, "eval_max_new_tokens": 12},
        "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
        "federation": {"rounds": 2, "prompts_per_round": 4, "eval_every": 0, "min_orgs": 1},
    })


def _first(params) -> torch.Tensor:
    return next(iter(params.values())).clone()


def test_the_shadow_trains_on_own_rows_and_is_adopted_when_the_learner_falls_behind(tmp_path, monkeypatch):
    cfg = _cfg(z=1.0, final_size=8)  # the last round's choice on the final split: a tie there (below)
    workers = {o: build_worker(cfg, o, run_dir=tmp_path) for o in ("acme", "globex")}
    acme = workers["acme"]
    half, full = [True] * 4 + [False] * 4, [True] * 8
    # initial, round 1 learner (no worse: new reference), round 1 shadow (4 lost: 4 > max(1 * sqrt(4), 2)), then
    # round 2 learner and shadow alike
    answers = iter([half, half, full, full, full])
    seen: list[torch.Tensor] = []

    def validate(engine, context, prompts=None):
        if prompts is not None:  # the final split at the last round: learner and shadow alike, no adoption
            return [True] * len(prompts)
        seen.append(next(acme.model.parameters()).detach().clone())
        return next(answers)

    monkeypatch.setattr(acme.outcome, "validate", validate)
    # rewards that vary within a group (the untrained micro model gets none right), the same for every verifier
    monkeypatch.setattr(type(acme.task), "verify", lambda self, text, reference: float(len(text) % 2))
    initial = next(acme.model.parameters()).detach().clone()
    coord = Coordinator(cfg, InProcessTransport(workers), tmp_path)
    m1 = coord.run_round(1).metrics
    shadow = acme.outcome.shadow.saved[0]
    assert m1["acme/outcome/shadow_rows"] == 16.0 and m1["acme/train/num_cross"] == 16  # 4 prompts x 4 own samples
    assert torch.equal(seen[2], _first(shadow)) and not torch.equal(seen[1], seen[2])  # its own weights validated
    assert not torch.equal(_first(shadow), initial)  # it trained
    assert m1["acme/outcome/cf_lost"] == 4.0 and m1["acme/outcome/cf_gained"] == 0.0
    assert m1["acme/outcome/adopted"] == 1.0 and m1["acme/outcome/shadow_accuracy"] == 1.0
    assert m1["acme/outcome/globex/blamed_counterfactual"] == 1.0
    assert m1["acme/outcome/globex/quarantined_until"] == 3.0  # round 1 + probation 2
    assert torch.equal(next(acme.model.parameters()), _first(shadow))  # the learner took the shadow's weights
    assert m1["acme/outcome/shadow_importance_mean"] == pytest.approx(1.0, abs=1e-4)  # the same weights then
    m2 = coord.run_round(2).metrics
    assert m2["acme/outcome/shadow_rows"] == 16.0  # the learner's own rows, importance weighted
    assert 0.0 < m2["acme/outcome/shadow_importance_mean"] <= 2.0  # truncated at importance_clip
    assert m2["acme/outcome/globex/quarantined"] == 1.0 and m2.get("acme/train/num_cross", 0.0) == 0.0
    assert m2["acme/outcome/adopted"] == 0.0 and m2["acme/outcome/globex/strikes"] == 1.0


@pytest.mark.parametrize("shadow_right", [0, 8])
def test_a_regression_validates_the_shadow_once_and_acts_only_below_it(tmp_path, monkeypatch, shadow_right):
    # round 1: the learner answers none of 8 against its reference's 8 (regressed: 8 > 2.5 * sqrt(8)); the shadow,
    # validated for the gate and reused by the counterfactual, answers none too (spared) or all 8 (rolled back and
    # struck)
    cfg = _cfg()  # round 1 of 2: no last round's choice
    workers = {o: build_worker(cfg, o, run_dir=tmp_path) for o in ("acme", "globex")}
    acme = workers["acme"]
    answers = iter([[True] * 8, [False] * 8, [True] * shadow_right + [False] * (8 - shadow_right)])
    calls = []

    def validate(engine, context):
        calls.append(1)
        return next(answers)

    monkeypatch.setattr(acme.outcome, "validate", validate)
    # rewards that vary within a group (the untrained micro model gets none right), so the update moves the weights
    monkeypatch.setattr(type(acme.task), "verify", lambda self, text, reference: float(len(text) % 2))
    initial = [p.detach().clone() for p in acme.model.parameters()]
    m1 = Coordinator(cfg, InProcessTransport(workers), tmp_path).run_round(1).metrics
    assert len(calls) == 3  # the reference, the learner, the shadow once
    assert m1["acme/train/num_cross"] == 16  # it trained on globex
    assert m1["acme/outcome/shadow_accuracy"] == shadow_right / 8
    rolled_back = all(torch.equal(a, b) for a, b in zip(initial, acme.model.parameters()))
    if shadow_right == 0:  # as bad as training alone: nothing happens
        assert m1["acme/outcome/spared"] == 1.0 and m1["acme/outcome/globex/spared"] == 1.0
        assert m1["acme/outcome/rollback"] == 0.0 and not rolled_back and acme.outcome.guard.strikes == {}
        assert "acme/outcome/globex/quarantined_until" not in m1 and m1["acme/outcome/adopted"] == 0.0
    else:
        assert m1["acme/outcome/spared"] == 0.0 and "acme/outcome/globex/spared" not in m1
        assert m1["acme/outcome/rollback"] == 1.0 and rolled_back
        assert m1["acme/outcome/globex/quarantined_until"] == 3.0 and acme.outcome.guard.strikes == {"globex": 1}


def test_the_last_round_chooses_on_the_final_split(tmp_path, monkeypatch):
    # learner and shadow tie on the validation split all run; on the final split the learner is 4 of 8 behind, which
    # is more than last_z = 1 standard deviation (4 > sqrt(4)): adopted (the choice on the validation split, which
    # kept it, was measured and removed after c30f784)
    final_size = 8
    cfg = _cfg(every=4, final_size=final_size)
    workers = {o: build_worker(cfg, o, run_dir=tmp_path) for o in ("acme", "globex")}
    acme = workers["acme"].outcome
    assert len(acme.final) == final_size
    assert not {p.prompt_id for p in acme.final} & {p.prompt_id for p in acme.prompts}  # apart from validation
    finals = iter([[True] * 4 + [False] * 4, [True] * 8])  # the learner's, then the shadow's

    def validate(engine, context, prompts=None):
        return next(finals) if prompts is acme.final else [True] * len(acme.prompts)

    monkeypatch.setattr(acme, "validate", validate)
    coord = Coordinator(cfg, InProcessTransport(workers), tmp_path)
    m1, m2 = coord.run_round(1).metrics, coord.run_round(2).metrics
    assert "acme/outcome/final_accuracy" not in m1
    assert "acme/outcome/shadow_accuracy" not in m2  # the last round's choice reads the final split alone
    assert m2["acme/outcome/final_accuracy"] == 0.5 and m2["acme/outcome/shadow_final_accuracy"] == 1.0
    assert m2["acme/outcome/cf_lost"] == 4.0 and m2["acme/outcome/adopted"] == 1.0
    assert not any(k.endswith("blamed_counterfactual") for k in m2)  # the last round's choice: no strike


def test_the_counterfactual_off_keeps_no_shadow(tmp_path):
    cfg = _cfg(counterfactual=False)
    workers = {o: build_worker(cfg, o, run_dir=tmp_path) for o in ("acme", "globex")}
    m = Coordinator(cfg, InProcessTransport(workers), tmp_path).run_round(1).metrics
    assert workers["acme"].outcome.shadow is None
    assert "acme/outcome/shadow_rows" not in m and "acme/outcome/adopted" not in m
    assert load_config({"orgs": ORGS}).trainer.outcome_guard.counterfactual  # on with the guard, by default


def test_every_key_the_guard_and_its_shadow_log_is_documented(tmp_path):
    cfg = _cfg()
    workers = {o: build_worker(cfg, o, run_dir=tmp_path) for o in ("acme", "globex")}
    with RunLogger(tmp_path, tensorboard=False) as logger:
        Coordinator(cfg, InProcessTransport(workers), tmp_path, logger=logger).run()
    keys = {k for rec in read_metrics(tmp_path) for k in rec}
    assert {"acme/outcome/adopted", "acme/outcome/shadow_importance_mean", "acme/time/outcome_shadow"} <= keys
    assert not any(k.endswith(("/outcome/shadow_reward", "/time/outcome_shadow_gen")) for k in keys)  # no sampling
    assert undocumented(keys, [key_pattern(k) for k in documented_keys()]) == []
