"""Coordinator round loop over fake workers: pooling, capability table, eval/checkpoint schedule, failures, resume,
and the in-process and gRPC transports."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from helpers_fake_workers import FakeTask, FakeWorker, fake_config
from hacrl_fed.algorithm import CapabilityTracker
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.config import config_hash
from hacrl_fed.coordinator.loop import Coordinator, FederationError, make_run_id
from hacrl_fed.run_files import STATE_FILE
from hacrl_fed.plan.sampler import PromptSampler
from hacrl_fed.metrics import RunLogger, plot_accuracy, read_metrics
from hacrl_fed.types import Rollout, RoundPlan, SamplingParams, StepRequest

SKILLS = {"a": 0.25, "b": 0.5, "c": 0.75}


def make_workers(**per_org):
    return {org: FakeWorker(org, skill, **per_org.get(org, {})) for org, skill in SKILLS.items()}


def run(cfg, workers, run_dir, *, logger=None, resume=False, results=None):
    coord = Coordinator(cfg, InProcessTransport(workers), run_dir, logger=logger, resume=resume, task=FakeTask(),
                        on_round=None if results is None else results.append)
    return coord, coord.run()


def test_end_to_end_pooling_capability_schedule_and_outputs(tmp_path):
    cfg = fake_config(rounds=4, eval_every=2, checkpoint_every=3)
    workers = make_workers(c={"invalid_per_batch": 2, "reported_accuracy": 0.95})
    results = []
    with RunLogger(tmp_path) as logger:
        coord, summary = run(cfg, workers, tmp_path, logger=logger, results=results)

    sampler = PromptSampler(1000, cfg.seed)
    run_id = coord.run_id
    assert run_id.startswith(f"fake-{config_hash(cfg)}-") and len(run_id) == len("fake-12345678-123456")
    for org, w in workers.items():
        assert [p.round for p in w.plans] == [1, 2, 3, 4]
        for p in w.plans:
            assert p.run_id == run_id and p.task == "fake"
            assert [q.prompt_id for q in p.prompts] == sampler.round_ids(p.round, 3)
            assert p.sampling.num_samples == 4 and p.sampling.max_new_tokens == 8
        assert [p.sampling.seed for p in w.plans] == [p.sampling.seed for p in workers["a"].plans]

    # TrainRequests carry exactly the other orgs' accepted rollouts: c's reward-2.0 extras claim slots of its first
    # prompt, so that whole group is dropped (exactly G per prompt or nothing) and c pools 2 of its 3 prompts.
    ref = CapabilityTracker(window=2)
    for t in range(1, 5):
        ref.update(SKILLS)
        for org, w in workers.items():
            req = w.train_requests[t - 1]
            assert req.round == t and req.org_id == org
            assert req.prompts == w.plans[t - 1].prompts
            sources = {r.org_id for r in req.foreign}
            assert sources == set(SKILLS) - {org}
            assert all(0.0 <= r.reward <= 1.0 for r in req.foreign)
            assert len(req.foreign) == sum(2 * 4 if o == "c" else 3 * 4 for o in SKILLS if o != org)
            assert req.capability == pytest.approx({o: ref.capability(o) for o in SKILLS})
    assert summary.capability == pytest.approx(SKILLS)

    # Eval before round 1, every 2 rounds, after the last; checkpoints every 3 rounds and at the end.
    assert [e.round for e in workers["a"].eval_requests] == [0, 2, 4]
    assert all(len(e.prompts) == 5 and e.max_new_tokens == 6 for e in workers["a"].eval_requests)
    assert [q.prompt_id for q in workers["a"].eval_requests[0].prompts] == [0, 1, 2, 3, 4]
    assert workers["b"].checkpoints == [3, 4]
    assert sorted(summary.eval_history) == [0, 2, 4]
    assert summary.orgs["a"].accuracy_before == pytest.approx(0.25)
    assert summary.orgs["a"].accuracy_after == pytest.approx(0.25 + 0.04)
    assert summary.orgs["c"].rollouts_shared == 4 * 8
    assert summary.orgs["a"].rollouts_received == 4 * 20
    assert summary.rounds_completed == 4 and summary.skipped_rounds == 0
    assert [r.round for r in results] == [1, 2, 3, 4]

    records = read_metrics(tmp_path)
    assert [r["round"] for r in records] == [0, 1, 2, 3, 4]
    r1 = records[1]
    assert r1["round/c/rollouts_received"] == 14 and r1["round/c/rollouts_accepted"] == 8
    assert r1["round/c/rollouts_rejected"] == 6 and r1["round/c/rejected/bad_reward"] == 2
    assert r1["round/c/rejected/incomplete_group"] == 4 and r1["round/c/shortfall"] == 4
    assert r1["round/a/shortfall"] == 0 and r1["round/a/mismatch_rate"] == 0.0
    assert r1["round/c/accuracy"] == pytest.approx(0.75)
    assert r1["round/c/accuracy_discrepancy"] == pytest.approx(0.2)
    assert r1["capability/b"] == pytest.approx(0.5)
    assert r1["a/hacpo/loss"] == pytest.approx(0.1) and r1["a/hacpo/foreign"] == 20
    assert {"time/step", "time/round"} <= set(r1) and r1["round/a/messages"] == 1  # fused: one message a round
    assert "eval/a/accuracy" in records[0] and "eval/a/accuracy" not in r1 and "eval/b/accuracy" in records[2]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert plot_accuracy(tmp_path).stat().st_size > 1000

    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert state["round"] == 4 and state["run_id"] == run_id and state["worker_checkpoint_round"] == 4


def test_org_failing_generate_is_skipped_then_rejoins(tmp_path):
    workers = make_workers(b={"fail_generate_rounds": {2}})
    coord, summary = run(fake_config(rounds=3), workers, tmp_path)
    assert [req.round for req in workers["b"].train_requests] == [1, 3]
    round2 = workers["a"].train_requests[1]
    assert round2.round == 2 and {r.org_id for r in round2.foreign} == {"c"}
    assert [p.round for p in workers["b"].plans] == [1, 2, 3]  # still asked every round
    assert coord.tracker.history("b") == [0.5, 0.5] and coord.tracker.history("a") == [0.25] * 3
    assert summary.skipped_rounds == 0


def test_round_below_min_orgs_skips_training(tmp_path):
    workers = make_workers(a={"fail_generate_rounds": {2}}, b={"fail_generate_rounds": {2}})
    with RunLogger(tmp_path, tensorboard=False) as logger:
        coord, summary = run(fake_config(rounds=3, min_orgs=2), workers, tmp_path, logger=logger)
    assert [req.round for req in workers["c"].train_requests] == [1, 3]
    assert summary.skipped_rounds == 1 and coord.consecutive_failures == 0
    assert coord.tracker.history("c") == [0.75, 0.75]  # the skipped round does not count
    rec = read_metrics(tmp_path)[2]
    assert rec["round"] == 2 and rec["round/skipped"] == 1 and rec["round/a/failed"] == 1


def test_consecutive_gaps_abort_with_clear_error(tmp_path):
    down = {"fail_generate_rounds": {2, 3, 4}}
    workers = make_workers(a=down, b=down, c=down)
    with pytest.raises(FederationError, match=r"3 consecutive rounds \(up to round 4\).*min_orgs=1"):
        run(fake_config(rounds=6), workers, tmp_path)
    assert json.loads((tmp_path / STATE_FILE).read_text())["round"] == 4


def test_failed_round_limit_is_configurable(tmp_path):
    down = {"fail_generate_rounds": {2, 3, 4}}
    workers = make_workers(a=down, b=down, c=down)
    with pytest.raises(FederationError, match=r"1 consecutive rounds \(up to round 2\)"):
        run(fake_config(rounds=6, max_failed_rounds=1), workers, tmp_path)


def test_orgs_without_valid_rollouts_do_not_count_as_replies(tmp_path):
    class Liar(FakeWorker):
        def generate(self, plan):
            batch = super().generate(plan)
            bad = tuple(Rollout(**{**r.__dict__, "logprob_sum": 3.0}) for r in batch.rollouts)
            return type(batch)(batch.run_id, batch.round, batch.org_id, bad, batch.accuracy)

    workers = {"a": FakeWorker("a", 0.25), "b": Liar("b", 0.5)}
    coord, _ = run(fake_config(orgs=("a", "b"), rounds=2), workers, tmp_path)
    assert workers["b"].train_requests == [] and coord.tracker.history("b") == []
    assert all(req.foreign == () for req in workers["a"].train_requests)
    assert coord.capability_table() == {"a": 0.25, "b": 1.0}


class CrashAt(InProcessTransport):
    """Raises (like a killed coordinator) when asked to send round ``crash_round``'s plans."""

    def __init__(self, workers, crash_round):
        super().__init__(workers)
        self.crash_round = crash_round

    def step(self, requests, timeout_s):  # the message carrying round crash_round's plan (either protocol)
        if any(r.plan is not None and r.plan.round == self.crash_round for r in requests.values()):
            raise KeyboardInterrupt("simulated crash")
        return super().step(requests, timeout_s)


@pytest.mark.parametrize("protocol", ["two_message", "fused"])
def test_resume_after_crash_equals_uninterrupted_run(tmp_path, protocol):
    cfg = fake_config(rounds=5, eval_every=2, protocol=protocol)
    full_workers = make_workers()
    full, _ = run(cfg, full_workers, tmp_path / "full")

    first = make_workers()
    coord = Coordinator(cfg, CrashAt(first, crash_round=4), tmp_path / "split", task=FakeTask())
    with pytest.raises(KeyboardInterrupt):
        coord.run()
    # fused: the crashed message also carried round 3's train requests, so round 3 is not finished either
    done = 3 if protocol == "two_message" else 2
    assert json.loads((tmp_path / "split" / STATE_FILE).read_text())["round"] == done
    with pytest.raises(FileExistsError, match="resume"):
        Coordinator(cfg, InProcessTransport(first), tmp_path / "split", task=FakeTask())
    second = make_workers()
    resumed, summary = run(cfg, second, tmp_path / "split", resume=True)

    def same_run(items):  # the uninterrupted run is another run: another run id
        return [dataclasses.replace(item, run_id="r") for item in items]

    assert {p.run_id for p in second["a"].plans} == {coord.run_id}  # the resumed run kept its id
    for org in SKILLS:
        plans = first[org].plans[:done] + second[org].plans
        assert same_run(plans) == same_run(full_workers[org].plans)
        reqs = first[org].train_requests + second[org].train_requests
        assert same_run(reqs) == same_run(full_workers[org].train_requests)
    assert resumed.tracker.state_dict() == full.tracker.state_dict()
    assert sorted(summary.eval_history) == [0, 2, 4, 5]
    assert [e.round for e in second["a"].eval_requests] == [4, 5]  # round 0 not repeated
    assert summary.orgs["b"].rollouts_shared == full.summary().orgs["b"].rollouts_shared


def test_every_new_run_has_its_own_id_and_a_resumed_run_keeps_it(tmp_path):
    cfg = fake_config(rounds=2)
    ids = [run(cfg, make_workers(), tmp_path / name)[0].run_id for name in ("one", "two")]
    assert ids[0] != ids[1] and all(i.startswith(f"fake-{config_hash(cfg)}-") for i in ids)
    assert make_run_id(cfg) not in ids
    longer = fake_config(rounds=3)  # a changed config resumes under the id it started with
    resumed, summary = run(longer, make_workers(), tmp_path / "one", resume=True)
    assert resumed.run_id == summary.run_id == ids[0]
    assert all(p.run_id == ids[0] for p in resumed.transport.workers["a"].plans)


def test_one_info_line_per_round_and_the_eval_table(tmp_path, caplog):
    class Liar(FakeWorker):
        def generate(self, plan):
            batch = super().generate(plan)
            lies = tuple(Rollout(**{**r.__dict__, "reward": 1.0}) for r in batch.rollouts)
            return type(batch)(batch.run_id, batch.round, batch.org_id, lies, 1.0)

    workers = {"a": FakeWorker("a", 0.25), "b": FakeWorker("b", 0.5, fail_generate_rounds={2}), "c": Liar("c", 0.5)}
    with caplog.at_level("INFO", logger="hacrl_fed.coordinator.loop"):
        run(fake_config(rounds=2, eval_every=1), workers, tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    rounds = [line for line in lines if line.startswith("round ")]
    assert len(rounds) == 2, lines
    assert rounds[0].startswith("round 1/2 in ") and " s | reward a 0.250 b 0.500 | " in rounds[0]
    assert "accepted a 12 b 12 |" in rounds[0] and "rejected c 12" in rounds[0]
    assert rounds[0].endswith("| trained a b | excluded c (reward mismatch 6/12 in round 1)")
    assert "no rollouts from b (error)" in rounds[1] and "reward a 0.250 |" in rounds[1]
    evals = [line for line in lines if line.startswith("eval at round")]
    assert [e.split(":")[0] for e in evals] == ["eval at round 0", "eval at round 1", "eval at round 2"]
    assert "  a  0.250\n" in evals[0] + "\n" and "  a  0.250 -> 0.270  (+0.020)" in evals[2]


def test_resume_without_state_and_oversized_rounds_fail_clearly(tmp_path):
    cfg = fake_config()
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        Coordinator(cfg, InProcessTransport(make_workers()), tmp_path, resume=True, task=FakeTask())
    with pytest.raises(ValueError, match="federation.prompts_per_round=3 exceeds the 2 train prompts"):
        Coordinator(cfg, InProcessTransport(make_workers()), tmp_path, task=FakeTask(n_train=2))


def test_transport_orgs_outside_config_are_ignored(tmp_path):
    workers = make_workers()
    workers["intruder"] = FakeWorker("intruder", 1.0)
    coord, _ = run(fake_config(orgs=("a", "b"), rounds=1), workers, tmp_path)
    assert workers["intruder"].plans == [] and workers["c"].plans == []
    assert coord.live_orgs() == ["a", "b"]


def test_inprocess_transport_returns_exceptions_as_values():
    workers = make_workers(a={"fail_generate_rounds": {1}})
    transport = InProcessTransport(workers)
    plan_args = dict(run_id="r", round=1, task="fake", prompts=tuple(FakeTask().prompts("train", [0])))
    plans = {org: RoundPlan(sampling=SamplingParams(num_samples=2), **plan_args) for org in ("a", "b", "ghost")}
    out = transport.step({org: StepRequest(plan=plan) for org, plan in plans.items()}, timeout_s=1.0)
    assert isinstance(out["a"].raised["generate"], RuntimeError) and "RuntimeError" in out["a"].generate_error
    assert isinstance(out["ghost"], KeyError)  # no worker: the call itself failed
    assert len(out["b"].batch.rollouts) == 2 and set(transport.last_call_seconds) == {"a", "b", "ghost"}


# ------------------------------------------------------------------------------------------------ gRPC


@pytest.fixture
def grpc_workers(tmp_path):
    from hacrl_fed.wire import grpc_server

    workers = {"a": FakeWorker("a", 0.25), "b": FakeWorker("b", 0.75, delay_s=0.0)}
    servers = {org: grpc_server.serve_worker(w, "127.0.0.1:0") for org, w in workers.items()}
    yield workers, {org: s.address for org, s in servers.items()}
    for s in servers.values():
        s.stop(0)


def test_grpc_transport_runs_the_loop(tmp_path, grpc_workers):
    from hacrl_fed.coordinator.grpc_transport import GrpcTransport

    workers, addresses = grpc_workers
    transport = GrpcTransport(addresses, max_message_mb=16)
    try:
        ready = transport.wait_ready(10.0)
        assert {org: info["org_id"] for org, info in ready.items()} == {"a": "a", "b": "b"}
        with RunLogger(tmp_path, tensorboard=False) as logger:
            coord = Coordinator(fake_config(orgs=("a", "b"), rounds=2), transport, tmp_path, logger=logger,
                                task=FakeTask())
            summary = coord.run()
    finally:
        transport.close()
    assert [req.round for req in workers["a"].train_requests] == [1, 2]
    assert {r.org_id for r in workers["a"].train_requests[0].foreign} == {"b"}
    assert len(workers["b"].train_requests[1].foreign) == 12
    assert summary.capability == pytest.approx({"a": 0.25, "b": 0.75})
    assert workers["a"].checkpoints == [2]
    rec = read_metrics(tmp_path)[1]
    assert rec["bytes/step/a"] > 0 and rec["bytes/step/b"] > 0
    assert rec["bytes/step/total"] == rec["bytes/step/a"] + rec["bytes/step/b"]
    # one message per org and round: round 2's evaluation and checkpoint ride in its train's step; only round 0's
    # evaluation is a message of its own
    assert transport.messages_sent == {("step", "a"): 3, ("step", "b"): 3, ("evaluate", "a"): 1, ("evaluate", "b"): 1}


def test_grpc_transport_timeout_and_dead_worker_are_values(grpc_workers):
    from hacrl_fed.coordinator.grpc_transport import GrpcTransport
    from hacrl_fed.wire.grpc_client import WorkerCallError

    workers, addresses = grpc_workers
    workers["b"].hold = threading.Event()  # b answers only when the test lets it: after generate() returned
    transport = GrpcTransport({**addresses, "dead": "127.0.0.1:1"})
    plan = RoundPlan("r", 1, "fake", tuple(FakeTask().prompts("train", [0])), SamplingParams(num_samples=2))
    try:
        out = transport.step({org: StepRequest(plan=plan) for org in ("a", "b", "dead")}, timeout_s=0.5)
        b_still_held = not workers["b"].hold.is_set()
    finally:
        workers["b"].hold.set()
        transport.close()
    assert b_still_held and len(out["a"].batch.rollouts) == 2
    assert isinstance(out["b"], TimeoutError)  # had step() waited for b, b's batch would be here
    assert isinstance(out["dead"], WorkerCallError) and not isinstance(out["dead"], TimeoutError)
    assert set(transport.last_call_bytes) == {"a"}


@pytest.mark.parametrize("protocol, phases", [("two_message", ("generate", "train")), ("fused", ("step",))])
def test_phase_timings_include_exchange_overhead(tmp_path, protocol, phases):
    workers = make_workers()
    with RunLogger(tmp_path, tensorboard=False) as logger:
        run(fake_config(rounds=1, protocol=protocol), workers, tmp_path, logger=logger)
    rec = read_metrics(tmp_path)[1]
    for phase in phases:
        assert rec["time/" + phase] > 0
        for org in "abc":  # the fake workers report no time of their own: all of the call is exchange
            assert rec[f"time/exchange/{phase}/{org}"] == rec[f"time/call/{phase}/{org}"] > 0


def test_exchange_time_is_the_call_less_the_workers_own_phases():
    from hacrl_fed.coordinator.round_metrics import exchange_time as _exchange_time

    worker = {"time/generate": 0.5, "time/verify": 0.25, "time/update": 9.0, "time/a/b": 9.0, "gen/x": 9.0,
              "time/nan": float("nan"), "time/flag": "x"}
    metrics = {"time/call/generate/a": 2.0, "time/call/generate/b": 0.5}
    _exchange_time("generate", "a", worker, metrics)
    _exchange_time("generate", "b", worker, metrics)  # the worker says it took longer than the call: 0, not < 0
    _exchange_time("generate", "c", worker, metrics)  # no call time: no exchange time
    assert metrics["time/exchange/generate/a"] == 1.25 and metrics["time/exchange/generate/b"] == 0.0
    assert "time/exchange/generate/c" not in metrics
