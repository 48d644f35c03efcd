"""Every attack of the trust issue, tried as a hostile peer or coordinator would, against real (micro) agents.

Each attack must fail with its reason counted, and the honest orgs must lose nothing: their own rollouts are
pooled and trained on that same round. Tests taking the ``via`` fixture run twice: in-process, and with every
worker served over real gRPC (unix sockets, the codec on both ends). The worker-port attacks are in
tests/test_security_grpc.py, and the lying org also runs once through the Flower simulation
(tests/test_flower_simulation.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hacrl_fed.config import load_config
from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.grpc_transport import GrpcTransport
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.metrics import format_table
from hacrl_fed.security.envelope import signed
from hacrl_fed.security.identity import generate_identity, identity_path, load_identity
from hacrl_fed.security.keyring import auto_keys_dir
from hacrl_fed.types import Rollout, RolloutBatch, RoundPlan, SamplingParams, TrainRequest
from hacrl_fed.wire.grpc_client import GrpcWorkerClient
from hacrl_fed.wire.grpc_server import serve_worker
from hacrl_fed.worker import build_worker
from hacrl_fed.worker.guard import RequestRefused
from hacrl_fed.worker.step import run_step
from tests.helpers_tiny import PAPER_TRAINER

ORGS = [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}, {"id": "globex", "model": {"zoo": "micro-gpt2-bpe"}}]
G, B, MAX_NEW = 4, 4, 16


def make_cfg(**security):
    return load_config({
        "name": "attack", "seed": 0, "orgs": ORGS, "algorithm": {"name": "hacpo"},
        # the trust boundary comes before the learner's own row choices: every accepted foreign row reaches the
        # update (rule all, no likelihood screen; those have their own tests)
        "trainer": {"lr": 1e-3, "minibatch_size": 64, "micro_batch_size": 32, **PAPER_TRAINER},
        "generation": {"num_samples": G, "max_new_tokens": MAX_NEW, "eval_max_new_tokens": MAX_NEW},
        "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
        "federation": {"rounds": 1, "prompts_per_round": B, "eval_every": 0, "min_orgs": 1},
        "security": security,
    })


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def plan_for(worker, round_: int = 1, run_id: str = "run-1", **sampling) -> RoundPlan:
    first = (round_ % 1000) * 10
    prompts = tuple(worker.task.prompts("train", list(range(first, first + B))))
    sp = {"max_new_tokens": MAX_NEW, "num_samples": G, "seed": 7, **sampling}
    return RoundPlan(run_id, round_, "arithmetic", prompts, SamplingParams(**sp))


def fresh(plan: RoundPlan, *learners) -> RoundPlan:
    """``plan`` carrying each learner's latest challenge (from its Health reply), as the coordinator sends it: the
    learner then trains on source batches made for this plan (hacrl_fed.security.freshness)."""
    return dataclasses.replace(
        plan, challenges={w.org_id: bytes.fromhex(w.health()["challenge"]) for w in learners}
    )


def spy_on_work(monkeypatch, worker) -> list[tuple[str, object]]:
    """Record the work ``worker`` does on a request, in order: ``("render", messages)`` for each prompt rendered,
    ``("generate", n)`` per engine call, ``("verify", text)`` per reward check and ``("tokenize", texts)`` per
    re-tokenization of foreign text. A refusal "before any work" leaves it empty."""
    import hacrl_fed.models.prompting as prompting
    import hacrl_fed.worker.intake as intake
    import hacrl_fed.worker.prompts as prompts

    work: list[tuple[str, object]] = []
    render, tokenize = prompts.render_prompt, intake.response_token_ids
    generate, verify = worker.engine.generate, worker.task.verify

    def spy_render(tokenizer, messages, *a, **k):
        work.append(("render", messages))
        return render(tokenizer, messages, *a, **k)

    def spy_tokenize(tokenizer, texts, *a, **k):
        work.append(("tokenize", list(texts)))
        return tokenize(tokenizer, texts, *a, **k)

    def spy_generate(texts, *a, **k):
        work.append(("generate", len(texts)))
        return generate(texts, *a, **k)

    def spy_verify(text, reference):
        work.append(("verify", text))
        return verify(text, reference)

    monkeypatch.setattr(prompts, "render_prompt", spy_render)
    monkeypatch.setattr(prompting, "render_prompt", spy_render)  # the org's prompt style renders chat prompts
    monkeypatch.setattr(intake, "response_token_ids", spy_tokenize)
    monkeypatch.setattr(worker.engine, "generate", spy_generate)
    monkeypatch.setattr(worker.task, "verify", spy_verify)
    return work


def key_of(run_dir, org):
    return load_identity(identity_path(auto_keys_dir(run_dir), org), org_id=org)


def lie(batch: RolloutBatch, run_dir) -> RolloutBatch:
    """globex runs its real model but claims reward 1.0 everywhere, signed with its own (valid) key."""
    liar = dataclasses.replace(batch, rollouts=tuple(dataclasses.replace(r, reward=1.0) for r in batch.rollouts),
                               signature=b"")
    return signed(liar, key_of(run_dir, batch.org_id))


class Hostile:
    """Wraps a real worker; ``attack(batch) -> batch`` rewrites what it publishes; records what it is sent."""

    def __init__(self, worker, attack):
        self.worker, self.attack, self.org_id = worker, attack, worker.org_id
        self.train_requests: list[TrainRequest] = []

    def generate(self, plan):
        return self.attack(self.worker.generate(plan))

    def train(self, request):
        self.train_requests.append(request)
        return self.worker.train(request)

    def step(self, request):  # a message of the round: each part through this wrapper (the test runs one per step)
        return run_step(self, request)

    def __getattr__(self, name):
        return getattr(self.worker, name)


@pytest.fixture()
def run_dir(tmp_path):
    return tmp_path / "run"


class Via:
    """How the coordinator (``transport``) and a test (``api``) reach the workers: in-process or over gRPC."""

    def __init__(self, kind: str, sock_dir):
        self.kind, self.sock_dir, self._servers, self._closers = kind, sock_dir, [], []

    def address(self, worker) -> str:
        server = serve_worker(worker, f"unix:{self.sock_dir / f'{worker.org_id}-{len(self._servers)}.sock'}")
        self._servers.append(server)
        return server.address

    def api(self, worker):
        if self.kind == "inprocess":
            return worker
        client = GrpcWorkerClient(self.address(worker), org_id=worker.org_id, timeout_s=120)
        self._closers.append(client.close)
        return client

    def transport(self, workers):
        if self.kind == "inprocess":
            return InProcessTransport(workers)
        transport = GrpcTransport({org: self.address(w) for org, w in workers.items()})
        self._closers.append(transport.close)
        return transport

    def close(self):
        for close in self._closers:
            close()
        for server in self._servers:
            server.stop(0)


@pytest.fixture(params=["inprocess", "grpc"])
def via(request, tmp_path):
    v = Via(request.param, tmp_path / "sock")
    yield v
    v.close()


def run_one_round(cfg, workers, run_dir, via=None):
    transport = via.transport(workers) if via is not None else InProcessTransport(workers)
    coord = Coordinator(cfg, transport, run_dir)
    result = coord.run_round(1)
    return coord, result


# ------------------------------------------------------------------------------------------ lying and forging


def test_lying_org_is_excluded_and_the_honest_org_trains_without_its_lies(run_dir, via):
    cfg = make_cfg()
    acme = Hostile(build_worker(cfg, "acme", run_dir=run_dir), lambda b: b)
    globex = Hostile(build_worker(cfg, "globex", run_dir=run_dir), lambda b: lie(b, run_dir))
    coord, result = run_one_round(cfg, {"acme": acme, "globex": globex}, run_dir, via)
    m = result.metrics
    assert m["round/globex/rejected/reward_mismatch"] > 0 and m["round/globex/mismatch_rate"] > 0.1
    assert m["security/globex/excluded"] == 1.0 and result.failed == {"globex": "excluded"}
    assert coord.tracker.history("globex") == []  # capability never saw the lies
    assert result.trained == ["acme"] and m["round/acme/train_failed"] == 0.0  # the honest org went on
    assert acme.train_requests[0].source_batches == () and acme.train_requests[0].foreign == ()
    assert "globex" not in coord.live_orgs()
    assert "globex EXCLUDED from the pool: reward mismatch" in format_table(coord.summary())


def test_honest_worker_drops_a_lying_batch_itself_and_trains_as_if_alone(run_dir):
    """Defence in depth: a TrainRequest that still carries the liar's signed batch changes nothing."""
    cfg = make_cfg()
    acme = build_worker(cfg, "acme", run_dir=run_dir)
    twin = build_worker(cfg, "acme", run_dir=run_dir / "twin")  # same seed: the same own rollouts
    globex = build_worker(cfg, "globex", run_dir=run_dir)
    plan = fresh(plan_for(acme), acme)
    acme.generate(plan), twin.generate(plan)
    lies = lie(globex.generate(plan), run_dir)
    cap = {"acme": 0.5, "globex": 0.5}
    report = acme.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), cap, source_batches=(lies,)))
    twin.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), cap))
    assert report.metrics["trust/globex/rejected/reward_mismatch"] > 0
    assert report.metrics["trust/globex/excluded"] == 1.0 and report.metrics["trust/globex/accepted"] == 0.0
    assert same_weights(weights(acme.model), weights(twin.model))


def _attacks(run_dir, plan):
    """name -> (rewrite of globex's honest signed batch, the reason it must be rejected with)."""
    mallory = generate_identity("mallory")
    return {
        "tampered": (lambda b: dataclasses.replace(b, rollouts=(dataclasses.replace(b.rollouts[0], reward=1.0 - b.rollouts[0].reward),) + b.rollouts[1:]), "bad_signature"),
        "forged": (lambda b: signed(dataclasses.replace(b, signature=b""), key_of(run_dir, "acme").sign_key), "bad_signature"),
        "unknown_org": (lambda b: signed(dataclasses.replace(b, org_id="mallory", signature=b"",
                                                             rollouts=tuple(dataclasses.replace(r, org_id="mallory") for r in b.rollouts)), mallory), "unknown_org"),
        "wrong_run": (lambda b: signed(dataclasses.replace(b, run_id="other-run", signature=b""), key_of(run_dir, "globex")), "wrong_run"),
        "unsigned": (lambda b: dataclasses.replace(b, signature=b""), "bad_signature"),
    }


@pytest.mark.parametrize("attack", ["tampered", "forged", "unknown_org", "wrong_run", "unsigned"])
def test_coordinator_rejects_forged_and_tampered_batches(run_dir, attack, via):
    cfg = make_cfg()
    acme = Hostile(build_worker(cfg, "acme", run_dir=run_dir), lambda b: b)
    rewrite, reason = _attacks(run_dir, None)[attack]
    globex = Hostile(build_worker(cfg, "globex", run_dir=run_dir), rewrite)
    coord, result = run_one_round(cfg, {"acme": acme, "globex": globex}, run_dir, via)
    assert result.metrics[f"round/globex/rejected/{reason}"] == G * B
    assert result.trained == ["acme"] and result.failed == {"globex": "invalid"}


def test_replayed_batch_of_an_earlier_round_is_rejected(run_dir, via):
    cfg = make_cfg()
    cfg = load_config({**cfg.model_dump(), "federation": {**cfg.federation.model_dump(), "rounds": 2}})
    acme = build_worker(cfg, "acme", run_dir=run_dir)
    globex = build_worker(cfg, "globex", run_dir=run_dir)
    first: list[RolloutBatch] = []

    def replay(batch):
        first.append(batch)
        return first[0]  # round 2 answered with the (validly signed) round-1 batch

    coord = Coordinator(cfg, via.transport({"acme": Hostile(acme, lambda b: b), "globex": Hostile(globex, replay)}),
                        run_dir)
    coord.run_round(1)
    result = coord.run_round(2)
    assert result.metrics["round/globex/rejected/wrong_round"] == G * B and result.trained == ["acme"]


@pytest.mark.parametrize("attack", ["tampered", "forged", "unknown_org", "wrong_run", "replayed"])
def test_worker_rejects_forged_batches_the_coordinator_forwards(run_dir, attack, via):
    """A tampering coordinator cannot put words in an org's mouth: the learner verifies every source batch."""
    cfg = make_cfg()
    acme = build_worker(cfg, "acme", run_dir=run_dir)
    twin = build_worker(cfg, "acme", run_dir=run_dir / "twin")
    globex = build_worker(cfg, "globex", run_dir=run_dir)
    plan = plan_for(acme)
    acme.generate(plan), twin.generate(plan)
    honest = globex.generate(plan)
    if attack == "replayed":
        bad, reason = signed(dataclasses.replace(honest, round=0, signature=b"",
                                                 rollouts=tuple(dataclasses.replace(r, round=0) for r in honest.rollouts)),
                             key_of(run_dir, "globex")), "wrong_round"
    else:
        rewrite, reason = _attacks(run_dir, plan)[attack]
        bad = rewrite(honest)
    cap = {"acme": 0.5, "globex": 0.5}
    report = via.api(acme).train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), cap, source_batches=(bad,)))
    twin.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), cap))
    src = "mallory" if attack == "unknown_org" else "globex"
    assert report.metrics[f"trust/{src}/rejected/{reason}"] == G * B
    assert report.metrics["trust/foreign_accepted"] == 0.0
    assert same_weights(weights(acme.model), weights(twin.model))


def test_unsigned_foreign_rollouts_are_ignored_when_signing_is_on(run_dir, via):
    cfg = make_cfg()
    acme, globex = build_worker(cfg, "acme", run_dir=run_dir), build_worker(cfg, "globex", run_dir=run_dir)
    plan = plan_for(acme)
    acme.generate(plan)
    injected = globex.generate(plan).rollouts
    report = via.api(acme).train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, injected, {}))
    assert report.metrics["trust/coordinator/rejected/unsigned"] == G * B
    assert report.metrics["trust/foreign_accepted"] == 0.0


def test_cherry_picking_one_sample_per_prompt_is_rejected_with_the_shortfall(run_dir, via):
    cfg = make_cfg()

    def pick(batch):
        best = tuple(r for r in batch.rollouts if r.sample_index == 0)
        return signed(dataclasses.replace(batch, rollouts=best, signature=b""), key_of(run_dir, "globex"))

    acme = Hostile(build_worker(cfg, "acme", run_dir=run_dir), lambda b: b)
    globex = Hostile(build_worker(cfg, "globex", run_dir=run_dir), pick)
    coord, result = run_one_round(cfg, {"acme": acme, "globex": globex}, run_dir, via)
    assert result.metrics["round/globex/rejected/incomplete_group"] == B
    assert result.metrics["round/globex/shortfall"] == B * G
    assert result.trained == ["acme"]


# -------------------------------------------------------------------------------- the worker's own state checks


def test_far_future_round_stale_run_and_checkpoint_attacks_are_refused(run_dir):
    cfg = make_cfg()
    w = build_worker(cfg, "acme", run_dir=run_dir)
    with pytest.raises(RequestRefused, match="round_too_far"):
        w.generate(plan_for(w, round_=10**15))
    with pytest.raises(RequestRefused, match="bad_checkpoint_round"):
        w.checkpoint(10**6)  # nothing trained: no checkpoint at all
    plan = plan_for(w)
    w.generate(plan)
    with pytest.raises(RequestRefused, match="wrong_run"):
        w.train(TrainRequest("other-run", 1, "acme", plan.prompts, (), {}))
    w.train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, (), {}))  # the honest train still works
    honest_ckpt = w.checkpoint(1)
    with pytest.raises(RequestRefused, match="bad_checkpoint_round"):
        w.checkpoint(10**6)  # cannot prune the honest checkpoint or move LATEST
    assert (run_dir / "orgs/acme/checkpoints/run-1/LATEST").read_text().strip() == "round-000001"
    assert honest_ckpt.endswith("run-1/round-000001")
    with pytest.raises(RequestRefused, match="wrong_run"):
        w.generate(plan_for(w, round_=2, run_id="another-run"))  # cannot reset the stale-round guard
    for bad in ("../run-1", "/abs", ".hidden", "a/b", ""):  # a run id never becomes a path outside the worker's
        with pytest.raises(RequestRefused, match="bad_run_id"):
            w.generate(plan_for(w, round_=1, run_id=bad))
    with pytest.raises(RequestRefused, match="stale_round"):
        w.generate(plan_for(w, round_=1))
    w.generate(plan_for(w, round_=2))


@pytest.mark.parametrize("sampling,prompts,match", [
    ({"num_samples": 100_000}, None, "num_samples=100000 exceeds"),
    ({"max_new_tokens": 10_000}, None, "max_new_tokens=10000 exceeds"),
    ({}, 50, "prompts=50 exceeds"),
])
def test_plans_beyond_the_workers_limits_are_refused_at_once(run_dir, sampling, prompts, match, monkeypatch):
    w = build_worker(make_cfg(), "acme", run_dir=run_dir)
    plan = plan_for(w, **sampling)
    if prompts:
        plan = dataclasses.replace(plan, prompts=tuple(w.task.prompts("train", list(range(prompts)))))
    work = spy_on_work(monkeypatch, w)
    with pytest.raises(RequestRefused, match=match):
        w.generate(plan)
    assert work == []  # refused before rendering, generating or verifying anything
    w.generate(plan_for(w))  # the spies see real work: an honest plan renders, generates and verifies
    assert {kind for kind, _ in work} == {"render", "generate", "verify"}


def _foreign_case(case: str, plan, honest: tuple[Rollout, ...]) -> tuple[tuple[Rollout, ...], str]:
    r0 = honest[0]
    if case == "huge_text":  # 16 rollouts of 1 MiB: refused before any tokenization
        return tuple(dataclasses.replace(r, response="7" * 2**20) for r in honest[:16]), "response_too_long"
    if case == "flood":  # 100,000 rollouts: more than (orgs - 1) x prompts x G
        return (r0,) * 100_000, "too_many_foreign"
    if case == "copies":  # copies of one rollout (2,000 of them are a flood: too_many_foreign)
        return (r0,) * 16, "duplicate"
    if case == "positive_logprob":
        return (dataclasses.replace(r0, logprob_sum=1e300),) + honest[1:], "bad_logprob"
    if case == "wrong_round":
        return (dataclasses.replace(r0, round=7),) + honest[1:], "rollout_round_mismatch"
    if case == "unknown_org":
        return tuple(dataclasses.replace(r, org_id="mallory") for r in honest), "unknown_org"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["huge_text", "flood", "copies", "positive_logprob", "wrong_round", "unknown_org"])
def test_foreign_rollouts_are_bounded_by_the_plan_before_any_work(run_dir, case, via, monkeypatch):
    cfg = make_cfg(signing=False)  # the unsigned path: the worker still screens everything itself
    acme, globex = build_worker(cfg, "acme", run_dir=run_dir), build_worker(cfg, "globex", run_dir=run_dir)
    plan = plan_for(acme)
    acme.generate(plan)
    foreign, reason = _foreign_case(case, plan, globex.generate(plan).rollouts)
    work = spy_on_work(monkeypatch, acme)
    report = via.api(acme).train(TrainRequest(plan.run_id, 1, "acme", plan.prompts, foreign, {}))
    verified = [text for kind, text in work if kind == "verify"]
    tokenized = [text for kind, texts in work if kind == "tokenize" for text in texts]
    bound = MAX_NEW * acme.cfg.security.max_bytes_per_token  # the plan's bound on a response's UTF-8 bytes
    assert len(verified) <= G * B and all(len(t.encode()) <= bound for t in verified + tokenized)
    # only what passed was tokenized, and of that only the rows the selection rule kept (successes by default)
    assert len(tokenized) == report.metrics["select/selected"] <= report.metrics["trust/foreign_accepted"]
    src = {"flood": "*", "unknown_org": "mallory"}.get(case, "globex")
    assert report.metrics.get(f"trust/{src}/rejected/{reason}", 0) >= 1, {k: v for k, v in report.metrics.items() if k.startswith("trust/")}
    assert report.metrics["train/num_self"] == G * B  # its own rollouts were still trained on
    if case in ("huge_text", "flood", "copies", "unknown_org"):
        assert report.metrics["trust/foreign_accepted"] == 0.0


# ------------------------------------------------------------------------------------ coordinator-blind mode


def test_blind_mode_trains_on_sealed_rollouts_and_capability_comes_from_the_receivers(run_dir, via):
    cfg = make_cfg(encrypt=True)
    cfg = load_config({**cfg.model_dump(), "federation": {**cfg.federation.model_dump(), "rounds": 2}})
    seen: list[RolloutBatch] = []

    def record(batch):
        seen.append(batch)
        return batch

    workers = {org: Hostile(build_worker(cfg, org, run_dir=run_dir), record) for org in ("acme", "globex")}
    coord = Coordinator(cfg, via.transport(workers), run_dir)
    r1 = coord.run_round(1)
    assert r1.trained == ["acme", "globex"]
    assert all(r.response == "" and r.sealed_response for b in seen for r in b.rollouts)
    for org in ("acme", "globex"):
        assert r1.metrics[f"{org}/trust/foreign_accepted"] == G * B  # every sealed rollout opened and pooled
        assert f"round/{org}/verified_accuracy" in r1.metrics
    assert coord.tracker.history("acme") == [pytest.approx(r1.metrics["round/acme/verified_accuracy"])]
    r2 = coord.run_round(2)
    assert r2.trained == ["acme", "globex"]


def test_a_coordinator_cannot_change_a_prompt_or_its_reference(run_dir):
    w = build_worker(make_cfg(), "acme", run_dir=run_dir)
    plan = plan_for(w)
    wrong = dataclasses.replace(plan.prompts[0], reference="-1")
    with pytest.raises(RequestRefused, match="prompt_mismatch"):
        w.generate(dataclasses.replace(plan, prompts=(wrong,) + plan.prompts[1:]))
    with pytest.raises(RequestRefused, match="unknown_prompt"):
        w.generate(dataclasses.replace(plan, prompts=(dataclasses.replace(wrong, prompt_id=10**12),)))
    w.generate(plan)


def test_public_helpers_are_exported_at_package_level(run_dir):
    import hacrl_fed.security as sec

    cfg = make_cfg()
    w = build_worker(cfg, "acme", run_dir=run_dir)
    batch = w.generate(plan_for(w))
    envelope = sec.sign_batch(dataclasses.replace(batch, signature=b""), key_of(run_dir, "acme"))
    assert sec.verify_batch(envelope, w.roster, run_id="run-1", round=1).rollouts == batch.rollouts
    with pytest.raises(sec.RejectedBatch, match="wrong run") as info:
        sec.verify_batch(envelope, w.roster, run_id="run-2", round=1)
    assert isinstance(info.value, ValueError) and info.value.reason == "wrong_run"
