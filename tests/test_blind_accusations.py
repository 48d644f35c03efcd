"""Issue 27, deliverable 3: coordinator-blind accusations under both protocols.

An accusation is matched against the batch it is about (the round its rows came from), so the liar is out of the
round after the first proven accusation under ``fused`` as under ``two_message``; a mismatch counter is a whole
count (the codec refuses a negative or fractional one, the coordinator counts it against the sender in process),
and a malformed accusation never makes the coordinator open an honest org's sealed batch.
"""

from __future__ import annotations

import dataclasses

import pytest

from hacrl_fed.config import load_config
from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.types import TrainReport
from hacrl_fed.wire import codec
from hacrl_fed.worker import build_worker
from test_security_attacks import B, G, Hostile
from test_security_edges import Framer, _blind_cfg, _sealed_lie

ORGS = ("acme", "globex", "initech")


def _run(tmp_path, protocol: str, rounds: int, wrap) -> tuple[Coordinator, list]:
    """A blind run of ``rounds`` rounds under ``protocol``, each worker wrapped by ``wrap(org, worker, run_dir)``;
    returns the coordinator and every round's result."""
    base, run_dir = _blind_cfg(ORGS), tmp_path / "run"
    fed = {**base.federation.model_dump(), "rounds": rounds, "protocol": protocol}
    cfg = load_config({**base.model_dump(), "federation": fed})
    workers = {o: wrap(o, build_worker(cfg, o, run_dir=run_dir), run_dir) for o in ORGS}
    results: list = []
    coord = Coordinator(cfg, InProcessTransport(workers), run_dir, on_round=results.append)
    coord.run()
    return coord, results


@pytest.mark.parametrize("protocol", ["fused", "two_message"])
def test_a_liar_is_out_in_the_round_after_the_first_proven_accusation(tmp_path, protocol):
    """globex claims reward 1 on every (sealed) rollout; the honest receivers' accusations of round 1 are matched
    against its round-1 batch (fused: they come back with round 2's batches) and prove the lie."""

    def wrap(org, worker, run_dir):
        lie = (lambda b: _sealed_lie(b, run_dir, ORGS)) if org == "globex" else (lambda b: b)
        return Hostile(worker, lie)

    coord, results = _run(tmp_path, protocol, 3, wrap)
    first, second, third = (r.metrics for r in results)
    assert first["round/globex/reverified_by_coordinator"] == G * B and first["round/globex/mismatch_rate"] > 0.1
    assert "in round 1, re-verified by the coordinator" in coord.guard.excluded["globex"]
    assert set(coord.guard.excluded) == {"globex"}
    for m in (first, second, third):  # the honest accusers are never counted as unproven or false
        assert not [k for k in m if k.endswith(("unproven_accusation", "false_accusation", "malformed_accusation"))]
    assert "globex" in results[0].replied and results[0].trained == list(ORGS)
    for r in results[1:]:
        assert r.failed["globex"] == "excluded" and "globex" not in r.replied and "globex" not in r.trained
        assert r.metrics["security/globex/excluded"] == 1.0
    assert first["security/globex/excluded"] == 1.0  # its proven lie excludes it as round 1's reports close
    assert coord.tracker.history("globex")[0] < 0.5 < first["round/globex/accuracy"]  # verified, not claimed


@pytest.mark.parametrize("protocol", ["fused", "two_message"])
def test_a_false_accusation_is_counted_against_the_accuser_under_both_protocols(tmp_path, protocol):
    def wrap(org, worker, run_dir):
        hostile = Hostile(worker, lambda b: b)
        return Framer(worker, "globex", run_dir, evidence=True) if org == "acme" else hostile

    coord, results = _run(tmp_path, protocol, 2, wrap)
    first, second = (r.metrics for r in results)
    assert first["round/acme/false_accusation"] == 1.0 and "round/acme/unproven_accusation" not in first
    assert "false accusation against globex in round 1" in coord.guard.excluded["acme"]
    assert first["round/globex/mismatch_rate"] == 0.0 and "globex" not in coord.guard.excluded
    assert results[1].failed["acme"] == "excluded" and "round/acme/false_accusation" not in second


def _report(**metrics: float) -> TrainReport:
    return TrainReport("run-1", 1, "acme", {"trust/globex/checked": 8.0, **metrics})


@pytest.mark.parametrize("bad", [-1.0, 0.5, 2.5, -3.0])
def test_the_codec_refuses_a_negative_or_fractional_mismatch_counter(bad):
    report = _report(**{"trust/globex/mismatches": bad})
    with pytest.raises(codec.WireError, match="trust/globex/mismatches"):
        codec.decode(TrainReport, codec.encode(report))
    with pytest.raises(codec.WireError, match="trust/globex/mismatches"):
        codec.check_report(report)


@pytest.mark.parametrize("good", [0.0, 1.0, 16.0])
def test_the_codec_keeps_a_whole_mismatch_counter(good):
    report = _report(**{"trust/globex/mismatches": good, "other/metric": -0.5})
    assert codec.decode(TrainReport, codec.encode(report)) == report
    codec.check_report(report)


class NegativeFramer(Framer):
    """Issue 27: reports -1 mismatches in globex's batch with globex's real content key, signed with its own key."""

    def __init__(self, worker, run_dir, count: float):
        super().__init__(worker, "globex", run_dir, evidence=True)
        self.count = count

    def train(self, request):
        from hacrl_fed.security.reports import sign_report
        from test_security_attacks import key_of

        report = super().train(request)
        m = {**report.metrics, "trust/globex/mismatches": self.count}
        unsigned = dataclasses.replace(report, metrics=m, signature=b"")
        return sign_report(unsigned, key_of(self.run_dir, self.org_id))


@pytest.mark.parametrize("count,kind", [(-1.0, "inprocess"), (0.5, "inprocess"), (-1.0, "grpc")])
def test_a_malformed_accusation_no_longer_opens_the_honest_batch_and_names_the_sender(tmp_path, count, kind):
    """In process the coordinator refuses the report's verdicts and counts them against the sender; over gRPC the
    codec refuses the sender's whole reply (its step failed, counted against it as a train failure)."""
    from test_security_attacks import Via

    orgs = ("acme", "globex")
    cfg, run_dir = _blind_cfg(orgs), tmp_path / "run"
    workers = {o: Hostile(build_worker(cfg, o, run_dir=run_dir), lambda b: b) for o in orgs}
    workers["acme"] = NegativeFramer(workers["acme"].worker, run_dir, count)
    via = Via(kind, tmp_path / "sock")
    try:
        coord = Coordinator(cfg, via.transport(workers), run_dir)
        m = coord.run_round(1).metrics
    finally:
        via.close()
    counter = "round/acme/malformed_accusation" if kind == "inprocess" else "round/acme/train_failure/error"
    assert m[counter] == 1.0 and not [k for k in m if k.startswith("round/globex/") and "failure" in k]
    assert "round/globex/malformed_accusation" not in m
    assert "round/globex/reverified_by_coordinator" not in m  # the honest sealed batch stays shut
    assert "round/acme/unproven_accusation" not in m and coord.guard.excluded == {}
    assert "round/globex/verified_accuracy" not in m  # the malformed report's verdicts are all ignored
