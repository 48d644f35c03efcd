"""WorkerProcesses: start stand-in worker processes, wait for the ready line, log, stop by PID (TERM, then KILL)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from helpers_fake_workers import fake_config
from hacrl_fed.coordinator.grpc_transport import GrpcTransport
from hacrl_fed.coordinator.launcher import WorkerProcesses, WorkerStartError, link_args, listen_address
from hacrl_fed.wire.grpc_client import WorkerCallError

FAKE_WORKER = [sys.executable, str(Path(__file__).with_name("helpers_fake_workers.py"))]


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(fake_config(orgs=("a", "b")).model_dump(mode="json")))
    return path


def test_start_serve_and_stop(tmp_path, config_path):
    procs = WorkerProcesses(config_path, ["a", "b"], run_dir=tmp_path / "run", command=FAKE_WORKER,
                            worker_args=["--run-dir", "X"], overrides=["federation.rounds=7"], ready_timeout_s=60)
    (tmp_path / "run" / "sock").mkdir(parents=True)
    os.chmod(tmp_path / "run" / "sock", 0o777)  # left over with a loose mode: tightened before any worker starts
    with procs as addresses:
        assert set(addresses) == {"a", "b"} and all(a.startswith("unix:") for a in addresses.values())
        assert stat.S_IMODE(os.stat(tmp_path / "run" / "sock").st_mode) == 0o700
        assert all(stat.S_IMODE(os.stat(a[5:]).st_mode) == 0o600 for a in addresses.values())
        pids = {org: w.proc.pid for org, w in procs.workers.items()}
        transport = GrpcTransport(addresses)
        try:
            health = transport.wait_ready(10.0)
        finally:
            transport.close()
        assert {org: h["org_id"] for org, h in health.items()} == {"a": "a", "b": "b"}
    assert procs.exit_codes == {"a": 0, "b": 0} and len(set(pids.values())) == 2
    log_a = (tmp_path / "run" / "logs" / "a.log").read_text()
    assert "fake worker a starting (run_dir=X" in log_a and "listening on unix:" in log_a
    resolved = yaml.safe_load((tmp_path / "run" / "worker_config.yaml").read_text())
    assert resolved["federation"]["rounds"] == 7


def test_worker_ignoring_sigterm_is_killed(tmp_path, config_path):
    procs = WorkerProcesses(config_path, ["a"], run_dir=tmp_path, command=FAKE_WORKER,
                            worker_args=["--ignore-sigterm"], grace_s=0.5, ready_timeout_s=60)
    procs.start()
    procs.close()
    assert procs.exit_codes == {"a": -9}
    procs.close()  # idempotent


def test_worker_dying_before_ready_is_reported_with_its_log(tmp_path, config_path):
    procs = WorkerProcesses(config_path, ["a"], run_dir=tmp_path, command=FAKE_WORKER,
                            worker_args=["--exit-code", "3"], ready_timeout_s=60)
    with pytest.raises(WorkerStartError, match=r"(?s)worker 'a' .*exited with code 3.*giving up on purpose"):
        procs.start()
    assert procs.workers == {}


def test_silent_worker_times_out_and_is_stopped(tmp_path, config_path):
    procs = WorkerProcesses(config_path, ["a"], run_dir=tmp_path, command=FAKE_WORKER,
                            worker_args=["--silent"], ready_timeout_s=2.0)
    with pytest.raises(WorkerStartError, match="was not ready after 2 s"):
        procs.start()
    # stopped by the launcher's SIGTERM: 0 through the worker's handler, or -15 when the signal came before the
    # handler was installed (a loaded machine can take longer than the 2 s to import); never left running / killed
    assert procs.exit_codes in ({"a": 0}, {"a": -15})


def test_long_run_dir_falls_back_to_a_free_tcp_port(tmp_path, config_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    assert listen_address(deep, "a") == "127.0.0.1:0"
    assert listen_address(Path("/tmp/r"), "a") == "unix:/tmp/r/sock/a.sock"
    assert link_args("127.0.0.1:0") == ["--insecure"] and link_args("unix:/tmp/r/sock/a.sock") == []
    assert link_args("127.0.0.1:0", Path("/s")) == ["--insecure", "--secret-file", "/s"]
    procs = WorkerProcesses(config_path, ["a"], run_dir=deep, command=FAKE_WORKER, ready_timeout_s=60)
    with procs as addresses:
        assert addresses["a"].startswith("127.0.0.1:")  # the worker accepted loopback TCP: --insecure was passed
        secret_file = deep / "sock" / "a.secret"  # a fresh per-launch link secret, owner-only
        assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
        assert secret_file.read_text().strip() == procs.secrets["a"]
        assert f"link secret in {secret_file}" in (deep / "logs" / "a.log").read_text()
        transport, stranger = GrpcTransport(addresses, secrets=procs.secrets), GrpcTransport(addresses)
        try:
            assert transport.wait_ready(10.0)["a"]["org_id"] == "a"
            refused = stranger.wait_ready(10.0)["a"]  # another local process, without the secret
            assert isinstance(refused, WorkerCallError) and refused.code == grpc.StatusCode.UNAUTHENTICATED
        finally:
            transport.close()
            stranger.close()


def test_bad_override_fails_before_any_process_starts(tmp_path, config_path):
    from hacrl_fed.config import ConfigError

    procs = WorkerProcesses(config_path, ["a"], run_dir=tmp_path, command=FAKE_WORKER,
                            overrides=["trainer.lr=-1"])
    with pytest.raises(ConfigError, match="trainer.lr"):
        procs.start()
    assert procs.workers == {}


def test_local_workers_share_the_cores(tmp_path, config_path, monkeypatch):
    from hacrl_fed.coordinator.launcher import worker_threads

    assert worker_threads(3, cpus=2) == 1 and worker_threads(2, cpus=16) == 8 and worker_threads(1, cpus=4) == 4
    assert worker_threads(0, cpus=4) == 4
    procs = WorkerProcesses(config_path, ["a", "b"], run_dir=tmp_path / "run", command=FAKE_WORKER)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert procs._env()["OMP_NUM_THREADS"] == str(worker_threads(2))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the operator's choice wins
    assert procs._env()["OMP_NUM_THREADS"] == "3"


def test_a_line_other_ranks_share_the_pipe_with_is_written_in_one_write(monkeypatch):
    """``print`` under PYTHONUNBUFFERED writes text and newline apart, so a second rank could split the ready line."""
    from hacrl_fed.cli.common import say_line

    class Pipe:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            pass

    pipe = Pipe()
    monkeypatch.setattr("sys.stdout", pipe)
    say_line("hacrl-fed worker a listening on unix:/x.sock")
    assert pipe.writes == ["hacrl-fed worker a listening on unix:/x.sock\n"]
