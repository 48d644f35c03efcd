"""The learner's outcome guard (hacrl_fed/algorithm/outcome_guard.py, hacrl_fed/worker/outcome.py): the paired
regression test, the verdicts and quarantines as an adaptive attacker would probe them, and the worker's rollback
and quarantine counters over a short in-process run of micro agents."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from hacrl_fed.algorithm.outcome_guard import OutcomeGuard, OutcomeParams, compare
from hacrl_fed.config import load_config
from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.worker import build_worker
from hacrl_fed.worker.stash import Stash

P = OutcomeParams(every=2, z=2.0, margin=2, probation=4, backoff=2.0)


def vec(right: int, n: int = 100) -> list[bool]:
    return [i < right for i in range(n)]


# ------------------------------------------------------------------------------------------------ pure logic


def test_the_paired_test_counts_discordant_prompts():
    ref = [True, True, True, False, False, True]
    cur = [False, True, False, True, False, False]
    cmp = compare(ref, cur, z=2.0, margin=0)
    assert (cmp.lost, cmp.gained) == (3, 1)
    assert not cmp.regressed  # 3 - 1 = 2 <= 2 * sqrt(4) = 4
    assert compare(vec(60), vec(40), 2.0, 2).regressed  # 20 lost, 0 gained: 20 > 2 * sqrt(20) = 8.9
    assert not compare(vec(60), vec(57), 2.0, 2).regressed  # 3 > max(3.46, 2) is false
    assert not compare(vec(60), vec(60), 2.0, 0).regressed and compare(vec(60), vec(60), 2.0, 0).not_worse
    with pytest.raises(ValueError, match="reference has 100 prompts, current 99"):
        compare(vec(1), vec(1, 99), 2.0, 0)


def test_a_regression_rolls_back_and_quarantines_the_sources_trained_since():
    g = OutcomeGuard(P)
    first = g.judge(0, vec(50))
    assert first.new_reference and not first.rollback and g.reference == vec(50)
    g.trained(["globex"])
    better = g.judge(2, vec(55))
    assert better.new_reference and g.reference == vec(55) and g.implicated == set()
    g.trained(["initech"])
    within = g.judge(4, vec(53))  # 2 lost: within the slack; the reference stays the best, initech stays implicated
    assert not within.new_reference and not within.rollback and g.reference == vec(55)
    assert g.implicated == {"initech"}
    g.trained(["globex"])
    worse = g.judge(6, vec(30))
    assert worse.rollback and not worse.new_reference and worse.quarantined == {"globex": 10, "initech": 10}
    assert g.reference == vec(55) and g.strikes == {"globex": 1, "initech": 1} and g.implicated == set()
    assert not g.admits("globex", 10) and g.admits("globex", 11)


def test_a_regression_the_shadow_matches_does_nothing_and_one_below_it_rolls_back_and_strikes():
    """With a shadow, a regression after foreign rows acts only when the weights are also significantly worse than the
    shadow's (the counterfactual's test); otherwise the reference and the implicated sources stay."""
    g = OutcomeGuard(P)
    g.judge(0, vec(60))
    g.trained(["globex", "initech"])
    assert g.needs_shadow(vec(30)) and not g.needs_shadow(vec(58))  # a regression, and one within the slack
    dip = g.judge(2, vec(30), shadow=vec(32))  # 2 below the shadow: within its slack, a learning dip
    assert not dip.rollback and not dip.new_reference and not dip.rebased and dip.quarantined == {}
    assert dip.spared == ("globex", "initech") and g.strikes == {} and g.implicated == {"globex", "initech"}
    assert g.reference == vec(60) and g.admits("globex", 3) and g.admits("initech", 3)
    g.trained(["globex"])
    harm = g.judge(4, vec(30), shadow=vec(55))  # 25 below the shadow too: back to the reference, both struck
    assert harm.rollback and harm.spared == () and harm.quarantined == {"globex": 8, "initech": 8}
    assert g.reference == vec(60) and g.implicated == set() and not g.needs_shadow(vec(30))


def test_without_a_shadow_every_regression_acts():
    g = OutcomeGuard(P)
    g.judge(0, vec(60))
    g.trained(["globex"])
    verdict = g.judge(2, vec(30), shadow=None)
    assert verdict.rollback and verdict.quarantined == {"globex": 6} and verdict.spared == ()


def test_a_source_on_trial_spared_by_the_gate_completes_its_trial():
    g = OutcomeGuard(P)
    g.judge(0, vec(60))
    g.trained(["globex"])
    g.judge(2, vec(30))  # no shadow: struck, left out through round 6
    assert g.admits("globex", 7) and g.trial == {"globex": 7}
    g.trained(["globex"])
    dip = g.judge(7, vec(30), shadow=vec(30))
    assert not dip.rollback and dip.spared == ("globex",) and g.strikes == {"globex": 1} and g.trial == {"globex": 7}
    g.trained(["globex"])
    end = g.judge(8, vec(31), shadow=vec(31))  # the trial's last round: spared again, which is no harm found
    assert not end.rollback and g.trial == {} and "globex" in g.passed and g.strikes == {"globex": 1}


def test_a_regression_on_the_learners_own_rows_alone_rebases():
    """No foreign row since the reference: training alone did it, not a member; no rollback, no strike."""
    g = OutcomeGuard(P)
    g.judge(0, vec(60))
    own = g.judge(4, vec(30))
    assert own.rebased and own.new_reference and not own.rollback and own.quarantined == {}
    assert g.reference == vec(30) and g.strikes == {}


def test_slow_harm_is_measured_against_the_same_reference():
    """An attacker that costs a little each window, never significant against the previous validation: the
    reference does not move down, so the sum is caught."""
    g = OutcomeGuard(P)
    g.judge(0, vec(60))
    verdicts = []
    for t, right in zip(range(2, 20, 2), (59, 58, 57, 56, 55)):
        g.trained(["globex"])
        verdicts.append(g.judge(t, vec(right)))
        assert not compare(vec(right + 1), vec(right), P.z, P.margin).regressed  # each step alone is noise
    assert [v.rollback for v in verdicts] == [False, False, False, False, True]
    assert g.strikes == {"globex": 1} and g.reference == vec(60)


def test_each_strike_multiplies_the_quarantine_so_alternating_attacks_are_few():
    """A source that doctors every time it is let back in (and is honest in between) causes at most
    1 + log2(rounds / probation) rollbacks, each caught in the first round of its trial."""
    g = OutcomeGuard(P)
    g.judge(0, vec(60))
    rollbacks, rounds, wasted = 0, 200, 0
    for t in range(1, rounds + 1):
        attacking = g.admits("globex", t)
        if attacking:
            g.trained(["globex"])
            wasted += 1
        if g.due(t, rounds):
            v = g.judge(t, vec(30 if attacking else 60))
            rollbacks += v.rollback
        else:
            assert not attacking  # an attacker is never let in unvalidated after its first strike
    assert g.strikes["globex"] == rollbacks and wasted == rollbacks
    assert rollbacks <= 1 + math.log2(rounds / P.probation)
    assert g.until["globex"] >= rounds - 1  # still out at the end


def test_an_attacker_that_waits_out_its_trial_is_caught_at_the_next_validation():
    g = OutcomeGuard(P)
    g.judge(0, vec(60))
    g.trained(["globex"])
    g.judge(2, vec(20))  # struck: out through round 6
    for t in (7, 8):  # its trial: honest, validated every round
        assert g.admits("globex", t) and g.due(t, 100)
        g.trained(["globex"])
        assert not g.judge(t, vec(60)).rollback
    assert g.passed == {"globex"} and g.trial == {} and not g.due(9, 100)
    g.trained(["globex"])  # round 9 doctored, unvalidated; round 10 is due
    assert g.due(10, 100) and g.judge(10, vec(25)).quarantined == {"globex": 18}  # second strike: 4 * 2 rounds


def test_a_source_with_strikes_keeps_the_slack_and_passes_its_trial():
    """The same within-slack loss on trial is no strike; the trial ends passed, and a significant
    regression still strikes it (twice the quarantine)."""
    g = OutcomeGuard(P)
    g.judge(0, vec(60))
    g.trained(["globex"])
    g.judge(2, vec(20))  # struck: out through round 6
    for t in (7, 8):
        assert g.admits("globex", t)
        g.trained(["globex"])
        assert not g.judge(t, vec(59)).rollback  # 1 lost: within the slack
    assert g.passed == {"globex"} and g.strikes == {"globex": 1} and g.reference == vec(60)
    g.trained(["globex"])
    assert g.judge(10, vec(40)).quarantined == {"globex": 18}


def test_readmitted_sources_go_on_trial_one_at_a_time():
    g = OutcomeGuard(P)
    g.judge(0, vec(60))
    g.trained(["globex", "initech"])
    g.judge(2, vec(20))  # both struck, out through round 6
    assert g.admits("globex", 7) and not g.admits("initech", 7)  # globex on trial, initech waits
    assert g.admits("hooli", 7)  # a source without strikes is always admitted
    g.trained(["globex", "hooli"])
    assert g.judge(7, vec(62)).new_reference and g.trial == {"globex": 7}  # one round is not a whole trial
    assert not g.admits("initech", 8) and g.admits("globex", 8)
    g.trained(["globex"])
    assert g.judge(8, vec(62)).new_reference and g.passed == {"globex"}
    assert g.admits("initech", 9) and g.admits("globex", 9)  # globex passed its trial, initech now on trial
    g.trained(["globex", "initech"])
    again = g.judge(9, vec(30))
    assert again.quarantined == {"globex": 17, "initech": 17}  # second strikes: 4 * 2 rounds


def test_validation_is_due_on_the_schedule_the_first_window_the_last_round_and_on_trial():
    g = OutcomeGuard(P)
    assert [t for t in range(1, 12) if g.due(t, 11)] == [1, 2, 4, 6, 8, 10, 11]


# ------------------------------------------------------------------------------------------------ the worker


ORGS = [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}, {"id": "globex", "model": {"zoo": "micro-qwen-char"}}]


def _cfg(**guard):
    return load_config({
        "name": "outcome", "seed": 0, "orgs": ORGS, "algorithm": {"name": "hacpo"},
        "trainer": {"lr": 1e-2, "minibatch_size": 64, "micro_batch_size": 32, "selection": {"rule": "all"},
                    "likelihood_screen": {"enabled": False},
                    "outcome_guard": {"enabled": True, "every": 1, "val_size": 8, "probation": 2, **guard}},
        "generation": {"num_samples": 4, "max_new_tokens": 12, "eval_max_new_tokens": 12},
        "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
        "federation": {"rounds": 3, "prompts_per_round": 4, "eval_every": 0, "min_orgs": 1},
    })


def test_a_regression_restores_the_weights_and_the_quarantine_names_the_source(tmp_path, monkeypatch):
    cfg = _cfg(counterfactual=False)  # the guard's own rollback; the counterfactual has its own test
    workers = {o: build_worker(cfg, o, run_dir=tmp_path) for o in ("acme", "globex")}
    acme = workers["acme"]
    real = acme.outcome.validate(acme.engine, acme.context)
    assert len(real) == 8 and all(isinstance(r, bool) for r in real)
    answers = iter([[True] * 8, [False] * 8, [True] * 8, [True] * 8])  # initial, round 1 (regressed), 2, 3
    monkeypatch.setattr(acme.outcome, "validate", lambda engine, context: next(answers))
    initial = [p.detach().clone() for p in acme.model.parameters()]
    coord = Coordinator(cfg, InProcessTransport(workers), tmp_path)
    m1 = coord.run_round(1).metrics
    assert m1["acme/outcome/reference_accuracy"] == 1.0 and m1["acme/outcome/val_accuracy"] == 0.0
    assert m1["acme/outcome/rollback"] == 1.0 and m1["acme/outcome/lost"] == 8.0
    assert m1["acme/outcome/globex/quarantined_until"] == 3.0  # round 1 + probation 2
    assert m1["acme/outcome/globex/quarantined"] == 0.0 and m1["acme/train/num_cross"] == 16  # it trained on them
    assert all(torch.equal(a, b) for a, b in zip(initial, acme.model.parameters()))  # rolled back
    assert "globex/outcome/rollback" in m1 and m1["globex/outcome/rollback"] == 0.0  # the other org's own guard
    m2 = coord.run_round(2).metrics
    assert m2["acme/outcome/globex/quarantined"] == 1.0 and m2["acme/outcome/globex/dropped_quarantine"] == 16
    assert m2["acme/outcome/globex/strikes"] == 1.0 and m2.get("acme/train/num_cross", 0.0) == 0.0
    assert m2["acme/trust/globex/accepted"] == 16 and m2["acme/outcome/new_reference"] == 1.0  # accepted, then left out
    m3 = coord.run_round(3).metrics
    assert m3["acme/outcome/globex/quarantined"] == 1.0  # through round 1 + 2


def test_the_guard_is_on_by_default_and_off_writes_nothing(tmp_path):
    default = load_config({"orgs": ORGS}).trainer.outcome_guard
    assert default.enabled and default.counterfactual and default.last_z == 1.0  # issue 27: the defaults
    cfg = _cfg(enabled=False)
    workers = {o: build_worker(cfg, o, run_dir=tmp_path) for o in ("acme", "globex")}
    assert workers["acme"].outcome is None
    m = Coordinator(cfg, InProcessTransport(workers), tmp_path).run_round(1).metrics
    assert not any("/outcome/" in k for k in m)


def test_the_guard_state_round_trips_through_plain_data():
    # what a checkpoint keeps (hacrl_fed.worker.routing): every field but the config's params, sets as sorted lists
    params = OutcomeParams(every=4, z=2.5, margin=2, probation=8, backoff=2.0)
    guard = OutcomeGuard(params, reference=[True, False, True], strikes={"b": 2}, until={"b": 30},
                         implicated={"c", "b"}, trial={"c": 12}, passed={"d"}, since_shadow={"b", "c"})
    state = guard.state()
    assert state["implicated"] == ["b", "c"] and state["since_shadow"] == ["b", "c"]
    other = OutcomeParams(every=2, z=1.0, margin=0, probation=2, backoff=1.0)
    back = OutcomeGuard.from_state(other, json.loads(json.dumps(state)))
    assert back == OutcomeGuard(other, **{f: getattr(guard, f) for f in ("reference", "strikes", "until", "implicated",
                                                                         "trial", "passed", "since_shadow")})
    assert OutcomeGuard.from_state(params, OutcomeGuard(params).state()) == OutcomeGuard(params)


def test_a_resumed_worker_continues_the_guard_of_its_checkpoint(tmp_path):
    # the guard's verdict state rides in the worker's checkpoint (trainer.pt, weights_only), its reference and
    # shadow as links to the guard's files (files/): the same bytes, not serialized again in trainer.pt
    cfg = load_config({**_cfg().model_dump(mode="json"), "federation": {
        "rounds": 2, "prompts_per_round": 4, "eval_every": 0, "min_orgs": 1, "checkpoint_every": 1}})
    workers = {o: build_worker(cfg, o, run_dir=tmp_path) for o in ("acme", "globex")}
    Coordinator(cfg, InProcessTransport(workers), tmp_path).run()
    before = workers["acme"].outcome.state_dict()
    assert before is not None and before["guard"]["reference"] is not None and before["shadow"] is not None
    saved = {part: Stash(before[part].path).get() for part in ("reference", "shadow")}
    saved = {part: ({k: v.clone() for k, v in p.items()}, s) for part, (p, s) in saved.items()}
    checkpoint = next((tmp_path / "orgs" / "acme" / "checkpoints").glob("*/round-000002"))
    for part in ("reference", "shadow"):  # linked in: one file, two names
        assert os.path.samefile(checkpoint / "files" / f"outcome_guard.{part}.pt", before[part].path)
    blob = torch.load(checkpoint / "trainer.pt", weights_only=True)["trainer"]["outcome_guard"]
    assert blob["reference"] == {"checkpoint_file": "files/outcome_guard.reference.pt"}
    for part in ("reference", "shadow"):  # the guard's files gone: the checkpoint holds its own names of them
        before[part].path.unlink()
    again = build_worker(cfg, "acme", run_dir=tmp_path)
    assert again.outcome.state_dict() is None and again.restore() == 2
    after = again.outcome.state_dict()
    assert after["run_id"] == before["run_id"] and after["guard"] == before["guard"]
    for part in ("reference", "shadow"):
        params, state = Stash(after[part].path).get()
        assert params.keys() == saved[part][0].keys()
        assert all(torch.equal(params[k], v) for k, v in saved[part][0].items())
        assert _same(state, saved[part][1])


def _same(a, b) -> bool:
    """Nested dicts / lists of tensors and plain values, equal exactly."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.parametrize("futility", [0.01, 0.0])
def test_a_check_reads_as_far_as_its_sequential_test_and_the_reference_answers_further(tmp_path, monkeypatch, futility):
    # 16 validation prompts in looks of 4, every answer right: the first look is futile (CP 0.0019 < 0.01); with
    # futility 0 the check reads all 16, and the reference (validated on its first look before round 1) answers the
    # other 12 from its file, one look at a time
    cfg = _cfg(counterfactual=False, val_size=16, look=4, futility=futility)
    workers = {o: build_worker(cfg, o, run_dir=tmp_path) for o in ("acme", "globex")}
    acme = workers["acme"]
    reads = []

    def validate(engine, context, prompts=None):
        prompts = acme.outcome.prompts if prompts is None else prompts
        reads.append(len(prompts))
        return [True] * len(prompts)

    monkeypatch.setattr(acme.outcome, "validate", validate)
    m1 = Coordinator(cfg, InProcessTransport(workers), tmp_path).run_round(1).metrics
    assert m1["acme/outcome/validated"] == 1.0 and m1["acme/outcome/new_reference"] == 1.0
    if futility:
        assert m1["acme/outcome/val_read"] == 4 and reads == [4, 4]  # the reference's look, the learner's
        assert len(acme.outcome.guard.reference) == 4
    else:
        assert m1["acme/outcome/val_read"] == 16 and reads == [4] + [4] * 7  # 4 looks + the reference's 3 more
        assert len(acme.outcome.guard.reference) == 16
