"""The coordinator's side of the trust boundary: what enters the pool, and who is excluded from it.

Per round, each org's reply is

1. verified against the pinned roster when ``security.signing`` is on (:func:`~hacrl_fed.security.envelope.
   verify_signed`): a forged, tampered, unknown-org, wrong-run or replayed (wrong-round) batch, or one that signs
   the digest of another plan than the one sent to its org (``stale_plan``, :mod:`hacrl_fed.security.freshness`),
   is dropped whole, counted as ``round/<org>/rejected/<reason>``;
2. screened against the org's plan (:func:`~hacrl_fed.plan.screening.screen_batch`): bounds, exactly
   ``G`` samples per prompt, and — whenever the coordinator can read the text (not in coordinator-blind mode) —
   every claimed reward re-verified with the task's own verifier;
3. excluded when its share of contradicted rewards passes ``security.max_mismatch_rate``: the org's batch is
   dropped that round, the org gets no more plans or rollouts for the rest of the run (logged,
   ``security/<org>/excluded``, the final table), and the honest orgs train that same round.

The pool sent to a learner is the other orgs' signed batches verbatim (``TrainRequest.source_batches``), so
every receiver verifies them end to end and the coordinator cannot put words in an org's mouth; with signing
off it is the flat list of accepted rollouts (``TrainRequest.foreign``).

Every mode: the receivers report what their likelihood screens left out (``screen/<source>/...``); a source whose
rows they leave out persistently, past ``security.max_screen_drop_rate``, is excluded the same way
(:meth:`PoolGuard.receiver_screened`).

Capability uses verified rewards only: the coordinator's own re-verification, or — in coordinator-blind mode,
where it cannot read the text — the receivers' verdicts, which count only when checkable
(:meth:`PoolGuard.receiver_verified`): reports signed by their org; no accusation, the source's claimed rewards
stand; an accusation comes with the batch's content key, so the coordinator re-verifies that batch itself and
excludes the liar or the false accuser. An accusation is about the batch of the round the report trains on, and
is matched against that batch whatever ``federation.protocol`` (under ``fused`` the reports of round t come back
with the batches of round t+1), so a liar is out from the round after the first proven accusation; an accusation
is a whole count >= 1, and a report with a malformed counter is counted against its sender
(``round/<org>/malformed_accusation``) and opens nothing. Blind mode therefore updates the capability table after
each round's training: the table a round trains with covers the rounds before it. With asynchronous rounds
(``federation.staleness >= 1``) a request may carry several batches of one source, so an accusation names the
(source, round) batch; :mod:`.async_accusations` judges each against that batch with :meth:`PoolGuard.judge`.
"""

from __future__ import annotations

import logging
import math
import statistics
from base64 import b64decode, b64encode
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from hacrl_fed.algorithm.likelihood_screen import REASONS as SCREEN_REASONS
from hacrl_fed.config import RunConfig
from hacrl_fed.plan.screening import Screened, screen_batch
from hacrl_fed.types import Rollout, RolloutBatch, RoundPlan, TrainReport
from hacrl_fed.wire.accusations import source_counter

log = logging.getLogger(__name__)


def _b64(obj: Any) -> str:
    """``obj`` (a protocol dataclass) through the wire codec, as base64 text (the state file is JSON)."""
    from hacrl_fed.wire.codec import encode

    return b64encode(encode(obj)).decode()


def accusation(report: TrainReport, src: str) -> float:
    """How many mismatches ``report`` claims in ``src``'s batch (0: no accusation; only a count >= 1 accuses)."""
    return float(report.metrics.get(source_counter(src), 0.0))


class PoolGuard:
    """Signature checks, screening and exclusion for one run (state: the excluded orgs and why)."""

    def __init__(self, cfg: RunConfig, roster: Mapping[str, Any] | None, verify: Callable[[str, str], float]):
        self.cfg, self.roster = cfg, roster
        self.verify = verify if cfg.security.reverify_rewards else None
        self.excluded: dict[str, str] = {}  # org -> why (for logs, metrics and the final table)
        # round -> org -> its accepted batch verbatim, and the plan it answered (to re-verify a disputed batch):
        # kept until the reports on that round are in (fused: they come back with the next round's batches)
        self.signed: dict[int, dict[str, RolloutBatch]] = {}
        self.plans: dict[int, dict[str, RoundPlan]] = {}
        self.screened: dict[str, dict[str, list[float]]] = {}  # source -> receiver -> [dropped, checked] so far

    @property
    def blind(self) -> bool:
        return self.cfg.security.encrypt

    # -- one reply ---------------------------------------------------------------------------------------------

    def check(self, round: int, org: str, batch: Any, plan: RoundPlan, metrics: dict[str, float]) -> Screened:
        """Verify and screen ``org``'s reply to ``plan``; adds ``round/<org>/...`` metrics."""
        out = self._verified(org, batch, plan)
        if out is None:
            out = screen_batch(
                batch,
                plan,
                org,
                verify=None if self.blind else self.verify,
                max_bytes_per_token=self.cfg.security.max_bytes_per_token,
            )
        if out.checked and out.mismatch_rate > self.cfg.security.max_mismatch_rate:
            self.exclude(round, org, f"reward mismatch {out.mismatches}/{out.checked} in round {round}")
            out.rejected["excluded_org"] += len(out.accepted)
            out.accepted = []
        if out.accepted:
            self.signed.setdefault(round, {})[org] = batch
            self.plans.setdefault(round, {})[org] = plan
        metrics[f"round/{org}/shortfall"] = float(out.shortfall)
        if out.checked:
            metrics[f"round/{org}/mismatch_rate"] = out.mismatch_rate
        return out

    def _verified(self, org: str, batch: Any, plan: RoundPlan) -> Screened | None:
        """None when the signature holds (or signing is off); else a Screened that rejects the whole batch."""
        if self.roster is None:
            return None
        from hacrl_fed.security.envelope import RejectedBatch, verify_signed
        from hacrl_fed.security.freshness import plan_digest

        try:
            verify_signed(batch, self.roster, run_id=plan.run_id, round=plan.round)
            if batch.plan_digest != plan_digest(plan):  # signed for another plan than the one sent to this org
                raise RejectedBatch("stale_plan", f"batch from {org!r} does not answer its plan of round {plan.round}")
            if self.cfg.federation.staleness >= 1 and dict(batch.plan_challenges) != dict(plan.challenges):
                # asynchronous rounds: learners re-derive the plan from these (hacrl_fed.security.freshness)
                raise RejectedBatch("stale_plan", f"batch from {org!r} signs other challenges than its plan's")
        except RejectedBatch as err:
            n = len(getattr(batch, "rollouts", ()) or ())
            log.warning("round %d: rejected the batch of %s: %s", plan.round, org, err)
            return Screened(
                rejected=Counter({err.reason: max(n, 1)}), shortfall=len(plan.prompts) * plan.sampling.num_samples
            )
        return None

    def exclude(self, round: int, org: str, why: str) -> None:
        if org not in self.excluded:
            self.excluded[org] = why
            log.warning("round %d: org %s is excluded from the pool for the rest of the run: %s", round, org, why)

    # -- the pool ----------------------------------------------------------------------------------------------

    def pool_for(
        self, learner: str, round: int, accepted: Mapping[str, list[Rollout]]
    ) -> tuple[tuple[Rollout, ...], tuple[RolloutBatch, ...]]:
        """``(foreign, source_batches)`` of ``learner``'s TrainRequest of round ``round``."""
        others = [org for org in accepted if org != learner]
        if self.roster is not None:
            return (), tuple(self.signed[round][org] for org in others)
        return tuple(r for org in others for r in accepted[org]), ()

    def new_round(self, round: int) -> None:
        """Round ``round`` opens: forget the batches of rounds before ``round - 1`` (whose reports are all in;
        round ``round - 1``'s may still be out under the fused protocol)."""
        for old in [r for r in self.signed.keys() | self.plans.keys() if r < round - 1]:
            self.signed.pop(old, None)
            self.plans.pop(old, None)

    # -- blind mode: what the receivers verified ---------------------------------------------------------------

    def receiver_verified(
        self,
        round: int,
        reports: Mapping[str, TrainReport],
        accepted: Mapping[str, list[Rollout]],
        metrics: dict[str, float],
    ) -> dict[str, float]:
        """``{source: verified accuracy}`` for blind mode; excludes a source proven to lie, or its false accuser.

        ``reports``: the round's reports that :meth:`signed_reports` let through. With no accusation, a source's
        accuracy is the mean of its accepted claimed rewards (visible to the coordinator; a learner's own count
        cannot move it). A learner reporting mismatches (a count >= 1) in a source's batch must disclose that
        batch's content key: the coordinator opens the batch it relayed in round ``round`` and re-verifies every
        accepted rollout itself. Mismatch rate
        above ``security.max_mismatch_rate``: the source is excluded; an accuser claiming more mismatches than the
        coordinator found is excluded (``round/<accuser>/false_accusation``); an accusation without a key that
        opens the batch is ignored (``round/<accuser>/unproven_accusation``).
        """
        accuracy: dict[str, float] = {}
        for src, rollouts in accepted.items():
            receivers = {org: rep for org, rep in reports.items() if org != src}
            if not rollouts or not any(rep.metrics.get(f"trust/{src}/checked", 0.0) > 0 for rep in receivers.values()):
                continue
            accusers = {org: rep for org, rep in receivers.items() if accusation(rep, src) >= 1}
            own = self._reverify(round, src, accusers, metrics) if accusers else None
            if own is None or not own.checked:
                accuracy[src] = sum(float(r.reward) for r in rollouts) / len(rollouts)
                metrics[f"round/{src}/mismatch_rate"] = 0.0
            else:
                accuracy[src] = own.verified_reward_sum / own.checked
                metrics[f"round/{src}/mismatch_rate"] = own.mismatch_rate
                metrics[f"round/{src}/reverified_by_coordinator"] = float(own.checked)
                self._judge(round, src, own, accusers, metrics)
            metrics[f"round/{src}/verified_accuracy"] = accuracy[src]
        return accuracy

    def signed_reports(
        self, round: int, reports: Mapping[str, TrainReport], metrics: dict[str, float]
    ) -> dict[str, TrainReport]:
        """The reports whose signature verifies against the roster (all of them when signing is off) and whose
        accusations are whole counts (:func:`~hacrl_fed.wire.codec.check_report`): only these receivers' verdicts
        (screen drop counts, accusations) are acted on; the others are counted as
        ``round/<org>/report_rejected/<reason>``, or ``round/<org>/malformed_accusation``."""
        reports = self._well_formed(round, reports, metrics)
        if self.roster is None:
            return reports
        from hacrl_fed.security.envelope import RejectedBatch
        from hacrl_fed.security.reports import verify_report

        out = {}
        for org, rep in reports.items():
            try:
                verify_report(rep, self.roster, run_id=getattr(rep, "run_id", ""), round=round)
            except RejectedBatch as err:
                log.warning("round %d: ignoring the verdicts of %s: its report %s", round, org, err)
                metrics[f"round/{org}/report_rejected/{err.reason}"] = 1.0
                continue
            if rep.org_id != org:
                metrics[f"round/{org}/report_rejected/wrong_org"] = 1.0
                continue
            out[org] = rep
        return out

    def _well_formed(
        self, round: int, reports: Mapping[str, TrainReport], metrics: dict[str, float]
    ) -> dict[str, TrainReport]:
        """``reports`` less those with a negative, fractional or non-finite mismatch counter, or (asynchronous
        rounds) more per-round counters or disclosed keys than ``W x (orgs - 1)`` (the codec refuses them on the
        wire; in process they are caught here), each counted against its sender."""
        from hacrl_fed.wire.codec import WireError, check_report

        fed = self.cfg.federation
        cap = fed.effective_window * (len(self.cfg.orgs) - 1) if fed.staleness >= 1 else None
        out = {}
        for org, rep in reports.items():
            try:
                check_report(rep, cap=cap)
            except (WireError, AttributeError, TypeError) as err:
                log.warning("round %d: ignoring the verdicts of %s: malformed accusation: %s", round, org, err)
                metrics[f"round/{org}/malformed_accusation"] = 1.0
                continue
            out[org] = rep
        return out

    def _reverify(
        self, round: int, src: str, accusers: Mapping[str, TrainReport], metrics: dict[str, float]
    ) -> Screened | None:
        """Open ``src``'s batch of round ``round`` (the batch the accusations are about, whatever the protocol)
        with the first disclosed key that opens it and re-verify it; None when no accuser's evidence opens it
        (each such accusation is counted as unproven)."""
        from hacrl_fed.security.envelope import RejectedBatch
        from hacrl_fed.security.sealing import open_with_content_key

        batch, plan = self.signed.get(round, {}).get(src), self.plans.get(round, {}).get(src)
        for org, rep in accusers.items():
            key = rep.disclosed_keys.get(src)
            if batch is None or plan is None or key is None:
                continue
            try:
                opened = open_with_content_key(batch, key, padded=self.cfg.security.pad_sealed)
            except RejectedBatch:
                continue
            log.info("re-verifying the batch of %s with the content key %s disclosed", src, org)
            bound = self.cfg.security.max_bytes_per_token
            return screen_batch(opened, plan, src, verify=self.verify, max_bytes_per_token=bound)
        for org in accusers:
            metrics[f"round/{org}/unproven_accusation"] = metrics.get(f"round/{org}/unproven_accusation", 0.0) + 1
            log.warning("ignoring the verdict of %s on %s: no disclosed key opens that batch", org, src)
        return None

    def _judge(
        self, round: int, src: str, own: Screened, accusers: Mapping[str, TrainReport], metrics: dict[str, float]
    ) -> None:
        """Lock-step rounds: :meth:`judge` the accusers' counts of ``src``'s batch of ``round``."""
        self.judge(round, src, own, {org: accusation(rep, src) for org, rep in accusers.items()}, metrics)

    def judge(
        self, round: int, src: str, own: Screened, claims: Mapping[str, float], metrics: dict[str, float]
    ) -> None:
        """The coordinator's own count ``own`` of ``src``'s batch of ``round`` decides: exclude the source when it
        lied, else each accuser in ``claims`` (``{accuser: mismatches claimed}``) that claimed more."""
        if own.mismatch_rate > self.cfg.security.max_mismatch_rate:
            why = f"reward mismatch {own.mismatches}/{own.checked} in round {round}, re-verified by the coordinator"
            self.exclude(round, src, why)
        for org, claimed in claims.items():
            if claimed > own.mismatches:
                metrics[f"round/{org}/false_accusation"] = 1.0
                self.exclude(
                    round,
                    org,
                    f"false accusation against {src} in round {round} ({claimed:g} mismatches claimed, "
                    f"{own.mismatches} found by the coordinator)",
                )

    # -- every mode: what the receivers' likelihood screens left out --------------------------------------------

    def receiver_screened(
        self, round: int, reports: Mapping[str, TrainReport], sources: list[str], metrics: dict[str, float]
    ) -> None:
        """Accumulate, per source and receiver, the rows the receiver's likelihood screen checked and dropped
        (``screen/<source>/checked`` and ``screen/<source>/dropped_<reason>`` in its TrainReport); a source whose
        run-long drop rate, the median over receivers that checked at least ``security.screen_min_rows`` of its
        rows, exceeds ``security.max_screen_drop_rate`` is excluded (``round/<source>/screen_drop_rate``)."""
        sec = self.cfg.security
        for src in sources:
            rates = []
            for learner, rep in reports.items():
                checked = float(rep.metrics.get(f"screen/{src}/checked", 0.0)) if learner != src else 0.0
                if not (math.isfinite(checked) and checked > 0):
                    continue
                dropped = sum(float(rep.metrics.get(f"screen/{src}/dropped_{why}", 0.0)) for why in SCREEN_REASONS)
                tally = self.screened.setdefault(src, {}).setdefault(learner, [0.0, 0.0])
                tally[0] += min(max(dropped, 0.0), checked) if math.isfinite(dropped) else checked
                tally[1] += checked
            for dropped_total, checked_total in self.screened.get(src, {}).values():
                if checked_total >= sec.screen_min_rows:
                    rates.append(dropped_total / checked_total)
            if not rates:
                continue
            rate = metrics[f"round/{src}/screen_drop_rate"] = statistics.median(rates)
            if rate > sec.max_screen_drop_rate:
                self.exclude(round, src, f"receivers' likelihood screens left out {rate:.2f} of its rows")

    # -- state -------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The excluded orgs, the receivers' screen tallies, and in blind mode the batches kept to judge
        accusations (each accepted batch verbatim and its plan, through the wire codec), so a resume between a
        step's reports and the next step still proves an accusation about the round before."""
        kept = {  # blind mode only: with the text readable the coordinator re-verified every batch on arrival
            str(r): {org: [_b64(batch), _b64(self.plans[r][org])] for org, batch in per.items()}
            for r, per in (self.signed.items() if self.blind else ())
        }
        screened = {k: dict(v) for k, v in self.screened.items()}
        return {"excluded": dict(self.excluded), "screened": screened, "kept": kept}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from hacrl_fed.wire.codec import decode

        self.excluded = {str(k): str(v) for k, v in (state.get("excluded") or {}).items()}
        kept = state.get("kept") or {}
        self.signed = {
            int(r): {o: decode(RolloutBatch, b64decode(b)) for o, (b, _) in per.items()} for r, per in kept.items()
        }
        self.plans = {
            int(r): {o: decode(RoundPlan, b64decode(p)) for o, (_, p) in per.items()} for r, per in kept.items()
        }
        self.screened = {
            str(src): {str(rx): [float(t[0]), float(t[1])] for rx, t in per.items()}
            for src, per in (state.get("screened") or {}).items()
        }

    def metrics(self, orgs: list[str]) -> dict[str, float]:
        return {f"security/{org}/excluded": float(org in self.excluded) for org in orgs}
