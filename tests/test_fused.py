"""The fused round (``federation.protocol: fused``) and the one table of the operations.

* the table of :mod:`hacrl_fed.wire.operations`, the ``PolicyWorker`` service of worker.proto, the WorkerAPI and
  the Transport agree;
* a seeded run gives identical per-round rewards, counts, losses and final accuracies with the fused protocol as
  with the two-message protocol (in-process here; gRPC, Flower simulation and deployment in the slow tests of
  test_e2e_transports.py and test_deployment.py), with one message per org per round (the transport's counter);
* faults on the fused path: the train half or the generate half failing at the worker, a deadline miss,
  and a hostile step request refused before any work.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

import pytest

from helpers_fake_workers import FakeTask, FakeWorker, fake_config
from hacrl_fed.config import load_config
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.coordinator.loop import Coordinator
from hacrl_fed.coordinator.transport import Transport
from hacrl_fed.metrics import RunLogger, read_metrics
from hacrl_fed.types import EvalReport, EvalRequest, StepReply, StepRequest, TrainRequest
from hacrl_fed.v1 import worker_pb2 as pb
from hacrl_fed.wire import codec
from hacrl_fed.wire.codec import WireError
from hacrl_fed.wire.operations import OPERATIONS, SERVICE
from hacrl_fed.worker.api import WorkerAPI
from hacrl_fed.worker.guard import RequestRefused

# ------------------------------------------------------------------------------------------ one table


def test_the_table_the_proto_service_and_the_worker_api_agree():
    service = pb.DESCRIPTOR.services_by_name["PolicyWorker"]
    assert SERVICE == service.full_name == "hacrl_fed.v1.PolicyWorker"
    assert {op.rpc for op in OPERATIONS.values()} == {m.name for m in service.methods}
    worker_methods = {n for n, v in vars(WorkerAPI).items() if callable(v) and not n.startswith("_")}
    round_ops = {name for name, op in OPERATIONS.items() if not op.part}  # what a round needs
    assert round_ops == worker_methods == {"step", "evaluate", "checkpoint", "health"}
    for op in OPERATIONS.values():
        method = service.methods_by_name[op.rpc]
        assert (op.request_kind, op.reply_kind) == (method.input_type.name, method.output_type.name)
        assert codec.proto_class(op.request_kind) is getattr(pb, op.request_kind)
        assert method.GetOptions().deprecated == bool(op.part), op.rpc  # Generate, Train: halves of Step
        if not op.part:
            params = [p for p in inspect.signature(getattr(WorkerAPI, op.name)).parameters if p != "self"]
            assert bool(params) == op.takes_request, op.name
    assert {op.rpc for op in OPERATIONS.values() if op.part} == {"Generate", "Train"}
    assert {n for n in OPERATIONS if n in vars(Transport)} == round_ops  # no generate / train on a Transport
    assert len({op.message_type for op in OPERATIONS.values()}) == len(OPERATIONS)


def test_step_messages_round_trip_and_refuse_what_is_not_a_step():
    plan = fake_plan(2)
    req = StepRequest(plan=plan)
    assert codec.decode("StepRequest", codec.encode(req)) == req
    full = StepRequest(plan=plan, evaluate=EvalRequest("r", 1, "fake", plan.prompts, 8), checkpoint=1)
    assert codec.decode("StepRequest", codec.encode(full)) == full
    with pytest.raises(WireError, match="neither train, plan, evaluate nor checkpoint"):
        codec.encode(StepRequest())
    with pytest.raises(WireError, match="neither train, plan, evaluate nor checkpoint"):
        codec.decode("StepRequest", pb.StepRequest(schema_version=1).SerializeToString())
    bad = pb.StepReply(schema_version=1, generate_error="x")
    bad.batch.CopyFrom(codec.to_proto(FakeWorker("a").generate(plan)))
    with pytest.raises(WireError, match="both batch and generate_error"):
        codec.decode("StepReply", bad.SerializeToString())


def test_a_step_does_train_evaluate_checkpoint_then_generate_and_each_part_fails_alone():
    order = []

    class Ordered(FakeWorker):
        def train(self, request):
            order.append("train")
            return super().train(request)

        def evaluate(self, request):
            order.append("evaluate")
            raise RuntimeError("eval set missing")

        def checkpoint(self, round):
            order.append("checkpoint")
            return super().checkpoint(round)

        def generate(self, plan):
            order.append("generate")
            return super().generate(plan)

    worker = Ordered("a")
    worker.step(StepRequest(plan=fake_plan(1)))
    order.clear()
    train = TrainRequest("r", 1, "a", fake_plan(1).prompts, (), {"a": 1.0})
    request = StepRequest(train, fake_plan(2), EvalRequest("r", 1, "fake", fake_plan(1).prompts, 8), 1)
    reply = worker.step(request)
    assert order == ["train", "evaluate", "generate", "checkpoint"]  # the checkpoint holds the step's generation
    assert reply.report is not None and reply.checkpoint == "/tmp/fake/a/round-1" and reply.batch.round == 2
    assert reply.eval_report is None and "eval set missing" in reply.eval_error  # only that part failed
    assert codec.decode("StepReply", codec.encode(reply)) == reply  # the failure travels as text
    bad = codec.to_proto(reply)
    bad.eval_report.CopyFrom(codec.to_proto(EvalReport("r", 1, "a", 0.5, 2)))
    with pytest.raises(WireError, match="both eval_report and eval_error"):
        codec.decode("StepReply", bad.SerializeToString())


def fake_plan(round: int):
    from hacrl_fed.types import RoundPlan, SamplingParams

    return RoundPlan("r", round, "fake", tuple(FakeTask().prompts("train", [0, 1])), SamplingParams(num_samples=2))


# ------------------------------------------------------------------------------ same numbers, one message


def run_fakes(tmp_path, protocol, **workers_kw):
    workers = {o: FakeWorker(o, s, **workers_kw.get(o, {})) for o, s in {"a": 0.25, "b": 0.5, "c": 0.75}.items()}
    transport = InProcessTransport(workers)
    cfg = fake_config(rounds=4, eval_every=2, checkpoint_every=2, protocol=protocol)
    with RunLogger(tmp_path, tensorboard=False) as logger:
        summary = Coordinator(cfg, transport, tmp_path, logger=logger, task=FakeTask()).run()
    return summary, workers, transport, {r["round"]: r for r in read_metrics(tmp_path)}


def learning(rec: dict) -> dict:
    """What depends on weights and data: no timings, sizes, message counts or wall clocks."""
    return {k: v for k, v in rec.items() if not {"time", "cpu", "bytes", "messages", "wall_time", "perf"} & set(k.split("/"))}


def test_fused_counts_one_message_per_org_per_round_and_the_workers_see_the_same_requests(tmp_path):
    _, two_workers, two, two_rec = run_fakes(tmp_path / "two", "two_message")
    _, fused_workers, fused, fused_rec = run_fakes(tmp_path / "fused", "fused")
    for org in "abc":
        # every message is a step; evaluations (rounds 2, 4) and checkpoints (2, 4) ride in the train's message
        assert two.messages_sent["step", org] == 8  # 4 rounds: a plan-only step, then a train-only step
        assert fused.messages_sent["step", org] == 5  # 4 rounds: 4 plans + the last round's train alone
        for sent in (two.messages_sent, fused.messages_sent):  # besides: round 0's evaluation, the first challenge
            assert {op: n for (op, o), n in sent.items() if o == org and op != "step"} == {"evaluate": 1, "health": 1}
        assert [fused_rec[t][f"round/{org}/messages"] for t in (1, 2, 3, 4)] == [1, 1, 1, 2]
        assert [two_rec[t][f"round/{org}/messages"] for t in (1, 2, 3, 4)] == [2, 2, 2, 2]
        same_run = lambda items: [dataclasses.replace(x, run_id="r") for x in items]  # noqa: E731
        assert same_run(fused_workers[org].plans) == same_run(two_workers[org].plans)  # (run ids differ)
        assert same_run(fused_workers[org].train_requests) == same_run(two_workers[org].train_requests)
        assert fused_workers[org].checkpoints == two_workers[org].checkpoints == [2, 4]
    assert {t: learning(r) for t, r in fused_rec.items()} == {t: learning(r) for t, r in two_rec.items()}


@pytest.fixture(scope="module")
def micro_runs(tmp_path_factory):
    """Real micro agents, in-process, 3 rounds, once per protocol (evaluation and checkpoints every 2 rounds)."""
    from hacrl_fed.worker import build_worker
    from test_faults import micro_config

    out = {}
    for protocol in ("two_message", "fused"):
        tmp = tmp_path_factory.mktemp(protocol)
        cfg = load_config(micro_config(tmp, orgs=("a", "b"), rounds=3, min_orgs=1, checkpoint_every=2,
                                       protocol=protocol))
        workers = {o.id: build_worker(cfg, o.id, run_dir=tmp / "run") for o in cfg.orgs}
        transport = InProcessTransport(workers)
        with RunLogger(tmp / "run", tensorboard=False) as logger:
            summary = Coordinator(cfg, transport, tmp / "run", logger=logger).run()
        out[protocol] = (summary, {r["round"]: r for r in read_metrics(tmp / "run")}, transport.messages_sent)
    return out


@pytest.mark.timeout(300)
def test_real_agents_give_identical_numbers_with_either_protocol(micro_runs):
    (two, two_rec, _), (fused, fused_rec, sent) = micro_runs["two_message"], micro_runs["fused"]
    assert sorted(fused_rec) == sorted(two_rec) == [0, 1, 2, 3]
    for t in (1, 2, 3):
        for org in ("a", "b"):
            for key in ("accuracy", "rollouts_accepted", "rollouts_rejected"):
                assert fused_rec[t][f"round/{org}/{key}"] == two_rec[t][f"round/{org}/{key}"], (t, org, key)
            assert fused_rec[t][f"{org}/train/loss"] == two_rec[t][f"{org}/train/loss"], (t, org)
    assert any(two_rec[t][f"{o}/train/grad_norm"] > 0 for t in (1, 2, 3) for o in "ab"), "nothing trained"
    assert {t: learning(r) for t, r in fused_rec.items()} == {t: learning(r) for t, r in two_rec.items()}
    assert fused.eval_history == two.eval_history and fused.capability == two.capability
    assert sent["step", "a"] == 4 and sent["generate", "a"] == 0


# ------------------------------------------------------------------------------------------ faults


def test_a_failed_train_half_still_generates_and_counts_as_a_failed_train(tmp_path):
    class TrainFails(FakeWorker):
        def train(self, request):
            if request.round == 2:
                raise RuntimeError("out of memory in the update")
            return super().train(request)

    workers = {"a": FakeWorker("a", 0.25), "b": TrainFails("b", 0.5)}
    cfg = fake_config(orgs=("a", "b"), rounds=3, eval_every=0, checkpoint_every=0)
    with RunLogger(tmp_path, tensorboard=False) as logger:
        Coordinator(cfg, InProcessTransport(workers), tmp_path, logger=logger, task=FakeTask()).run()
    rec = {r["round"]: r for r in read_metrics(tmp_path)}
    assert rec[2]["round/b/train_failed"] == 1.0 and rec[2]["round/b/train_failure/error"] == 1.0
    assert rec[2]["round/a/train_failed"] == 0.0
    assert rec[3]["round/b/failed"] == 0.0 and rec[3]["round/b/rollouts_accepted"] == 12.0  # its plan 3 was served
    assert [p.round for p in workers["b"].plans] == [1, 2, 3]
    assert rec[3]["round/b/train_failed"] == 0.0


def test_a_failed_generate_half_keeps_the_train_report(tmp_path):
    workers = {"a": FakeWorker("a", 0.25), "b": FakeWorker("b", 0.5, fail_generate_rounds={2})}
    cfg = fake_config(orgs=("a", "b"), rounds=3, eval_every=0, checkpoint_every=0)
    with RunLogger(tmp_path, tensorboard=False) as logger:
        coord = Coordinator(cfg, InProcessTransport(workers), tmp_path, logger=logger, task=FakeTask())
        coord.run()
    rec = {r["round"]: r for r in read_metrics(tmp_path)}
    assert rec[1]["round/b/train_failed"] == 0.0 and rec[1]["b/hacpo/loss"] == pytest.approx(0.1)  # same message
    assert rec[2]["round/b/failed"] == 1.0 and rec[2]["round/b/failure/error"] == 1.0
    assert "round/b/train_failed" not in rec[2]  # no batch in round 2: nothing to train on
    assert [r.round for r in workers["b"].train_requests] == [1, 3]
    assert coord.tracker.history("b") == [0.5, 0.5]


@pytest.mark.timeout(60)
def test_a_deadline_miss_fails_both_halves_of_the_message_and_the_org_rejoins(tmp_path):
    from hacrl_fed.coordinator.grpc_transport import GrpcTransport
    from hacrl_fed.wire.grpc_server import serve_worker

    release = threading.Event()

    class Stalls(FakeWorker):
        def generate(self, plan):
            if plan.round == 2:
                release.wait(30)
            return super().generate(plan)

    workers = {"a": FakeWorker("a", 0.25), "c": Stalls("c", 0.75)}
    servers = [serve_worker(w, "127.0.0.1:0") for w in workers.values()]
    transport = GrpcTransport({org: s.address for org, s in zip(workers, servers)})

    def on_round(result):
        if result.round == 2:
            release.set()  # c's stuck round-2 generate ends; its reply is long gone

    cfg = fake_config(orgs=("a", "c"), rounds=4, eval_every=0, checkpoint_every=0, round_timeout_s=0.6)
    try:
        with RunLogger(tmp_path, tensorboard=False) as logger:
            summary = Coordinator(cfg, transport, tmp_path, logger=logger, task=FakeTask(),
                                  on_round=on_round).run()
    finally:
        transport.close()
        for s in servers:
            s.stop(0)
    rec = {r["round"]: r for r in read_metrics(tmp_path)}
    # the message with c's round-1 train and round-2 plan timed out: the coordinator cannot tell how far c got
    assert rec[1]["round/c/train_failure/timeout"] == 1.0
    assert rec[2]["round/c/failed"] == 1.0 and rec[2]["round/c/failure/timeout"] == 1.0
    assert rec[4]["round/c/failed"] == 0.0 and rec[4]["round/c/rollouts_accepted"] == 12.0
    assert [r.round for r in workers["a"].train_requests] == [1, 2, 3, 4]
    assert all({r.round for r in req.foreign} <= {req.round} for req in workers["a"].train_requests)
    assert summary.rounds_completed == 4


def test_hostile_step_requests_are_refused_before_any_work(tmp_path):
    from hacrl_fed.types import TrainRequest
    from hacrl_fed.worker import build_worker
    from test_faults import micro_config

    cfg = load_config(micro_config(tmp_path, orgs=("a", "b"), rounds=2, min_orgs=1))
    worker = build_worker(cfg, "a", run_dir=tmp_path / "run")
    updates = []
    real_update = worker.trainer.update
    worker.trainer.update = lambda *a, **kw: updates.append(1) or real_update(*a, **kw)
    from hacrl_fed.coordinator.loop import sampling_params
    from hacrl_fed.tasks import get_task
    from hacrl_fed.types import RoundPlan

    task = get_task(cfg.task.name, cfg.task.params, seed=cfg.seed)
    prompts = tuple(task.prompts("train", [0, 1]))
    plan = lambda r, **kw: RoundPlan("run", r, cfg.task.name, prompts, kw.get("sp", sampling_params(cfg, "a", r)))  # noqa: E731
    first = worker.step(StepRequest(plan=plan(1)))
    assert isinstance(first, StepReply) and first.batch is not None and first.batch.round == 1
    train = TrainRequest("run", 1, "a", prompts, (), {"a": 1.0, "b": 1.0})

    too_big = dataclasses.replace(sampling_params(cfg, "a", 2), num_samples=99)
    hostile = {
        "step_mismatch": StepRequest(train=train, plan=plan(3)),
        "wrong_org": StepRequest(train=dataclasses.replace(train, org_id="b"), plan=plan(2)),
        "over_limit": StepRequest(train=train, plan=plan(2, sp=too_big)),
        "wrong_run": StepRequest(train=train, plan=dataclasses.replace(plan(2), run_id="other")),
    }
    for reason, request in hostile.items():
        with pytest.raises(RequestRefused) as err:
            worker.step(request)
        assert err.value.reason in (reason, "step_mismatch"), (reason, err.value.reason)
    assert updates == [] and worker.last_round == 0  # nothing trained
    ok = worker.step(StepRequest(train=train, plan=plan(2)))
    assert ok.report is not None and ok.batch is not None and ok.batch.round == 2
    assert updates == [1, 1]  # the learner's update and its outcome guard's shadow's (the guard is on by default)
    stale = worker.step(StepRequest(train=train))  # round 1 again: refused as a train of a round not generated
    assert stale.report is None and "not_generated" in stale.train_error
