"""The trust attacks over real gRPC: a hostile client on the worker port, a lying org behind the gRPC transport,
and coordinator-blind mode with worker processes (no rollout text reaches the coordinator process in plaintext).
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.grpc_transport import GrpcTransport
from hacrl_fed.security.identity import identity_path, load_identity
from hacrl_fed.security.keyring import auto_keys_dir
from hacrl_fed.security.sealing import open_batch
from hacrl_fed.types import RolloutBatch, TrainRequest
from hacrl_fed.wire import codec
from hacrl_fed.wire.grpc_client import GrpcWorkerClient, WorkerCallError
from hacrl_fed.wire.grpc_server import serve_worker
from hacrl_fed.worker import build_worker
from test_security_attacks import B, G, Hostile, lie, make_cfg, plan_for, spy_on_work


@pytest.fixture()
def served(tmp_path):
    """``serve(worker) -> GrpcWorkerClient`` on a unix socket; every server stopped at teardown."""
    servers, clients = [], []

    def serve(worker):
        sock = tmp_path / "sock" / f"{worker.org_id}-{len(servers)}.sock"
        server = serve_worker(worker, f"unix:{sock}")
        servers.append(server)
        client = GrpcWorkerClient(server.address, org_id=worker.org_id, timeout_s=60)
        clients.append(client)
        return client

    yield serve
    for c in clients:
        c.close()
    for s in servers:
        s.stop(0)


def _refused(call, match: str) -> None:
    with pytest.raises(WorkerCallError) as info:
        call()
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and match in info.value.details


def test_worker_port_attacks_are_refused_and_the_honest_run_goes_on(tmp_path, served, monkeypatch):
    cfg = make_cfg()
    worker = build_worker(cfg, "acme", run_dir=tmp_path / "run")
    client = served(worker)
    work = spy_on_work(monkeypatch, worker)
    _refused(lambda: client.generate(plan_for(worker, round_=10**15)), "round_too_far")
    _refused(lambda: client.checkpoint(10**15), "bad_checkpoint_round")
    _refused(lambda: client.generate(plan_for(worker, num_samples=100_000)), "over_limit")
    assert work == []  # refused before any work: nothing rendered, generated or verified
    plan = plan_for(worker)
    client.generate(plan)
    assert ("generate", B) in work
    _refused(lambda: client.train(TrainRequest("other-run", 1, "acme", plan.prompts, (), {})), "wrong_run")
    report = client.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), {}))
    assert report.metrics["train/num_self"] == G * B
    assert client.checkpoint(1).endswith("round-000001")
    _refused(lambda: client.generate(plan_for(worker, round_=2, run_id="another")), "wrong_run")


def test_huge_foreign_text_is_refused_before_tokenizing(tmp_path, served, monkeypatch):
    cfg = make_cfg(signing=False)
    acme, globex = build_worker(cfg, "acme", run_dir=tmp_path), build_worker(cfg, "globex", run_dir=tmp_path)
    client = served(acme)
    plan = plan_for(acme)
    client.generate(plan)
    foreign = tuple(dataclasses.replace(r, response="7" * (2**20 - 1)) for r in globex.generate(plan).rollouts)
    work = spy_on_work(monkeypatch, acme)
    report = client.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, foreign, {}))
    assert [(kind, t) for kind, t in work if kind in ("verify", "tokenize") and t] == []  # none verified/tokenized
    assert report.metrics["trust/globex/rejected/response_too_long"] == G * B
    assert report.metrics["trust/foreign_accepted"] == 0.0


def test_lying_org_over_the_grpc_transport(tmp_path, served):
    run_dir = tmp_path / "run"
    cfg = make_cfg()
    acme = Hostile(build_worker(cfg, "acme", run_dir=run_dir), lambda b: b)
    globex = Hostile(build_worker(cfg, "globex", run_dir=run_dir), lambda b: lie(b, run_dir))
    addresses = {org: served(w).address for org, w in (("acme", acme), ("globex", globex))}
    transport = GrpcTransport(addresses)
    try:
        coord = Coordinator(cfg, transport, run_dir)
        result = coord.run_round(1)
    finally:
        transport.close()
    assert result.metrics["round/globex/rejected/reward_mismatch"] > 0
    assert result.metrics["security/globex/excluded"] == 1.0 and result.trained == ["acme"]
    assert acme.train_requests[0].source_batches == ()  # nothing of the liar reached the honest learner


class RecordingTransport(GrpcTransport):
    """Keeps the serialized bytes of every reply and request the coordinator handles."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[bytes] = []
        self.batches: list[bytes] = []  # the rollout batches among them

    def step(self, requests, timeout_s):  # every message: the requests, and the replies' batches
        self.seen += [codec.encode(r) for r in requests.values()]
        replies = super().step(requests, timeout_s)
        batches = [r.batch for r in replies.values() if getattr(r, "batch", None) is not None]
        self.batches += [codec.encode(b) for b in batches]
        self.seen += [codec.encode(b) for b in batches]
        return replies


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_blind_mode_no_rollout_text_reaches_the_coordinator_process(tmp_path):
    """Worker processes (launched like `hacrl-fed run --transport grpc`) seal their text for each other; the
    coordinator handles only ciphertext, yet both orgs train on each other's rollouts."""
    import yaml

    from hacrl_fed.coordinator.launcher import WorkerProcesses

    run_dir = tmp_path / "run"
    cfg = make_cfg(encrypt=True)
    config = tmp_path / "blind.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    procs = WorkerProcesses(config, ["acme", "globex"], run_dir=run_dir, worker_args=["--run-dir", str(run_dir)])
    try:
        transport = RecordingTransport(procs.start(), secrets=procs.secrets)  # secrets: when TCP (long tmp path)
        assert all(not isinstance(v, Exception) for v in transport.wait_ready(120).values())
        coord = Coordinator(cfg, transport, run_dir)
        result = coord.run_round(1)
        transport.close()
    finally:
        procs.close()
    assert result.trained == ["acme", "globex"]
    assert result.metrics["acme/trust/foreign_accepted"] == G * B == result.metrics["globex/trust/foreign_accepted"]
    keys = {org: load_identity(identity_path(auto_keys_dir(run_dir), org), org_id=org) for org in ("acme", "globex")}
    batches = [codec.decode(RolloutBatch, b) for b in transport.batches]
    texts = set()
    for batch in batches:
        assert all(r.response == "" and r.sealed_response for r in batch.rollouts)
        reader = "globex" if batch.org_id == "acme" else "acme"
        texts |= {r.response for r in open_batch(batch, reader, keys[reader].box_key).rollouts}
    texts = {t for t in texts if len(t) >= 6}  # long enough not to occur by chance in ciphertext
    assert texts, "the micro agents wrote nothing long enough to look for"
    blob = b"".join(transport.seen)
    assert not any(t.encode() in blob for t in texts)
