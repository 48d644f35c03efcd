"""Replay protection (issue 20, Why 4 and Deliver 4): old signed batches replayed into a worker that holds no state
of a run are refused as ``stale_plan`` (hacrl_fed.security.freshness), in-process and over gRPC; a fresh plan's
batches are accepted; a tampered, missing or oversized challenge map is refused with its reason.

The attack: a coordinator reuses an old run id, sends an old round's plan to a worker that never served that run
(it joins at any round), then forwards an absent org's old signed batches of that round. Signature, run and round
all check; only the learner's own challenge, which no old plan can carry, shows the batches are not current.
"""

from __future__ import annotations

import dataclasses

import pytest

from hacrl_fed.config import load_config
from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.security.freshness import (
    CHALLENGE_BYTES,
    ChallengeBook,
    challenges_problem,
    parse_challenge,
    plan_digest,
)
from hacrl_fed.types import RolloutBatch, RoundPlan, SamplingParams, TrainRequest
from hacrl_fed.wire import codec
from hacrl_fed.wire.codec import WireError
from hacrl_fed.worker import build_worker
from hacrl_fed.worker.guard import RequestRefused
from hacrl_fed.worker.step import run_step
from test_security_attacks import B, G, fresh, make_cfg, plan_for, same_weights, via, weights  # noqa: F401

CAP = {"acme": 0.5, "globex": 0.5}


# ------------------------------------------------------------------------------------------------ the pieces


def test_the_plan_digest_ignores_per_org_sampling_and_binds_everything_else(tmp_path):
    w = build_worker(make_cfg(), "acme", run_dir=tmp_path)
    plan = dataclasses.replace(plan_for(w), challenges={"acme": b"a" * 32})
    digest = plan_digest(plan)
    assert len(digest) == 32
    assert plan_digest(dataclasses.replace(plan, sampling=SamplingParams(temperature=0.3, num_samples=2))) == digest
    for changed in (
        dataclasses.replace(plan, run_id="run-2"),
        dataclasses.replace(plan, round=2),
        dataclasses.replace(plan, task="other"),
        dataclasses.replace(plan, prompts=plan.prompts[1:]),
        dataclasses.replace(plan, challenges={"acme": b"b" * 32}),
        dataclasses.replace(plan, challenges={}),
    ):
        assert plan_digest(changed) != digest


def test_challenges_are_fresh_bounded_and_parsed_strictly():
    book = ChallengeBook()
    assert book.expect() is None  # issued none yet
    health = book.for_health()
    assert len(health) == CHALLENGE_BYTES and book.for_health() == health  # Health does not replace it
    issued = book.issue()
    assert issued != health and book.expect() == issued
    book.hold()  # a fused message arrives: its plan carries the challenge issued before it
    book.issue()  # its train half issues the next one
    assert book.expect() == issued
    book.release()
    assert book.expect() != issued
    assert parse_challenge(issued) == issued and parse_challenge(issued.hex()) == issued
    for bad in (b"", b"x" * 31, b"x" * 33, "zz" * 32, issued.hex()[:-2], None, 7):
        assert parse_challenge(bad) is None
    orgs = ["acme", "globex"]
    assert challenges_problem({"acme": issued, "globex": issued}, orgs) is None
    assert "3 challenges for 2 orgs" in challenges_problem({o: issued for o in ("acme", "globex", "x")}, orgs)
    assert "not in the run" in challenges_problem({"mallory": issued}, orgs)
    assert "not 32 bytes" in challenges_problem({"acme": b"short"}, orgs)


def test_the_wire_carries_the_new_fields_and_caps_them():
    plan_for_wire = _wire_plan()
    both = {"acme": b"\x01" * 32, "globex": b"\x02" * 32}
    plan = codec.decode("RoundPlan", codec.encode(dataclasses.replace(plan_for_wire, challenges=both)))
    assert plan.challenges == {"acme": b"\x01" * 32, "globex": b"\x02" * 32}
    batch = RolloutBatch("r", 1, "acme", (), 0.0, plan_digest=plan_digest(plan_for_wire))
    assert codec.decode(RolloutBatch, codec.encode(batch)).plan_digest == plan_digest(plan_for_wire)
    with pytest.raises(WireError, match=r"RoundPlan.challenges\['acme'\]: 65 bytes exceed the cap of 64"):
        codec.decode("RoundPlan", codec.encode(dataclasses.replace(plan_for_wire, challenges={"acme": b"x" * 65})))
    with pytest.raises(WireError, match="RolloutBatch.plan_digest: 65 bytes"):
        codec.decode(RolloutBatch, codec.encode(dataclasses.replace(batch, plan_digest=b"x" * 65)))
    too_many = {f"o{i}": b"x" for i in range(codec.DEFAULT_LIMITS.max_recipients + 1)}
    with pytest.raises(WireError, match="RoundPlan.challenges: 1025 entries exceed"):
        codec.decode("RoundPlan", codec.encode(dataclasses.replace(plan_for_wire, challenges=too_many)))


def _wire_plan():
    from hacrl_fed.types import ChatMessage, Prompt

    return RoundPlan("r", 1, "arithmetic", (Prompt(1, (ChatMessage("user", "1+1"),), "2"),), SamplingParams())


# ------------------------------------------------------------------------------------------------ the learner


def _round(tmp_path, plan_of):
    """acme (learner), its twin (trains on its own rows only) and globex answer ``plan_of(acme)``; returns acme's
    report on globex's signed batch, and whether acme's weights equal the twin's after the update."""
    cfg = make_cfg()
    acme = build_worker(cfg, "acme", run_dir=tmp_path / "run")
    twin = build_worker(cfg, "acme", run_dir=tmp_path / "twin")
    globex = build_worker(cfg, "globex", run_dir=tmp_path / "run")
    plan, source_plan = plan_of(acme)
    own = acme.generate(plan)
    twin.generate(plan)
    batch = globex.generate(source_plan)
    report = acme.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), CAP, source_batches=(batch,)))
    twin.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), CAP))
    return own, report, same_weights(weights(acme.model), weights(twin.model))


def test_a_fresh_plans_batches_are_accepted(tmp_path):
    def plan_of(acme):
        plan = fresh(plan_for(acme), acme)
        return plan, plan

    own, report, alone = _round(tmp_path, plan_of)
    assert own.metrics["trust/plan_fresh"] == 1.0 and own.plan_digest
    assert report.metrics["trust/globex/accepted"] == G * B and "trust/globex/rejected/stale_plan" not in report.metrics
    assert report.metrics["train/num_cross"] == G * B  # globex's rows reached the update
    assert len(report.challenge) == 32  # the next plan must carry this one


@pytest.mark.parametrize("case", ["missing", "tampered", "other_learner", "source_answered_another_plan"])
def test_a_missing_or_tampered_challenge_trains_on_own_rows_only(tmp_path, case):
    def plan_of(acme):
        good = fresh(plan_for(acme), acme)
        mine = good.challenges["acme"]
        flipped = bytes([mine[0] ^ 1]) + mine[1:]
        if case == "missing":
            return dataclasses.replace(good, challenges={}), dataclasses.replace(good, challenges={})
        if case == "tampered":
            bad = dataclasses.replace(good, challenges={"acme": flipped})
            return bad, bad
        if case == "other_learner":  # a challenge, but under another org's name
            bad = dataclasses.replace(good, challenges={"globex": mine})
            return bad, bad
        return good, dataclasses.replace(good, challenges={"acme": flipped})  # globex signed another plan

    own, report, alone = _round(tmp_path, plan_of)
    assert own.metrics["trust/plan_fresh"] == (1.0 if case == "source_answered_another_plan" else 0.0)
    assert report.metrics["trust/globex/rejected/stale_plan"] == G * B
    assert report.metrics["trust/foreign_accepted"] == 0.0 and report.metrics["train/num_cross"] == 0.0
    assert report.metrics["train/num_rows"] == G * B  # its own rows, nothing else
    assert alone  # exactly the update of the twin that got no foreign batch


@pytest.mark.parametrize(
    "challenges, match",
    [
        ({"acme": b"x" * 32, "globex": b"y" * 32, "initech": b"z" * 32}, "3 challenges for 2 orgs"),
        ({"mallory": b"x" * 32}, "not in the run"),
        ({"acme": b"x" * 16}, "not 32 bytes"),
    ],
)
def test_a_challenge_map_outside_the_roster_is_refused_before_any_work(tmp_path, challenges, match):
    w = build_worker(make_cfg(), "acme", run_dir=tmp_path)
    with pytest.raises(RequestRefused, match=f"bad_challenges: .*{match}"):
        w.generate(dataclasses.replace(plan_for(w), challenges=challenges))
    assert w.generate(fresh(plan_for(w), w)).round == 1  # the worker goes on


# ------------------------------------------------------------------------------------------------ the attack


class Recorder:
    """Wraps a real worker: records the plans it answers and the batches it publishes, per round."""

    def __init__(self, worker):
        self.worker, self.org_id = worker, worker.org_id
        self.plans: dict[int, RoundPlan] = {}
        self.batches: dict[int, RolloutBatch] = {}

    def generate(self, plan):
        self.plans[plan.round] = plan
        self.batches[plan.round] = self.worker.generate(plan)
        return self.batches[plan.round]

    def step(self, request):  # a message of the round: each part through this wrapper (the test runs one per step)
        return run_step(self, request)

    def __getattr__(self, name):
        return getattr(self.worker, name)


def _old_run(cfg, run_dir):
    """An honest two-org run (no checkpoints): acme's plans and globex's signed batches, per round, as an attacker
    holding the coordinator's traffic keeps them."""
    acme = Recorder(build_worker(cfg, "acme", run_dir=run_dir))
    globex = Recorder(build_worker(cfg, "globex", run_dir=run_dir))
    coord = Coordinator(cfg, InProcessTransport({"acme": acme, "globex": globex}), run_dir)
    for t in range(1, cfg.federation.rounds + 1):
        m = coord.run_round(t).metrics
        assert m["acme/trust/globex/accepted"] == G * B and m["acme/train/num_cross"] > 0  # fresh: trained on it
        assert globex.batches[t].plan_digest == plan_digest(acme.plans[t])  # one digest for both orgs' plans
    return coord.run_id, acme.plans, globex.batches


def _attack(cfg, run_dir, api, twin):
    """The replay: the old run's id, into ``api`` (a worker that never served the run, reached in-process or over
    gRPC). Round 2: acme's old plan exactly (its digest is what globex's old batch signs; it carries the old
    acme's challenge). Round 3: the old plan with the joining worker's own fresh challenge (learned from its
    Health reply). Both times globex's old signed batch of that round. ``twin`` gets the same plans, no batch."""
    run_id, plans, old = _old_run(cfg, run_dir)
    reports = []
    for t in (2, 3):
        plan = plans[t]
        if t == 3:
            mine = bytes.fromhex(api.health()["challenge"])
            plan = dataclasses.replace(plan, challenges={**plan.challenges, "acme": mine})
        api.generate(plan)
        reports.append(api.train(TrainRequest(run_id, t, "acme", plan.prompts, (), CAP, source_batches=(old[t],))))
        twin.generate(plan)
        twin.train(TrainRequest(run_id, t, "acme", plan.prompts, (), CAP))
    for report in reports:
        assert report.metrics["trust/globex/received"] == G * B
        assert report.metrics["trust/globex/rejected/stale_plan"] == G * B  # counted against the source
        assert report.metrics["trust/foreign_accepted"] == 0.0 and report.metrics["train/num_cross"] == 0.0
        assert report.metrics["train/num_rows"] == G * B  # its own rows only


def _three_rounds(**security):
    cfg = make_cfg(**security)
    return load_config({**cfg.model_dump(), "federation": {**cfg.federation.model_dump(), "rounds": 3}})


@pytest.mark.parametrize("blind", [False, True], ids=["plain", "blind"])
def test_old_batches_replayed_into_a_worker_without_state_of_the_run_are_refused(tmp_path, via, blind):  # noqa: F811
    """In-process and over gRPC (``via``), plain and coordinator-blind (sealed batches: refused before they are
    opened): the joining worker trains on its own rows only, exactly as a twin that got no foreign batch."""
    cfg = _three_rounds(encrypt=blind)
    run_dir = tmp_path / "run"  # the same keys (roster) as the old run; the old run wrote no checkpoint
    joining = build_worker(cfg, "acme", run_dir=run_dir)
    twin = build_worker(cfg, "acme", run_dir=tmp_path / "twin")
    _attack(cfg, run_dir, via.api(joining), twin)
    assert same_weights(weights(joining.model), weights(twin.model))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_old_batches_replayed_into_a_worker_process_are_refused(tmp_path):
    """The same attack against a `hacrl-fed worker` process (launched as `hacrl-fed run --transport grpc` does)."""
    import yaml

    from hacrl_fed.coordinator.grpc_transport import GrpcTransport
    from hacrl_fed.coordinator.launcher import WorkerProcesses

    cfg = _three_rounds()
    run_dir = tmp_path / "run"
    config = tmp_path / "replay.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    build_worker(cfg, "acme", run_dir=run_dir)  # provisions the run's keys before the process starts
    procs = WorkerProcesses(config, ["acme"], run_dir=run_dir, worker_args=["--run-dir", str(run_dir)])
    try:
        transport = GrpcTransport(procs.start(), secrets=procs.secrets)
        assert all(not isinstance(v, Exception) for v in transport.wait_ready(120).values())
        client = transport.clients["acme"]
        _attack(cfg, run_dir, _Timed(client), build_worker(cfg, "acme", run_dir=tmp_path / "twin"))
        transport.close()
    finally:
        procs.close()


class _Timed:
    """A GrpcWorkerClient with a deadline on every call."""

    def __init__(self, client):
        self.client = client

    def health(self):
        return self.client.health(timeout_s=60)

    def generate(self, plan):
        return self.client.generate(plan, timeout_s=120)

    def train(self, request):
        return self.client.train(request, timeout_s=120)

    def step(self, request):
        return self.client.step(request, timeout_s=240)


def test_a_coordinator_run_trains_on_fresh_plans_with_both_protocols(tmp_path):
    """Honest runs: the coordinator takes round 1's challenge from Health and later ones from the train reports
    (fused: the report of two rounds before, which is the latest the worker issued when the message arrives), so
    every learner trains on every source in every round."""
    for protocol in ("fused", "two_message"):
        cfg = _three_rounds()
        cfg = load_config({**cfg.model_dump(), "federation": {**cfg.federation.model_dump(), "protocol": protocol}})
        run_dir = tmp_path / protocol
        workers = {o: build_worker(cfg, o, run_dir=run_dir) for o in ("acme", "globex")}
        seen: list = []
        coord = Coordinator(cfg, InProcessTransport(workers), run_dir, on_round=seen.append)
        coord.run()
        assert [r.round for r in seen] == [1, 2, 3]
        for result in seen:
            for learner, source in (("acme", "globex"), ("globex", "acme")):
                assert result.metrics[f"{learner}/trust/{source}/accepted"] == G * B, (protocol, result.round)
                assert f"{learner}/trust/{source}/rejected/stale_plan" not in result.metrics
                assert result.metrics[f"{learner}/trust/plan_fresh"] == 1.0


class _Crash(Exception):
    pass


@pytest.mark.parametrize("protocol", ["fused", "two_message"])
@pytest.mark.parametrize("restart_workers", [False, True], ids=["coordinator_restart", "everything_restarts"])
def test_a_resumed_run_goes_on_with_fresh_plans(tmp_path, protocol, restart_workers):
    """The coordinator stops after round 2 (its state saved) and resumes: its new process learns each worker's
    latest challenge from Health (the same one when the worker kept running; a new one from a worker restarted
    from its checkpoint), so round 3 still trains on every peer."""
    cfg = _three_rounds()
    fed = {**cfg.federation.model_dump(), "protocol": protocol, "checkpoint_every": 1}
    cfg = load_config({**cfg.model_dump(), "federation": fed})
    run_dir = tmp_path / "run"
    workers = {o: build_worker(cfg, o, run_dir=run_dir) for o in ("acme", "globex")}

    def crash_after_two(result):
        if result.round == 2:
            raise _Crash

    with pytest.raises(_Crash):
        Coordinator(cfg, InProcessTransport(workers), run_dir, on_round=crash_after_two).run()
    if restart_workers:
        workers = {o: build_worker(cfg, o, run_dir=run_dir) for o in ("acme", "globex")}  # resume from checkpoints
    seen: list = []
    Coordinator(cfg, InProcessTransport(workers), run_dir, resume=True, on_round=seen.append).run()
    (last,) = seen
    assert last.round == 3 and last.trained == ["acme", "globex"]
    for learner, source in (("acme", "globex"), ("globex", "acme")):
        assert last.metrics[f"{learner}/trust/plan_fresh"] == 1.0
        assert last.metrics[f"{learner}/trust/{source}/accepted"] == G * B


def test_an_excluded_org_drops_out_of_the_challenges_and_the_others_stay_fresh(tmp_path):
    """3 orgs, globex lies about its rewards and is excluded in round 1: round 2's plans carry only the live orgs'
    challenges, and acme and initech go on training on each other."""
    from test_security_attacks import Hostile, lie

    cfg = make_cfg()
    orgs = [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}, {"id": "globex", "model": {"zoo": "micro-gpt2-bpe"}},
            {"id": "initech", "model": {"zoo": "micro-qwen-char"}}]
    cfg = load_config({**cfg.model_dump(), "orgs": orgs,
                       "federation": {**cfg.federation.model_dump(), "rounds": 2}})
    run_dir = tmp_path / "run"
    workers = {o["id"]: Recorder(build_worker(cfg, o["id"], run_dir=run_dir)) for o in orgs}
    workers["globex"] = Hostile(workers["globex"].worker, lambda b: lie(b, run_dir))
    coord = Coordinator(cfg, InProcessTransport(workers), run_dir)
    coord.run_round(1)
    assert "globex" in coord.guard.excluded
    m = coord.run_round(2).metrics
    assert set(workers["acme"].plans[2].challenges) == {"acme", "initech"}
    for learner, source in (("acme", "initech"), ("initech", "acme")):
        assert m[f"{learner}/trust/plan_fresh"] == 1.0 and m[f"{learner}/trust/{source}/accepted"] == G * B


class _BadChallenge(Recorder):
    """Replaces the challenge in its org's train reports with ``value`` (a broken link or a hostile relay)."""

    def __init__(self, worker, value):
        super().__init__(worker)
        self.value = value

    def train(self, request):
        return dataclasses.replace(self.worker.train(request), challenge=self.value)

    def health(self):
        return {**self.worker.health(), "challenge": "zz" * 32}  # not hex: ignored, logged


def test_a_malformed_challenge_is_counted_and_costs_its_org_one_round_of_peers(tmp_path):
    """acme's report carries a 5-byte challenge and its Health a non-hex one: the coordinator counts the first
    (``round/acme/bad_challenge``), ignores both, and never crashes; acme's plans then carry no valid challenge of
    its latest, so acme trains on its own rows (``stale_plan`` counted) while globex goes on as usual."""
    cfg = _three_rounds()
    run_dir = tmp_path / "run"
    acme = _BadChallenge(build_worker(cfg, "acme", run_dir=run_dir), b"x" * 5)
    globex = Recorder(build_worker(cfg, "globex", run_dir=run_dir))
    coord = Coordinator(cfg, InProcessTransport({"acme": acme, "globex": globex}), run_dir)
    first, second = coord.run_round(1).metrics, coord.run_round(2).metrics
    assert first["round/acme/bad_challenge"] == 1.0 and "round/globex/bad_challenge" not in first
    assert "acme" not in acme.plans[1].challenges and "acme" not in acme.plans[2].challenges
    for m in (first, second):
        assert m["acme/trust/plan_fresh"] == 0.0 and m["acme/trust/globex/rejected/stale_plan"] == G * B
        assert m["acme/train/num_cross"] == 0.0 and m["round/acme/train_failed"] == 0.0
        assert m["globex/trust/plan_fresh"] == 1.0 and m["globex/trust/acme/accepted"] == G * B
