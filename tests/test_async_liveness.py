"""Deaths and rejoins in asynchronous rounds (hacrl_fed/coordinator/async_liveness.py, async_driver.py).

* the virtual clock's fault injection (the in-process ``VirtualClock``'s ``dies`` / ``rejoins``, a benchmark's
  ``federation.virtual_dies`` / ``virtual_rejoins``): the driver's schedule is
  async_schedule.simulate's for the same deaths and rejoins (steps, lost steps, batches, refusals, idle times);
  the fast org is never held back by the dead one; every (learner, foreign batch) pair is taken or counted;
* a step whose call fails (unreachable) kills the org; it is probed with Health on the reconnect policy and rejoins
  at the current round, on the virtual clock and on the wall clock (the probes hold no step); a part failing at the
  worker is no death; a worker that answers busy is not back yet; a rejoin's version is the worker's Health
  ``version`` when an integer within its bound, else refused and counted;
* the config refusals.
"""

from __future__ import annotations

import pytest
from helpers_fake_workers import FakeTask, FakeWorker, fake_config

from hacrl_fed.config import ConfigError
from hacrl_fed.coordinator.async_liveness import PROBE_S, Liveness, is_death, rejoin_version, reported_version
from hacrl_fed.coordinator.async_schedule import ScheduleSpec, simulate
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.coordinator.loop import Coordinator
from hacrl_fed.coordinator.virtual_clock import VirtualClock
from hacrl_fed.failures import NoWorker, PartFailed
from hacrl_fed.metrics import RunLogger, read_metrics

SKILLS = {"a": 0.25, "b": 0.5, "c": 0.75}


def _run(tmp_path, steps, *, staleness=1, rounds=8, workers=None, virtual_dies=None, virtual_rejoins=None):
    cfg = fake_config(tuple(SKILLS), rounds=rounds, staleness=staleness)
    workers = workers or {o: FakeWorker(o, s) for o, s in SKILLS.items()}
    clock = VirtualClock(steps, virtual_dies or {}, virtual_rejoins or {})
    co = Coordinator(cfg, InProcessTransport(workers, clock=clock), tmp_path, task=FakeTask())
    return co, workers, co.run()


def _taken_or_counted(drv, org):
    offered = [(t.source, t.round) for s in drv.steps if s.org == org for t in s.foreign]
    assert len(offered) == len(set(offered))  # at most once
    foreign = [tag for _, tag in drv.published if tag.source != org]
    assert len(offered) + sum(drv.refused[org].values()) == len(foreign)  # taken or counted, never dropped


SPECS = [  # (durations, K, dies, rejoins)
    ({"a": 1.0, "b": 4.0, "c": 1.5}, 1, {"b": 5.5}, {"b": 11.3}),  # the slow org dies mid-step, comes back
    ({"a": 1.0, "b": 4.0, "c": 1.5}, 2, {"c": 3.2}, {}),  # dies for good
    ({"a": 1.0, "b": 1.0, "c": 1.0}, 1, {"a": 2.0, "c": 2.5}, {"a": 4.0, "c": 9.7}),  # at a step's end; two
    ({"a": 1.0, "b": 3.0, "c": 1.0}, 1, {"b": 3.0}, {"b": 3.5}),  # at its start: nothing lost; back while others run
]


@pytest.mark.parametrize("steps,staleness,dies,rejoins", SPECS)
def test_deaths_and_rejoins_give_the_simulation_s_schedule(tmp_path, steps, staleness, dies, rejoins):
    co, workers, summary = _run(tmp_path, steps, staleness=staleness, virtual_dies=dies, virtual_rejoins=rejoins)
    drv, sim = co.async_driver, simulate(ScheduleSpec(steps, 8, staleness, None, dies, rejoins))
    assert drv.steps == sim.steps and drv.lost == sim.lost
    assert drv.published == sim.published
    assert {o: dict(c) for o, c in drv.refused.items()} == {o: dict(c) for o, c in sim.refused.items()}
    assert drv.idle == pytest.approx(sim.idle) and drv.finished == sim.finished
    assert summary.rounds_completed == 8
    for org in SKILLS:
        _taken_or_counted(drv, org)
        lost = [s for s in drv.lost if s.org == org]  # a lost step never reached the worker
        assert len(workers[org].train_requests) == len([s for s in drv.steps if s.org == org and s.own]) - len(
            [s for s in lost if s.own])


def test_a_dead_org_never_holds_the_fast_one_back_and_rejoins_at_the_current_round(tmp_path):
    """b (4x slower) dies at 5.5 in its step planning round 2 and is back at 11.3: while dead a steps back to back
    (its clock never waits on b); b rejoins planning floor + 1 (only generating), then trains on what is left."""
    steps = {"a": 1.0, "b": 4.0, "c": 1.0}
    co, workers, _ = _run(tmp_path, steps, rounds=12, virtual_dies={"b": 5.5}, virtual_rejoins={"b": 11.3})
    drv = co.async_driver
    assert [(s.org, s.round) for s in drv.lost] == [("b", 2)]
    a_steps = [s for s in drv.steps if s.org == "a"]
    # with b alive a waits on it (K = 1); dead, never
    gaps = [(prev.end, nxt.start) for prev, nxt in zip(a_steps, a_steps[1:]) if 5.5 <= prev.end <= 11.3]
    assert len(gaps) == 5 and all(end == start for end, start in gaps)  # a's steps from 5.5 to 11.5
    assert any(end < start for end, start in ((p.end, n.start) for p, n in zip(a_steps, a_steps[1:])) if end < 5.5)
    floor = min(max(t.round for w, t in drv.published if t.source == o and w <= 11.3) for o in ("a", "c"))
    b_after = [s for s in drv.steps if s.org == "b" and s.start >= 11.3]
    assert b_after[0].round == floor + 1 and b_after[0].own is None and not b_after[0].foreign  # only generates
    assert b_after[1].own is not None and b_after[1].foreign  # then trains with what it has not used
    assert drv.refused["b"]["beyond_window"] > 0  # the batches it missed while dead left the window
    assert workers["b"].trained_rounds > 0 and drv.finished["b"] > drv.finished["a"]
    for org in SKILLS:
        _taken_or_counted(drv, org)


def test_an_org_dead_for_good_counts_learner_dead_and_the_others_finish(tmp_path):
    co, workers, summary = _run(tmp_path, {"a": 1.0, "b": 1.0, "c": 1.0}, virtual_dies={"c": 2.5})
    drv = co.async_driver
    assert summary.rounds_completed == 8 and set(drv.finished) == {"a", "b"}
    published_by_others = len([t for _, t in drv.published if t.source != "c"])
    assert drv.refused["c"]["learner_dead"] == published_by_others - len([t for s in drv.steps if s.org == "c"
                                                                          for t in s.foreign])
    assert workers["a"].trained_rounds == workers["b"].trained_rounds == 8
    for org in SKILLS:
        _taken_or_counted(drv, org)


class Unplugged(FakeWorker):
    """A fake worker whose step calls number ``down`` (1-based) fail as unreachable, and whose health fails the
    first ``deaf`` times it is asked after that."""

    def __init__(self, org_id, skill, *, down, deaf):
        super().__init__(org_id, skill)
        self.calls, self.down, self.deaf, self.probes = 0, set(down), deaf, 0

    def step(self, request):
        self.calls += 1
        if self.calls in self.down:
            raise NoWorker(f"{self.org_id} unplugged")
        return super().step(request)

    def health(self):
        if self.calls < min(self.down):
            return super().health()  # the challenge asked at the run's start
        self.probes += 1
        if self.probes <= self.deaf:
            raise ConnectionError("still down")
        return super().health()


def test_a_failed_call_kills_the_org_and_a_health_probe_brings_it_back(tmp_path):
    workers = {o: FakeWorker(o, s) for o, s in SKILLS.items()}
    workers["b"] = Unplugged("b", SKILLS["b"], down={3}, deaf=1)
    co, _, summary = _run(tmp_path, {"a": 1.0, "b": 1.0, "c": 1.0}, workers=workers)
    drv = co.async_driver
    assert [(s.org, s.round) for s in drv.lost] == [("b", 3)]  # its third step's call failed at 3.0
    assert workers["b"].probes == 2  # at 3.0 + PROBE_S (still down), then PROBE_S later: back
    b_back = [s for s in drv.steps if s.org == "b" and s.start > 3.0]
    assert b_back[0].start == pytest.approx(3.0 + 2 * PROBE_S) and b_back[0].own is None
    assert b_back[0].round == 1 + min(max(t.round for w, t in drv.published if t.source == o and w <= b_back[0].start)
                                      for o in ("a", "c"))
    assert summary.rounds_completed == 8 and set(drv.finished) == set(SKILLS)
    for org in SKILLS:
        _taken_or_counted(drv, org)


def test_what_is_a_death():
    assert is_death(NoWorker("x")) and is_death(ConnectionError("reset")) and is_death(TimeoutError("late"))
    assert not is_death(RuntimeError("boom")) and not is_death(PartFailed("[stale_round] x"))
    assert not is_death(None) and not is_death("a reply")


def test_a_reported_version_is_an_integer_within_its_bound_or_refused():
    assert reported_version(None, 3) is None and reported_version({"status": "ok"}, 3) is None  # none reported
    assert reported_version({"version": "0"}, 3) == 0 and reported_version({"version": "3"}, 3) == 3
    for hostile in ("4", "-1", "+1", " 1", "1_0", "1.0", "1e3", "", "٣", "9" * 19, 3, None.__class__):
        with pytest.raises(ValueError, match="version"):
            reported_version({"version": hostile}, 3)
    metrics = {}  # coordinator's count 5, two lost steps that carried a train request: [0, 7]
    assert rejoin_version("b", {"version": "7"}, 5, 2, metrics) == 7 and metrics == {"async/b/version_adopted": 7.0}
    assert rejoin_version("b", {"version": "8"}, 5, 2, metrics) == 5 and metrics["async/b/bad_version_report"] == 1
    assert rejoin_version("b", {"version": "x"}, 5, 2, metrics) == 5 and metrics["async/b/bad_version_report"] == 2
    assert rejoin_version("b", None, 5, 2, metrics) == 5 and len(metrics) == 2  # no reply: nothing to say


class Counting(FakeWorker):
    """A fake worker whose Health reports its count of updates (its train requests), as the policy worker does."""

    def health(self):
        return {**super().health(), "version": str(len(self.train_requests))}


def test_a_virtual_rejoin_asks_health_and_takes_the_worker_s_count(tmp_path):
    """b (4 s a step) dies at 5.5 in its second step (it would train round 1: never sent, so the worker's count and
    the coordinator's are 0, the bound 0 + 1) and is back at 11.3: asked Health then, its 0 is adopted."""
    workers = {o: Counting(o, s) for o, s in SKILLS.items()}
    cfg = fake_config(tuple(SKILLS), rounds=12, staleness=1)
    clock = VirtualClock({"a": 1.0, "b": 4.0, "c": 1.0}, {"b": 5.5}, {"b": 11.3})
    with RunLogger(tmp_path, tensorboard=False) as log:
        co = Coordinator(cfg, InProcessTransport(workers, clock=clock), tmp_path, task=FakeTask())
        co.logger = log
        co.run()
    [rejoin] = [r for r in read_metrics(tmp_path) if "async/b/rejoined_at" in r]
    assert rejoin["async/b/version_adopted"] == 0 and "async/b/bad_version_report" not in rejoin
    assert co.async_driver.orgs["b"].version == len(workers["b"].train_requests) > 0


def test_liveness_probes_on_its_schedule():
    class Health:
        def __init__(self, *answers):
            self.answers = list(answers)

        def health(self, orgs, timeout_s):
            return {orgs[0]: self.answers.pop(0)}

    back = {"org_id": "b", "version": "4"}
    live = Liveness(Health(ConnectionError("down"), {"org_id": "b", "busy": "1"}, back), 5.0, {}, {}, wall=False)
    live.died("b", 1.0, probe=True)
    assert live.events(1.0 + PROBE_S - 0.1, ["b"]) == ([], [])  # not due yet
    assert live.events(1.0 + PROBE_S, ["b"]) == ([], [])  # due: down
    assert live.events(1.0 + 2 * PROBE_S, ["b"]) == ([], [])  # answers, busy (the call it lost still runs)
    assert live.reply("b") is None
    assert live.events(1.0 + 3 * PROBE_S, ["b"]) == ([], ["b"])  # back
    assert live.reply("b") == back and live.reply("b") is None  # its reply, for the driver, once
    faults = Liveness(Health({"org_id": "c", "version": "2"}), 5.0, {"c": 2.0}, {"c": 3.0}, wall=False)
    assert faults.dies_before("c", 1.0, 2.5) and not faults.dies_before("c", 2.0, 3.0)
    assert not faults.dies_before("c", 1.0, 2.0)  # the step completes first
    assert faults.next_fault(0.0) == [2.0] and faults.events(2.0, []) == (["c"], [])
    assert faults.events(3.0, ["c"]) == ([], ["c"]) and faults.next_fault(3.0) == []
    assert faults.reply("c") == {"org_id": "c", "version": "2"}  # a virtual rejoin asks Health too


def test_the_fault_fields_and_their_refusals():
    """The virtual clock is a benchmark's setting (issue 42): its checks name the field by its benchmark name, and a
    run config that names one is refused, naming it."""
    refusals = {
        "virtual_dies names orgs not in the run": (1, {"dies": {"zz": 1.0}}),
        "rejoins only after its virtual_dies": (1, {"dies": {"a": 2.0}, "rejoins": {"a": 2.0}}),
        "virtual_dies needs federation.staleness": (0, {"dies": {"a": 1.0}}),
        "finite and >= 0": (1, {"dies": {"a": -1.0}}),
        "virtual_step_s: every step duration must be finite and > 0": (1, {"step_s": {"a": 0.0}}),
        "virtual_step_s names orgs not in the run": (1, {"step_s": {"zz": 1.0}}),
    }
    for match, (staleness, fields) in refusals.items():
        with pytest.raises(ValueError, match=match):
            VirtualClock(**fields).check(SKILLS, staleness)
    with pytest.raises(ValueError, match="rejoins only after"):
        VirtualClock(rejoins={"a": 2.0}).check(SKILLS, 1)
    VirtualClock({"a": 2.0}, {"b": 1.0}, {"b": 3.0}).check(SKILLS, 1)
    for name in ("virtual_step_s", "virtual_dies", "virtual_rejoins"):
        with pytest.raises(ConfigError, match=f"federation: {name} is a benchmark-only setting"):
            fake_config(staleness=1, **{name: {"a": 2.0}})
    clock = VirtualClock.from_bench({"federation.virtual_step_s": {"a": 4}, "federation.virtual_dies": {"b": 2}})
    assert clock == VirtualClock({"a": 4.0}, {"b": 2.0}) and clock.duration("a") == 4.0 and clock.duration("c") == 1.0


@pytest.mark.slow
def test_on_the_wall_clock_a_dead_org_is_probed_off_the_round_and_rejoins(tmp_path):
    """b's third call fails (unreachable) and its first probe too: a and c run on without waiting (nothing holds a
    step), b's second probe PROBE_S later brings it back at the current round, and every pair is taken or counted."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from test_async_driver import _wall_transport

    workers = {o: FakeWorker(o, s) for o, s in SKILLS.items()}
    workers["b"] = Unplugged("b", SKILLS["b"], down={3}, deaf=1)
    delays = {"a": 0.05, "b": 0.05, "c": 0.05}
    wall = _wall_transport(workers, delays)
    pool = ThreadPoolExecutor(max_workers=3)

    def submit_step(org, request, timeout_s):  # as GrpcTransport: a failed call is the reply, not a raise
        def call():
            time.sleep(delays[org])
            try:
                return workers[org].step(request), delays[org]
            except Exception as err:
                return err, delays[org]

        return pool.submit(call)

    wall.submit_step = submit_step
    cfg = fake_config(tuple(SKILLS), rounds=150, staleness=1)  # >= 7.5 s: b is back (4 s) before the end
    co = Coordinator(cfg, wall, tmp_path, task=FakeTask())
    summary = co.run()
    pool.shutdown()
    wall.close()
    drv = co.async_driver
    assert drv.wall and summary.rounds_completed == 150 and set(drv.finished) == set(SKILLS)
    (lost,) = drv.lost
    assert (lost.org, lost.round) == ("b", 3) and workers["b"].probes == 2
    b_back = [s for s in drv.steps if s.org == "b" and s.start > lost.end][0]
    assert b_back.start - lost.end >= 2 * PROBE_S * 0.95 and b_back.own is None
    a_while_dead = [s for s in drv.steps if s.org == "a" and lost.end < s.start < b_back.start]
    assert len(a_while_dead) > 10  # a ran on while b was dead (0.05 s a step over 4 s)
    for org in SKILLS:
        _taken_or_counted(drv, org)
