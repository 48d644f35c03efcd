"""Signatures and replay protection with several plans in flight (hacrl_fed/worker/late_signed.py, the identity
border's LateOpener, hacrl_fed/security/freshness.check_fresh_late; issue 29, Deliver 4).

A learner ``a`` (W = 2) generated rounds 2 and 3 and issued the challenges ``CA``; ``b`` and ``c`` sign batches
over their source, round, version, plan digest and plan challenges. Each refusal is counted under its reason.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from helpers_fake_workers import fake_config
from hacrl_fed.security.envelope import signed
from hacrl_fed.security.freshness import ChallengeBook, plan_digest, recent_keep
from hacrl_fed.security.identity import generate_identity
from hacrl_fed.types import RolloutBatch, RoundPlan, SamplingParams, TrainRequest
from hacrl_fed.worker.identity_border import LateOpener
from hacrl_fed.worker.late_rounds import RecentRounds
from hacrl_fed.worker.late_signed import split_signed
from hacrl_fed.worker.ledger import Ledger
from test_late_rounds import G, _batch, _own

CFG = fake_config(security={"signing": True}, staleness=1, window=2)
IDS = {o: generate_identity(o) for o in ("a", "b", "c", "mallory")}
ROSTER = {o: IDS[o].public() for o in ("a", "b", "c")}
CA = (b"\x01" * 32, b"\x02" * 32)  # a's recent challenges
ROWS = 3 * G  # one batch: 3 prompts x G


def _recent(*rounds):
    recent = RecentRounds(2)
    for r in rounds:
        recent.keep(_own(r))
    return recent


def _signed(src, rnd, version=1, *, challenge=CA[1], signer=None, ids=(1, 2, 3)):
    """``src``'s batch of round ``rnd`` answering a plan of a's prompts of that round that carried ``challenge``."""
    challenges = {"a": challenge, "b": b"\x0b" * 32, "c": b"\x0c" * 32}
    prompts = _own(rnd, ids=ids).prompts
    digest = plan_digest(RoundPlan("run", rnd, "fake", prompts, SamplingParams(), challenges))
    batch = RolloutBatch(
        "run", rnd, src, tuple(_batch(src, rnd)), 0.25, plan_digest=digest, version=version, plan_challenges=challenges
    )
    return signed(batch, IDS[signer or src].sign_key)


def _split(own_round, batches, tags, recent):
    opener = LateOpener(SimpleNamespace(roster=ROSTER, org_id="a", identity=IDS["a"], cfg=CFG), "run", recent, CA)
    req = TrainRequest("run", own_round, "a", (), (), {"a": 1.0}, tuple(batches), tags=tuple(tags), version=3)
    ledger = Ledger()
    current, late = split_signed(CFG, "a", req, _own(own_round), recent, ledger, opener)
    return current, late, ledger.trust_metrics()


def _refused(metrics):
    return {k: v for k, v in metrics.items() if "/rejected/" in k}


def test_signed_batches_of_the_window_that_answer_issued_plans_are_taken():
    recent = _recent(2, 3)
    current, late, metrics = _split(3, [_signed("b", 3, 2), _signed("c", 2, 1)], [("b", 3, 2), ("c", 2, 1)], recent)
    assert [(b.org_id, b.round) for b in current.source_batches] == [("b", 3)]
    assert current.foreign == () and set(late) == {2} and len(late[2]["c"]) == ROWS
    assert _refused(metrics) == {} and recent.used == {("b", 3), ("c", 2)}


def test_a_replay_across_rounds_of_the_window_is_refused_and_counted():
    recent = _recent(2, 3)
    batch = _signed("c", 3, 1)
    current, _, metrics = _split(3, [batch, batch], [("c", 3, 1)], recent)  # twice in one request: once
    assert len(current.source_batches) == 1 and metrics["trust/c/rejected/already_used"] == ROWS
    recent.keep(_own(4))
    _, late, metrics = _split(4, [batch], [("c", 3, 1)], recent)  # the next round's request (round 3 in W)
    assert late == {} and metrics["trust/c/rejected/already_used"] == ROWS


def test_a_batch_beyond_the_window_or_of_a_round_not_generated_is_refused_and_counted():
    recent = _recent(2, 3, 4)  # W = 2: a request of round 4 reaches rounds 3 and 4
    _, late, metrics = _split(4, [_signed("b", 2), _signed("c", 5)], [("b", 2, 1), ("c", 5, 1)], recent)
    assert late == {}
    assert metrics["trust/b/rejected/beyond_window"] == metrics["trust/c/rejected/future_round"] == ROWS
    _, _, metrics = _split(4, [_signed("b", 3)], [("b", 3, 1)], _recent(4))  # round 3 never generated here
    assert metrics["trust/b/rejected/not_generated"] == ROWS


def test_a_batch_for_a_plan_never_issued_or_of_another_version_is_refused_and_counted():
    recent = _recent(2, 3)
    batches = [_signed("b", 3, 2), _signed("c", 2, 1)]
    _, late, metrics = _split(3, batches, [("c", 2, 5)], recent)  # no tag for b's round 3; c's issued as version 5
    assert late == {} and recent.used == set()
    assert metrics["trust/b/rejected/not_issued"] == metrics["trust/c/rejected/version_mismatch"] == ROWS
    forged = dataclasses.replace(_signed("c", 2, 1), version=5)  # the version changed after signing
    _, late, metrics = _split(3, [forged], [("c", 2, 5)], recent)
    assert late == {} and metrics["trust/c/rejected/bad_signature"] == ROWS


def test_a_forged_or_stale_copy_is_refused_and_does_not_burn_the_honest_batch():
    recent = _recent(2, 3)
    stale = _signed("c", 2, 1, challenge=b"\x07" * 32)  # a plan of another incarnation: not a's challenge
    other_prompts = _signed("c", 2, 1, ids=(4, 5, 6))  # signed for a plan of other prompts than a's round 2
    mallory = _signed("c", 2, 1, signer="mallory")
    _, late, metrics = _split(3, [stale, other_prompts, mallory, _signed("c", 2, 1)], [("c", 2, 1)], recent)
    assert metrics["trust/c/rejected/stale_plan"] == 2 * ROWS and metrics["trust/c/rejected/bad_signature"] == ROWS
    assert len(late[2]["c"]) == ROWS  # the honest copy, after them, is taken


def test_too_many_batches_or_loose_rows_are_refused_whole():
    recent = _recent(2, 3)
    flood = [_signed("b", 3)] * (2 * 2 + 1)  # > W x (orgs - 1)
    current, late, metrics = _split(3, flood, [("b", 3, 1)], recent)
    assert current.source_batches == () and late == {}
    assert metrics["trust/*/rejected/too_many_foreign"] == len(flood) * ROWS
    req = TrainRequest("run", 3, "a", (), tuple(_batch("b", 3)), {"a": 1.0})
    opener = LateOpener(SimpleNamespace(roster=ROSTER, org_id="a", identity=IDS["a"], cfg=CFG), "run", recent, CA)
    ledger = Ledger()
    split_signed(CFG, "a", req, _own(3), recent, ledger, opener)
    assert ledger.trust_metrics()["trust/coordinator/rejected/unsigned"] == ROWS


@pytest.mark.parametrize("k,w", [(1, 2), (2, 3), (4, 5)])
def test_a_learner_keeps_enough_of_its_challenges_for_the_window(k, w):
    book = ChallengeBook(recent_keep(k, w))
    issued = [book.issue() for _ in range(3 * recent_keep(k, w))]
    assert list(book.recent) == issued[-recent_keep(k, w) :] and book.latest == issued[-1]
    assert recent_keep(k, w) > k + w + 1  # the steps between a plan's issue and its batch's last use
