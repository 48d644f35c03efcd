"""gRPC PolicyWorker service + GrpcWorkerClient over real loopback TCP and unix sockets, with a fake worker."""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from hacrl_fed import types as t
from hacrl_fed.v1 import worker_pb2 as pb
from hacrl_fed.v1 import worker_pb2_grpc
from hacrl_fed.wire import codec
from hacrl_fed.wire.codec import WireError
from hacrl_fed.wire.grpc_client import GrpcWorkerClient, WorkerCallError, WorkerCallTimeout
from hacrl_fed.worker.step import run_step
from hacrl_fed.cli.worker import main as main_worker
from hacrl_fed.wire.grpc_server import serve_worker
from hacrl_fed.worker.api import WorkerAPI

REPO = Path(__file__).resolve().parents[1]


class FakeWorker:
    """Deterministic stand-in for a policy worker: rollouts are a pure function of the plan and the org id.

    ``response_chars`` pads every response to at least that length (big-message tests); ``fail`` maps a method
    name to an exception to raise; with ``gate`` set, generate blocks until the gate opens; ``active`` /
    ``max_active`` count overlapping generate calls.
    """

    def __init__(self, org_id: str = "acme", *, response_chars: int = 0, gate: threading.Event | None = None) -> None:
        self.org_id = org_id
        self.response_chars = response_chars
        self.gate = gate
        self.fail: dict[str, BaseException] = {}
        self.calls: list[str] = []
        self.last_round = -1
        self.active = 0
        self.max_active = 0
        self._count_lock = threading.Lock()

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]

    def _response(self, prompt: t.Prompt, i: int) -> str:
        text = f"{self.org_id}·{prompt.reference}·{i} ✓"
        return text * max(1, -(-self.response_chars // len(text)))

    def generate(self, plan: t.RoundPlan) -> t.RolloutBatch:
        with self._count_lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            self._enter("generate")
            if self.gate is not None:
                assert self.gate.wait(20), "test never opened the gate"
            rollouts = tuple(
                t.Rollout(
                    org_id=self.org_id, round=plan.round, prompt_id=p.prompt_id, sample_index=i,
                    response=self._response(p, i), finish_reason=(t.FINISH_STOP, t.FINISH_LENGTH)[i % 2],
                    reward=float(i % 2), logprob_sum=-0.125 * (i + 1) - p.prompt_id, token_count=i + 1,
                )
                for p in plan.prompts
                for i in range(plan.sampling.num_samples)
            )
            accuracy = sum(r.reward for r in rollouts) / max(len(rollouts), 1)
            return t.RolloutBatch(plan.run_id, plan.round, self.org_id, rollouts, accuracy,
                                  {"time/generate": 0.25, "gen/seed": float(plan.sampling.seed)}, b"sig:" + bytes(8))
        finally:
            with self._count_lock:
                self.active -= 1

    def train(self, request: t.TrainRequest) -> t.TrainReport:
        self._enter("train")
        self.last_round = request.round
        metrics = {"train/foreign": float(len(request.foreign)), "hacpo/cap_sum": sum(request.capability.values()),
                   "train/chars": float(sum(len(r.response) for r in request.foreign))}
        return t.TrainReport(request.run_id, request.round, self.org_id, metrics)

    def evaluate(self, request: t.EvalRequest) -> t.EvalReport:
        self._enter("evaluate")
        return t.EvalReport(request.run_id, request.round, self.org_id, accuracy=0.5, num_prompts=len(request.prompts),
                            metrics={"eval/max_new_tokens": float(request.max_new_tokens)})

    def health(self) -> dict[str, str]:
        self._enter("health")
        return {"org_id": self.org_id, "status": "ok", "round": str(self.last_round)}

    def checkpoint(self, round: int) -> str:
        self._enter("checkpoint")
        return f"/ckpt/{self.org_id}/round-{round:06d}"

    def step(self, request: t.StepRequest) -> t.StepReply:  # the deprecated Generate / Train are its halves
        return run_step(self, request)


def _prompts(n: int = 2) -> tuple[t.Prompt, ...]:
    return tuple(t.Prompt(i, (t.ChatMessage("user", f"{i} + {i} = ? ünï"),), str(2 * i)) for i in range(n))


def _plan(num_samples: int = 3, n_prompts: int = 2) -> t.RoundPlan:
    return t.RoundPlan("run-x", 4, "arithmetic", _prompts(n_prompts), t.SamplingParams(num_samples=num_samples, seed=9))


def _train_request(foreign: tuple[t.Rollout, ...]) -> t.TrainRequest:
    return t.TrainRequest("run-x", 4, "acme", _prompts(), foreign, {"acme": 0.5, "beta": 1.0})


@pytest.fixture
def served():
    """Start ``serve_worker`` servers on demand; stop all of them (and close clients) at teardown."""
    servers, clients = [], []

    def start(worker, address="127.0.0.1:0", **kw):
        server = serve_worker(worker, address, **kw)
        servers.append(server)
        client = GrpcWorkerClient(server.address, org_id=worker.org_id, timeout_s=20)
        clients.append(client)
        return server, client

    yield start
    for c in clients:
        c.close()
    for s in servers:
        s.stop(0).wait(5)


@pytest.fixture
def unix_address():
    d = tempfile.mkdtemp(prefix="hacrl-sock-", dir="/tmp")  # short path: sun_path holds ~107 bytes
    yield f"unix:{d}/worker.sock"
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


def _exercise_every_rpc(client: GrpcWorkerClient, twin: FakeWorker) -> None:
    plan = _plan()
    batch = client.generate(plan)
    assert batch == twin.generate(plan) and len(batch.rollouts) == 6
    req = _train_request(batch.rollouts[:4])
    assert client.train(req) == twin.train(req)
    ereq = t.EvalRequest("run-x", 4, "arithmetic", _prompts(3), max_new_tokens=16)
    assert client.evaluate(ereq) == twin.evaluate(ereq)
    assert client.health() == twin.health() == {"org_id": "acme", "status": "ok", "round": "4"}
    assert client.checkpoint(4) == twin.checkpoint(4) == "/ckpt/acme/round-000004"


def test_every_rpc_over_loopback_tcp_matches_direct_calls(served):
    server, client = served(FakeWorker(), "localhost:0")
    assert server.address.startswith("localhost:") and server.port > 0
    assert isinstance(client, WorkerAPI) and isinstance(server, grpc.Server)
    assert client.wait_ready(5)["org_id"] == "acme"
    _exercise_every_rpc(client, FakeWorker())


def test_every_rpc_over_unix_socket(served, unix_address):
    ready = threading.Event()
    server, client = served(FakeWorker(), unix_address, ready_event=ready)
    assert ready.is_set() and server.address == unix_address and server.port is None
    _exercise_every_rpc(client, FakeWorker())


def test_messages_over_4_mib_pass_both_ways(served):
    fake = FakeWorker(response_chars=400_000)
    _, client = served(fake)
    plan = _plan(num_samples=6, n_prompts=2)  # 12 responses x ~400 k chars (~5.6 MB UTF-8) reply
    batch = client.generate(plan)
    assert len(codec.encode(batch)) > 4 * 2**20
    assert batch == FakeWorker(response_chars=400_000).generate(plan)
    report = client.train(_train_request(batch.rollouts))  # the same ~5.6 MB going the other way
    assert report.metrics["train/chars"] == sum(len(r.response) for r in batch.rollouts)


def test_server_message_cap_is_enforced(served):
    _, client = served(FakeWorker(), max_message_mb=1)
    big = t.Rollout("beta", 4, 0, 0, "x" * (2 * 2**20 - 100), t.FINISH_STOP, 1.0, -1.0, 3)
    with pytest.raises(WorkerCallError) as info:
        client.train(_train_request((big,)))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ValueError("prompt 3 has no reference"), grpc.StatusCode.INVALID_ARGUMENT),
        (WireError("RoundPlan.x: bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (RuntimeError("generate() must run before train()"), grpc.StatusCode.FAILED_PRECONDITION),
        (NotImplementedError("no eval for this task"), grpc.StatusCode.UNIMPLEMENTED),
        (KeyError("boom"), grpc.StatusCode.INTERNAL),
    ],
)
def test_worker_exceptions_map_to_status_and_log_lines(served, caplog, exc, code):
    fake = FakeWorker()
    _, client = served(fake)
    fake.fail["train"] = exc
    with caplog.at_level("WARNING", logger="hacrl_fed.wire.grpc_server"):
        with pytest.raises(WorkerCallError) as info:
            client.train(_train_request(()))
    err = info.value
    assert err.code == code and err.rpc == "Train" and err.address == client.address
    assert err.details == f"{type(exc).__name__}: {exc}" and err.failure_cause == "error"  # hacrl_fed.failures
    assert "Traceback" not in err.details and "File " not in err.details
    records = [r for r in caplog.records if r.name == "hacrl_fed.wire.grpc_server" and r.levelno >= logging.WARNING]
    assert len(records) == 1 and f"Train " in records[0].getMessage() and code.name in records[0].getMessage()
    if code == grpc.StatusCode.INTERNAL:  # unexpected: the traceback is logged server-side
        assert records[0].exc_info and records[0].exc_info[1] is exc
    else:  # a refused / unsupported request: one line, no traceback
        assert not records[0].exc_info and "\n" not in records[0].getMessage()
    assert client.health()["status"] == "ok"  # the server keeps serving


def test_malformed_request_is_invalid_argument_naming_the_field(served):
    fake = FakeWorker()
    server, _ = served(fake)
    msg = codec.to_proto(_plan())
    msg.sampling.top_p = 2.0
    with grpc.insecure_channel(server.address) as channel:
        stub = worker_pb2_grpc.PolicyWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(msg, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "RoundPlan.sampling.top_p: 2.0 outside (0, 1]" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Health(pb.HealthRequest(), timeout=10)  # schema_version unset
        assert "HealthRequest.schema_version: missing" in info.value.details()
    assert "generate" not in fake.calls


def test_bad_replies_fail_clearly(served):
    class NanWorker(FakeWorker):
        def evaluate(self, request):
            return t.EvalReport(request.run_id, request.round, self.org_id, float("nan"), 1)

        def checkpoint(self, round):
            return 42  # not a str: cannot be encoded

    _, client = served(NanWorker())
    ereq = t.EvalRequest("run-x", 1, "arithmetic", _prompts())
    with pytest.raises(WireError, match=r"EvalReport\.accuracy: non-finite value nan"):
        client.evaluate(ereq)
    with pytest.raises(WorkerCallError) as info:
        client.checkpoint(1)
    assert info.value.code == grpc.StatusCode.INTERNAL and "unencodable Checkpoint reply" in info.value.details


def _wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_calls_are_serialized_but_health_is_not_blocked(served):
    gate = threading.Event()
    fake = FakeWorker(gate=gate)
    _, client = served(fake)
    results, errors = [], []

    def call():
        try:
            results.append(client.generate(_plan()))
        except Exception as err:  # pragma: no cover - reported by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for th in threads:
        th.start()
    _wait_until(lambda: fake.active == 1)
    time.sleep(0.2)  # time for the other two to pile up on the lock (they would enter without it)
    assert fake.active == 1
    busy = client.health(timeout_s=5)
    assert busy["status"] == "ok" and busy["busy"] == "1"  # answered while a generate holds the lock, and says so
    gate.set()
    for th in threads:
        th.join(20)
    assert not errors and len(results) == 3 and fake.max_active == 1
    assert "busy" not in client.health(timeout_s=5)  # idle


def test_call_abandoned_while_waiting_for_the_lock_is_not_run(served):
    gate = threading.Event()
    fake = FakeWorker(gate=gate)
    _, client = served(fake)
    first = threading.Thread(target=client.generate, args=(_plan(),))
    first.start()
    _wait_until(lambda: fake.active == 1)
    with pytest.raises(WorkerCallTimeout) as info:
        client.generate(_plan(), timeout_s=0.2)  # per-call deadline override; waits on the lock, then expires
    assert isinstance(info.value, TimeoutError) and info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    gate.set()
    first.join(20)
    time.sleep(0.3)  # the abandoned handler now gets the lock and must drop the call
    assert fake.calls.count("generate") == 1


def test_wait_ready_before_the_server_starts_and_timeouts(unix_address):
    client = GrpcWorkerClient(unix_address, timeout_s=5)
    with pytest.raises(WorkerCallTimeout, match=r"Health on unix:.* failed: DEADLINE_EXCEEDED"):
        client.wait_ready(0.3)
    holder = {}
    server = None
    waiter = threading.Thread(target=lambda: holder.update(info=client.wait_ready(10)))
    waiter.start()
    try:
        time.sleep(0.2)
        server = serve_worker(FakeWorker("beta"), unix_address)
        waiter.join(10)
        assert holder["info"]["org_id"] == "beta" and client.org_id == "beta"  # learned from Health
    finally:
        client.close()
        if server is not None:
            server.stop(0).wait(5)


def test_org_mismatch_closed_client_and_bad_addresses(served):
    server, client = served(FakeWorker("acme"))
    wrong = GrpcWorkerClient(server.address, org_id="beta")
    with pytest.raises(WorkerCallError, match=r"worker serves org 'acme', expected 'beta'"):
        wrong.wait_ready(5)
    wrong.close()
    client.close()
    client.close()  # idempotent
    with pytest.raises(WorkerCallError) as info:
        client.health()
    assert info.value.code == grpc.StatusCode.CANCELLED
    with pytest.raises(RuntimeError, match=r"cannot listen on"):
        serve_worker(FakeWorker(), server.address)  # port taken: no silent SO_REUSEPORT sharing
    with pytest.raises(ValueError, match=r"must be HOST:PORT or unix:/PATH"):
        serve_worker(FakeWorker(), "no-port")
    with pytest.raises(ValueError, match=r"max_message_mb must be in \[1, 2047\]"):
        serve_worker(FakeWorker(), "127.0.0.1:0", max_message_mb=4096)


# ------------------------------------------------------------------------------------------- hacrl-fed worker

_RUN_YAML = """
name: wire-test
orgs:
  - id: acme
    model: {zoo: tiny}
  - id: beta
    model: {zoo: tiny}
"""

_LAUNCH = """
import sys
sys.path.insert(0, {tests!r})
import hacrl_fed.worker as w
from test_grpc_worker import FakeWorker
def build(cfg, org_id, **kw):
    assert cfg.federation.rounds == 3 and kw == {{"run_dir": "runs/x", "resume": True}}, (cfg.federation, kw)
    return FakeWorker(org_id)
w.build_worker = build
from hacrl_fed.cli.worker import main as main_worker
sys.exit(main_worker(sys.argv[1:]))
"""


def test_main_worker_serves_until_sigterm(tmp_path):
    from hacrl_fed.config import load_config
    from hacrl_fed.wire.bounds import max_request_bytes
    from hacrl_fed.wire.link_secret import read_secret_file

    cfg = tmp_path / "run.yaml"
    cfg.write_text(_RUN_YAML)
    code = _LAUNCH.format(tests=str(REPO / "tests"))
    cmd = [sys.executable, "-c", code, "--config", str(cfg), "--org", "beta", "--listen", "127.0.0.1:0",
           "--insecure", "--set", "federation.rounds=3", "--run-dir", "runs/x", "--resume"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "worker printed nothing within 60 s"
        secret_line = proc.stdout.readline().strip()  # --insecure: a fresh link secret, its path printed first
        assert secret_line.startswith("hacrl-fed worker beta link secret in "), (secret_line, proc.stderr.read())
        line = proc.stdout.readline().strip()
        assert line.startswith("hacrl-fed worker beta listening on 127.0.0.1:"), (line, proc.stderr.read())
        address = line.rsplit(" ", 1)[1]
        secret_file = Path(secret_line.rsplit(" in ", 1)[1])
        secret = read_secret_file(secret_file)
        with GrpcWorkerClient(address, org_id="beta", timeout_s=10, secret=secret) as client:
            assert client.health()["org_id"] == "beta"
            assert client.generate(_plan()) == FakeWorker("beta").generate(_plan())
            # the receive limit is what the config's plans can need (hacrl_fed.wire.bounds), not 256 MiB
            bound = max_request_bytes(load_config(cfg, overrides=["federation.rounds=3"]), "beta")
            huge = t.EvalRequest("r", 0, "arithmetic", (t.Prompt(0, (t.ChatMessage("user", "7" * bound),), "7"),), 8)
            with pytest.raises(WorkerCallError) as info:
                client.evaluate(huge)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        shutil.rmtree(secret_file.parent)  # the private temp dir the worker made for its secret
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_main_worker_rejects_unknown_or_ambiguous_org(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(_RUN_YAML)
    with pytest.raises(SystemExit) as info:
        main_worker(["--config", str(cfg), "--org", "gamma", "--listen", "127.0.0.1:0", "--insecure"])
    assert info.value.code == 2
    assert "--org 'gamma' is not in the config (orgs: ['acme', 'beta'])" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main_worker(["--config", str(cfg), "--listen", "127.0.0.1:0", "--insecure"])
    assert info.value.code == 2 and "--org is required: the config lists 2 orgs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main_worker(["--config", str(tmp_path / "missing.yaml"), "--listen", f"unix:{tmp_path}/w.sock"])
    assert info.value.code == 2 and "config file not found" in capsys.readouterr().err
