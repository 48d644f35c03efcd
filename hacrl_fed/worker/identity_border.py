"""A policy worker's identity border: what it signs and what it accepts as signed (SECURITY.md).

:class:`IdentityBorder` holds the org's identity and the run's pinned roster (both None with ``security.signing``
off) and does the four things that cross it: :meth:`~IdentityBorder.publish` a batch (sealed for the other orgs in
coordinator-blind mode, ``security.encrypt``, then signed), :meth:`~IdentityBorder.opener` (the intake's check of
a foreign batch: signature, freshness, decryption), :meth:`~IdentityBorder.sign_report` and
:meth:`~IdentityBorder.evidence` (the content keys of batches this learner found lying, for the coordinator; per
(source, round) in asynchronous rounds, :mod:`hacrl_fed.wire.accusations`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hacrl_fed.config import RunConfig
from hacrl_fed.security.envelope import RejectedBatch, signed, verify_signed
from hacrl_fed.security.freshness import check_fresh, check_fresh_late
from hacrl_fed.security.keyring import load_org_identity, load_run_roster
from hacrl_fed.security.reports import sign_report
from hacrl_fed.security.sealing import content_key, is_sealed, open_batch, seal_batch
from hacrl_fed.types import RolloutBatch, TrainReport, TrainRequest
from hacrl_fed.wire.accusations import round_counter, round_key, source_counter
from hacrl_fed.worker.intake import Opener


class IdentityBorder:
    """One org's signing identity and the run's roster (module docstring)."""

    def __init__(self, cfg: RunConfig, org_id: str, run_dir: str | Path) -> None:
        self.cfg, self.org_id = cfg, org_id
        self.roster = load_run_roster(cfg, run_dir)  # None when signing is off
        self.identity = load_org_identity(cfg, org_id, run_dir)

    def publish(self, batch: RolloutBatch, max_text_bytes: int) -> RolloutBatch:
        """Seal the text for the other orgs (coordinator-blind mode), then sign (encrypt-then-sign)."""
        if self.identity is None:
            return batch
        t0 = time.perf_counter()
        if self.cfg.security.encrypt:
            recipients = {o: k for o, k in (self.roster or {}).items() if o != self.org_id}
            pad_limit = max_text_bytes if self.cfg.security.pad_sealed else None
            batch = seal_batch(batch, recipients, pad_limit=pad_limit)
        metrics = {**batch.metrics, "time/seal_sign": time.perf_counter() - t0}  # signing itself: ~0.1 ms
        return signed(replace(batch, metrics=metrics), self.identity)

    def opener(self, run_id: str, round: int, fresh_digest: bytes | None) -> Opener | None:
        """The check of a foreign batch of round ``round`` of ``run_id`` against the pinned roster, made for the plan
        this learner answered (``fresh_digest``, else ``stale_plan``), opened when sealed; raises RejectedBatch.
        None with signing off."""
        if self.identity is None:
            return None
        roster, identity = self.roster, self.identity
        assert roster is not None

        def open_source(batch: RolloutBatch) -> RolloutBatch:
            batch = verify_signed(batch, roster, run_id=run_id, round=round)
            check_fresh(batch, fresh_digest)  # made for the plan this learner answered, this round (stale_plan)
            if not is_sealed(batch):
                return batch
            return open_batch(batch, self.org_id, identity.box_key, padded=self.cfg.security.pad_sealed)

        return open_source

    def late_opener(self, run_id: str, recent: Any, challenges: Iterable[bytes]) -> LateOpener | None:
        """Asynchronous rounds: the checks of a foreign batch of any round of the window (:class:`LateOpener`);
        ``recent``: the learner's :class:`~hacrl_fed.worker.late_rounds.RecentRounds`, ``challenges``: its last
        issued ones. None with signing off."""
        if self.identity is None:
            return None
        assert self.roster is not None
        return LateOpener(self, run_id, recent, tuple(challenges))

    def evidence(self, request: TrainRequest, trust: dict[str, float]) -> dict[str, bytes]:
        """Blind mode: the content key of every source batch in which this learner found reward mismatches, so
        the coordinator can open that batch and check the verdict itself (SECURITY.md)."""
        if not self.cfg.security.encrypt or self.identity is None:
            return {}
        if self.cfg.federation.staleness >= 1:
            return self.late_evidence(request, trust)
        keys = {}
        for batch in request.source_batches:
            src = str(getattr(batch, "org_id", ""))
            if trust.get(source_counter(src), 0.0) > 0 and src not in keys:
                try:
                    keys[src] = content_key(batch, self.org_id, self.identity.box_key)
                except RejectedBatch:  # its batch did not open here either: nothing to disclose
                    continue
        return keys

    def late_evidence(self, request: TrainRequest, trust: dict[str, float]) -> dict[str, bytes]:
        """Asynchronous rounds: the content key of each (source, round) batch this learner found mismatches in
        (``trust/<source>/round/<round>/mismatches`` >= 1), under ``"<source>/<round>"``: a request may carry
        several batches of one source, and the coordinator opens exactly the one accused."""
        assert self.identity is not None
        keys = {}
        for batch in request.source_batches:
            src, rnd = str(getattr(batch, "org_id", "")), getattr(batch, "round", None)
            if not isinstance(rnd, int) or trust.get(round_counter(src, rnd), 0.0) < 1:
                continue
            if round_key(src, rnd) not in keys:
                try:
                    keys[round_key(src, rnd)] = content_key(batch, self.org_id, self.identity.box_key)
                except RejectedBatch:  # its batch did not open here either: nothing to disclose
                    continue
        return keys

    def sign_report(self, report: TrainReport) -> TrainReport:
        """Sign the report with this org's identity (signing on), so its verdicts on other orgs count."""
        if self.identity is None:
            return report
        return sign_report(report, self.identity)


@dataclass(frozen=True)
class LateOpener:
    """A learner's checks of a signed source batch in asynchronous rounds, in two halves so that nothing in the
    header is trusted before the signature holds: :meth:`verify` (signature against the pinned roster, run, the
    rollouts naming the batch's org and round; the round is the batch's own, checked against the window by the
    caller) and :meth:`open` (freshness against the learner's own plan of that round,
    :func:`~hacrl_fed.security.freshness.check_fresh_late`, then decryption when sealed). Both raise only
    RejectedBatch."""

    border: IdentityBorder
    run_id: str
    recent: Any  # RecentRounds: the learner's own plans of the window
    challenges: tuple[bytes, ...]

    def verify(self, batch: Any) -> RolloutBatch:
        if not isinstance(batch, RolloutBatch) or not isinstance(batch.round, int):
            raise RejectedBatch("malformed", f"expected a RolloutBatch, got {type(batch).__name__}")
        assert self.border.roster is not None
        return verify_signed(batch, self.border.roster, run_id=self.run_id, round=batch.round)

    def open(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch`` (verified) checked fresh against the learner's own plan of ``batch.round`` (which the caller
        made sure it generated), opened when sealed."""
        own = self.recent.rounds[batch.round].own
        check_fresh_late(batch, self.border.org_id, self.run_id, own.task, own.prompts, self.challenges)
        if not is_sealed(batch):
            return batch
        identity = self.border.identity
        assert identity is not None
        return open_batch(batch, self.border.org_id, identity.box_key, padded=self.border.cfg.security.pad_sealed)
