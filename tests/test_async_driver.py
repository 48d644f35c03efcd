"""The asynchronous round driver (hacrl_fed/coordinator/async_driver.py) on the in-process transport.

* config: the fields, their defaults and the refusals naming the field;
* on fake workers (microseconds per step): the schedule is async_schedule.simulate's for the same spec, the fast org
  runs at most K rounds ahead of the slowest published round, every (learner, foreign batch) pair is taken once or
  refused with a counted reason, the train requests carry their tags and per-round capability table, two runs are
  equal;
* on tiny models (slow): K = 0 is today's loop bit for bit, and a K = 1 run trains with late foreign batches.
"""

from __future__ import annotations

from collections import Counter

import pytest

from helpers_fake_workers import FakeTask, FakeWorker, fake_config
from hacrl_fed.config import ConfigError, load_config
from hacrl_fed.coordinator.async_schedule import ScheduleSpec, simulate
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.coordinator.loop import Coordinator
from hacrl_fed.metrics import RunLogger, read_metrics
from hacrl_fed.types import TrainRequest
from hacrl_fed.wire import codec
from hacrl_fed.wire.codec import WireError

SKILLS = {"a": 0.25, "b": 0.5, "c": 0.75}


def _run(tmp_path, steps, *, staleness=1, window=None, rounds=6, skills=SKILLS, logger=False):
    fed = {"rounds": rounds, "staleness": staleness, "virtual_step_s": steps}
    if window is not None:
        fed["window"] = window
    cfg = fake_config(tuple(skills), **fed)
    workers = {o: FakeWorker(o, s) for o, s in skills.items()}
    co = Coordinator(cfg, InProcessTransport(workers), tmp_path, task=FakeTask())
    if logger:
        with RunLogger(tmp_path, tensorboard=False) as log:
            co.logger = log
            summary = co.run()
    else:
        summary = co.run()
    return co, workers, summary


# -- config ------------------------------------------------------------------------------------------------------


def test_the_config_fields_and_their_refusals():
    cfg = fake_config()
    assert (cfg.federation.staleness, cfg.federation.window, cfg.federation.effective_window) == (0, None, 1)
    cfg = fake_config(staleness=2, virtual_step_s={"a": 4.0})
    assert cfg.federation.effective_window == 3
    refusals = {
        "federation.staleness": {"staleness": -1},
        "federation.window": {"staleness": 1, "window": 0},
        "virtual_step_s": {"virtual_step_s": {"a": 0.0}},
        "names orgs not in the run": {"virtual_step_s": {"zz": 1.0}},
        "window=2 needs federation.staleness": {"window": 2},
        "needs federation.protocol: fused": {"staleness": 1, "protocol": "two_message"},
        "needs federation.min_orgs: 1": {"staleness": 1, "min_orgs": 2},
        "needs federation.transport: inprocess": {"staleness": 1, "transport": "grpc"},
    }
    for words, fed in refusals.items():
        with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")):
            fake_config(**fed)
    with pytest.raises(ConfigError, match=r"needs security\.signing: false"):
        fake_config(security={"signing": True}, staleness=1)
    with pytest.raises(ConfigError, match=r"needs trainer\.outcome_guard"):
        base = fake_config().model_dump()
        base["federation"]["staleness"] = 1
        base["trainer"]["outcome_guard"] = {"enabled": True}
        load_config(base)


def test_the_asynchronous_fields_do_not_travel():
    req = TrainRequest("r", 1, "a", (), (), {"a": 1.0}, round_capability={1: {"a": 1.0}})
    with pytest.raises(WireError, match="asynchronous fields"):
        codec.encode(req)
    plain = TrainRequest("r", 1, "a", (), (), {"a": 1.0})
    assert codec.decode("TrainRequest", codec.encode(plain)) == plain


# -- the schedule on fake workers --------------------------------------------------------------------------------


@pytest.mark.parametrize("staleness,window", [(1, None), (2, None), (1, 3), (3, 1)])
def test_the_schedule_is_the_simulation_s(tmp_path, staleness, window):
    steps = {"a": 1.0, "b": 4.0, "c": 1.5}
    co, _, summary = _run(tmp_path, steps, staleness=staleness, window=window)
    drv = co.async_driver
    sim = simulate(ScheduleSpec(steps, 6, staleness, window))
    assert drv.steps == sim.steps
    assert drv.published == sim.published
    assert {o: dict(c) for o, c in drv.refused.items()} == {o: dict(c) for o, c in sim.refused.items()}
    assert drv.idle == pytest.approx(sim.idle) and drv.finished == sim.finished
    assert summary.rounds_completed == 6


def test_the_fast_org_runs_at_most_k_rounds_ahead_and_uses_each_batch_once(tmp_path):
    k = 2
    co, workers, _ = _run(tmp_path, {"a": 1.0, "b": 4.0, "c": 1.0}, staleness=k, rounds=8)
    drv = co.async_driver
    published: dict[str, list[tuple[float, int]]] = {o: [] for o in SKILLS}
    for when, tag in drv.published:
        published[tag.source].append((when, tag.round))
    for step in drv.steps:  # when a step starts, every org has published round step.round - K - 1
        for org, pubs in published.items():
            assert step.round - k - 1 <= max([r for when, r in pubs if when <= step.start], default=0)
    assert max(s.round for s in drv.steps if s.org == "a" and s.start < 4.0) == k + 1  # ran ahead, by K at most
    for org, worker in workers.items():
        offered = Counter()
        for req in worker.train_requests:
            assert {(r.org_id, r.round) for r in req.foreign} == {(s, t) for s, t, _ in req.tags}
            assert set(req.round_capability) == {req.round, *(t for _, t, _ in req.tags)}
            assert all(req.round - t < drv.window for _, t, _ in req.tags)  # inside the window
            offered.update((s, t) for s, t, _ in req.tags)
        assert max(offered.values()) == 1  # at most once
        foreign = [tag for _, tag in drv.published if tag.source != org]
        assert len(offered) + sum(drv.refused[org].values()) == len(foreign)  # taken or counted
    assert drv.refused["a"]["beyond_window"] == 0  # K + 1 window: nothing ages out under the bound


def test_refusals_are_counted_per_learner_and_reason_in_the_metrics(tmp_path):
    co, _, _ = _run(tmp_path, {"a": 1.0, "b": 4.0, "c": 1.0}, staleness=2, window=1, rounds=6, logger=True)
    drv = co.async_driver
    assert drv.refused["a"]["beyond_window"] > 0
    records = read_metrics(tmp_path)
    logged = Counter()
    for rec in records:
        for key, value in rec.items():
            parts = key.split("/")
            if len(parts) == 4 and parts[0] == "round" and parts[2] == "refused":
                logged[parts[1], parts[3]] += value
    expected = Counter({(o, why): n for o, c in drv.refused.items() for why, n in c.items() if n})
    assert logged == expected
    assert [rec["round"] for rec in records] == list(range(0, 7))  # every round logged once, in order
    assert records[-1]["async/a/version"] == records[-1]["async/b/version"] == 6


def test_two_runs_are_equal(tmp_path):
    steps = {"a": 1.0, "b": 4.0, "c": 2.0}
    runs = [_run(tmp_path / str(i), steps, staleness=1, logger=True) for i in range(2)]
    assert runs[0][0].async_driver.steps == runs[1][0].async_driver.steps
    for org in SKILLS:
        assert [r.tags for r in runs[0][1][org].train_requests] == [r.tags for r in runs[1][1][org].train_requests]
    strip = [
        [{k: v for k, v in rec.items() if not k.startswith(("time/", "cpu/", "wall"))} for rec in read_metrics(tmp_path / str(i))]
        for i in range(2)
    ]
    assert strip[0] == strip[1]


def test_asynchronous_rounds_refuse_another_transport_and_a_resume(tmp_path):
    from hacrl_fed.config import BuildError

    cfg = fake_config(staleness=1)

    class Other(InProcessTransport):
        pass

    with pytest.raises(BuildError, match="resuming asynchronous rounds"):
        Coordinator(cfg, InProcessTransport({"a": FakeWorker("a")}), tmp_path, task=FakeTask(), resume=True)
    assert Other  # a subclass is still in process; another transport class is refused:
    from hacrl_fed.coordinator.transport import Transport

    class NotInProcess(Transport):
        def org_ids(self):
            return ["a", "b", "c"]

        def evaluate(self, requests, timeout_s):
            return {o: FakeWorker(o).evaluate(r) for o, r in requests.items()}

        def checkpoint(self, org_ids, round, timeout_s):
            return {}

        def step(self, requests, timeout_s):
            return {}

    with pytest.raises(BuildError, match="in-process transport only"):
        Coordinator(cfg, NotInProcess(), tmp_path / "x", task=FakeTask()).run()
