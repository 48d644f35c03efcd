"""The edges the second attack rerun found (issue 20, Why 4), each tried as the attacker would and refused with a
counted reason: in-process and, where the path differs, over real gRPC (unix sockets or loopback TCP).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from hacrl_fed.config import ConfigError, load_config
from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.worker.step import run_step
from hacrl_fed.security.identity import IdentityError, generate_identity, load_roster
from hacrl_fed.security.sealing import MIN_BUCKET, TAG_BYTES, open_batch, padded_size, seal_batch
from hacrl_fed.types import Rollout, RolloutBatch, TrainRequest
from hacrl_fed.wire import codec
from hacrl_fed.wire.bounds import max_request_bytes
from hacrl_fed.wire.grpc_client import GrpcWorkerClient, WorkerCallError
from hacrl_fed.wire.grpc_server import serve_worker
from hacrl_fed.worker import build_worker
from hacrl_fed.worker.checkpoint import CheckpointRefused
from hacrl_fed.worker.guard import RequestRefused
from test_security_attacks import B, G, MAX_NEW, Hostile, make_cfg, plan_for

FAKE_WORKER = [sys.executable, str(Path(__file__).with_name("helpers_fake_workers.py"))]


@pytest.fixture()
def serve(tmp_path):
    """``serve(worker, **serve_worker kwargs) -> GrpcWorkerClient`` on a unix socket; all stopped at teardown."""
    servers, clients = [], []

    def start(worker, *, secret=None, **kwargs):
        server = serve_worker(worker, f"unix:{tmp_path / 'sock' / f'{worker.org_id}-{len(servers)}.sock'}", **kwargs)
        servers.append(server)
        clients.append(GrpcWorkerClient(server.address, org_id=worker.org_id, timeout_s=60, secret=secret))
        return clients[-1]

    yield start
    for c in clients:
        c.close()
    for s in servers:
        s.stop(0)


def _status(call) -> WorkerCallError:
    with pytest.raises(WorkerCallError) as info:
        call()
    return info.value


# ------------------------------------------------------------------------------------------ the served run


def test_no_error_names_the_run_the_worker_serves(tmp_path, serve):
    cfg = make_cfg()
    worker = build_worker(cfg, "acme", run_dir=tmp_path / "run")
    client = serve(worker)
    plan = plan_for(worker, run_id="secret-run-7")
    client.generate(plan)
    client.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), {}))
    probes = [
        lambda: client.generate(plan_for(worker, round_=5, run_id="guess")),  # another run, not at its start
        lambda: client.train(TrainRequest("guess", 1, "acme", plan.prompts, (), {})),
        lambda: client.evaluate(dataclasses.replace(_eval(worker), run_id="guess")),
    ]
    for probe in probes:
        err = _status(probe)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "secret-run-7" not in err.details, err.details
    with pytest.raises(RequestRefused, match="wrong_run") as info:  # in-process: the same messages
        worker.generate(plan_for(worker, round_=5, run_id="guess"))
    assert "secret-run-7" not in str(info.value)


def _eval(worker):
    from hacrl_fed.types import EvalRequest

    return EvalRequest("secret-run-7", 1, "arithmetic", tuple(worker.task.prompts("test", [0, 1])), MAX_NEW)


# ------------------------------------------------------------------------------------------ driven ahead


def test_a_worker_driven_far_ahead_is_counted_as_an_attack_not_a_restart(tmp_path):
    """A local process drives the worker to round 1000 of the real run; the real coordinator's round 1 is then
    refused as ``round_ahead`` (an attack), while a plan one round behind is still a benign ``stale_round``."""
    cfg = make_cfg()
    run_dir = tmp_path / "run"
    acme = build_worker(cfg, "acme", run_dir=run_dir)
    globex = build_worker(cfg, "globex", run_dir=run_dir)
    coord = Coordinator(cfg, InProcessTransport({"acme": acme, "globex": globex}), run_dir)
    ahead = plan_for(acme, round_=1000, run_id=coord.run_id)  # the worker serves no run yet: it joins at any round
    acme.generate(ahead)
    acme.train(TrainRequest(coord.run_id, 1000, "acme", ahead.prompts, (), {}))
    result = coord.run_round(1)
    assert result.metrics["round/acme/failure/round_ahead"] == 1.0 and result.failed["acme"] == "round_ahead"
    assert "round/acme/failure/stale_round" not in result.metrics
    assert result.trained == ["globex"]
    with pytest.raises(RequestRefused, match="stale_round"):  # one round behind: what a restart looks like
        acme.generate(plan_for(acme, round_=1000, run_id=coord.run_id))


def test_round_ahead_travels_as_its_own_cause_over_grpc(tmp_path, serve):
    cfg = make_cfg()
    worker = build_worker(cfg, "acme", run_dir=tmp_path / "run")
    client = serve(worker)
    ahead = plan_for(worker, round_=1000)
    client.generate(ahead)
    client.train(TrainRequest(ahead.run_id, 1000, "acme", ahead.prompts, (), {}))
    err = _status(lambda: client.generate(plan_for(worker, round_=1)))
    assert err.details.startswith("[round_ahead]") and err.failure_cause == "round_ahead"
    err = _status(lambda: client.generate(plan_for(worker, round_=999)))
    assert err.failure_cause == "stale_round"


# ------------------------------------------------------------------------------------------ the link secret


def _start_fake(tmp_path, *args):
    config = tmp_path / "run.yaml"
    if not config.exists():
        import yaml

        from helpers_fake_workers import fake_config

        config.write_text(yaml.safe_dump(fake_config(orgs=("a",)).model_dump(mode="json")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([*FAKE_WORKER, "--config", str(config), "--org", "a", "--listen", "127.0.0.1:0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_a_hand_started_insecure_worker_needs_its_printed_secret(tmp_path):
    proc = _start_fake(tmp_path, "--insecure")
    try:
        lines = iter(proc.stdout)  # type: ignore[arg-type]
        secret_line = next(line for line in lines if "link secret in" in line)
        path = Path(secret_line.rsplit(" in ", 1)[1].strip())
        address = next(line for line in lines if "listening on" in line).rsplit(" ", 1)[1].strip()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        from hacrl_fed.wire.link_secret import read_secret_file

        with GrpcWorkerClient(address, timeout_s=10, secret=read_secret_file(path)) as owner:
            assert owner.health()["org_id"] == "a"
        for wrong in (None, "0" * 64):  # another local process: no secret, or a guessed one
            with GrpcWorkerClient(address, timeout_s=10, secret=wrong) as stranger:
                err = _status(stranger.health)
                assert err.code == grpc.StatusCode.UNAUTHENTICATED
        shutil.rmtree(path.parent)  # the private temp dir the worker made for its secret
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_secret_file_others_can_read_is_refused_with_one_line(tmp_path):
    from hacrl_fed.wire.link_secret import create_secret_file

    path = tmp_path / "loose.secret"
    create_secret_file(path)
    os.chmod(path, 0o644)
    proc = _start_fake(tmp_path, "--insecure", "--secret-file", str(path))
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "readable by group/others" in out and len(out.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------ message size


def _huge_train(plan, text_bytes: int) -> TrainRequest:
    r = Rollout("globex", 1, plan.prompts[0].prompt_id, 0, "7" * text_bytes, "length", 0.0, -1.0, MAX_NEW)
    return TrainRequest(plan.run_id, 1, "acme", plan.prompts, (r,), {})


class Spy:
    """Counts the worker calls that got through (the message was decoded and handed over)."""

    def __init__(self, worker):
        self.worker, self.org_id, self.calls = worker, worker.org_id, []

    def step(self, request):  # each part through the spied calls
        return run_step(self, request)

    def __getattr__(self, name):
        attr = getattr(self.worker, name)
        if name in ("generate", "train", "evaluate"):
            def spied(arg, _attr=attr, _name=name):
                self.calls.append(_name)
                return _attr(arg)
            return spied
        return attr


def test_a_message_larger_than_the_plan_can_need_is_refused_before_decoding(tmp_path, serve):
    cfg = make_cfg(signing=False)
    bound = max_request_bytes(cfg, "acme")
    honest_max = (len(cfg.orgs)) * B * G * MAX_NEW * cfg.security.max_bytes_per_token
    assert honest_max < bound < 16 * 2**20 < cfg.federation.max_message_mb * 2**20  # from the plan, not 256 MiB
    worker = Spy(build_worker(cfg, "acme", run_dir=tmp_path / "run"))
    client = serve(worker, max_receive_bytes=bound)
    plan = plan_for(worker.worker)
    client.generate(plan)
    err = _status(lambda: client.train(_huge_train(plan, 16 * 2**20)))
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and worker.calls == ["generate"]
    full = tuple(Rollout("globex", 1, p.prompt_id, j, "7" * (MAX_NEW * cfg.security.max_bytes_per_token), "length",
                         0.0, -1.0, MAX_NEW) for p in plan.prompts for j in range(G))
    report = client.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, full, {}))  # the largest honest one
    assert report.metrics["trust/globex/received"] == G * B and worker.calls == ["generate", "train"]


def test_unsigned_text_that_will_be_ignored_is_counted_not_decoded(tmp_path, serve, monkeypatch):
    cfg = make_cfg()
    worker = build_worker(cfg, "acme", run_dir=tmp_path / "run")
    client = serve(worker, limits=codec.WireLimits(skip_unsigned_foreign=True))
    plan = plan_for(worker)
    client.generate(plan)
    converted = []
    real = codec._rollout_from
    monkeypatch.setattr(codec, "_rollout_from", lambda *a: converted.append(1) or real(*a))
    foreign = tuple(dataclasses.replace(r, response="x" * 2**16) for r in _huge_train(plan, 8).foreign * (G * B))
    report = client.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, foreign, {}))
    assert converted == [] and report.metrics["trust/coordinator/rejected/unsigned"] == G * B
    assert report.metrics["train/foreign_received"] == G * B and report.metrics["trust/foreign_accepted"] == 0.0


# ------------------------------------------------------------------------------------------ roster, resume


def test_a_roster_with_a_duplicate_org_or_a_shared_key_is_refused(tmp_path):
    a, b = generate_identity("a").public().to_text(), generate_identity("b").public().to_text()
    with pytest.raises(IdentityError, match="orgs 'a' and 'b' share one sign key"):
        load_roster({"a": a, "b": a})
    path = tmp_path / "roster.yaml"
    path.write_text(f'a: "{a}"\nb: "{b}"\na: "{b}"\n')
    with pytest.raises(IdentityError, match=r"org 'a' is listed twice \(line 3\)") as info:
        load_roster(path)
    assert "\n" not in str(info.value)
    cfg = make_cfg(roster={"acme": a, "globex": a})
    with pytest.raises(ConfigError, match="^security: roster: orgs 'acme' and 'globex' share one sign key"):
        build_worker(cfg, "acme", run_dir=tmp_path / "run")


def test_latest_pointing_outside_the_checkpoint_root_is_refused_on_resume(tmp_path):
    cfg = make_cfg()
    run_dir = tmp_path / "run"
    w = build_worker(cfg, "acme", run_dir=run_dir)
    plan = plan_for(w)
    w.generate(plan)
    w.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), {}))
    root = Path(w.checkpoint(1)).parent
    elsewhere = tmp_path / "elsewhere" / "round-000009"
    elsewhere.mkdir(parents=True)
    for target in ("../../../../elsewhere/round-000009", str(elsewhere)):
        (root / "LATEST").write_text(target)
        with pytest.raises(CheckpointRefused, match="not a round-NNNNNN checkpoint inside"):
            build_worker(cfg, "acme", run_dir=run_dir, resume=True)
    (root / "round-000009").symlink_to(elsewhere)
    (root / "LATEST").write_text("round-000009")
    with pytest.raises(CheckpointRefused, match="is a link out of"):
        build_worker(cfg, "acme", run_dir=run_dir, resume=True)


# ------------------------------------------------------------------------------------------ plan shape


def test_an_empty_plan_is_refused_with_invalid_argument(tmp_path, serve):
    worker = build_worker(make_cfg(), "acme", run_dir=tmp_path / "run")
    client = serve(worker)
    err = _status(lambda: client.generate(dataclasses.replace(plan_for(worker), prompts=())))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "empty_plan" in err.details
    err = _status(lambda: client.evaluate(dataclasses.replace(_eval(worker), prompts=())))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "empty_plan" in err.details
    assert client.generate(plan_for(worker)).round == 1  # the worker goes on


@pytest.mark.parametrize("capability,match", [
    ({"acme": 1.0, "globex": 1.0, "mallory": 1.0}, "3 capability entries for 2 orgs"),
    ({"mallory": 1.0}, "capability entries for orgs not in the run: ['mallory']"),
])
def test_the_capability_map_is_bounded_by_the_roster(tmp_path, serve, capability, match):
    worker = build_worker(make_cfg(), "acme", run_dir=tmp_path / "run")
    client = serve(worker)
    plan = plan_for(worker)
    client.generate(plan)
    err = _status(lambda: client.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), capability)))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "bad_capability" in err.details
    assert f"bad_capability: {match}" in err.details
    report = client.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), {"acme": 1.0}))
    assert report.metrics["train/num_self"] == G * B


# ------------------------------------------------------------------------------------------ padding


def test_padded_sealed_text_round_trips_and_shows_only_its_bucket():
    ids = {o: generate_identity(o) for o in ("a", "b")}
    texts = ["", "7", "x" * 63, "x" * 64, "é" * 100, "y" * 511]
    batch = RolloutBatch("r", 1, "a", tuple(Rollout("a", 1, 0, j, t, "stop", 1.0, -1.0, 3)
                                            for j, t in enumerate(texts)), 1.0)
    limit = 512
    sealed = seal_batch(batch, {"b": ids["b"].public()}, pad_limit=limit)
    sizes = [len(r.sealed_response) - TAG_BYTES for r in sealed.rollouts]
    assert sizes == [64, 64, 64, 128, 256, 512] and sizes == [padded_size(len(t.encode()), limit) for t in texts]
    assert all(s in {MIN_BUCKET * 2**k for k in range(8)} | {limit + 1} for s in sizes)
    opened = open_batch(sealed, "b", ids["b"], padded=True)
    assert [r.response for r in opened.rollouts] == texts
    from hacrl_fed.security.envelope import RejectedBatch

    with pytest.raises(RejectedBatch, match="padding mismatch"):
        open_batch(sealed, "b", ids["b"])  # sealed padded, opened as unpadded: the marker byte is not UTF-8
    with pytest.raises(RejectedBatch, match="padding mismatch"):
        open_batch(seal_batch(batch, {"b": ids["b"].public()}), "b", ids["b"], padded=True)
    assert padded_size(600, limit) == 601  # over the plan's bound: never cut, the receiver's screen refuses it


def test_blind_mode_with_padding_trains_on_every_rollout(tmp_path):
    cfg = make_cfg(encrypt=True, pad_sealed=True)
    seen: list[RolloutBatch] = []

    def record(batch):
        seen.append(batch)
        return batch

    run_dir = tmp_path / "run"
    workers = {o: Hostile(build_worker(cfg, o, run_dir=run_dir), record) for o in ("acme", "globex")}
    result = Coordinator(cfg, InProcessTransport(workers), run_dir).run_round(1)
    assert result.trained == ["acme", "globex"]
    assert result.metrics["acme/trust/foreign_accepted"] == G * B == result.metrics["globex/trust/foreign_accepted"]
    limit = MAX_NEW * cfg.security.max_bytes_per_token
    buckets = {MIN_BUCKET * 2**k for k in range(10) if MIN_BUCKET * 2**k <= limit} | {limit + 1}
    assert {len(r.sealed_response) - TAG_BYTES for b in seen for r in b.rollouts} <= buckets
    with pytest.raises(ConfigError, match="pad_sealed needs encrypt"):
        load_config({**cfg.model_dump(), "security": {"pad_sealed": True}})


# ------------------------------------------------------------------------------------------ verdicts (blind)


def _blind_cfg(orgs: tuple[str, ...]):
    zoo = {"acme": "micro-qwen-char", "globex": "micro-gpt2-bpe", "initech": "micro-qwen-char"}
    cfg = make_cfg(encrypt=True)
    return load_config({**cfg.model_dump(), "orgs": [{"id": o, "model": {"zoo": zoo[o]}} for o in orgs]})


class Framer(Hostile):
    """Publishes honestly but reports that every rollout of ``victim`` contradicted its reward, signed with its own
    valid key; ``evidence``: disclose the victim's real content key (it can unwrap it), or nothing."""

    def __init__(self, worker, victim: str, run_dir, *, evidence: bool, sign: bool = True):
        super().__init__(worker, lambda b: b)
        self.victim, self.run_dir, self.evidence, self.sign = victim, run_dir, evidence, sign

    def train(self, request):
        from hacrl_fed.security.reports import sign_report
        from hacrl_fed.security.sealing import content_key
        from test_security_attacks import key_of

        report = self.worker.train(request)
        m = dict(report.metrics)
        checked = m[f"trust/{self.victim}/checked"]
        m[f"trust/{self.victim}/mismatches"], m[f"trust/{self.victim}/verified_reward_sum"] = checked, 0.0
        me = key_of(self.run_dir, self.org_id)
        batch = next(b for b in request.source_batches if b.org_id == self.victim)
        keys = {self.victim: content_key(batch, self.org_id, me.box_key)} if self.evidence else {}
        lie = dataclasses.replace(report, metrics=m, disclosed_keys=keys, signature=b"")
        return sign_report(lie, me) if self.sign else lie


@pytest.mark.parametrize("orgs,kind", [(("acme", "globex", "initech"), "inprocess"), (("acme", "globex"), "inprocess"),
                                       (("acme", "globex", "initech"), "grpc")])
def test_framing_with_evidence_excludes_the_accuser_not_the_framed_org(tmp_path, orgs, kind):
    """Issue 20 Why 3: an org that publishes honestly but reports that another org's rollouts all contradicted
    their rewards. It must disclose the batch's content key; the coordinator re-verifies and excludes the framer.
    Over gRPC the signed report and its disclosed key cross the codec on both ends."""
    from test_security_attacks import Via

    cfg, run_dir = _blind_cfg(orgs), tmp_path / "run"
    workers = {o: Hostile(build_worker(cfg, o, run_dir=run_dir), lambda b: b) for o in orgs}
    workers["acme"] = Framer(workers["acme"].worker, "globex", run_dir, evidence=True)
    via = Via(kind, tmp_path / "sock")
    try:
        coord = Coordinator(cfg, via.transport(workers), run_dir)
        result = coord.run_round(1)
    finally:
        via.close()
    m = result.metrics
    assert m["round/acme/false_accusation"] == 1.0 and "false accusation against globex" in coord.guard.excluded["acme"]
    assert "globex" not in coord.guard.excluded and m["round/globex/mismatch_rate"] == 0.0
    assert m["round/globex/reverified_by_coordinator"] == G * B
    assert coord.tracker.history("globex") == [pytest.approx(m["round/globex/accuracy"])]  # its claims stand
    assert "acme" not in coord.live_orgs() and "globex" in coord.live_orgs()


@pytest.mark.parametrize("orgs", [("acme", "globex", "initech"), ("acme", "globex")])
@pytest.mark.parametrize("mode", ["no_evidence", "unsigned"])
def test_framing_without_evidence_or_signature_is_ignored_and_counted(tmp_path, orgs, mode):
    cfg, run_dir = _blind_cfg(orgs), tmp_path / "run"
    workers = {o: Hostile(build_worker(cfg, o, run_dir=run_dir), lambda b: b) for o in orgs}
    workers["acme"] = Framer(workers["acme"].worker, "globex", run_dir, evidence=mode == "unsigned",
                             sign=mode != "unsigned")
    coord = Coordinator(cfg, InProcessTransport(workers), run_dir)
    m = coord.run_round(1).metrics
    counter = "round/acme/unproven_accusation" if mode == "no_evidence" else "round/acme/report_rejected/bad_signature"
    assert m[counter] == 1.0 and coord.guard.excluded == {} and "round/acme/false_accusation" not in m
    if mode == "unsigned" and len(orgs) == 2:  # its one receiver's report does not count: no verdict this round
        assert "round/globex/verified_accuracy" not in m and coord.tracker.history("globex") == []
    else:  # the lie moved nothing
        assert m["round/globex/verified_accuracy"] == pytest.approx(m["round/globex/accuracy"])
        assert m["round/globex/mismatch_rate"] == 0.0


def test_an_honest_learners_report_is_signed_and_a_tampered_one_fails(tmp_path):
    from hacrl_fed.security.envelope import RejectedBatch
    from hacrl_fed.security.reports import verify_report

    cfg = make_cfg()
    w = build_worker(cfg, "acme", run_dir=tmp_path / "run")
    plan = plan_for(w)
    w.generate(plan)
    report = w.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), {}))
    decoded = codec.decode(type(report), codec.encode(report))
    assert verify_report(decoded, w.roster, run_id=plan.run_id, round=1) == report
    forged = dataclasses.replace(report, metrics={**report.metrics, "trust/globex/mismatches": 16.0})
    for bad, reason in [(forged, "bad_signature"), (dataclasses.replace(report, signature=b""), "bad_signature"),
                        (dataclasses.replace(report, org_id="mallory"), "unknown_org")]:
        with pytest.raises(RejectedBatch) as info:
            verify_report(bad, w.roster, run_id=plan.run_id, round=1)
        assert info.value.reason == reason
    with pytest.raises(RejectedBatch, match="round 1, not 2"):
        verify_report(report, w.roster, run_id=plan.run_id, round=2)  # a replayed report of another round


def _sealed_lie(batch, run_dir, orgs):
    """globex claims reward 1.0 everywhere on its real (sealed) responses, re-sealed and signed with its own key."""
    from hacrl_fed.security.envelope import signed
    from hacrl_fed.security.sealing import open_batch
    from test_security_attacks import key_of

    reader = next(o for o in orgs if o != batch.org_id)
    plain = open_batch(batch, reader, key_of(run_dir, reader))
    lied = dataclasses.replace(plain, rollouts=tuple(dataclasses.replace(r, reward=1.0) for r in plain.rollouts))
    recipients = {o: key_of(run_dir, o).public() for o in orgs if o != batch.org_id}
    return signed(seal_batch(dataclasses.replace(lied, signature=b""), recipients), key_of(run_dir, batch.org_id))


def test_a_true_accusation_in_blind_mode_excludes_the_liar_with_the_coordinators_own_check(tmp_path):
    orgs = ("acme", "globex", "initech")
    cfg, run_dir = _blind_cfg(orgs), tmp_path / "run"
    workers = {o: Hostile(build_worker(cfg, o, run_dir=run_dir), lambda b: b) for o in orgs}
    workers["globex"] = Hostile(workers["globex"].worker, lambda b: _sealed_lie(b, run_dir, orgs))
    coord = Coordinator(cfg, InProcessTransport(workers), run_dir)
    m = coord.run_round(1).metrics
    assert "re-verified by the coordinator" in coord.guard.excluded["globex"] and m["security/globex/excluded"] == 1.0
    assert m["round/globex/mismatch_rate"] > 0.1 and m["round/globex/reverified_by_coordinator"] == G * B
    assert set(coord.guard.excluded) == {"globex"} and "round/acme/false_accusation" not in m
