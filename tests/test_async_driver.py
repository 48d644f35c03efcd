"""The asynchronous round driver (hacrl_fed/coordinator/async_driver.py) on the in-process transport.

* config: the fields, their defaults and the refusals naming the field;
* on fake workers (microseconds per step): the schedule is async_schedule.simulate's for the same spec, the fast org
  runs at most K rounds ahead of the slowest published round, every (learner, foreign batch) pair is taken once or
  refused with a counted reason, the train requests carry their tags and per-round capability table, two runs are
  equal;
* on tiny models (slow): K = 0 is today's loop bit for bit, and a K = 1 run trains with late foreign batches;
* signing: batches travel verbatim with their signed versions; a forged version is refused; a rejoin after a lost
  step the worker did finish (or a fresh restart) adopts the worker's own count from its Health, so its batches are
  taken, where without a plausible report they are refused version_mismatch (a bad report counted).
"""

from __future__ import annotations

from collections import Counter

import pytest
from helpers_fake_workers import FakeTask, FakeWorker, fake_config

from hacrl_fed.config import ConfigError, load_config
from hacrl_fed.coordinator.async_schedule import ScheduleSpec, simulate
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.coordinator.loop import Coordinator
from hacrl_fed.coordinator.virtual_clock import VirtualClock
from hacrl_fed.metrics import RunLogger, read_metrics
from hacrl_fed.wire import codec
from hacrl_fed.wire.bounds import worker_limits

SKILLS = {"a": 0.25, "b": 0.5, "c": 0.75}


def _run(tmp_path, steps, *, staleness=1, window=None, rounds=6, skills=SKILLS, logger=False, org_rounds=None):
    fed = {"rounds": rounds, "staleness": staleness}
    if window is not None:
        fed["window"] = window
    if org_rounds is not None:
        fed["org_rounds"] = org_rounds
    cfg = fake_config(tuple(skills), **fed)
    workers = {o: FakeWorker(o, s) for o, s in skills.items()}
    co = Coordinator(cfg, InProcessTransport(workers, clock=VirtualClock(steps)), tmp_path, task=FakeTask())
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
    cfg = fake_config(staleness=2)
    assert cfg.federation.effective_window == 3
    refusals = {
        "federation.staleness": {"staleness": -1},
        "federation.window": {"staleness": 1, "window": 0},
        # the virtual clock is a benchmark's setting since issue 42 (tests/test_virtual_clock.py)
        "federation: virtual_step_s is a benchmark-only setting": {"virtual_step_s": {"a": 2.0}},
        "window=2 needs federation.staleness": {"window": 2},
        "needs federation.protocol: fused": {"staleness": 1, "protocol": "two_message"},
        "needs federation.min_orgs: 1": {"staleness": 1, "min_orgs": 2},
        "federation.org_rounds needs federation.staleness >= 1": {"org_rounds": {"a": 8}},
        "org_rounds names orgs not in the run": {"staleness": 1, "org_rounds": {"zz": 8}},
        "org_rounds": {"staleness": 1, "org_rounds": {"a": 0}},
    }
    fake_config(staleness=1, transport="flower")  # the Flower simulation and deployment run asynchronous rounds
    for words, fed in refusals.items():
        with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")):
            fake_config(**fed)
    fake_config(security={"signing": True}, staleness=1)  # signing holds with several plans in flight
    fake_config(security={"signing": True, "encrypt": True}, staleness=1)  # blind mode too (per-batch accusations)
    base = fake_config().model_dump()  # the outcome guard too (tests/test_async_outcome.py)
    base["federation"]["staleness"] = 1
    base["trainer"]["outcome_guard"] = {"enabled": True}
    assert load_config(base).trainer.outcome_guard.enabled


# -- the schedule on fake workers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "staleness,window,org_rounds",
    [(1, None, {}), (2, None, {}), (1, 3, {}), (3, 1, {}), (1, None, {"a": 12, "c": 9}), (1000, 4, {"a": 20, "b": 3})],
)
def test_the_schedule_is_the_simulation_s(tmp_path, staleness, window, org_rounds):
    steps = {"a": 1.0, "b": 4.0, "c": 1.5}
    co, _, summary = _run(tmp_path, steps, staleness=staleness, window=window, org_rounds=org_rounds)
    drv = co.async_driver
    sim = simulate(ScheduleSpec(steps, 6, staleness, window, org_rounds=org_rounds))
    assert drv.steps == sim.steps
    assert drv.published == sim.published
    assert {o: dict(c) for o, c in drv.refused.items()} == {o: dict(c) for o, c in sim.refused.items()}
    assert drv.idle == pytest.approx(sim.idle) and drv.finished == sim.finished
    assert summary.rounds_completed == max([6, *org_rounds.values()])


def test_a_fast_org_with_its_own_rounds_keeps_stepping_and_evaluates_at_its_rounds(tmp_path):
    """a: 1 s a step, federation.org_rounds 16; b: 4 s, federation.rounds 4; no lead bound (K = 1000). a trains 16
    rounds and is done at 17 (b at 20: never held); it evaluates and checkpoints every 2 of its rounds and at 16,
    b at 2 and 4; rounds 5..16 hold only a; every (learner, foreign batch) pair is taken or counted."""
    skills = {"a": 0.25, "b": 0.5}
    co, workers, summary = _run(
        tmp_path, {"a": 1.0, "b": 4.0}, staleness=1000, rounds=4, skills=skills, logger=True, org_rounds={"a": 16}
    )
    drv = co.async_driver
    assert drv.finished == {"a": 17.0, "b": 20.0} and summary.rounds_completed == 16
    assert [len(workers[o].train_requests) for o in skills] == [16, 4]
    assert [r.round for r in workers["a"].eval_requests] == [0, *range(2, 17, 2)]
    assert [r.round for r in workers["b"].eval_requests] == [0, 2, 4]
    assert workers["a"].checkpoints == list(range(2, 17, 2)) and workers["b"].checkpoints == [2, 4]
    records = {int(rec["round"]): rec for rec in read_metrics(tmp_path)}
    assert sorted(records) == list(range(17))  # every round logged once
    assert [records[t]["async/a/trained_at_s"] for t in (1, 4, 16)] == [2.0, 5.0, 17.0]
    assert [records[t]["async/b/trained_at_s"] for t in (1, 4)] == [8.0, 20.0]
    assert not any(k.startswith(("async/b/", "round/b/")) for t in range(5, 16) for k in records[t])
    assert records[16]["round/b/refused/learner_finished"] == 12  # a's rounds 5..16: b trained its last before
    assert set(co.eval_history[16]) == {"a"} and set(co.eval_history[4]) == {"a", "b"}
    for org in skills:
        taken = sum(len(r.tags) for r in workers[org].train_requests)
        foreign = [tag for _, tag in drv.published if tag.source != org]
        assert taken + sum(drv.refused[org].values()) == len(foreign)
    assert (taken, len(foreign)) == (4, 16)  # b (the last org): a's rounds 1..4 taken


def test_with_a_lead_bound_an_org_that_published_its_last_round_stops_holding_the_others(tmp_path):
    """K = 1, a (1 s) 8 rounds, b (4 s) 4: a plans round t once b published t - 2 (at 4 (t - 2)), and from b's last
    round (16) on runs at its own pace (hand-computed in tests/test_async_schedule.py)."""
    co, _, _ = _run(
        tmp_path, {"a": 1.0, "b": 4.0}, staleness=1, rounds=4, skills={"a": 0.25, "b": 0.5}, org_rounds={"a": 8}
    )
    drv = co.async_driver
    assert [s.start for s in drv.steps if s.org == "a"] == [0.0, 1.0, 4.0, 8.0, 12.0, 16.0, 17.0, 18.0, 19.0]
    assert drv.finished == {"a": 20.0, "b": 20.0}


def test_the_fast_org_runs_at_most_k_rounds_ahead_and_uses_each_batch_once(tmp_path):
    k = 2
    co, workers, _ = _run(tmp_path, {"a": 1.0, "b": 4.0, "c": 1.0}, staleness=k, rounds=8)
    drv = co.async_driver
    published: dict[str, list[tuple[float, int]]] = {o: [] for o in SKILLS}
    for when, tag in drv.published:
        published[tag.source].append((when, tag.round))
    for step in drv.steps:  # when a step starts, every org has published round step.round - K - 1
        for pubs in published.values():
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


def test_trained_at_is_the_end_of_the_step_that_trained_the_round(tmp_path):
    """``async/<org>/trained_at_s`` (what the benchmarks read the time to an accuracy from): the end of the org's
    step that trained round ``t``, i.e. its step planning ``t + 1``; (t + 1) x its step for an org never held."""
    steps = {"a": 1.0, "b": 4.0, "c": 1.0}
    co, _, _ = _run(tmp_path, steps, staleness=1000, window=8, rounds=6, logger=True)
    ends = {(s.org, s.round - 1): s.end for s in co.async_driver.steps if s.own is not None}
    records = {int(rec["round"]): rec for rec in read_metrics(tmp_path)}
    for t in range(1, 7):
        for org in steps:
            assert records[t][f"async/{org}/trained_at_s"] == ends[(org, t)]
    assert [records[t]["async/b/trained_at_s"] for t in (1, 6)] == [8.0, 28.0]  # never held: (t + 1) x 4
    assert records[6]["async/a/trained_at_s"] == 7.0  # K = 1000: the fast org ran at its own pace


def test_two_runs_are_equal(tmp_path):
    steps = {"a": 1.0, "b": 4.0, "c": 2.0}
    runs = [_run(tmp_path / str(i), steps, staleness=1, logger=True) for i in range(2)]
    assert runs[0][0].async_driver.steps == runs[1][0].async_driver.steps
    for org in SKILLS:
        assert [r.tags for r in runs[0][1][org].train_requests] == [r.tags for r in runs[1][1][org].train_requests]
    strip = [
        [
            {k: v for k, v in rec.items() if not k.startswith(("time/", "cpu/", "wall")) and not k.endswith("/step_s")}
            for rec in read_metrics(tmp_path / str(i))
        ]
        for i in range(2)
    ]
    assert strip[0] == strip[1]


def test_asynchronous_rounds_refuse_another_transport(tmp_path):
    from hacrl_fed.config import BuildError

    cfg = fake_config(staleness=1)

    class Other(InProcessTransport):
        pass

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

    with pytest.raises(BuildError, match="asynchronous rounds run in process, on gRPC or Flower: NotInProcess"):
        Coordinator(cfg, NotInProcess(), tmp_path / "x", task=FakeTask()).run()


# -- the wall clock (a transport that calls in parallel) ------------------------------------------------------------


def _wall_transport(workers, delays):
    """A GrpcTransport whose "calls" are the fake workers' steps on its thread pool, each after ``delays[org]`` s."""
    import time as clock
    from concurrent.futures import ThreadPoolExecutor

    from hacrl_fed.coordinator.grpc_transport import GrpcTransport

    class Wall(GrpcTransport):
        def __init__(self):
            self.clients = dict(workers)
            self._pool = ThreadPoolExecutor(max_workers=len(workers))

        def _fan_out(self, items, call, timeout_s):
            return {org: call(self.clients[org], item) for org, item in items.items()}

        def submit_step(self, org, request, timeout_s):
            def slow():
                clock.sleep(delays[org])
                return workers[org].step(request), delays[org]

            return self._pool.submit(slow)

        def close(self):
            self._pool.shutdown()

    class Client:  # GrpcWorkerClient's calls the transport makes outside steps
        def __init__(self, worker):
            self.worker = worker

        def evaluate(self, request, timeout_s):
            return self.worker.evaluate(request)

        def health(self, timeout_s):
            return self.worker.health()

        def checkpoint(self, round, timeout_s):
            return self.worker.checkpoint(round)

    wall = Wall()
    wall.clients = {org: Client(w) for org, w in workers.items()}
    return wall


def test_on_the_wall_clock_replies_are_taken_as_they_come_within_the_bound(tmp_path):
    """b's steps take 4x as long on the wall: a and c step ahead of it by at most K = 1 round, the steps' times
    are the replies' arrivals, and every (learner, foreign batch) pair is taken once or counted."""
    cfg = fake_config(("a", "b", "c"), rounds=5, staleness=1)
    workers = {o: FakeWorker(o, s) for o, s in SKILLS.items()}
    delays = {"a": 0.02, "b": 0.08, "c": 0.02}
    transport = _wall_transport(workers, delays)
    co = Coordinator(cfg, transport, tmp_path, task=FakeTask())
    summary = co.run()
    transport.close()
    drv = co.async_driver
    assert drv.wall and summary.rounds_completed == 5
    assert all(s.end - s.start >= delays[s.org] * 0.9 for s in drv.steps)
    for step in drv.steps:  # the staleness bound: every other org had published round - K - 1 when it started
        for other in workers:
            published = [t.round for at, t in drv.published if t.source == other and at <= step.start]
            assert other == step.org or step.round - 2 <= max(published, default=0), (step, other)
    b_by = [(at, t.round) for at, t in drv.published if t.source == "b"]
    ahead = [
        s
        for s in drv.steps
        if s.org == "a" and s.round <= 5 and max([r for at, r in b_by if at <= s.start], default=0) < s.round - 1
    ]
    assert ahead  # a planned a round before b had published the one before it: it did not wait for b
    for org in workers:
        offered = [(t.source, t.round) for s in drv.steps if s.org == org for t in s.foreign]
        assert len(offered) == len(set(offered))
        assert len(offered) + sum(drv.refused[org].values()) == len([t for _, t in drv.published if t.source != org])
    assert [w.trained_rounds for w in workers.values()] == [5, 5, 5]


# -- tiny models (the real worker, trainer and intake) ------------------------------------------------------------


def _tiny_cfg(security=None, **federation):
    from tests.test_docs import ORGS

    fed = {"rounds": 4, "prompts_per_round": 4, "eval_every": 2, "min_orgs": 1, **federation}
    return load_config(
        {
            "name": "async",
            "seed": 0,
            "orgs": ORGS,
            "algorithm": {"name": "hacpo", "warmup_rounds": 0},
            "trainer": {"lr": 1e-3, "minibatch_size": 64, "micro_batch_size": 32, "selection": {"rule": "all"}},
            "generation": {"num_samples": 4, "max_new_tokens": 16, "eval_max_new_tokens": 16},
            "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
            "federation": fed,
            "security": {"signing": False, **(security or {})},
        }
    )


def _tiny_run(tmp_path, cfg, steps=None):
    from hacrl_fed.worker import build_worker

    workers = {o.id: build_worker(cfg, o.id, run_dir=tmp_path) for o in cfg.orgs}
    with RunLogger(tmp_path, tensorboard=False) as logger:
        co = Coordinator(cfg, InProcessTransport(workers, clock=VirtualClock(steps or {})), tmp_path, logger=logger)
        summary = co.run()
    return co, workers, summary, read_metrics(tmp_path)


@pytest.mark.slow
def test_a_k1_run_on_tiny_models_trains_on_late_batches(tmp_path):
    """globex 4x slower, K = 1: acme trains round 2 on its own batch and globex's round-1 batch (one round late,
    age 1), and so on; every key it logs is documented."""
    from tests.test_docs import documented_keys, key_pattern

    cfg = _tiny_cfg(staleness=1)
    co, workers, summary, records = _tiny_run(tmp_path, cfg, {"acme": 1.0, "globex": 4.0})
    drv = co.async_driver
    assert summary.rounds_completed == 4
    assert drv.steps == simulate(ScheduleSpec({"acme": 1.0, "globex": 4.0}, 4, 1)).steps
    assert [s.ages() for s in drv.steps if s.org == "acme" and s.foreign] == [(1,), (1,), (1,)]
    assert [s.ages() for s in drv.steps if s.org == "globex" and s.foreign] == [(0,), (0,), (0,), (0,)]
    assert [rec["round"] for rec in records] == [0, 1, 2, 3, 4]
    assert records[2]["acme/trust/globex/received"] == 4 * 4  # globex's round-1 batch: B prompts x G
    assert records[2]["acme/train/num_cross"] > 0
    for org in ("acme", "globex"):
        assert records[-1][f"async/{org}/version"] == 4
    assert records[-1]["round/acme/refused/learner_finished"] == 1  # globex's round 4 came after acme finished
    patterns = [key_pattern(k) for k in documented_keys()]
    keys = {k for rec in records for k in rec}
    assert not [k for k in keys if not any(p.fullmatch(k) for p in patterns)]


@pytest.mark.slow
def test_org_rounds_on_tiny_models_the_fast_org_runs_its_own_rounds(tmp_path):
    """globex 4x slower with 2 rounds, acme 8 (federation.org_rounds), no lead bound: acme trains 8 times on the real
    worker (globex's rounds 1-2 late), evaluates at its rounds 2, 4, 6, 8 and is done at 9, globex at 12; rounds 3-8
    hold only acme; every key logged is documented."""
    from tests.test_docs import documented_keys, key_pattern

    steps = {"acme": 1.0, "globex": 4.0}
    cfg = _tiny_cfg(rounds=2, staleness=1000, window=8, org_rounds={"acme": 8})
    co, _, summary, records = _tiny_run(tmp_path, cfg, steps)
    drv = co.async_driver
    assert drv.steps == simulate(ScheduleSpec(steps, 2, 1000, 8, org_rounds={"acme": 8})).steps
    assert summary.rounds_completed == 8 and drv.finished == {"acme": 9.0, "globex": 12.0}
    assert [rec["round"] for rec in records] == list(range(9))
    assert [records[t]["async/acme/version"] for t in (2, 8)] == [2, 8] and records[2]["async/globex/version"] == 2
    assert [t for t in range(9) if "eval/acme/accuracy" in records[t]] == [0, 2, 4, 6, 8]
    assert [t for t in range(9) if "eval/globex/accuracy" in records[t]] == [0, 2]
    assert not [k for t in range(3, 8) for k in records[t] if k.startswith(("globex/", "async/globex/"))]
    assert sum(s.foreign != () for s in drv.steps if s.org == "acme") == 2  # globex's rounds 1 and 2
    assert records[8]["round/globex/refused/learner_finished"] == 6  # acme's rounds 3..8
    patterns = [key_pattern(k) for k in documented_keys()]
    assert not [k for rec in records for k in rec if not any(p.fullmatch(k) for p in patterns)]


def _weights(worker):
    import torch

    return torch.cat([p.detach().flatten() for p in worker.model.parameters()])


def _comparable(records):
    """Per round, the metrics both drivers write, less timings."""
    skip = ("time/", "cpu/", "perf/", "async/", "wall_time")
    return [
        {
            k: v
            for k, v in rec.items()
            if not k.startswith(skip)
            and "/time/" not in k
            and "/cpu/" not in k
            and "/perf/" not in k
            and not k.endswith("/messages")
            and "/gen/tok" not in k
        }
        for rec in records
    ]


@pytest.mark.slow
def test_k0_is_today_s_loop_bit_for_bit_and_the_driver_at_k0_reproduces_it(tmp_path, monkeypatch):
    """K = 0 runs today's lock-step loop (an explicit ``staleness: 0`` changes nothing); the asynchronous driver
    held at K = 0 (with the workers' asynchronous intake, window 1) gives the same metrics and the same weights."""
    import torch

    from hacrl_fed.coordinator import async_driver

    today = _tiny_run(tmp_path / "today", _tiny_cfg())
    explicit = _tiny_run(tmp_path / "k0", _tiny_cfg(staleness=0, window=1))
    assert _comparable(today[3]) == _comparable(explicit[3])
    for org in ("acme", "globex"):
        assert torch.equal(_weights(today[1][org]), _weights(explicit[1][org]))
    assert today[2].capability == explicit[2].capability and today[2].eval_history == explicit[2].eval_history

    init = async_driver.AsyncDriver.__init__

    def held_at_k0(self, coordinator):
        init(self, coordinator)
        self.staleness = 0

    monkeypatch.setattr(async_driver.AsyncDriver, "__init__", held_at_k0)
    driven = _tiny_run(tmp_path / "driver", _tiny_cfg(staleness=1, window=1))
    assert driven[0].async_driver.steps == simulate(ScheduleSpec({"acme": 1.0, "globex": 1.0}, 4, 0)).steps
    for org in ("acme", "globex"):
        assert torch.equal(_weights(today[1][org]), _weights(driven[1][org])), org
    assert today[2].eval_history == driven[2].eval_history
    mine, theirs = _comparable(driven[3]), _comparable(today[3])
    common = [sorted(a.keys() & b.keys()) for a, b in zip(mine, theirs)]
    assert any(k.startswith("acme/hacpo/") for k in common[2]) and "eval/acme/accuracy" in common[2]
    differ = [(k, a[k], b[k]) for a, b, c in zip(mine, theirs, common) for k in c if a[k] != b[k]]
    assert not differ


@pytest.mark.slow
def test_an_honest_signed_k1_run_gives_the_unsigned_run_s_numbers(tmp_path, monkeypatch):
    """globex 4x slower, K = 1, signing on: every batch is verified by the coordinator and end to end by each
    learner (signature, window, tag, version, fresh plan), none is refused, and the weights and metrics are those of
    the same run unsigned."""
    import torch

    from hacrl_fed.coordinator.async_driver import AsyncDriver

    relayed: list = []  # every envelope the driver kept, before it forgets the spent ones
    forget = AsyncDriver.forget_spent
    monkeypatch.setattr(
        AsyncDriver, "forget_spent", lambda self: (relayed.extend(self.envelopes.values()), forget(self))
    )
    steps = {"acme": 1.0, "globex": 4.0}
    plain = _tiny_run(tmp_path / "plain", _tiny_cfg(staleness=1), steps)
    assert not relayed
    signed = _tiny_run(tmp_path / "signed", _tiny_cfg({"signing": True}, staleness=1), steps)
    assert signed[0].async_driver.steps == plain[0].async_driver.steps
    assert relayed and all(b.signature and b.plan_challenges for b in relayed)
    assert signed[3][2]["acme/trust/globex/received"] == 4 * 4
    for org in ("acme", "globex"):
        assert torch.equal(_weights(plain[1][org]), _weights(signed[1][org])), org
    assert plain[2].eval_history == signed[2].eval_history and plain[2].capability == signed[2].capability
    mine, theirs = _comparable(signed[3]), _comparable(plain[3])
    assert not [k for rec in mine for k in rec if "/rejected/" in k]
    pairs = enumerate(zip(mine, theirs))
    assert [(r, k) for r, (a, b) in pairs for k in a.keys() | b.keys() if a.get(k) != b.get(k)] == []


def test_a_failed_batch_or_train_half_is_counted_and_the_others_run_on(tmp_path):
    """b's generate fails in round 2 and c's train half fails once: nobody stalls, b's step planning 3 trains
    nothing, c's next batch is refused version_mismatch by everyone, and every pair is still taken or counted."""
    cfg = fake_config(("a", "b", "c"), rounds=5, staleness=1)
    clock = VirtualClock({"a": 1.0, "b": 2.0, "c": 1.0})
    workers = {o: FakeWorker(o, s) for o, s in SKILLS.items()}
    workers["b"].fail_generate_rounds = {2}
    real_train = workers["c"].train

    def train_once_failing(request):
        if request.round == 2:
            raise RuntimeError("c's update crashed")
        return real_train(request)

    workers["c"].train = train_once_failing
    co = Coordinator(cfg, InProcessTransport(workers, clock=clock), tmp_path, task=FakeTask())
    summary = co.run()
    drv = co.async_driver
    assert summary.rounds_completed == 5
    assert not any(s.own for s in drv.steps if s.org == "b" and s.round == 3)  # no batch of round 2: no train
    assert ("b", 2) not in {(t.source, t.round) for _, t in drv.published}
    assert all(drv.refused[o]["version_mismatch"] == 1 for o in ("a", "b"))  # c's round-3 batch
    assert [s for s in drv.steps if s.org == "c" and s.round == 3][0].foreign  # sent with the train that failed
    for org in workers:
        offered = [(t.source, t.round) for s in drv.steps if s.org == org for t in s.foreign]
        assert len(offered) == len(set(offered))
        foreign = [tag for _, tag in drv.published if tag.source != org]
        assert len(offered) + sum(drv.refused[org].values()) == len(foreign)


# -- signing with several plans in flight (fake workers that sign) -----------------------------------------------


class SigningWorker(FakeWorker):
    """A fake worker that signs its batches (version, plan digest, plan challenges) and reports, and issues
    challenges; ``forge_version`` / ``wrong_round``: the rounds whose batch signs another version / another round."""

    def __init__(self, org_id, skill, identity, forge_version=(), wrong_round=()):
        super().__init__(org_id, skill)
        from hacrl_fed.security.freshness import ChallengeBook

        self.identity, self.version, self.book = identity, 0, ChallengeBook(8)
        self.forge_version, self.wrong_round = set(forge_version), set(wrong_round)

    def generate(self, plan):
        import dataclasses

        from hacrl_fed.security.envelope import signed
        from hacrl_fed.security.freshness import plan_digest

        batch = super().generate(plan)
        round = plan.round + 1 if plan.round in self.wrong_round else plan.round
        rollouts = tuple(dataclasses.replace(r, round=round) for r in batch.rollouts)
        version = self.version + (1 if plan.round in self.forge_version else 0)
        batch = dataclasses.replace(
            batch, round=round, rollouts=rollouts, plan_digest=plan_digest(plan), version=version,
            plan_challenges=dict(plan.challenges),
        )  # fmt: skip
        return signed(batch, self.identity)

    def train(self, request):
        import dataclasses

        from hacrl_fed.security.reports import sign_report

        report = super().train(request)
        self.version += 1
        return sign_report(dataclasses.replace(report, challenge=self.book.issue()), self.identity)

    def health(self):
        return {**super().health(), "challenge": self.book.for_health().hex()}


def _signed_run(tmp_path, steps=None, rounds=5, make=None, **kinds):
    from hacrl_fed.security.keyring import load_org_identity

    steps = steps or {"a": 1.0, "b": 2.0, "c": 1.0}
    cfg = fake_config(("a", "b", "c"), rounds=rounds, staleness=1, security={"signing": True})
    make = make or {}
    workers = {
        o: make.get(o, SigningWorker)(o, s, load_org_identity(cfg, o, tmp_path), **kinds.get(o, {}))
        for o, s in SKILLS.items()
    }
    with RunLogger(tmp_path, tensorboard=False) as log:
        co = Coordinator(cfg, InProcessTransport(workers, clock=VirtualClock(steps)), tmp_path, task=FakeTask())
        co.logger = log
        summary = co.run()
    return co, workers, summary, read_metrics(tmp_path)


def test_signed_batches_travel_verbatim_with_their_signed_versions(tmp_path):
    co, workers, summary, _ = _signed_run(tmp_path)
    drv = co.async_driver
    assert summary.rounds_completed == 5
    assert set(co.guard.signed) <= {5}  # the trust guard forgets a round's batches once the round is logged
    assert drv.steps == simulate(ScheduleSpec({"a": 1.0, "b": 2.0, "c": 1.0}, 5, 1)).steps
    assert not any(drv.refused[o] - Counter({"learner_finished": drv.refused[o]["learner_finished"]}) for o in workers)
    for org, w in workers.items():
        for req in w.train_requests:
            assert codec.decode("TrainRequest", codec.encode(req), limits=worker_limits(co.cfg)) == req  # the wire
            assert req.foreign == () and all(b.signature for b in req.source_batches)
            assert sorted(req.tags) == sorted((b.org_id, b.round, b.version) for b in req.source_batches)
        offered = sum(len(r.source_batches) for r in w.train_requests)
        assert offered == len([t for _, t in drv.published if t.source != org]) - drv.refused[org]["learner_finished"]


def test_a_forged_version_or_a_batch_for_a_plan_never_issued_is_refused_and_counted(tmp_path):
    """b signs version + 1 in round 3: every learner refuses it version_mismatch; c answers its round-2 plan with a
    batch of round 3: the trust guard refuses it (wrong_round), it never enters the pool, and the run goes on."""
    co, workers, summary, records = _signed_run(tmp_path, b={"forge_version": {3}}, c={"wrong_round": {2}})
    drv = co.async_driver
    assert summary.rounds_completed == 5
    assert all(drv.refused[o]["version_mismatch"] == 1 for o in ("a", "c"))
    assert ("c", 2) not in {(t.source, t.round) for _, t in drv.published}
    assert records[2]["round/c/rejected/wrong_round"] == 4 * 3  # G x B rollouts
    assert not any(b.org_id == "c" and b.round == 2 for w in workers.values() for r in w.train_requests
                   for b in r.source_batches)  # fmt: skip


class Hung(SigningWorker):
    """A signing fake worker whose step call number ``hang`` trains and generates, but whose reply never comes back
    (the call times out: the org dies, its step lost to the coordinator, not to the worker; ``restart``: the worker
    is then restarted fresh, its count back to 0); its Health reports ``report(its own version)`` as ``version``
    (None: no ``version``, as every worker did before the field)."""

    def __init__(self, org_id, skill, identity, *, hang, report, restart=False):
        super().__init__(org_id, skill, identity)
        self.calls, self.hang, self.report, self.restart = 0, hang, report, restart

    def step(self, request):
        self.calls += 1
        reply = super().step(request)
        if self.calls == self.hang:
            self.version = 0 if self.restart else self.version
            raise TimeoutError(f"{self.org_id}: the reply was lost")
        return reply

    def health(self):
        reported = self.report(self.version)
        return super().health() if reported is None else {**super().health(), "version": reported}


def _hung_run(tmp_path, report, restart=False):
    """b's third step (trains round 2: its version 1 -> 2, plans round 3) is lost at 3.0; its probe at 5.0 answers
    and b rejoins planning round 6 (a and c have published 5), then trains rounds 6 and 7 and 8."""
    steps = {"a": 1.0, "b": 1.0, "c": 1.0}
    kinds = {"b": {"hang": 3, "report": report, "restart": restart}}
    co, workers, summary, records = _signed_run(tmp_path, steps, rounds=8, make={"b": Hung}, **kinds)
    assert [(s.org, s.round) for s in co.async_driver.lost] == [("b", 3)] and summary.rounds_completed == 8
    assert records[6]["async/b/rejoined_at"] == 6
    return co.async_driver, workers, records


@pytest.mark.parametrize("restart,adopted", [(False, 2), (True, 0)])
def test_a_rejoin_adopts_the_worker_s_own_count_of_its_updates(tmp_path, restart, adopted):
    """The lost step trained at b: b counts 2 updates, the coordinator 1 (or b restarted fresh: 0). Adopted from b's
    Health, b's batches after the rejoin sign the issued version: taken by a and c, and b trains again."""
    drv, workers, records = _hung_run(tmp_path, str, restart)
    assert records[6]["async/b/version_adopted"] == adopted and "async/b/bad_version_report" not in records[6]
    assert not any(drv.refused[o]["version_mismatch"] for o in SKILLS)
    b_batches = {t.round: t.version for _, t in drv.published if t.source == "b"}
    assert {r: b_batches[r] for r in (6, 7, 8)} == {6: adopted, 7: adopted + 1, 8: adopted + 2}
    assert sum(1 for r in workers["a"].train_requests for b in r.source_batches if b.org_id == "b" and b.round >= 6)
    assert [r.round for r in workers["b"].train_requests][-3:] == [6, 7, 8]
    assert drv.orgs["b"].version == workers["b"].version == adopted + 3


@pytest.mark.parametrize("report", [lambda v: None, lambda v: "-1", lambda v: "3", lambda v: "2.0", lambda v: "٢",
                                    lambda v: "1" * 400, lambda v: ""])  # fmt: skip
def test_without_a_plausible_report_the_rejoined_org_s_batches_are_refused(tmp_path, report):
    """No version in b's Health (the gap before the field), or one that is not an integer in [0, 1 + 1] (its count
    plus its one lost step that trained): the coordinator keeps its count 1 and counts a bad report; b's batches
    after the rejoin sign 2 and are refused version_mismatch by every learner (its own too: b never trains again)."""
    drv, workers, records = _hung_run(tmp_path, report)
    bad = records[6].get("async/b/bad_version_report", 0)
    assert bad == (report(0) is not None) and "async/b/version_adopted" not in records[6]
    mismatched = [t for _, t in drv.published if t.source == "b" and t.round >= 6]
    assert [t.version for t in mismatched] == [2, 2, 2] and drv.orgs["b"].version == 1
    assert drv.refused["a"]["version_mismatch"] == drv.refused["c"]["version_mismatch"] == 3  # rounds 6, 7, 8
    assert [r.round for r in workers["b"].train_requests] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("staleness,window", [(1, None), (1000, 5)])
def test_at_equal_speeds_asynchronous_rounds_are_the_lock_step_run(tmp_path, staleness, window):
    """f = 1 (every step as long): all batches of round t - 1 are published at the instant every org's step
    planning t starts, so any K and window give the lock-step schedule, requests and weights (the benchmark's
    f = 1 arms are the synchronous cells, BENCHMARKS.md "Asynchronous rounds")."""
    import torch

    fed = {"staleness": staleness} | ({"window": window} if window else {})
    today = _tiny_run(tmp_path / "today", _tiny_cfg())
    equal = _tiny_run(tmp_path / "async", _tiny_cfg(**fed))
    assert equal[0].async_driver.steps == simulate(ScheduleSpec({"acme": 1.0, "globex": 1.0}, 4, 0)).steps
    for org in ("acme", "globex"):
        assert torch.equal(_weights(today[1][org]), _weights(equal[1][org])), org
    assert today[2].eval_history == equal[2].eval_history
