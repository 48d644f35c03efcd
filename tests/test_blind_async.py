"""Coordinator-blind mode with asynchronous rounds (issue 29): accusations name the (source, round) batch they are
about (``trust/<source>/round/<round>/mismatches`` with ``disclosed_keys["<source>/<round>"]``), and the
coordinator judges each against that batch's kept envelope (hacrl_fed/coordinator/async_accusations.py).

Three micro models (``acme``, ``globex``, ``initech``; G = B = 4, so a batch is 16 rollouts), K = 1, sealed and
signed, in process on the virtual clock (about a second a run).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_security_attacks import B, G, Hostile
from test_security_edges import _blind_cfg, _sealed_lie

from hacrl_fed.algorithm.capability import CAPABILITY_FLOOR
from hacrl_fed.config import load_config
from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.coordinator.virtual_clock import VirtualClock
from hacrl_fed.types import TrainReport
from hacrl_fed.wire import codec
from hacrl_fed.worker import build_worker

ORGS = ("acme", "globex", "initech")
ROWS = G * B  # one batch
SLOW_GLOBEX = {"acme": 1.0, "globex": 4.0, "initech": 1.0}
FAST_GLOBEX = {"acme": 4.0, "globex": 1.0, "initech": 4.0}
ACCUSATION_COUNTERS = ("unproven_accusation", "false_accusation", "malformed_accusation")


def _cfg(encrypt: bool, steps: dict[str, float], rounds: int = 4):
    data = _blind_cfg(ORGS).model_dump()
    data["federation"].update(rounds=rounds, staleness=1)
    data["security"]["encrypt"] = encrypt
    return load_config(data)


def _run(tmp_path, steps, wrap=None, *, encrypt: bool = True, rounds: int = 4):
    """A K = 1 run; ``wrap(org, worker, run_dir)`` may replace an org's worker. Returns the coordinator, every
    round's result and the workers."""
    cfg, run_dir = _cfg(encrypt, steps, rounds), tmp_path / "run"
    workers = {}
    for org in ORGS:
        worker = build_worker(cfg, org, run_dir=run_dir)
        workers[org] = wrap(org, worker, run_dir) if wrap is not None else Hostile(worker, lambda b: b)
    results: list = []
    co = Coordinator(cfg, InProcessTransport(workers, clock=VirtualClock(steps)), run_dir, on_round=results.append)
    co.run()
    return co, results, workers


def _flagged(results, org: str) -> list[str]:
    return [k for r in results for k in r.metrics if k.startswith(f"round/{org}/") and k.endswith(ACCUSATION_COUNTERS)]


def test_an_honest_blind_k1_run_with_a_slow_org_excludes_nobody_and_refuses_what_the_unsealed_run_refuses(tmp_path):
    co, results, _ = _run(tmp_path / "blind", SLOW_GLOBEX)
    plain, plain_results, _ = _run(tmp_path / "plain", SLOW_GLOBEX, encrypt=False)
    drv = co.async_driver
    assert co.guard.excluded == {} and len(results) == 4
    assert drv.steps == plain.async_driver.steps  # the same schedule
    assert (
        drv.refused
        == plain.async_driver.refused
        == {
            "acme": {"learner_finished": 1},
            "globex": {},
            "initech": {"learner_finished": 1},
        }
    )
    assert not [o for o in ORGS if _flagged(results, o)]
    second = results[1].metrics  # acme trains round 2 on initech's round 2 and globex's round 1 (one round late)
    assert second["acme/trust/globex/round/1/checked"] == ROWS and second["acme/trust/globex/round/1/mismatches"] == 0
    assert second["acme/trust/initech/round/2/checked"] == ROWS
    assert not [k for r in results for k in r.metrics if "reverified_by_coordinator" in k]
    assert not [k for r in plain_results for k in r.metrics if "/round/" in k.split("/trust/")[-1]]  # blind only


@pytest.mark.parametrize("steps", [SLOW_GLOBEX, FAST_GLOBEX], ids=["slow_liar", "fast_liar"])
def test_a_reward_liar_is_out_in_the_step_after_the_first_proven_accusation(tmp_path, steps):
    """globex claims reward 1 on every sealed rollout; the first report on its round-1 batch proves the lie."""

    def wrap(org, worker, run_dir):
        return Hostile(worker, (lambda b: _sealed_lie(b, run_dir, ORGS)) if org == "globex" else (lambda b: b))

    co, results, workers = _run(tmp_path, steps, wrap)
    drv = co.async_driver
    assert co.guard.excluded["globex"] == f"reward mismatch {ROWS}/{ROWS} in round 1, re-verified by the coordinator"
    assert set(co.guard.excluded) == {"globex"}
    proven = min(s.end for s in drv.steps if ("globex", 1) in [(t.source, t.round) for t in s.foreign])
    assert [s.start for s in drv.steps if s.org == "globex" and s.start >= proven] == []  # no step after it
    proof = next(r.metrics for r in results if "round/globex/reverified_by_coordinator" in r.metrics)
    assert proof["round/globex/reverified_by_coordinator"] == ROWS and proof["round/globex/mismatch_rate"] == 1.0
    assert drv.capabilities.capability("globex", 1) == CAPABILITY_FLOOR  # verified 0, not 1
    assert not [o for o in ORGS if _flagged(results, o)]  # the honest accusers are never counted
    published = [t for _, t in drv.published if t.source == "globex"]
    for org in ("acme", "initech"):
        taken = [(s, r) for req in workers[org].train_requests for s, r, _ in req.tags if s == "globex"]
        assert taken == [("globex", 1)]  # the batch that proved the lie, then none
        assert [req.round for req in workers[org].train_requests] == [1, 2, 3, 4]
    if steps is FAST_GLOBEX:  # its batches published before the proof wait for the slow learners: refused
        assert len(published) == 3 and drv.refused["acme"] == drv.refused["initech"] == {"source_excluded": 2}
    else:  # its step in flight at the proof publishes once the others are done
        assert len(published) == 2 and drv.refused["acme"] == drv.refused["initech"] == {"learner_finished": 1}


class LateFramer(Hostile):
    """Publishes honestly, but accuses ``victim``'s batches in its reports, signed with its own key: ``count`` (None:
    the rows it checked) mismatches in each, with ``keys(rnd, keys_seen)`` disclosed (``keys_seen``: the real
    content keys of every victim batch it was sent, by round) and ``rounds(rnd)`` the rounds it names."""

    def __init__(self, worker, victim, run_dir, *, keys, count=None, rounds=lambda rnd: [rnd]):
        super().__init__(worker, lambda b: b)
        self.victim, self.run_dir, self.keys, self.count, self.rounds = victim, run_dir, keys, count, rounds
        self.seen: dict[int, bytes] = {}

    def train(self, request):
        from test_security_attacks import key_of

        from hacrl_fed.security.reports import sign_report
        from hacrl_fed.security.sealing import content_key

        report = super().train(request)
        me = key_of(self.run_dir, self.org_id)
        metrics, disclosed = dict(report.metrics), {}
        for batch in request.source_batches:
            if batch.org_id != self.victim:
                continue
            self.seen[batch.round] = content_key(batch, self.org_id, me.box_key)
            for rnd in self.rounds(batch.round):
                checked = metrics.get(f"trust/{self.victim}/round/{batch.round}/checked", float(ROWS))
                metrics[f"trust/{self.victim}/round/{rnd}/mismatches"] = checked if self.count is None else self.count
                key = self.keys(batch.round, self.seen)
                if key is not None:
                    disclosed[f"{self.victim}/{rnd}"] = key
        lie = dataclasses.replace(report, metrics=metrics, disclosed_keys=disclosed, signature=b"")
        return sign_report(lie, me)


def _framed(tmp_path, **framer):
    def wrap(org, worker, run_dir):
        return LateFramer(worker, "globex", run_dir, **framer) if org == "acme" else Hostile(worker, lambda b: b)

    return _run(tmp_path, SLOW_GLOBEX, wrap)


def test_a_false_accuser_is_excluded_and_the_framed_org_stays(tmp_path):
    co, results, _ = _framed(tmp_path, keys=lambda rnd, seen: seen[rnd])
    assert co.guard.excluded == {
        "acme": f"false accusation against globex in round 1 ({ROWS} mismatches claimed, 0 found by the coordinator)"
    }
    flagged = next(r.metrics for r in results if "round/acme/false_accusation" in r.metrics)
    assert flagged["round/globex/reverified_by_coordinator"] == ROWS and flagged["round/globex/mismatch_rate"] == 0
    assert _flagged(results, "acme") == ["round/acme/false_accusation"]
    floor, verified = CAPABILITY_FLOOR, results[0].metrics["round/globex/accuracy"]  # honest: alike
    assert co.async_driver.capabilities.capability("globex", 1) == max(floor, verified)


@pytest.mark.parametrize(
    "framer",
    [
        {"keys": lambda rnd, seen: None},  # no key
        {"keys": lambda rnd, seen: seen.get(rnd - 1)},  # the key of globex's batch of another round
        {"keys": lambda rnd, seen: seen[rnd], "rounds": lambda rnd: [rnd + 5]},  # a round its request did not carry
    ],
    ids=["no_key", "other_round_key", "not_in_tags"],
)
def test_an_accusation_that_opens_nothing_is_counted_unproven_against_the_accuser(tmp_path, framer):
    co, results, workers = _framed(tmp_path, **framer)
    accused = sum(1 for req in workers["acme"].train_requests for b in req.source_batches if b.org_id == "globex")
    unproven = sum(r.metrics.get("round/acme/unproven_accusation", 0.0) for r in results)
    assert accused == 3 and unproven == accused  # globex's rounds 1-3 reach acme (its round 4 comes too late)
    assert co.guard.excluded == {}
    assert not [k for r in results for k in r.metrics if "reverified_by_coordinator" in k]  # nothing opened
    assert set(_flagged(results, "acme")) == {"round/acme/unproven_accusation"}


@pytest.mark.parametrize("count", [-1.0, 0.5, math.inf, math.nan])
def test_a_malformed_per_round_counter_is_counted_against_its_sender_and_opens_nothing(tmp_path, count):
    co, results, _ = _framed(tmp_path, keys=lambda rnd, seen: seen[rnd], count=count)
    assert sum(r.metrics.get("round/acme/malformed_accusation", 0.0) for r in results) == 3
    assert co.guard.excluded == {}
    assert not [k for r in results for k in r.metrics if "reverified_by_coordinator" in k]


# -- the codec's rule (hand-built reports) -------------------------------------------------------------------------


def _report(keys=None, **metrics: float) -> TrainReport:
    return TrainReport("run-1", 3, "acme", {"trust/globex/round/2/checked": 8.0, **metrics}, disclosed_keys=keys or {})


@pytest.mark.parametrize("bad", [-1.0, 0.5, 2.5, math.inf, math.nan])
def test_the_codec_refuses_a_malformed_per_round_counter(bad):
    report = _report(**{"trust/globex/round/2/mismatches": bad})
    with pytest.raises(codec.WireError, match="trust/globex/round/2/mismatches"):
        codec.check_report(report)
    if math.isfinite(bad):  # the wire's float map refuses a non-finite metric before the accusation rule
        with pytest.raises(codec.WireError, match="trust/globex/round/2/mismatches"):
            codec.decode(TrainReport, codec.encode(report))


@pytest.mark.parametrize("name", ["trust/globex/round/two/mismatches", "trust/globex/round/-1/mismatches"])
def test_a_per_round_counter_must_name_a_decimal_round(name):
    with pytest.raises(codec.WireError, match="does not name a"):
        codec.check_report(_report(**{name: 1.0}))


def test_per_round_counters_and_disclosed_keys_are_bounded_by_the_window():
    """W = 2, 3 orgs: at most 2 x 2 = 4 per-round counters and 4 keys."""
    counters = {f"trust/{s}/round/{r}/mismatches": 1.0 for s in ("globex", "initech") for r in (2, 3)}
    keys = {f"{s}/{r}": b"k" * 32 for s in ("globex", "initech") for r in (2, 3)}
    codec.check_report(_report(keys, **counters), cap=4)
    limits = codec.WireLimits(window=2, max_sources=2)
    assert codec.decode(TrainReport, codec.encode(_report(keys, **counters)), limits=limits).disclosed_keys == keys
    more = {**counters, "trust/globex/round/1/mismatches": 0.0}
    with pytest.raises(codec.WireError, match="5 per-round mismatch counters exceed the cap of 4"):
        codec.check_report(_report(keys, **more), cap=4)
    with pytest.raises(codec.WireError, match="5 per-round mismatch counters exceed the cap of 4"):
        codec.decode(TrainReport, codec.encode(_report(keys, **more)), limits=limits)
    with pytest.raises(codec.WireError, match="disclosed_keys: 5 keys exceed the cap of 4"):
        codec.check_report(_report({**keys, "globex/1": b"k" * 32}, **counters), cap=4)
    codec.check_report(_report({**keys, "globex/1": b"k" * 32}, **more))  # lock-step: no window cap


def test_over_grpc_the_per_batch_accusation_and_its_key_cross_the_codec_and_exclude_the_liar(tmp_path):
    """The same liar on the wall clock (three in-process gRPC servers): the signed report with its per-round counter
    and ``"globex/<round>"`` key crosses the codec, the coordinator opens that batch and excludes globex."""
    from test_security_attacks import Via

    cfg, run_dir = _cfg(True, {}, rounds=3), tmp_path / "run"
    workers = {o: Hostile(build_worker(cfg, o, run_dir=run_dir), lambda b: b) for o in ORGS}
    workers["globex"] = Hostile(workers["globex"].worker, lambda b: _sealed_lie(b, run_dir, ORGS))
    via = Via("grpc", tmp_path / "sock")
    try:
        results: list = []
        co = Coordinator(cfg, via.transport(workers), run_dir, on_round=results.append)
        co.run()
    finally:
        via.close()
    assert co.async_driver.wall and set(co.guard.excluded) == {"globex"}
    assert "re-verified by the coordinator" in co.guard.excluded["globex"]
    assert sum(r.metrics.get("round/globex/reverified_by_coordinator", 0.0) for r in results) >= ROWS
    assert not [o for o in ORGS if _flagged(results, o)]
