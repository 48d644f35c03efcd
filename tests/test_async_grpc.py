"""Asynchronous rounds over real gRPC worker processes (issue 29, Deliver 3): a signed K = 1 run of the smoke config
with its two `hacrl-fed worker` processes (started as `hacrl-fed run --transport grpc` starts them, stopped by PID),
the replies taken on the wall clock as they come, the signed batches, tags and per-round tables through the codec's
bounds, and every (learner, foreign batch) pair taken once or counted; a train request naming a round outside the
worker's window is refused by the worker's codec, naming the field; a worker SIGKILLed or SIGSTOPped mid-run (fake
worker processes) no longer holds the others back, and one restarted on its address rejoins at the current round."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers_fake_workers import FakeTask, fake_config
from hacrl_fed.config import load_config
from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.grpc_transport import GrpcTransport
from hacrl_fed.coordinator.launcher import WorkerProcesses
from hacrl_fed.metrics import RunLogger, read_metrics
from hacrl_fed.security.keyring import load_run_roster
from hacrl_fed.types import StepRequest, TrainRequest

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
OVERRIDES = ["federation.staleness=1", "federation.rounds=3", "trainer.selection.rule=all", "task.eval_size=8"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("encrypt", [False, True], ids=["signed", "blind"])
def test_a_signed_k1_run_over_grpc_worker_processes(tmp_path, encrypt):
    """Two `hacrl-fed worker` processes, K = 1, signed (and, `blind`, coordinator-blind: sealed batches, per-batch
    accusations): honest, nothing refused, every batch taken once or counted, the version each signed."""
    cfg = load_config(CONFIG, overrides=[*OVERRIDES, f"security.encrypt={str(encrypt).lower()}"])
    assert cfg.security.signing and cfg.federation.staleness == 1 and cfg.security.encrypt == encrypt
    run_dir, config = tmp_path / "run", tmp_path / "async.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    load_run_roster(cfg, run_dir)  # provisions the run's keys before the processes start
    procs = WorkerProcesses(config, ["acme", "globex"], run_dir=run_dir, worker_args=["--run-dir", str(run_dir)])
    try:
        transport = GrpcTransport(procs.start(), secrets=procs.secrets)
        assert all(not isinstance(v, Exception) for v in transport.wait_ready(120).values())
        with RunLogger(run_dir, tensorboard=False) as logger:
            co = Coordinator(cfg, transport, run_dir, logger=logger)
            summary = co.run()
        hostile = TrainRequest(co.run_id, 3, "acme", (), (), {"acme": 1.0}, tags=(("globex", 1, 0),))  # W = 2
        with pytest.raises(Exception, match=r"tags\[0\]\.round: round 1 outside the window \[2, 3\]"):
            transport.clients["acme"].step(StepRequest(train=hostile), timeout_s=60)  # refused by the worker's codec
        transport.close()
    finally:
        procs.close()
    assert all(w.proc.poll() is not None for w in procs.workers.values())  # stopped by PID
    drv, records = co.async_driver, read_metrics(run_dir)
    assert drv.wall and summary.rounds_completed == 3 and [r["round"] for r in records] == [0, 1, 2, 3]
    assert all(s.end >= s.start for s in drv.steps)  # wall times
    for org, src in (("acme", "globex"), ("globex", "acme")):  # signed batches relayed and checked end to end
        assert sum(rec.get(f"{org}/trust/{src}/received", 0.0) for rec in records) > 0
    assert records[-1]["async/acme/version"] == records[-1]["async/globex/version"] == 3
    assert not [k for rec in records for k in rec if "/rejected/" in k and rec[k]]  # honest: nothing refused
    assert sum(rec.get(f"{o}/train/num_cross", 0) for rec in records for o in ("acme", "globex")) > 0
    for org in ("acme", "globex"):
        offered = [(t.source, t.round) for s in drv.steps if s.org == org for t in s.foreign]
        assert len(offered) == len(set(offered))
        assert len(offered) + sum(drv.refused[org].values()) == len([t for _, t in drv.published if t.source != org])


FAKE_WORKER = [sys.executable, str(Path(__file__).with_name("helpers_fake_workers.py"))]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_worker_killed_or_hung_mid_run_no_longer_holds_the_others_back(tmp_path, sig):
    """Three fake `hacrl-fed worker` processes (0.2 s a step), K = 1; once round 2 is logged c is SIGKILLed (its call
    fails: unreachable) or SIGSTOPped (its call times out): c is dead for the bound after at most one step deadline
    (``round_timeout_s`` times the step's parts, at most 4), a and b finish every round, every (learner, foreign
    batch) pair is taken or counted (c's unreached ones learner_dead), and the probes asking c to rejoin hold no step.
    Before deaths existed, a hung c held the others back one deadline per round."""
    timeout_s = 2.0
    cfg = fake_config(("a", "b", "c"), rounds=8, staleness=1, round_timeout_s=timeout_s)
    config = tmp_path / "async.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    procs = WorkerProcesses(
        config,
        ["a", "b", "c"],
        run_dir=tmp_path / "run",
        command=FAKE_WORKER,
        worker_args=["--step-s", "0.2"],
        ready_timeout_s=60,
    )
    hit: list[float] = []

    def hit_c(result):
        if result.round == 2 and not hit:
            os.kill(procs.workers["c"].proc.pid, sig)
            hit.append(time.monotonic())

    try:
        transport = GrpcTransport(procs.start(), secrets=procs.secrets)
        assert all(not isinstance(v, Exception) for v in transport.wait_ready(60).values())
        co = Coordinator(cfg, transport, tmp_path / "run", task=FakeTask(), on_round=hit_c)
        summary = co.run()
        after = time.monotonic() - hit[0]
        transport.close()
    finally:
        if sig == signal.SIGSTOP:
            os.kill(procs.workers["c"].proc.pid, signal.SIGKILL)  # a stopped process ignores SIGTERM until resumed
        procs.close()
    assert all(w.proc.poll() is not None for w in procs.workers.values())  # stopped by PID
    drv = co.async_driver
    assert summary.rounds_completed == 8 and set(drv.finished) == {"a", "b"}
    assert after < 4 * timeout_s + 6  # one deadline at most, then the 6 rounds left at 0.2 s a step (slack: CPU)
    assert not drv.orgs["c"].alive and drv.refused["c"]["learner_dead"] > 0
    assert {s.org for s in drv.lost} <= {"c"}
    for org in ("a", "b", "c"):
        offered = [(t.source, t.round) for s in drv.steps if s.org == org for t in s.foreign]
        assert len(offered) == len(set(offered))
        assert len(offered) + sum(drv.refused[org].values()) == len([t for _, t in drv.published if t.source != org])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_worker_restarted_on_its_address_rejoins_at_the_current_round(tmp_path):
    """c is SIGKILLed once round 2 is logged and a fresh fake worker process for c starts on its socket at once:
    c dies (its call fails), a Health probe finds the new process, and c rejoins at the current round (its first step
    only generates) while a and b run on, at the new process's version (0, its Health says); it then trains again
    and finishes with them."""
    import subprocess

    cfg = fake_config(("a", "b", "c"), rounds=30, staleness=1, round_timeout_s=5.0)
    config = tmp_path / "async.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    procs = WorkerProcesses(
        config,
        ["a", "b", "c"],
        run_dir=tmp_path / "run",
        command=FAKE_WORKER,
        worker_args=["--step-s", "0.2"],
        ready_timeout_s=60,
    )
    again: list[subprocess.Popen] = []

    def restart_c(result):
        if result.round == 2 and not again:
            os.kill(procs.workers["c"].proc.pid, signal.SIGKILL)
            address = procs.addresses["c"]
            procs.workers["c"].proc.wait(10)
            Path(address[len("unix:") :]).unlink(missing_ok=True)
            argv = [*FAKE_WORKER, "--config", str(config), "--org", "c", "--listen", address, "--step-s", "0.2"]
            log = (tmp_path / "c-again.log").open("w")
            env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
            again.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env))

    try:
        transport = GrpcTransport(procs.start(), secrets=procs.secrets)
        assert all(not isinstance(v, Exception) for v in transport.wait_ready(60).values())
        co = Coordinator(cfg, transport, tmp_path / "run", task=FakeTask(), on_round=restart_c)
        summary = co.run()
        transport.close()
    finally:
        for proc in again:  # stopped by PID
            proc.kill()
            proc.wait(10)
        procs.close()
    drv = co.async_driver
    assert summary.rounds_completed == 30 and set(drv.finished) == {"a", "b", "c"}
    (lost,) = drv.lost
    assert lost.org == "c"
    back = [s for s in drv.steps if s.org == "c" and s.start > lost.end]
    floor = min(max(t.round for w, t in drv.published if t.source == o and w <= back[0].start) for o in ("a", "b"))
    assert back[0].round == floor + 1 > lost.round and back[0].own is None  # the current round, only generating
    assert any(s.own is not None and s.foreign for s in back[1:])  # then trains with the others' batches
    assert drv.orgs["c"].version == len([s for s in back if s.own is not None])  # the new process's count, from 0
    assert any(s.org == "a" and lost.end < s.start < back[0].start for s in drv.steps)  # a ran on meanwhile
    for org in ("a", "b", "c"):
        offered = [(t.source, t.round) for s in drv.steps if s.org == org for t in s.foreign]
        assert len(offered) == len(set(offered))
        assert len(offered) + sum(drv.refused[org].values()) == len([t for _, t in drv.published if t.source != org])
