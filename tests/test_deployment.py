"""Real Flower deployment on loopback: flower-superlink, flower-supernode per org, policy-worker processes, flwr run.

(a) insecure, real ``hacrl-fed worker`` processes with the micro zoo agents of ``configs/smoke.yaml``;
(b) TLS + SuperNode authentication with keys from ``hacrl-fed keys`` and fake workers (no models), plus an
unregistered SuperNode that must be refused.

Every process is stopped by PID in the harness's teardown (also when a test fails), and each test checks that
nothing it started is left running. Timings go to ``<tmp>/timings.json`` (and stdout with ``-s``).
"""

from __future__ import annotations

import json
import socket
import ssl
import sys
import time
from pathlib import Path

import pytest

from hacrl_fed.config import load_config
from hacrl_fed.deploy.harness import HOST, Deployment, start_local
from hacrl_fed.security.keys import write_keys

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"
FAKE_WORKER = REPO / "tests" / "helpers_fake_workers.py"
ORGS = ("acme", "globex")
ROUNDS = 2


def _metrics(run_dir: Path) -> dict[int, dict]:
    """``{round: merged record}`` of the coordinator's ``metrics.jsonl`` (one run dir per config name)."""
    path = run_dir / load_config(SMOKE).name / "metrics.jsonl"
    merged: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        merged.setdefault(record["round"], {}).update(record)
    return merged


def _submit_and_wait(dep: Deployment, run_dir: Path, timeout_s: float = 240) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    overrides = f"federation.rounds={ROUNDS} run_dir={run_dir}"
    run_id = dep.submit(REPO, {"config-path": str(SMOKE), "overrides": overrides})
    info = dep.wait_run(run_id, timeout_s=timeout_s)
    elapsed = time.monotonic() - t0
    assert info["status"] == "finished:completed", f"run {info['status']}:\n{dep.run_log(run_id)[-4000:]}"
    return run_id, info, elapsed


def _report(tmp_path: Path, name: str, dep: Deployment, **extra) -> None:
    data = {"test": name, "processes": dep.timings(), **extra}
    (tmp_path / "timings.json").write_text(json.dumps(data, indent=1))
    print(json.dumps(data))


def _assert_per_org_metrics(metrics: dict[int, dict], orgs: tuple[str, ...]) -> None:
    assert set(range(ROUNDS + 1)) <= set(metrics), sorted(metrics)
    for org in orgs:
        assert f"eval/{org}/accuracy" in metrics[0] and f"eval/{org}/accuracy" in metrics[ROUNDS]
        for t in range(1, ROUNDS + 1):
            assert metrics[t][f"round/{org}/failed"] == 0.0, (t, org)
            assert metrics[t][f"round/{org}/rollouts_accepted"] > 0, (t, org)


@pytest.mark.timeout(420)
def test_insecure_deployment_with_real_workers(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    with Deployment(tmp_path / "dep") as dep:  # __exit__ stops every process, also when an assertion fails
        start_local(dep, SMOKE, ORGS)
        up_s = time.monotonic() - t0
        run_id, info, run_s = _submit_and_wait(dep, run_dir)
    assert dep.leftovers() == {}
    metrics = _metrics(run_dir)
    _assert_per_org_metrics(metrics, ORGS)
    for org in ORGS:  # the real workers did the work: their own timings came back through Flower
        assert metrics[1][f"{org}/time/generate"] > 0
        assert "listening on" in (tmp_path / "dep" / "logs" / f"worker-{org}.log").read_text()
    _report(tmp_path, "insecure-real-workers", dep, up_s=up_s, run_s=run_s, total_s=time.monotonic() - t0,
            round_times={t: {k: v for k, v in m.items() if k.startswith("time/")} for t, m in metrics.items()})


def _fake_worker(org: str, listen: str) -> list[str]:
    return [sys.executable, str(FAKE_WORKER), "--config", str(SMOKE), "--org", org, "--listen", listen]


def _plain_http_reply(port: int) -> bytes:
    """What a plaintext HTTP request to ``port`` gets back (first bytes; b"" if the server just closes)."""
    with socket.create_connection((HOST, port), timeout=10) as raw:
        raw.sendall(b"POST /v1/control/list-runs HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        try:
            return raw.recv(64)
        except (ConnectionResetError, TimeoutError):
            return b""


def _peer_sans(ca_cert: Path, port: int) -> list[tuple[str, str]]:
    """Handshake with the SuperLink as ``127.0.0.1`` trusting only our CA; the SANs it presented."""
    ctx = ssl.create_default_context(cafile=str(ca_cert))
    with socket.create_connection((HOST, port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=HOST) as tls:
            return list(tls.getpeercert()["subjectAltName"])


@pytest.mark.timeout(420)
def test_tls_and_supernode_auth_refuse_an_unregistered_node(tmp_path):
    keys = write_keys(tmp_path / "keys", [*ORGS, "mallory"])  # mallory's key is made but never registered
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    with Deployment(tmp_path / "dep", tls=keys) as dep:
        start_local(dep, SMOKE, ORGS, worker_argv=_fake_worker)
        up_s = time.monotonic() - t0
        assert ("IP Address", HOST) in _peer_sans(keys.ca_cert, dep.superlink_port)
        assert not _plain_http_reply(dep.superlink_port).startswith(b"HTTP/")  # TLS only, no plaintext

        intruder = dep.start_supernode("mallory", f"{HOST}:1", wait=False)
        rc = intruder.popen.wait(timeout=120)
        assert rc != 0
        assert "Failed to activate SuperNode" in intruder.log_text()
        assert dep.supernode_id(intruder) is None
        assert "No SuperNode found with the given public key" in dep.superlink.log_text()

        nodes = dep.list_supernodes()
        assert len(nodes) == len(ORGS) and {n["status"] for n in nodes} == {"online"}, nodes
        registered = {int(n["node-id"]) for n in nodes}
        assert {dep.supernode_id(p) for p in dep.procs if p.name.startswith("supernode-")} - {None} == registered

        run_id, info, run_s = _submit_and_wait(dep, run_dir)
    assert dep.leftovers() == {}
    metrics = _metrics(run_dir)
    _assert_per_org_metrics(metrics, ORGS)
    for org in ORGS:  # exact: FakeWorker answers G rollouts per prompt, skill 0.5
        assert metrics[1][f"round/{org}/rollouts_accepted"] == 4 * 4
        assert metrics[1][f"round/{org}/accuracy"] == 0.5
    assert not any("mallory" in key for m in metrics.values() for key in m)
    _report(tmp_path, "tls-auth-fake-workers", dep, up_s=up_s, run_s=run_s, total_s=time.monotonic() - t0,
            intruder_exit_code=rc)
