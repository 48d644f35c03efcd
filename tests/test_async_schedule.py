"""The staleness-bounded schedule on a virtual clock (hacrl_fed/coordinator/async_schedule.py)."""

import math
import random

import pytest

from hacrl_fed.coordinator.async_schedule import (
    HOLD,
    TAKE,
    BatchTag,
    ScheduleSpec,
    offer_verdict,
    simulate,
)

DURATIONS = {"acme": 1.0, "globex": 2.5, "initech": 0.7}


def _lockstep(durations, rounds):
    """Today's rounds: step t of every org starts when the slowest has finished step t - 1; it trains on every
    org's batch of round t - 1 (version t - 2) and plans round t (the step after the last round only trains)."""
    steps, start, orgs = [], 0.0, list(durations)
    for t in range(1, rounds + 2):
        for o in orgs:
            own = BatchTag(o, t - 1, t - 2) if t > 1 else None
            foreign = sorted(BatchTag(j, t - 1, t - 2) for j in orgs if j != o) if t > 1 else []
            steps.append((o, start, start + durations[o], t, max(t - 2, 0), own, foreign))
        start += max(durations.values())
    return steps


@pytest.mark.parametrize("rounds", [1, 4])
def test_k0_is_today_s_lock_step_schedule(rounds):
    out = simulate(ScheduleSpec(DURATIONS, rounds, staleness=0))
    got = [(s.org, s.start, s.end, s.round, s.version, s.own, sorted(s.foreign)) for s in out.steps]
    assert got == _lockstep(DURATIONS, rounds)
    assert all(not c for c in out.refused.values()) and not out.lost
    assert all(age == 0 for s in out.steps for age in s.ages())
    slowest = max(DURATIONS.values())
    assert out.finished == {o: rounds * slowest + d for o, d in DURATIONS.items()}
    assert out.idle["initech"] == pytest.approx(rounds * (slowest - 0.7))


def _random_spec(rng, faults):
    orgs = [f"o{i}" for i in range(rng.randint(2, 4))]
    durations = {o: rng.choice([0.5, 1.0, 1.5, 4.0]) * rng.uniform(0.9, 1.1) for o in orgs}
    k = rng.randint(0, 3)
    window = rng.choice([None, rng.randint(1, k + 2)])
    dies, rejoins = {}, {}
    if faults:
        victim = rng.choice(orgs)
        dies[victim] = rng.uniform(0.5, 10.0)
        if rng.random() < 0.6:
            rejoins[victim] = dies[victim] + rng.uniform(0.5, 10.0)
    return ScheduleSpec(durations, rng.randint(2, 8), k, window, dies, rejoins)


def _live(spec, org, t):
    died = spec.dies.get(org, math.inf)
    return not (died <= t < spec.rejoins.get(org, math.inf))


@pytest.mark.parametrize("faults", [False, True])
def test_properties_bound_window_at_most_once_accounting_determinism(faults):
    rng = random.Random(17 + faults)
    for _ in range(150):
        spec = _random_spec(rng, faults)
        out = simulate(spec)
        assert out == simulate(spec)  # deterministic
        window = spec.effective_window
        seen = set()
        for step in out.steps:  # every step started (the lost ones too)
            for tag in step.foreign:
                assert step.round - window <= tag.round <= step.round - 1  # inside the window
                assert (step.org, tag.source, tag.round) not in seen  # each batch at most once per learner
                seen.add((step.org, tag.source, tag.round))
                assert tag.source != step.org
        for org in spec.durations:  # every (learner, foreign batch) pair is taken or counted
            foreign = [tag for _, tag in out.published if tag.source != org]
            taken = sum(1 for s in out.steps if s.org == org for _ in s.foreign)
            assert taken + sum(out.refused[org].values()) == len(foreign)
        if not faults:
            _assert_bound(spec, out)


def _assert_bound(spec, out):
    """No step plans round t before every org has published round t - K - 1; every org plays every round; a batch
    of round r has version r - 1, so a foreign row's age is t - 1 - r, in 0 .. W - 1."""
    assert all(tag.version == tag.round - 1 for _, tag in out.published)
    assert all(0 <= age < spec.effective_window for s in out.steps for age in s.ages())
    for step in out.steps:
        need = step.round - spec.staleness - 1
        for org in spec.durations:
            if need >= 1:
                times = [t for t, tag in out.published if tag.source == org and tag.round == need]
                assert times and times[0] <= step.start
    for org in spec.durations:
        assert [s.round for s in out.steps if s.org == org] == list(range(1, spec.rounds + 2))
    if spec.effective_window >= spec.staleness + 1:
        assert all(set(c) <= {"learner_finished"} for c in out.refused.values())


def test_a_faster_org_runs_ahead_and_finishes_sooner():
    durations = {"fast": 1.0, "slow": 4.0}
    sync = simulate(ScheduleSpec(durations, 8, staleness=0))
    for k in (1, 2, 4):
        out = simulate(ScheduleSpec(durations, 8, staleness=k))
        assert out.finished["fast"] < sync.finished["fast"] and out.finished["slow"] == sync.finished["slow"]
        ages = {age for s in out.steps for age in s.ages()}
        assert ages <= set(range(k + 1)) and k in ages  # the default window K + 1: ages 0..K, the slow org's at K
        assert out.idle["fast"] < sync.idle["fast"]
    unbounded = simulate(ScheduleSpec(durations, 8, staleness=8))
    assert unbounded.finished["fast"] == 9.0  # never waits


def test_a_dead_org_no_longer_holds_the_others_and_rejoins_at_the_current_round():
    spec = ScheduleSpec({"a": 1.0, "b": 1.0, "c": 1.0}, 10, staleness=0, dies={"c": 2.5}, rejoins={"c": 6.2})
    out = simulate(spec)
    assert [s.round for s in out.lost] == [3] and out.lost[0].org == "c"
    c_rounds = [s.round for s in out.steps if s.org == "c"]
    assert c_rounds[:4] == [1, 2, 3, 7]  # round 3 lost; at 6.2 the others have published round 6
    a_starts = [s.start for s in out.steps if s.org == "a"]
    assert a_starts[:7] == [float(t) for t in range(7)]  # while c is dead, a never waits for it
    assert a_starts[7] == pytest.approx(7.2)  # with K = 0 the rejoined c (round 7 done at 7.2) sets the pace
    assert all(tag.source != "c" or tag.round != 3 for s in out.steps for tag in s.foreign)  # c's lost batch
    dead = simulate(ScheduleSpec({"a": 1.0, "b": 1.0, "c": 1.0}, 10, staleness=0, dies={"c": 2.5}))
    assert [s.round for s in dead.steps if s.org == "a"] == list(range(1, 12)) and dead.finished.keys() == {"a", "b"}


def test_offers_are_checked_with_counted_reasons():
    issued = {("b", 3): 2, ("b", 4): 3, ("b", 6): 5}
    used = {("b", 3)}
    assert offer_verdict(BatchTag("b", 4, 3), 5, 2, used, issued) == TAKE
    assert offer_verdict(BatchTag("b", 3, 2), 5, 2, used, issued) == "already_used"  # a replay inside the window
    assert offer_verdict(BatchTag("b", 4, 3), 7, 2, set(), issued) == "beyond_window"
    assert offer_verdict(BatchTag("b", 5, 4), 7, 2, set(), issued) == "not_issued"  # a plan never issued
    assert offer_verdict(BatchTag("b", 4, 9), 5, 2, set(), issued) == "version_mismatch"
    assert offer_verdict(BatchTag("b", 6, 5), 5, 2, set(), issued) == HOLD  # a later round waits


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="durations"):
        ScheduleSpec({"a": 0.0}, 3)
    with pytest.raises(ValueError, match="staleness"):
        ScheduleSpec({"a": 1.0}, 3, staleness=-1)
    with pytest.raises(ValueError, match="unknown"):
        ScheduleSpec({"a": 1.0}, 3, dies={"b": 1.0})
    with pytest.raises(ValueError, match="rejoins"):
        ScheduleSpec({"a": 1.0}, 3, dies={"a": 2.0}, rejoins={"a": 1.0})
    with pytest.raises(ValueError, match="unknown"):
        ScheduleSpec({"a": 1.0}, 3, org_rounds={"b": 4})
    with pytest.raises(ValueError, match="org_rounds"):
        ScheduleSpec({"a": 1.0}, 3, org_rounds={"a": 0})


def test_a_fast_org_with_more_rounds_keeps_stepping_while_the_slow_one_runs():
    """a: 1 s a step, 16 rounds; b: 4 s, 4 rounds; no lead bound. a plans 1..16 at 0..15 and trains round 16 in its
    step at 16 (done at 17); b is never held: its 4 rounds and its train-only step end at 5 x 4 = 20. b takes a's
    batches of rounds 1..4 (one per step: a step planning t trains round t - 1 and takes rounds <= t - 1); a's
    rounds 5..16 come after b's last train, counted learner_finished."""
    out = simulate(ScheduleSpec({"a": 1.0, "b": 4.0}, 4, staleness=1000, org_rounds={"a": 16}))
    assert [(s.round, s.start) for s in out.steps if s.org == "a"] == [(t, t - 1.0) for t in range(1, 18)]
    assert [(s.round, s.start) for s in out.steps if s.org == "b"] == [(t, 4.0 * (t - 1)) for t in range(1, 6)]
    assert out.finished == {"a": 17.0, "b": 20.0}
    assert [tag.round for s in out.steps if s.org == "b" for tag in s.foreign] == [1, 2, 3, 4]
    assert sorted(tag.round for s in out.steps if s.org == "a" for tag in s.foreign) == [1, 2, 3, 4]
    assert out.refused == {"a": {}, "b": {"learner_finished": 12}}


def test_an_org_that_published_its_last_round_no_longer_holds_the_bound():
    """K = 1, a (1 s) runs 8 rounds, b (4 s) 4: a plans t once b published t - 2 (b publishes round r at 4r): 3 at
    4, 4 at 8, 5 at 12, 6 at 16; b's round 4 is its last, so from 16 a is no longer bound (7 at 17, 8 at 18, its
    train-only step at 19): with b still counting while it trains round 4, a would wait for b's end (20)."""
    out = simulate(ScheduleSpec({"a": 1.0, "b": 4.0}, 4, staleness=1, org_rounds={"a": 8}))
    starts = [s.start for s in out.steps if s.org == "a"]
    assert starts == [0.0, 1.0, 4.0, 8.0, 12.0, 16.0, 17.0, 18.0, 19.0]
    assert out.finished == {"a": 20.0, "b": 20.0}
    assert out.refused == {"a": {}, "b": {"learner_finished": 4}}  # a's rounds 5..8


@pytest.mark.parametrize("f", [2.0, 4.0])
def test_the_bound_caps_the_lead_not_the_pace(f):
    """One org f times slower, R rounds: the fast orgs finish at max((R - K) f d, R d) + d (lock-step: R f d + d),
    the slow org as in lock-step (docs/ALGORITHM.md "What the bound implies for clock time")."""
    rounds = 10
    for k in range(0, rounds):
        out = simulate(ScheduleSpec({"a": 1.0, "b": 1.0, "slow": f}, rounds, staleness=k))
        assert out.finished["a"] == out.finished["b"] == max((rounds - k) * f, rounds) + 1.0
        assert out.finished["slow"] == rounds * f + f


@pytest.mark.parametrize("orgs", [("acme", "globex"), ("acme", "globex", "initech")])
def test_at_k1_what_each_step_trains_on_does_not_depend_on_how_much_slower_the_slow_org_is(orgs):
    """K = 1, one org f times slower: for every f >= 2 each org's steps carry the same own and foreign batches (so
    the same weights; the matrix's `async2_k1` and `async4_k1` cells have equal curves), only the clock differs. At
    equal speeds (f = 1: lock-step) every foreign batch is of the round before; at any f > 1 the fast org's are one
    round older (it ran ahead by K) and the data differ."""

    def data(f):
        out = simulate(ScheduleSpec({o: (f if o == "acme" else 1.0) for o in orgs}, 12, staleness=1))
        return sorted((s.org, s.round, s.version, s.own, tuple(sorted(s.foreign))) for s in out.steps)

    assert data(1.1) == data(1.5) == data(2.0) == data(3.0) == data(4.0) == data(16.0)
    assert data(1.0) != data(1.1)
