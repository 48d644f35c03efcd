"""FlowerTransport, node -> org discovery, the ClientApp's dispatch (simulation and deployment modes) and the
ServerApp's run_federation, over an in-memory fake Grid that calls the real ``client.app:app``. No Ray: seconds."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from uuid import uuid4

import pytest
import yaml
from flwr.app import ConfigRecord, Context, RecordDict

from client.app import app as client_app
from hacrl_fed.coordinator.transport import TransportTimeout
from hacrl_fed.flower import node
from hacrl_fed.flower import transport as flower_transport
from hacrl_fed.flower.federation import run_federation
from hacrl_fed.flower.settings import ENV_VAR, SettingsError
from hacrl_fed.flower.transport import (
    MAX_POLL_S, DiscoveryError, FlowerRemoteError, FlowerTransport, OrgUnavailable, assign_orgs, discover_orgs,
)
from hacrl_fed.flower import records
from hacrl_fed.types import ChatMessage, EvalRequest, Prompt, RoundPlan, SamplingParams, StepRequest, TrainRequest
from hacrl_fed.wire import codec
from hacrl_fed.wire import operations as ops
from helpers_fake_workers import FakeWorker

APP_DIR = Path(__file__).resolve().parents[1]
SKILLS = {"a": 0.25, "b": 0.75, "c": 0.5}
BUILT: list[str] = []


def make_fake_worker(cfg, org_id, *, run_dir, resume=False):
    """``worker-factory`` for these tests: a FakeWorker per org (records that it was built)."""
    BUILT.append(org_id)
    return FakeWorker(org_id, SKILLS[org_id], fail_generate_rounds={13})


@pytest.fixture(autouse=True)
def flower_identity():
    """Let ``flwr.app.Message(...)`` be built outside a Flower runtime (it reads the process's task identity)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 4242, 0
    node.release_simulation_workers()
    BUILT.clear()
    yield
    node.release_simulation_workers()
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


class FakeGrid:
    """A Grid whose nodes run ``client.app:app`` synchronously when their replies are pulled.

    ``silent`` nodes never answer; pushes to ``refuse`` nodes are dropped like the SuperLink drops bad messages.
    """

    def __init__(self, contexts: dict[int, Context], *, silent=(), refuse=()):
        self.contexts, self.silent, self.refuse = contexts, set(silent), set(refuse)
        self.inbox: dict[str, object] = {}
        self.pushed: list[object] = []

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid4().hex
            self.pushed.append(msg)
            if msg.metadata.dst_node_id not in self.refuse:
                self.inbox[msg.metadata.message_id] = msg
                ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        out = []
        for mid in list(message_ids):
            msg = self.inbox.get(mid)
            if msg is None or msg.metadata.dst_node_id in self.silent:
                continue
            del self.inbox[mid]
            reply = client_app(msg, self.contexts[msg.metadata.dst_node_id])
            reply.metadata.__dict__["_message_id"] = uuid4().hex
            out.append(reply)
        return out


def write_config(tmp_path: Path, orgs=("a", "b"), **federation) -> Path:
    fed = {"rounds": 2, "prompts_per_round": 2, "eval_every": 1, "min_orgs": 1, "round_timeout_s": 10.0,
           **federation}
    data = {"name": "flower-test", "seed": 3, "run_dir": str(tmp_path / "runs"),
            "generation": {"num_samples": 2, "max_new_tokens": 8, "eval_max_new_tokens": 8},
            "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 3},
            "orgs": [{"id": o, "model": {"zoo": "tiny"}} for o in orgs], "federation": fed,
            "security": {"signing": False}}  # the fake workers do not sign
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def sim_contexts(config: Path, n: int, *, run_id: int = 7, **extra) -> dict[int, Context]:
    """``n`` simulated nodes with random-looking ids, partition i, run config pointing at ``config``."""
    run_config = {"config-path": str(config), "overrides": "",
                  "worker-factory": "test_flower_transport:make_fake_worker", **extra}
    return {9000 + 17 * i: Context(run_id=run_id, node_id=9000 + 17 * i,
                                   node_config={"partition-id": i, "num-partitions": n},
                                   state=RecordDict(), run_config=run_config) for i in range(n)}


def _plan(round: int = 1) -> RoundPlan:
    prompts = (Prompt(1, (ChatMessage("user", "1+1"),), "2"), Prompt(2, (ChatMessage("user", "2+2"),), "4"))
    return RoundPlan("run-x", round, "arithmetic", prompts, SamplingParams(num_samples=2, max_new_tokens=8))


def test_discovery_maps_partitions_to_config_orgs(tmp_path):
    grid = FakeGrid(sim_contexts(write_config(tmp_path, ("a", "b", "c")), 3))
    found = discover_orgs(grid, ["a", "b", "c"], timeout_s=5)
    assert found == {9000: "a", 9017: "b", 9034: "c"}
    assert sorted(BUILT) == ["a", "b", "c"]  # the health query built each in-process worker once
    assert all(m.metadata.message_type == "query.health" for m in grid.pushed)


def test_transport_round_trip_every_operation(tmp_path):
    grid = FakeGrid(sim_contexts(write_config(tmp_path), 2))
    transport = FlowerTransport(grid, discover_orgs(grid, ["a", "b"], 5), expected_orgs=["a", "b"])
    assert transport.org_ids() == ["a", "b"]
    plan = _plan()
    replies = transport.step({"a": StepRequest(plan=plan), "b": StepRequest(plan=plan)}, timeout_s=5)
    batches = {org: r.batch for org, r in replies.items()}
    assert {org: (b.org_id, len(b.rollouts), b.accuracy) for org, b in batches.items()} == {
        "a": ("a", 4, 0.25), "b": ("b", 4, 0.75)}
    assert set(transport.last_call_bytes) == {"a", "b"}
    assert transport.last_call_bytes["a"] == len(codec.encode(StepRequest(plan=plan))) + len(codec.encode(replies["a"]))
    assert all(0 <= s < 5 for s in transport.last_call_seconds.values())
    assert grid.pushed[-1].metadata.message_type == "train.step" and grid.pushed[-1].metadata.group_id == "1"
    assert grid.pushed[-1].metadata.ttl == pytest.approx(5 + transport.ttl_grace_s)
    req = TrainRequest("run-x", 1, "a", plan.prompts, batches["b"].rollouts, {"a": 0.25, "b": 0.75})
    evaluate = EvalRequest("run-x", 1, "arithmetic", plan.prompts, 8)
    step = transport.step({"a": StepRequest(train=req, evaluate=evaluate, checkpoint=1)}, timeout_s=5)["a"]
    assert step.report.metrics["hacpo/foreign"] == 4.0 and grid.pushed[-1].metadata.message_type == "train.step"
    assert grid.pushed[-1].metadata.group_id == "1"  # a step without a plan: the round of its train request
    assert step.eval_report.num_prompts == 2 and step.checkpoint == "/tmp/fake/a/round-1"  # in the same message
    evals = transport.evaluate({"b": evaluate}, timeout_s=5)
    assert evals["b"].num_prompts == 2 and grid.pushed[-1].metadata.message_type == "evaluate"
    assert transport.checkpoint(["a", "b"], 1, timeout_s=5) == {"a": "/tmp/fake/a/round-1",
                                                                "b": "/tmp/fake/b/round-1"}
    # the deprecated message type is still served, as the plan-only half of a step
    old = flower_transport.exchange(grid, ops.GENERATE, {9017: records.pack(_plan(2))}, timeout_s=5)
    assert flower_transport.decode_reply(ops.GENERATE, "b", old[9017][0]).round == 2
    health = transport.health(["a"], timeout_s=5)["a"]  # a trained once
    assert health["org_id"] == "a" and health["node_mode"] == "simulation" and health["round"] == "1"
    assert BUILT == ["a", "b"]  # cached: built once per (run, org)


def test_worker_failure_becomes_remote_error_for_that_org_only(tmp_path):
    grid = FakeGrid(sim_contexts(write_config(tmp_path), 2))
    transport = FlowerTransport(grid, discover_orgs(grid, ["a", "b"], 5))
    out = transport.step({o: StepRequest(plan=_plan(13)) for o in "ab"}, timeout_s=5)  # FakeWorkers fail round 13
    assert out["a"].batch is None and "a is down in round 13" in out["a"].generate_error  # that part, in the reply
    out = transport.step({"a": TrainRequest("r", 1, "a", (), (), {}), "b": StepRequest(plan=_plan())}, timeout_s=5)
    assert isinstance(out["a"], FlowerRemoteError) and out["a"].code == 2  # a request of the wrong kind
    assert "step on org 'a'" in str(out["a"]) and "expected 'StepRequest', got 'TrainRequest'" in str(out["a"])
    assert out["b"].batch.org_id == "b" and set(transport.last_call_bytes) == {"b"}


class FakeClock:
    """``time`` for the transport module: ``sleep`` advances ``monotonic`` at once and is recorded."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_silent_refused_and_missing_orgs(tmp_path, monkeypatch):
    contexts = sim_contexts(write_config(tmp_path, ("a", "b", "c")), 3)
    grid = FakeGrid(contexts)
    transport = FlowerTransport(grid, discover_orgs(grid, ["a", "b", "c"], 5))
    grid.silent, grid.refuse = {9017}, {9034}
    clock = FakeClock()
    monkeypatch.setattr(flower_transport, "time", clock)
    out = transport.step({org: StepRequest(plan=_plan()) for org in ("a", "b", "c", "zeta")}, timeout_s=0.5)
    # it waited for the silent node exactly until the deadline, in polls no longer than MAX_POLL_S
    assert clock.now == pytest.approx(0.5) and max(clock.sleeps) <= MAX_POLL_S and len(clock.sleeps) < 20
    assert out["a"].batch.org_id == "a"
    assert isinstance(out["b"], TransportTimeout) and "within 0.5 s" in str(out["b"])
    assert isinstance(out["c"], OrgUnavailable) and "refused" in str(out["c"])
    assert isinstance(out["zeta"], OrgUnavailable) and "no connected Flower node" in str(out["zeta"])
    assert set(transport.last_call_bytes) == {"a"}


def test_refresh_drops_departed_nodes_and_discovers_new_ones(tmp_path):
    contexts = sim_contexts(write_config(tmp_path, ("a", "b", "c")), 3)
    grid = FakeGrid({n: c for n, c in contexts.items() if n != 9034})
    transport = FlowerTransport(grid, discover_orgs(grid, ["a", "b", "c"], 0.2, min_orgs=2),
                                expected_orgs=["a", "b", "c"])
    assert transport.org_ids() == ["a", "b"]
    del grid.contexts[9000]
    grid.contexts[9034] = contexts[9034]
    assert transport.org_ids() == ["b", "c"]
    assert transport.org_by_node == {9017: "b", 9034: "c"}


def test_failed_nodes_are_asked_again_only_after_retry_failed_s(tmp_path):
    contexts = sim_contexts(write_config(tmp_path), 2)
    grid = FakeGrid(contexts)
    transport = FlowerTransport(grid, discover_orgs(grid, ["a", "b"], 5), retry_failed_s=60)
    grid.contexts[5] = Context(run_id=7, node_id=5, node_config={"partition-id": 9, "num-partitions": 3},
                               state=RecordDict(), run_config=contexts[9000].run_config)  # serves no org
    health_to_5 = lambda: sum(m.metadata.dst_node_id == 5 for m in grid.pushed)  # noqa: E731
    assert transport.org_ids() == ["a", "b"] and health_to_5() == 1
    assert transport.org_ids() == ["a", "b"] and health_to_5() == 1  # not asked again within 60 s
    transport.retry_failed_s = 0
    assert transport.org_ids() == ["a", "b"] and health_to_5() == 2


def test_discovery_errors(tmp_path):
    grid = FakeGrid(sim_contexts(write_config(tmp_path, ("a", "b")), 2))
    with pytest.raises(DiscoveryError, match=r"only 2 of 3 orgs .* missing \['c'\]"):
        discover_orgs(grid, ["a", "b", "c"], timeout_s=0.3, poll_s=0.05)
    assert discover_orgs(grid, ["a", "b", "c"], timeout_s=0.3, poll_s=0.05, min_orgs=2) == {9000: "a", 9017: "b"}
    got = assign_orgs({1: {"org_id": "a"}, 2: {"org_id": "a"}, 3: {"org_id": "x"}, 4: RuntimeError("down")},
                      ["a", "b"])
    assert (got.new, list(got.duplicate), list(got.unknown), list(got.failed)) == ({1: "a"}, [2], [3], [4])
    twins = sim_contexts(write_config(tmp_path, ("a", "b")), 2)
    for ctx in twins.values():
        ctx.node_config["partition-id"] = 0  # both nodes claim org "a"
    with pytest.raises(DiscoveryError, match="two Flower nodes claim the same org"):
        discover_orgs(FakeGrid(twins), ["a", "b"], timeout_s=1)


def test_node_errors_are_replied_not_raised(tmp_path):
    config = write_config(tmp_path)
    contexts = sim_contexts(config, 2)
    contexts[9017].node_config["partition-id"] = 5  # more partitions than orgs
    contexts[1] = Context(run_id=7, node_id=1, node_config={}, state=RecordDict(), run_config={})
    out = FlowerTransport(FakeGrid(contexts), {9017: "b", 1: "c"}).step({o: StepRequest(plan=_plan()) for o in "bc"}, 5)
    assert "partition-id 5 but the config has 2 orgs" in str(out["b"])
    assert "names no worker" in str(out["c"]) and "--node-config" in str(out["c"])


def test_simulation_guard_detects_a_second_actor_process(tmp_path):
    contexts = sim_contexts(write_config(tmp_path), 2)
    contexts[9000].state.config_records[node.STATE_KEY] = ConfigRecord({"pid": os.getpid() + 1, "host": "elsewhere"})
    out = FlowerTransport(FakeGrid(contexts), {9000: "a"}).step({"a": StepRequest(plan=_plan())}, 5)
    assert isinstance(out["a"], FlowerRemoteError) and "exactly one ClientApp actor" in str(out["a"])


def test_deployment_mode_forwards_to_a_grpc_worker(tmp_path):
    from hacrl_fed.wire.grpc_server import serve_worker

    servers = {org: serve_worker(FakeWorker(org, SKILLS[org]), "127.0.0.1:0") for org in ("a", "b")}
    try:
        contexts = {
            50: Context(run_id=1, node_id=50, state=RecordDict(), run_config={},
                        node_config={"org": "a", "worker": servers["a"].address}),
            51: Context(run_id=1, node_id=51, state=RecordDict(), run_config={},  # points at b's worker
                        node_config={"org": "c", "worker": servers["b"].address}),
        }
        grid = FakeGrid(contexts)
        infos = discover_orgs(grid, ["a", "c"], timeout_s=0.5, min_orgs=1)
        assert infos == {50: "a"}
        out = FlowerTransport(grid, {50: "a", 51: "c"}).step({o: StepRequest(plan=_plan()) for o in "ac"}, 5)
        assert out["a"].batch.org_id == "a" and out["a"].batch.accuracy == 0.25
        assert "the worker answered as org 'b'; this node serves 'c'" in str(out["c"])
        assert BUILT == []  # no in-process worker in deployment mode
    finally:
        for server in servers.values():
            server.stop(0)


def test_run_federation_runs_the_coordinator(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    config = write_config(tmp_path, ("a", "b", "c"))
    run_dir = tmp_path / "run"
    grid = FakeGrid(sim_contexts(config, 3, **{"run-dir": str(run_dir)}))
    run_config = {"config-path": str(config), "overrides": "federation.rounds=3", "run-dir": str(run_dir)}
    summary = run_federation(grid, run_config, app_dir=APP_DIR)
    assert summary.rounds_completed == 3 and summary.skipped_rounds == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [rec["round"] for rec in lines] == [0, 1, 2, 3]
    assert all(rec[f"bytes/step/{org}"] > 0 for rec in lines[1:] for org in "abc")
    assert all(rec[f"round/{org}/messages"] == (1 if rec["round"] < 3 else 2) for rec in lines[1:] for org in "abc")
    types = [m.metadata.message_type for m in grid.pushed]  # fused: 3 rounds = 3 plans + 1 closing train, per org
    assert types.count("train.step") == 12 and types.count("query.generate") == 0 and types.count("train") == 0
    # one message per org and round, evaluation (every round) and checkpoint (the last) rounds included: only the
    # evaluation before round 1 is a message of its own
    assert types.count("evaluate") == 3 and types.count("query.checkpoint") == 0 and types[:3] == ["query.health"] * 3
    assert all(f"eval/{org}/accuracy" in rec for rec in lines for org in "abc")


def test_run_federation_resumes(tmp_path):
    config = write_config(tmp_path)
    run_dir = tmp_path / "run"
    base = {"config-path": str(config), "run-dir": str(run_dir)}
    first = run_federation(FakeGrid(sim_contexts(config, 2, run_id=1, **base)), base, app_dir=APP_DIR)
    assert first.rounds_completed == 2
    more = {**base, "overrides": "federation.rounds=3", "resume": True}
    second = run_federation(FakeGrid(sim_contexts(config, 2, run_id=2, **more)), more, app_dir=APP_DIR)
    assert second.rounds_completed == 3
    rounds = [json.loads(line)["round"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2, 3]
    (run_dir / "config.yaml").write_text("kept")
    with pytest.raises(SettingsError, match="already holds a run"):
        run_federation(FakeGrid(sim_contexts(config, 2, run_id=3, **base)), base, app_dir=APP_DIR)
    assert (run_dir / "config.yaml").read_text() == "kept"


def test_deployment_mode_uses_mutual_tls_when_node_config_names_the_keys(tmp_path):
    from hacrl_fed.security.keys import write_keys
    from hacrl_fed.wire.grpc_server import WorkerTLS, serve_worker

    keys = write_keys(tmp_path / "keys", ["a"], ["127.0.0.1"])
    tls = WorkerTLS(keys.worker_cert("a"), keys.worker_key("a"), keys.ca_cert, client_names=("a-client",))
    server = serve_worker(FakeWorker("a", SKILLS["a"]), "127.0.0.1:0", tls=tls)
    mtls = {"worker-ca": str(keys.ca_cert), "worker-cert": str(keys.worker_client_cert("a")),
            "worker-key": str(keys.worker_client_key("a"))}

    def ctx(node_id: int, **config) -> Context:
        return Context(run_id=1, node_id=node_id, state=RecordDict(), run_config={},
                       node_config={"org": "a", "worker": server.address, **config})

    try:
        contexts = {
            60: ctx(60, **mtls),
            61: ctx(61),  # no client certificate: the worker's handshake refuses it
            62: ctx(62, **{"worker-ca": mtls["worker-ca"]}),
            63: ctx(63, worker="10.1.2.3:50051"),  # refused before dialling
        }
        transport = FlowerTransport(FakeGrid(contexts), {60: "a", 61: "b", 62: "c", 63: "d"})
        out = transport.step({org: StepRequest(plan=_plan()) for org in "abcd"}, 5)
        assert out["a"].batch.org_id == "a" and out["a"].batch.accuracy == 0.25
        assert "UNAVAILABLE" in str(out["b"])
        assert "mutual TLS needs all of ['worker-ca', 'worker-cert', 'worker-key']" in str(out["c"])
        assert "'10.1.2.3:50051' is neither a unix: socket nor loopback: set worker-ca" in str(out["d"])
    finally:
        server.stop(0)


def test_asynchronous_rounds_push_each_step_and_pull_replies_as_they_come(tmp_path, monkeypatch):
    """K = 1 over the ServerApp: every step is pushed alone as soon as the bound lets it (one message per push) and
    its reply pulled by the in-flight thread; the bound holds, every org trains every round, every (learner, foreign
    batch) pair is taken once or counted, and the transport's pulling thread is stopped at the end."""
    from hacrl_fed.coordinator.async_driver import AsyncDriver

    monkeypatch.delenv(ENV_VAR, raising=False)
    drivers, run = [], AsyncDriver.run
    monkeypatch.setattr(AsyncDriver, "run", lambda self: (drivers.append(self), run(self))[1])
    config = write_config(tmp_path, ("a", "b", "c"), staleness=1, rounds=4, checkpoint_every=2)
    run_dir = tmp_path / "run"
    grid = FakeGrid(sim_contexts(config, 3, **{"run-dir": str(run_dir)}))
    pushes: list[int] = []
    push = grid.push_messages
    grid.push_messages = lambda messages: (pushes.append(len(messages)), push(messages))[1]
    summary = run_federation(grid, {"config-path": str(config), "run-dir": str(run_dir)}, app_dir=APP_DIR)
    (drv,) = drivers
    assert drv.wall and summary.rounds_completed == 4
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [rec["round"] for rec in lines] == [0, 1, 2, 3, 4]
    steps = [m for m in grid.pushed if m.metadata.message_type == "train.step"]
    assert len(steps) == 3 * 5 and set(pushes[-15:]) == {1}  # 4 plans + 1 closing train per org, pushed one by one
    assert lines[-1]["async/a/version"] == lines[-1]["async/b/version"] == lines[-1]["async/c/version"] == 4
    for step in drv.steps:  # the staleness bound: every other org had published round - K - 1 when it started
        for other in "abc":
            published = [t.round for at, t in drv.published if t.source == other and at <= step.start]
            assert other == step.org or step.round - 2 <= max(published, default=0), (step, other)
    for org in "abc":
        offered = [(t.source, t.round) for s in drv.steps if s.org == org for t in s.foreign]
        assert offered and len(offered) == len(set(offered))
        assert len(offered) + sum(drv.refused[org].values()) == len([t for _, t in drv.published if t.source != org])
    assert not grid.inbox and not any(t.name == "flower-inflight" and t.is_alive() for t in threading.enumerate())
