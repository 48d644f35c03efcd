"""Progress where a run executes: the worker's start-up line (org, model, size, device, dtype) and one log line per
call; the coordinator's per-round line and eval table are in test_coordinator.py, the ServerApp's in ``flwr log``
and deploy-local's stream in test_deployment.py."""

from __future__ import annotations

import logging
import re

from hacrl_fed.config import load_config
from hacrl_fed.types import EvalRequest, RoundPlan, SamplingParams, StepRequest, TrainRequest
from hacrl_fed.wire.grpc_client import GrpcWorkerClient
from hacrl_fed.wire.grpc_server import describe_worker, serve_worker
from hacrl_fed.worker import build_worker
from helpers_fake_workers import FakeTask, FakeWorker

SERVER_LOG = "hacrl_fed.wire.grpc_server"


def test_a_worker_says_what_it_serves(tmp_path):
    cfg = load_config({"name": "p", "orgs": [{"id": "acme", "model": {"zoo": "micro-qwen-char", "device": "cpu"}}],
                       "security": {"signing": False}})
    worker = build_worker(cfg, "acme", run_dir=tmp_path)
    text = describe_worker(worker)
    n = sum(p.numel() for p in worker.model.parameters())
    assert re.fullmatch(rf"org acme, model zoo:micro-qwen-char, {n / 1e6:.2f} M parameters, device cpu, "
                        rf"dtype float32, engine hf, checkpoints in {re.escape(str(tmp_path))}/orgs/acme/checkpoints",
                        text), text
    assert describe_worker(FakeWorker("a")) == "org a"  # a stand-in says what it can


def test_one_log_line_per_call_with_rpc_round_and_seconds(caplog):
    server = serve_worker(FakeWorker("a", 0.5), "127.0.0.1:0")
    prompts = tuple(FakeTask().prompts("train", [1, 2]))
    try:
        with caplog.at_level(logging.DEBUG, logger=SERVER_LOG), GrpcWorkerClient(server.address, timeout_s=10) as c:
            c.health()
            c.generate(RoundPlan("r", 3, "fake", prompts, SamplingParams(num_samples=2)))
            c.evaluate(EvalRequest("r", 3, "fake", prompts, max_new_tokens=4))
            c.checkpoint(3)
            c.step(StepRequest(train=TrainRequest("r", 3, "a", prompts, (), {"a": 1.0}),
                               plan=RoundPlan("r", 4, "fake", prompts, SamplingParams(num_samples=2))))
    finally:
        server.stop(0)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == SERVER_LOG]
    info = [m for level, m in lines if level == "INFO"]
    assert [m.split(" ok in ")[0] for m in info] == ["Generate round 3", "Evaluate round 3", "Checkpoint round 3",
                                                     "Step train round 3 plan round 4"]
    assert all(re.search(r" ok in \d+\.\d\d s$", m) for m in info)
    assert any(level == "DEBUG" and m.startswith("Health ok in") for level, m in lines)  # polled: debug only
