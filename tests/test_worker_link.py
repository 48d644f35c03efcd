"""The worker link: unix socket permissions, mutual TLS, loopback-only plaintext, raw-bytes decoding and
cancellation of running calls. Everything binds loopback or a unix socket; non-loopback addresses appear only as
arguments that must be refused before anything binds."""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time
from pathlib import Path

import grpc
import pytest
from helpers_fake_workers import FakeWorker

from hacrl_fed import types as t
from hacrl_fed.cancel import raise_if_cancelled
from hacrl_fed.cli.worker import main as main_worker
from hacrl_fed.security.keys import KeyLayout, cert_pem, key_pem, make_ca, make_client_cert, write_keys
from hacrl_fed.wire import codec
from hacrl_fed.wire.grpc_client import ClientTLS, GrpcWorkerClient, WorkerCallError, WorkerCallTimeout
from hacrl_fed.wire.grpc_server import (
    SERVICE,
    ListenError,
    WorkerTLS,
    check_listen,
    is_local_address,
    serve_worker,
)

SERVER_LOG = "hacrl_fed.wire.grpc_server"
RUN_YAML = "name: link-test\norgs:\n  - id: acme\n    model: {zoo: tiny}\n"


def _plan(round: int = 1) -> t.RoundPlan:
    prompts = (t.Prompt(1, (t.ChatMessage("user", "1+1"),), "2"),)
    return t.RoundPlan("run-x", round, "arithmetic", prompts, t.SamplingParams(num_samples=2, max_new_tokens=8))


class CountingWorker(FakeWorker):
    """FakeWorker that records every method call (to prove a refused caller never reached the worker)."""

    def __init__(self, org_id: str = "acme", **kw):
        super().__init__(org_id, **kw)
        self.called: list[str] = []

    def generate(self, plan):
        self.called.append("generate")
        return super().generate(plan)

    def health(self):
        self.called.append("health")
        return super().health()


@pytest.fixture
def servers():
    """``start(worker, address, **kw)`` -> started server; every one is stopped at teardown."""
    started = []

    def start(worker, address, **kw):
        server = serve_worker(worker, address, **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(0).wait(5)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> KeyLayout:
    return write_keys(tmp_path_factory.mktemp("keys") / "k", ["acme", "globex"], ["127.0.0.1", "localhost"])


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ------------------------------------------------------------------------------------------- unix sockets


def test_unix_socket_is_owner_only_in_a_new_private_dir(servers, tmp_path):
    sock = tmp_path / "run" / "sock" / "acme.sock"  # neither directory exists yet
    server = servers(CountingWorker(), f"unix:{sock}")
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    assert _mode(sock) == 0o600 and _mode(sock.parent) == 0o700
    with GrpcWorkerClient(server.address, org_id="acme", timeout_s=10) as client:
        assert client.health()["org_id"] == "acme"


def test_unix_socket_in_an_existing_private_dir(servers, tmp_path):
    (tmp_path / "s").mkdir(mode=0o755)
    os.chmod(tmp_path / "s", 0o755)  # others may read it, not write it: accepted
    servers(CountingWorker(), f"unix:{tmp_path}/s/w.sock")
    assert _mode(tmp_path / "s" / "w.sock") == 0o600


@pytest.mark.parametrize("mode", [0o770, 0o757, 0o1777])
def test_unix_socket_dir_writable_by_others_is_refused(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(ListenError, match=rf"socket directory {shared} is writable by group/others \(mode {mode:o}\)"):
        serve_worker(CountingWorker(), f"unix:{shared}/w.sock")
    assert list(shared.iterdir()) == []  # refused before binding
    with pytest.raises(ListenError, match="abstract sockets have no file permissions"):
        serve_worker(CountingWorker(), "unix-abstract:hacrl")


# ------------------------------------------------------------------------------------------- plaintext TCP


@pytest.mark.parametrize("address", ["127.0.0.1:0", "127.8.9.1:50051", "localhost:0", "[::1]:0", "unix:/x/y.sock"])
def test_local_addresses(address):
    assert is_local_address(address)
    check_listen(address, insecure=True, require_flag=True)


@pytest.mark.parametrize("address", ["0.0.0.0:50051", "10.1.2.3:50051", ":50051", "[::]:50051", "example.org:1",
                                     "dns:///127.0.0.1:1"])
def test_plaintext_is_refused_off_loopback_even_in_the_python_api(address):
    assert not is_local_address(address)
    with pytest.raises(ListenError):
        serve_worker(CountingWorker(), address, insecure=True)
    with pytest.raises(ValueError, match="plaintext is refused"):
        GrpcWorkerClient(address)  # no channel is opened


def test_insecure_without_a_link_secret_is_refused_in_the_python_api(servers):
    worker = CountingWorker()
    with pytest.raises(ListenError, match=r"insecure=True needs secret="):
        serve_worker(worker, "127.0.0.1:0", insecure=True)  # refused before anything binds
    secret = "ab" * 32
    server = servers(worker, "127.0.0.1:0", insecure=True, secret=secret)  # as --insecure does: with its secret
    with GrpcWorkerClient(server.address, timeout_s=10) as stranger, pytest.raises(WorkerCallError) as info:
        stranger.health()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED and worker.called == []
    with GrpcWorkerClient(server.address, timeout_s=10, secret=secret) as owner:
        assert owner.health()["org_id"] == "acme" and worker.called == ["health"]


def _worker_cli(tmp_path: Path, capsys, *link: str) -> tuple[int, str]:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(RUN_YAML)
    with pytest.raises(SystemExit) as info:
        main_worker(["--config", str(cfg), *link])
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(("link", "message"), [
    (["--listen", "127.0.0.1:0"], "is TCP without TLS: add --tls-cert, --tls-key and --tls-ca (mutual TLS), "
                                  "or --insecure (loopback only), or listen on unix:/PATH"),
    (["--listen", "0.0.0.0:50051", "--insecure"], "'0.0.0.0:50051' is not loopback: plaintext is refused there"),
    (["--listen", "10.1.2.3:50051", "--insecure"], "'10.1.2.3:50051' is not loopback"),
    (["--listen", "10.1.2.3:50051"], "'10.1.2.3:50051' is not loopback"),
    (["--listen", "127.0.0.1:0", "--tls-cert", "c.pem"], "go together: missing --tls-key, --tls-ca"),
    (["--listen", "127.0.0.1:0", "--insecure", "--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"],
     "--insecure and --tls-cert/--tls-key/--tls-ca exclude each other"),
    (["--listen", "127.0.0.1:0", "--tls-cert", "/nonexistent/c.pem", "--tls-key", "k", "--tls-ca", "a"],
     "--tls-key k: cannot read it"),
    (["--listen", "unix:/tmp/w.sock"], "socket directory /tmp is writable by group/others"),
    (["--listen", "nowhere"], "must be HOST:PORT or unix:/PATH"),
])
def test_cli_refuses_a_bad_link_with_one_line_and_exit_2(tmp_path, capsys, monkeypatch, link, message):
    import hacrl_fed.cli.worker as gs

    monkeypatch.setattr(gs, "serve_worker", lambda *a, **k: pytest.fail("must be refused before binding"))
    code, err = _worker_cli(tmp_path, capsys, *link)
    assert code == 2 and message in err, err
    assert err.startswith("hacrl-fed worker: ") and err.count("\n") == 1 and "Traceback" not in err


# ------------------------------------------------------------------------------------------- mutual TLS


def _tls(keys: KeyLayout, org: str = "acme", **kw) -> WorkerTLS:
    return WorkerTLS(keys.worker_cert(org), keys.worker_key(org), keys.ca_cert, **kw)


def _client_tls(keys: KeyLayout, org: str = "acme", **kw) -> ClientTLS:
    return ClientTLS(keys.ca_cert, keys.worker_client_cert(org), keys.worker_client_key(org), **kw)


def test_mtls_admits_the_orgs_client_certificate(servers, keys):
    worker = CountingWorker()
    server = servers(worker, "127.0.0.1:0", tls=_tls(keys, client_names=("acme-client",)))
    with GrpcWorkerClient(server.address, org_id="acme", timeout_s=10, tls=_client_tls(keys)) as client:
        assert client.generate(_plan()).org_id == "acme"
    with GrpcWorkerClient(server.address, timeout_s=10, tls=_client_tls(keys, server_name="localhost")) as client:
        assert client.health()["org_id"] == "acme"  # checked against the certificate's DNS SAN
    assert worker.called == ["generate", "health"]


def _refused(address: str, credentials: grpc.ChannelCredentials | None, **options) -> grpc.RpcError:
    opts = list(options.items())
    channel = (grpc.insecure_channel(address) if credentials is None
               else grpc.secure_channel(address, credentials, options=opts))
    with channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(f"/{SERVICE}/Health")(codec.encode(codec.health_request()), timeout=5)
    return info.value


def test_mtls_refuses_clients_without_a_certificate_from_the_ca(servers, keys, tmp_path):
    worker = CountingWorker()
    server = servers(worker, "127.0.0.1:0", tls=_tls(keys))
    ca = keys.ca_cert.read_bytes()
    other_ca_key, other_ca = make_ca("someone else's CA")
    rogue_key, rogue = make_client_cert(other_ca_key, other_ca, "acme-client")  # right name, wrong CA
    attempts = {
        "plaintext": None,
        "no client certificate": grpc.ssl_channel_credentials(ca),
        "certificate from another CA": grpc.ssl_channel_credentials(ca, key_pem(rogue_key), cert_pem(rogue)),
        "server certificate as client": grpc.ssl_channel_credentials(  # signed by the CA, but serverAuth only
            ca, keys.worker_key("globex").read_bytes(), keys.worker_cert("globex").read_bytes()),
    }
    for what, credentials in attempts.items():
        err = _refused(server.address, credentials)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (what, err)
    assert worker.called == []  # no one got through to the worker


def test_client_name_pin_keeps_other_orgs_out(servers, keys):
    worker = CountingWorker()
    server = servers(worker, "127.0.0.1:0", tls=_tls(keys, client_names=("acme-client",)))
    with GrpcWorkerClient(server.address, timeout_s=10, tls=_client_tls(keys, "globex")) as client:
        with pytest.raises(WorkerCallError) as info:
            client.health()
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED and "globex-client" in info.value.details
    assert worker.called == []


def test_mtls_over_a_unix_socket_and_plaintext_clients_refused(servers, keys, tmp_path):
    worker = CountingWorker()
    server = servers(worker, f"unix:{tmp_path}/s/acme.sock", tls=_tls(keys))
    assert _refused(server.address, None).code() == grpc.StatusCode.UNAVAILABLE
    with GrpcWorkerClient(server.address, timeout_s=10, tls=_client_tls(keys)) as client:  # checked as localhost
        assert client.health()["org_id"] == "acme"


def test_cli_serves_mtls_when_given_the_keys(tmp_path, keys, monkeypatch):
    """``hacrl-fed worker --listen 127.0.0.1:0 --tls-*``: the flags reach serve_worker as a WorkerTLS."""
    import hacrl_fed.cli.worker as gs
    import hacrl_fed.worker as w

    seen = {}

    class Stop(BaseException):  # not an Exception: the command would report it as a failed run (exit 1)
        pass

    def fake_serve(worker, address, **kw):
        seen.update(kw, address=address)
        raise Stop

    monkeypatch.setattr(w, "build_worker", lambda cfg, org, **kw: CountingWorker(org))
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # keep pytest's own SIGINT / SIGTERM handlers
    monkeypatch.setattr(gs, "serve_worker", fake_serve)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(RUN_YAML)
    with pytest.raises(Stop):
        main_worker(["--config", str(cfg), "--listen", "127.0.0.1:0", "--tls-cert", str(keys.worker_cert("acme")),
                     "--tls-key", str(keys.worker_key("acme")), "--tls-ca", str(keys.ca_cert),
                     "--tls-client-name", "acme-client"])
    tls = seen["tls"]
    assert (tls.cert, tls.key, tls.ca) == tuple(str(p) for p in (keys.worker_cert("acme"), keys.worker_key("acme"),
                                                                  keys.ca_cert))
    assert tls.client_names == ("acme-client",) and seen["insecure"] is False


# ------------------------------------------------------------------------------------------- undecodable requests

_REQUESTS = {"Generate": "RoundPlan", "Train": "TrainRequest", "Evaluate": "EvalRequest",
             "Checkpoint": "CheckpointRequest", "Health": "HealthRequest"}


@pytest.mark.parametrize("rpc", list(_REQUESTS))
def test_garbage_bytes_are_invalid_argument_with_one_log_line(servers, tmp_path, caplog, rpc):
    worker = CountingWorker()
    server = servers(worker, f"unix:{tmp_path}/w.sock")
    with caplog.at_level(logging.WARNING, logger=SERVER_LOG), grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(f"/{SERVICE}/{rpc}")  # no serializers: raw bytes on the wire
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xfe\x00 not a protobuf \x01\x02", timeout=10)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(f"WireError: {_REQUESTS[rpc]}: not a valid serialized message")
    records = [r for r in caplog.records if r.name == SERVER_LOG and r.levelno >= logging.WARNING]
    assert len(records) == 1 and records[0].levelno == logging.WARNING and not records[0].exc_info
    assert f"{rpc} refused (INVALID_ARGUMENT): WireError: {_REQUESTS[rpc]}" in records[0].getMessage()
    assert "Exception deserializing" not in caplog.text and "Traceback" not in caplog.text
    assert worker.called == []
    with GrpcWorkerClient(server.address, timeout_s=10) as client:
        assert client.health()["status"] == "ok"  # still serving


def test_a_request_with_an_undeclared_field_is_refused_before_the_worker_sees_it(servers, tmp_path, caplog):
    worker = CountingWorker()
    server = servers(worker, f"unix:{tmp_path}/w.sock")
    data = codec.encode(_plan()) + b"\x40\x01"  # RoundPlan field 8: reserved
    with caplog.at_level(logging.WARNING, logger=SERVER_LOG), grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(f"/{SERVICE}/Generate")(data, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    expected = "WireError: RoundPlan: 2 bytes of fields schema v1 does not declare (reserved or unknown)"
    assert info.value.details() == expected
    assert f"Generate refused (INVALID_ARGUMENT): {expected}" in caplog.text
    assert worker.called == []


# ------------------------------------------------------------------------------------------- cancellation


class LoopingWorker(CountingWorker):
    """generate() works in 50 ms steps, checking for cancellation between them, for at most MAX_STEPS steps (30 s):
    a call that ends before its last step was stopped by its cancellation, which ``stop_reason`` names."""

    MAX_STEPS = 600

    def __init__(self):
        super().__init__()
        self.steps = 0
        self.stopped = threading.Event()
        self.stop_reason = ""

    def generate(self, plan):
        self.called.append("generate")
        if plan.round == 2:  # the quick follow-up call
            return FakeWorker.generate(self, plan)
        try:
            for self.steps in range(1, self.MAX_STEPS + 1):
                raise_if_cancelled("between generation steps")
                time.sleep(0.05)
        except Exception as err:
            self.stop_reason = str(err)
            raise
        finally:
            self.stopped.set()
        raise AssertionError("never cancelled")


def test_deadline_stops_a_running_call_and_frees_the_worker(servers, tmp_path, caplog):
    worker = LoopingWorker()
    server = servers(worker, f"unix:{tmp_path}/w.sock")
    with GrpcWorkerClient(server.address, timeout_s=10) as client, caplog.at_level(logging.WARNING, SERVER_LOG):
        with pytest.raises(WorkerCallTimeout):
            client.generate(_plan(1), timeout_s=1.0)
        assert worker.stopped.wait(30)
        # stopped at a cancellation check (not at the end of its work) by the deadline's cancellation
        assert worker.steps < worker.MAX_STEPS and "stopped between generation steps" in worker.stop_reason
        batch = client.generate(_plan(2), timeout_s=5)  # the lock is free again
        assert batch.round == 2 and worker.called == ["generate", "generate"]
    lines = [r for r in caplog.records if r.name == SERVER_LOG and r.levelno >= logging.WARNING]
    assert len(lines) == 1 and not lines[0].exc_info
    assert "Generate stopped (DEADLINE_EXCEEDED): the caller's deadline passed" in lines[0].getMessage()


def test_client_cancel_stops_a_running_call(servers, tmp_path, caplog):
    worker = LoopingWorker()
    server = servers(worker, f"unix:{tmp_path}/w.sock")
    with grpc.insecure_channel(server.address) as channel, caplog.at_level(logging.WARNING, SERVER_LOG):
        future = channel.unary_unary(f"/{SERVICE}/Generate").future(codec.encode(_plan(1)), timeout=20)
        _wait(lambda: worker.called == ["generate"], 5.0)
        assert future.cancel()
        assert worker.stopped.wait(30)
        assert worker.steps < worker.MAX_STEPS and "cancelled" in worker.stop_reason
        _wait(lambda: any("Generate stopped (CANCELLED)" in r.getMessage() for r in caplog.records), 3.0)


def _wait(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_calls_without_a_deadline_run(servers, tmp_path):
    """grpc reports "no deadline" as a huge time_remaining(); the lock wait and the cancel scope must cope."""
    server = servers(CountingWorker(), f"unix:{tmp_path}/w.sock")
    with GrpcWorkerClient(server.address, timeout_s=None) as client:
        assert client.generate(_plan()).org_id == "acme"


def test_grpc_transport_dials_workers_over_mtls(servers, keys, tmp_path):
    from hacrl_fed.coordinator.grpc_transport import GrpcTransport

    tcp = servers(CountingWorker("acme"), "127.0.0.1:0", tls=_tls(keys, "acme"))
    unix = servers(CountingWorker("globex"), f"unix:{tmp_path}/g.sock")
    transport = GrpcTransport({"acme": tcp.address, "globex": unix.address}, tls={"acme": _client_tls(keys)})
    try:
        ready = transport.wait_ready(10.0)
        assert {org: info["org_id"] for org, info in ready.items()} == {"acme": "acme", "globex": "globex"}
    finally:
        transport.close()
    with pytest.raises(ValueError, match="plaintext is refused"):
        GrpcTransport({"acme": "10.1.2.3:50051"})
