"""Coordinator-blind mode with asynchronous rounds: each accusation judged against the exact batch it is about
(SECURITY.md "Receivers' verdicts can be checked", docs/ALGORITHM.md "Capability per round").

With ``federation.staleness >= 1`` a learner's train request may carry several batches of one source (rounds of
its window, ``TrainRequest.tags`` = (source, round, version)), so a learner accuses one batch:
``trust/<source>/round/<round>/mismatches`` >= 1 in its signed TrainReport, with that batch's content key as
``disclosed_keys["<source>/<round>"]`` (:mod:`hacrl_fed.wire.accusations`). For each accusation of a report the
trust guard let through (signature, whole counts, at most ``W x (orgs - 1)`` counters and keys,
:meth:`~hacrl_fed.coordinator.trust.PoolGuard.signed_reports`), :class:`LateAccusations`:

1. finds the batch it is about among those of the request the report answers: a (source, round) the request's tags
   do not name (another round, outside the window, the learner's own) opens nothing;
2. opens the signed envelope of that (source, round, version) the driver kept verbatim with the disclosed key (the
   AEAD tags prove it is that batch's key) and re-verifies every rollout against the plan of that round sent to
   that source (once per batch: a second accuser's count is judged against the same result);
3. judges with the lock-step rule (:meth:`~hacrl_fed.coordinator.trust.PoolGuard.judge`): a mismatch rate above
   ``security.max_mismatch_rate`` excludes the source; an accuser claiming more mismatches than the coordinator
   found is excluded (``round/<accuser>/false_accusation``);
4. counts an accusation that opens nothing (no key, a key that does not open the batch, or no such batch in the
   request) against the accuser (``round/<accuser>/unproven_accusation``).

The per-source counter ``trust/<source>/mismatches`` (the sum over the request's batches of that source) is not an
accusation here. Capability: ``P_source(round)`` is the mean claimed reward of the accepted rollouts, recorded at
acceptance (the coordinator sees rewards), and is replaced by the coordinator's own re-verified accuracy of that
batch once an accusation opened it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hacrl_fed.coordinator.trust import PoolGuard
from hacrl_fed.plan.screening import Screened, screen_batch
from hacrl_fed.types import RolloutBatch, RoundPlan, TrainReport, TrainRequest
from hacrl_fed.wire.accusations import is_counter, parse_round_counter, round_key

log = logging.getLogger(__name__)

Batch = tuple[RolloutBatch, RoundPlan]  # a signed batch verbatim, and the plan its source answered


def round_accusations(report: TrainReport) -> dict[tuple[str, int], float]:
    """``{(source, round): mismatches claimed}`` for each per-round counter >= 1 of ``report`` (whose counters
    :func:`~hacrl_fed.wire.codec.check_report` already found well formed)."""
    out = {}
    for key, value in report.metrics.items():
        where = parse_round_counter(key) if is_counter(key) else None
        if where is not None and float(value) >= 1:
            out[where] = float(value)
    return out


@dataclass
class LateAccusations:
    """The judge of one run's per-batch accusations (module docstring). ``batch_of(source, round, version)``: the
    driver's kept envelope and plan of that batch (None: none kept); ``revise(round, source, accuracy)``: replaces
    that batch's capability input."""

    guard: PoolGuard
    batch_of: Callable[[str, int, int], Batch | None]
    revise: Callable[[int, str, float], None]
    verdicts: dict[tuple[str, int], Screened] = field(default_factory=dict)  # the batches opened so far

    def take(self, request: TrainRequest, report: TrainReport, metrics: dict[str, float]) -> None:
        """Judge every accusation of ``report``, the learner's answer to ``request``; adds ``round/...`` metrics."""
        learner = report.org_id
        issued = {(str(s), int(r)): int(v) for s, r, v in request.tags}
        for (src, rnd), claimed in sorted(round_accusations(report).items()):
            own = self._open(src, rnd, issued, report.disclosed_keys, metrics)
            if own is None:
                key = f"round/{learner}/unproven_accusation"
                metrics[key] = metrics.get(key, 0.0) + 1
                log.warning("ignoring the verdict of %s on %s's round %d: no disclosed key opens it", learner, src, rnd)
                continue
            if own.checked:  # nothing re-verifiable (security.reverify_rewards off): nothing to judge, as lock-step
                self.guard.judge(rnd, src, own, {learner: claimed}, metrics)

    def _open(
        self,
        src: str,
        rnd: int,
        issued: Mapping[tuple[str, int], int],
        keys: Mapping[str, bytes],
        metrics: dict[str, float],
    ) -> Screened | None:
        """The coordinator's own count of ``src``'s batch of ``rnd`` (opened with ``keys["<src>/<rnd>"]``), or
        None when the request did not carry that batch or the key does not open it."""
        from hacrl_fed.security.envelope import RejectedBatch
        from hacrl_fed.security.sealing import open_with_content_key

        kept = self.batch_of(src, rnd, issued[(src, rnd)]) if (src, rnd) in issued else None
        key = keys.get(round_key(src, rnd))
        if kept is None or key is None:
            return None
        batch, plan = kept
        try:
            opened = open_with_content_key(batch, key, padded=self.guard.cfg.security.pad_sealed)
        except RejectedBatch:
            return None
        if (src, rnd) not in self.verdicts:
            log.info("re-verifying the batch of %s of round %d with a disclosed content key", src, rnd)
            bound = self.guard.cfg.security.max_bytes_per_token
            own = screen_batch(opened, plan, src, verify=self.guard.verify, max_bytes_per_token=bound)
            self.verdicts[(src, rnd)] = own
            if own.checked:
                self.revise(rnd, src, own.verified_reward_sum / own.checked)
            count = f"round/{src}/reverified_by_coordinator"
            metrics[count] = metrics.get(count, 0.0) + float(own.checked)
            metrics[f"round/{src}/mismatch_rate"] = own.mismatch_rate
        return self.verdicts[(src, rnd)]
