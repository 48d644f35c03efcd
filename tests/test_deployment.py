"""Real Flower deployment on loopback: flower-superlink, flower-supernode per org, policy-worker processes, flwr run.

Fast checks of the harness itself (process-tree teardown, readiness failures, the files it writes for flwr) come
first; the end-to-end tests are marked slow:

(a) insecure Flower, real ``hacrl-fed worker`` processes with the micro zoo agents of ``configs/smoke.yaml`` on
unix sockets (mode 0600 in a 0700 directory); ``flwr log`` shows one line per round, the workers say what they
serve and log one line per call, and the same ``flwr run`` again into the used run dir fails with one line naming
``resume=true`` / ``run-dir=``, no traceback; on the same deployment (one per module: :func:`insecure_runs`), the
seeded run with the two-message protocol gives the numbers of the fused one;
(b) TLS + SuperNode authentication with keys from ``hacrl-fed keys`` and fake workers (no models) serving mutual
TLS on loopback TCP (the ClientApps present their org's client certificate), plus an unregistered SuperNode that
must be refused;

(c) ``hacrl-fed deploy-local`` (:func:`run_local`, stand-in workers): streams the ServerApp's log and ends with
the final table. (b) and (c) read one ``deploy-local --tls --worker-link tls`` run (:func:`tls_local_run`), which
probes the live deployment of (b) before its run.

Every process is stopped by PID in the harness's teardown (also when a test fails), and each test checks that
nothing it started is left running. Timings go to ``<tmp>/timings.json`` (and stdout with ``-s``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import stat
import sys
import textwrap
import time
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from hacrl_fed.cli.deploy_local import main as main_local
from hacrl_tools.deploy_local import (
    HOST, Deployment, HarnessError, descendants, identity_overrides, process_table, run_local,
    WORKER_READY, start_local, toml_table, worker_command, worker_link_args, worker_listen, worker_node_config,
)
from hacrl_fed.security.keys import KeyLayout, make_supernode_keypair
from hacrl_fed.wire.grpc_client import GrpcWorkerClient

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"
FAKE_WORKER = REPO / "tests" / "helpers_fake_workers.py"
ORGS = ("acme", "globex")
ROUNDS = 2


def _metrics(run_dir: Path) -> dict[int, dict]:
    """``{round: merged record}`` of the coordinator's ``metrics.jsonl`` in the ServerApp's ``run-dir``."""
    path = run_dir / "metrics.jsonl"
    merged: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        merged.setdefault(record["round"], {}).update(record)
    return merged


def _submit_and_wait(dep: Deployment, run_dir: Path, overrides: tuple[str, ...] = (),
                     timeout_s: float = 240) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    run_config = {"config-path": str(SMOKE), "overrides": " ".join([f"federation.rounds={ROUNDS}", *overrides]),
                  "run-dir": str(run_dir)}
    run_id = dep.submit(REPO, run_config)
    info = dep.wait_run(run_id, timeout_s=timeout_s)
    elapsed = time.monotonic() - t0
    assert info["status"] == "finished:completed", (
        f"run {info['status']} ({info.get('status-details')}):\n{dep.run_log(run_id)[-4000:]}")
    return run_id, info, elapsed


def _report(tmp_path: Path, name: str, dep: Deployment, **extra) -> None:
    data = {"test": name, "processes": dep.timings(), **extra}
    (tmp_path / "timings.json").write_text(json.dumps(data, indent=1))
    print(json.dumps(data))


def _assert_per_org_metrics(metrics: dict[int, dict], orgs: tuple[str, ...], fresh: bool = True) -> None:
    assert set(range(ROUNDS + 1)) <= set(metrics), sorted(metrics)
    for org in orgs:
        assert f"eval/{org}/accuracy" in metrics[0] and f"eval/{org}/accuracy" in metrics[ROUNDS]
        for t in range(1, ROUNDS + 1):
            assert metrics[t][f"round/{org}/failed"] == 0.0, (t, org)
            assert metrics[t][f"round/{org}/rollouts_accepted"] > 0, (t, org)
            if fresh:  # real policy workers (the fake workers of the TLS test keep no challenges)
                _assert_fresh(metrics[t], org, orgs, t)


def _assert_fresh(record: dict, org: str, orgs, t: int) -> None:
    """Replay protection on the deployment path: the org's plan carried its latest challenge (from the Health reply
    of the key check, then its train reports), so it trained on every peer's batch (SECURITY.md "Fresh plans")."""
    assert record[f"{org}/trust/plan_fresh"] == 1.0, (t, org)
    for peer in orgs:
        if peer != org:
            assert record[f"{org}/trust/{peer}/accepted"] > 0 and f"{org}/trust/{peer}/rejected/stale_plan" not in record


# ------------------------------------------------------------------------------------------ the harness itself

# A parent that ignores SIGTERM and starts a child in its own session (as flower-superlink does with
# flower-superexec), then prints the child's pid and sleeps.
_STUBBORN_TREE = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    print("child", child.pid, flush=True)
    time.sleep(600)
""")


def test_stop_kills_a_stubborn_process_and_its_detached_child(tmp_path):
    dep = Deployment(tmp_path, grace_s=0.5)
    proc = dep.spawn("superlink", [sys.executable, "-c", _STUBBORN_TREE])
    child = int(dep.wait_log(proc, re.compile(r"child (\d+)"), "the child line", timeout_s=30)[1])
    assert child in descendants(proc.pid)
    dep.stop_all()
    assert proc.popen.returncode == -9  # SIGTERM ignored -> SIGKILL after the grace period
    assert child in proc.seen_descendants
    assert child not in process_table() or "<defunct>" in process_table()[child][1]
    assert dep.leftovers() == {}
    assert dep.timings()["superlink"]["stop_s"] >= 0.5


def test_readiness_fails_fast_with_the_log_tail(tmp_path):
    dep = Deployment(tmp_path, startup_timeout_s=30)
    proc = dep.spawn("worker-acme", [sys.executable, "-c", "print('no model for you'); raise SystemExit(3)"])
    # the exit is reported as such (a wait that ran into the 30 s timeout would say "no ... within 30 s")
    with pytest.raises(HarnessError, match=r"(?s)worker-acme exited with code 3 .*no model for you"):
        dep.wait_log(proc, re.compile("listening on"), "the 'listening on' line")
    slow = dep.spawn("worker-slow", [sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(HarnessError, match=r"worker-slow: no the 'listening on' line within 0.5 s"):
        dep.wait_log(slow, re.compile("listening on"), "the 'listening on' line", timeout_s=0.5)
    dep.stop_all()
    assert dep.leftovers() == {}


def test_federation_file_is_what_flwr_reads(tmp_path, monkeypatch):
    from flwr.cli.flower_config import read_superlink_connection

    keys = KeyLayout(tmp_path / "keys")
    for tls, expect_insecure in ((None, True), (keys, False)):
        dep = Deployment(tmp_path / ("tls" if tls else "plain"), tls=tls)
        dep.superlink_port = 4242
        path = dep.write_federation("fed")
        monkeypatch.setenv("FLWR_HOME", str(path.parent))
        conn = read_superlink_connection()  # the default connection
        assert (conn.name, conn.address, conn.insecure) == ("fed", f"{HOST}:4242", expect_insecure)
        assert conn.root_certificates == (None if tls is None else str(keys.ca_cert))


def test_toml_table_round_trips_and_rejects_what_toml_cannot_say():
    values = {"config-path": '/a "b"/c.yaml', "overrides": "x.y=1 z=[1, 2]", "resume": True, "n": 3, "f": 0.5}
    assert tomllib.loads(toml_table(values)) == values
    with pytest.raises(HarnessError, match="run-config key 'a.b'"):
        toml_table({"a.b": 1})
    with pytest.raises(HarnessError, match="'x': list values"):
        toml_table({"x": [1]})


def test_worker_links_and_the_node_config_flwr_parses(tmp_path, capsys):
    from flwr.common.config import parse_config_args

    keys = KeyLayout(tmp_path / "keys")
    dep = Deployment(tmp_path / "dep", tls=keys)
    listen, link = worker_listen(dep, ORGS)
    assert link == "unix" and listen["acme"] == f"unix:{dep.workdir / 'sock' / 'acme.sock'}"
    assert stat.S_IMODE(os.stat(dep.workdir / "sock").st_mode) == 0o700
    assert worker_link_args(listen["acme"], "acme", keys) == []
    assert worker_node_config(listen["acme"], "acme", keys) == {}
    deep = Deployment(tmp_path / ("d" * 100))  # socket paths too long: loopback TCP
    assert worker_listen(deep, ORGS)[1] == "insecure"
    assert worker_listen(Deployment(deep.workdir, tls=keys), ORGS)[1] == "tls"
    with pytest.raises(HarnessError, match="needs a deployment with keys"):
        worker_listen(deep, ORGS, "tls")
    tcp = f"{HOST}:5"
    assert worker_link_args(tcp, "acme") == ["--insecure"] and worker_node_config(tcp, "acme") == {}
    assert worker_link_args(tcp, "acme", keys) == [
        "--tls-cert", str(keys.worker_cert("acme")), "--tls-key", str(keys.worker_key("acme")),
        "--tls-ca", str(keys.ca_cert), "--tls-client-name", "acme-client"]
    assert worker_command(SMOKE, "acme")[-2:] == ["127.0.0.1:0", "--insecure"]
    extra = worker_node_config(tcp, "acme", keys)
    dep.superlink_port = 4242
    argv = dep.supernode_argv("acme", tcp, 9101, worker_config=extra)
    parsed = parse_config_args([argv[argv.index("--node-config") + 1]])
    assert parsed == {"org": "acme", "worker": tcp, "worker-ca": str(keys.ca_cert),
                      "worker-cert": str(keys.worker_client_cert("acme")),
                      "worker-key": str(keys.worker_client_key("acme"))}
    with pytest.raises(SystemExit) as info:
        main_local(["--config", str(SMOKE), "--worker-link", "tls"])
    assert info.value.code == 2 and "--worker-link tls needs --tls" in capsys.readouterr().err


def test_identity_overrides_pin_one_roster_for_workers_and_coordinator(tmp_path):
    from hacrl_fed.config import load_config
    from hacrl_fed.security.identity import load_identity, load_roster

    overrides = identity_overrides(tmp_path / "ids", ORGS)
    assert identity_overrides(tmp_path / "ids", ORGS) == overrides  # an existing complete set is reused
    sec = load_config(SMOKE, overrides=overrides).security
    roster = load_roster(sec.roster_file)
    for org in ORGS:
        assert load_identity(sec.identity_file.replace("{org}", org), org).public() == roster[org]


def test_every_process_gets_a_private_flwr_home_and_the_quiet_env(tmp_path):
    env = Deployment(tmp_path).env("supernode-acme")
    assert env["FLWR_HOME"] == str(tmp_path.absolute() / "homes" / "supernode-acme")
    assert env["FLWR_TELEMETRY_ENABLED"] == "0" and env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)  # flower-superexec is found


# ------------------------------------------------------------------------------------------ real deployments


def _log_through(path: Path, pattern: re.Pattern, timeout_s: float = 60) -> str:
    """``path``'s text once ``pattern`` is in it (the worker logs a call after answering it)."""
    deadline = time.monotonic() + timeout_s
    while not pattern.search(text := path.read_text()):
        assert time.monotonic() < deadline, f"no {pattern.pattern!r} in {path} within {timeout_s:g} s:\n{text[-2000:]}"
        time.sleep(0.2)
    return text


@pytest.fixture(scope="module")
def insecure_runs(tmp_path_factory) -> dict:
    """One insecure deployment (SuperLink, SuperNodes, real ``hacrl-fed worker`` processes on unix sockets that serve
    run after run from their initial weights), three runs on it, then every process stopped by PID:

    1. the seeded smoke run with ``federation.protocol=fused``, into ``fused/``;
    2. the same ``flwr run`` again into that used run dir (it must be refused);
    3. the same seeded run with ``two_message``, into ``two_message/``.

    Each worker's log up to the end of run 2 (``worker_logs``) is the log of the fused run alone: the refused run
    reached no worker. Both real-deployment tests below read what this leaves; a failure here fails both."""
    tmp = tmp_path_factory.mktemp("insecure")
    out: dict = {"tmp": tmp, "run_ids": {}}
    t0 = time.monotonic()
    with Deployment(tmp / "dep") as dep:  # __exit__ stops every process, also when an assertion fails
        identities = identity_overrides(tmp / "identity_set", ORGS)  # workers and coordinator: one roster
        out["addresses"] = start_local(dep, SMOKE, ORGS, overrides=identities)
        out["socket_modes"] = {org: stat.S_IMODE(os.stat(a[len("unix:"):]).st_mode)
                               for org, a in out["addresses"].items()}
        up_s = time.monotonic() - t0
        fused = (*identities, "federation.protocol=fused")
        run_id, _, run_s = _submit_and_wait(dep, tmp / "fused", fused)
        out["run_ids"]["fused"], out["server_log"] = run_id, dep.flwr_log(run_id)
        again = dep.submit(REPO, {"config-path": str(SMOKE), "run-dir": str(tmp / "fused"),
                                  "overrides": " ".join([f"federation.rounds={ROUNDS}", *fused])})
        out["refused"] = dep.wait_run(again, timeout_s=120)
        out["refused_log"] = dep.flwr_log(again)
        last_call = re.compile(rf"Step train round {ROUNDS} \+ evaluate \+ checkpoint ok in")
        out["worker_logs"] = {org: _log_through(tmp / "dep" / "logs" / f"worker-{org}.log", last_call)
                              for org in ORGS}
        out["run_ids"]["two_message"] = _submit_and_wait(
            dep, tmp / "two_message", (*identities, "federation.protocol=two_message"))[0]
    out["leftovers"] = dep.leftovers()
    metrics = _metrics(tmp / "fused")
    _report(tmp, "insecure-real-workers", dep, up_s=up_s, run_s=run_s, total_s=time.monotonic() - t0,
            round_times={t: {k: v for k, v in m.items() if k.startswith("time/")} for t, m in metrics.items()})
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_insecure_deployment_with_real_workers(insecure_runs):
    tmp, run_dir = insecure_runs["tmp"], insecure_runs["tmp"] / "fused"
    run_id, server_log, refused_log = (insecure_runs["run_ids"]["fused"], insecure_runs["server_log"],
                                       insecure_runs["refused_log"])
    assert insecure_runs["leftovers"] == {}
    metrics = _metrics(run_dir)
    _assert_per_org_metrics(metrics, ORGS)
    # progress in the ServerApp's log as flwr log shows it, and the run's outputs link the two run ids
    for t in range(1, ROUNDS + 1):
        assert re.search(rf"round {t}/{ROUNDS} in [\d.]+ s \| reward acme [\d.]+ globex [\d.]+ \| accepted acme",
                         server_log), server_log[-3000:]
    assert "eval at round 0: held-out accuracy" in server_log and f"eval at round {ROUNDS}:" in server_log
    assert "org " in server_log and "outputs in" in server_log  # the final table
    run_info = json.loads((run_dir / "run_info.json").read_text())
    assert run_info["flower_run_id"] == run_id and run_info["transport"] == "flower-deployment"
    assert "\n# transport: flower-deployment\n" in (run_dir / "config.yaml").read_text()
    assert f"Flower run id {run_id}" in (run_dir / "summary.txt").read_text()
    # the same run again into the used run dir: fails cleanly, with the keys of flwr run
    refused = insecure_runs["refused"]
    assert refused["status"] == "finished:failed" and "resume=true" in refused.get("status-details", "")
    assert "already holds a run: set resume=true to continue it, or another run-dir=" in refused_log
    assert "Traceback" not in refused_log, refused_log
    for org in ORGS:  # each worker: what it serves, one line per call, the ready line once
        worker_log = insecure_runs["worker_logs"][org]  # up to the end of the refused run
        assert re.search(rf"hacrl-fed worker serves org {org}, model zoo:micro-\S+, [\d.]+ M parameters, "
                         r"device \w+, dtype \w+", worker_log), worker_log[-2000:]
        assert (tmp / "dep" / "logs" / f"worker-{org}.log").read_text().count("listening on unix:") == 1
        # fused rounds: one Step call per round (plan 1 alone, train 1 with plan 2, the last train alone with the
        # evaluation and checkpoint of the last round)
        assert re.search(r"Step plan round 1 ok in [\d.]+ s", worker_log), worker_log[-2000:]
        assert "Step train round 1 plan round 2 ok in" in worker_log
        assert f"Step train round {ROUNDS} + evaluate + checkpoint ok in" in worker_log
        # the message counter: each Flower message is one ClientApp process and one call to the worker, so these
        # are all the messages the org got (Health polls log at DEBUG): every round one, evaluation and
        # checkpoint rounds included; only the evaluation before round 1 is a message of its own; the refused run
        # sent none
        calls = Counter(m.group(1) for m in re.finditer(r"grpc_server: (\w+)\b[^\n]* ok in [\d.]+ s", worker_log))
        assert calls == {"Step": ROUNDS + 1, "Evaluate": 1}, (org, calls)
        assert "Evaluate round 0 ok in" in worker_log
    for org in ORGS:  # the real workers did the work: their own timings came back through Flower
        assert metrics[1][f"{org}/time/generate"] > 0
        assert insecure_runs["addresses"][org] == f"unix:{tmp / 'dep' / 'sock' / f'{org}.sock'}"
    assert insecure_runs["socket_modes"] == {org: 0o600 for org in ORGS}
    assert all(metrics[1][f"round/{org}/messages"] == 1.0 for org in ORGS)  # one Flower message per org and round


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deployment_fused_and_two_message_protocols_give_identical_numbers(insecure_runs):
    """One deployment (SuperLink, SuperNodes, real workers serving run after run from their initial weights): the
    same seeded run with each protocol gives identical per-round rewards, counts, losses and accuracies."""
    learned = {}
    for protocol in ("two_message", "fused"):
        metrics = _metrics(insecure_runs["tmp"] / protocol)
        learned[protocol] = {t: {k: v for k, v in m.items() if k != "wall_time"
                                 and not {"time", "cpu", "bytes", "messages", "perf"} & set(k.split("/"))}
                             for t, m in metrics.items()}
        assert all(metrics[1][f"round/{o}/messages"] == (2.0 if protocol == "two_message" else 1.0) for o in ORGS)
    assert insecure_runs["leftovers"] == {}
    assert learned["fused"] == learned["two_message"]
    for t in range(1, ROUNDS + 1):  # the later run (two_message), on the same long-lived workers, was fresh too
        for org in ORGS:
            _assert_fresh(learned["two_message"][t], org, ORGS, t)
    assert all(f"{o}/train/loss" in learned["fused"][ROUNDS] and f"eval/{o}/accuracy" in learned["fused"][ROUNDS]
               for o in ORGS)


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


def _probe_tls_deployment(dep: Deployment, seen: dict) -> None:
    """``run_local``'s ``on_up``: from outside the live TLS deployment, what the TLS test checks (into ``seen``)."""
    seen["dep"] = dep
    seen["addresses"] = {org: WORKER_READY.search(next(p for p in dep.procs if p.name == f"worker-{org}").log_text())
                         ["address"] for org in ORGS}
    seen["plaintext_health"] = {}
    for org, address in seen["addresses"].items():  # the workers serve mutual TLS: a plaintext client is refused
        try:
            seen["plaintext_health"][org] = f"answered {GrpcWorkerClient(address, timeout_s=5).health()}"
        except Exception as err:  # the test matches the error's text
            seen["plaintext_health"][org] = f"{type(err).__name__}: {err}"
    seen["sans"] = _peer_sans(dep.tls.ca_cert, dep.superlink_port)
    seen["plain_http"] = _plain_http_reply(dep.superlink_port)
    # mallory's SuperNode key is made here but never registered
    private, _ = make_supernode_keypair(comment="hacrl-fed-supernode-mallory")
    mallory_key = dep.workdir / "mallory.key"
    mallory_key.write_bytes(private)
    mallory_key.chmod(0o600)
    intruder = dep.start_supernode("mallory", f"{HOST}:1", auth_key=mallory_key, wait=False)
    seen["intruder_rc"] = intruder.popen.wait(timeout=120)
    seen["intruder_log"], seen["intruder_id"] = intruder.log_text(), dep.supernode_id(intruder)
    seen["superlink_log"] = dep.superlink.log_text()
    seen["nodes"] = dep.list_supernodes()
    seen["supernode_ids"] = {dep.supernode_id(p) for p in dep.procs if p.name.startswith("supernode-")} - {None}


@pytest.fixture(scope="module")
def tls_local_run(tmp_path_factory) -> dict:
    """One ``hacrl-fed deploy-local --tls --worker-link tls`` (:func:`run_local`: keys from ``hacrl-fed keys``,
    SuperNode authentication) with stand-in workers (no models) serving mutual TLS on loopback TCP, the ClientApps
    presenting their org's client certificate. Once everything is up and before the run,
    :func:`_probe_tls_deployment` looks at it from outside (``seen``); then the run, its streamed output
    (``lines``) and return code (``rc``). Every process is stopped (by PID) before the tests read this."""
    tmp = tmp_path_factory.mktemp("tls-local")
    lines: list[str] = []
    seen: dict = {}
    t0 = time.monotonic()
    rc = run_local(SMOKE, workdir=tmp / "dep", app=REPO, tls=True, worker_link="tls", worker_argv=_fake_worker,
                   timeout_s=300, overrides=[f"federation.rounds={ROUNDS}", "security.signing=false"],  # unsigned
                   out=lambda text: lines.extend(text.splitlines()), on_up=lambda dep: _probe_tls_deployment(dep, seen))
    dep = seen["dep"]
    _report(tmp, "tls-auth-fake-workers", dep, total_s=time.monotonic() - t0, intruder_exit_code=seen["intruder_rc"])
    return {"tmp": tmp, "rc": rc, "lines": lines, "seen": seen, "leftovers": dep.leftovers()}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_tls_and_supernode_auth_refuse_an_unregistered_node(tls_local_run):
    seen, run_dir = tls_local_run["seen"], tls_local_run["tmp"] / "dep" / "run"
    dep = seen["dep"]
    for org, address in seen["addresses"].items():  # the workers serve mutual TLS: a plaintext client is refused
        assert address.startswith(f"{HOST}:")
        assert "UNAVAILABLE" in seen["plaintext_health"][org], seen["plaintext_health"][org]
    assert ("IP Address", HOST) in seen["sans"]
    assert not seen["plain_http"].startswith(b"HTTP/")  # TLS only, no plaintext

    assert seen["intruder_rc"] != 0
    assert "Failed to activate SuperNode" in seen["intruder_log"]
    assert seen["intruder_id"] is None
    assert "No SuperNode found with the given public key" in seen["superlink_log"]

    nodes = seen["nodes"]
    assert len(nodes) == len(ORGS) and {n["status"] for n in nodes} == {"online"}, nodes
    assert seen["supernode_ids"] == {int(n["node-id"]) for n in nodes}

    assert tls_local_run["rc"] == 0, "\n".join(tls_local_run["lines"][-60:])  # the run finished:completed
    assert tls_local_run["leftovers"] == {}
    metrics = _metrics(run_dir)
    _assert_per_org_metrics(metrics, ORGS, fresh=False)  # fake workers: unsigned, no challenges
    for org in ORGS:  # the ClientApps reached their workers over mutual TLS with their org's client certificate
        assert "--tls-client-name" in " ".join(next(p.argv for p in dep.procs if p.name == f"worker-{org}"))
    for org in ORGS:  # exact: FakeWorker answers G rollouts per prompt, skill 0.5
        assert metrics[1][f"round/{org}/rollouts_accepted"] == 4 * 4
        assert metrics[1][f"round/{org}/accuracy"] == 0.5
    assert not any("mallory" in key for m in metrics.values() for key in m)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_deploy_local_streams_the_server_log_and_ends_with_the_table(tls_local_run):
    lines, workdir = tls_local_run["lines"], tls_local_run["tmp"] / "dep"
    assert tls_local_run["rc"] == 0, "\n".join(lines[-60:])
    text = "\n".join(lines)
    status = next(i for i, line in enumerate(lines) if "finished:completed" in line)
    assert all(f"round {t}/{ROUNDS} in " in "\n".join(lines[:status]) for t in range(1, ROUNDS + 1)), text[-3000:]
    table = (workdir / "run" / "summary.txt").read_text().rstrip().splitlines()
    assert lines[-len(table):] == table and table[0].startswith("org ")  # ends with the final table
    assert table[-1] == f"outputs in {workdir / 'run'}"
    assert f"round {ROUNDS}/{ROUNDS} in " in (workdir / "logs" / "serverapp.log").read_text()
    assert json.loads((workdir / "timings.json").read_text())["run"]["status"] == "finished:completed"
    assert tls_local_run["leftovers"] == {}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_asynchronous_rounds_on_an_insecure_deployment_with_fake_workers(tmp_path):
    """K = 1 through SuperLink + SuperNodes + `flwr-clientapp` processes (stand-in workers, unsigned): each step pushed
    alone, its reply pulled as it comes; every round logged, each org trains every round, every foreign batch
    trained on once or counted refused, and every process stopped (by PID)."""
    import yaml

    from hacrl_fed.config import load_config

    cfg = load_config(SMOKE, ["federation.rounds=3", "security.signing=false", "federation.staleness=1"])
    config = tmp_path / "async.yaml"  # the stand-in workers read it too: their codec's window is K + 1
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    argv = lambda org, listen: [sys.executable, str(FAKE_WORKER), "--config", str(config), "--org", org,  # noqa: E731
                                "--listen", listen]
    seen: dict = {}
    rc = run_local(config, workdir=tmp_path / "dep", app=REPO, worker_argv=argv, timeout_s=300,
                   out=lambda text: None, on_up=lambda dep: seen.setdefault("dep", dep))
    assert rc == 0
    assert seen["dep"].leftovers() == {}
    records = [json.loads(line) for line in (tmp_path / "dep" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert all(records[-1][f"async/{o}/version"] == 3 for o in ORGS)
    for org in ORGS:  # 16 rollouts a batch; the other org's batches of rounds 1-3: taken or refused
        taken = sum(r.get(f"{org}/hacpo/foreign", 0.0) for r in records) / 16
        refused = sum(v for r in records for k, v in r.items() if k.startswith(f"round/{org}/refused/"))
        assert taken + refused == 3 * (len(ORGS) - 1), (org, taken, refused)
