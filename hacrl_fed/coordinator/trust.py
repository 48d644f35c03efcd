"""The coordinator's side of the trust boundary: what enters the pool, and who is excluded from it.

Per round, each org's reply is

1. verified against the pinned roster when ``security.signing`` is on (:func:`~hacrl_fed.security.envelope.
   verify_signed`): a forged, tampered, unknown-org, wrong-run or replayed (wrong-round) batch is dropped whole,
   counted as ``round/<org>/rejected/<reason>``;
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
where it cannot read the text — the rewards the receivers verified and reported back (``trust/<source>/...``
in their TrainReports; the median over receivers). Blind mode therefore updates the capability table after
each round's training: the table a round trains with covers the rounds before it.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from hacrl_fed.algorithm.likelihood_screen import REASONS as SCREEN_REASONS
from hacrl_fed.config import RunConfig
from hacrl_fed.plan.screening import Screened, screen_batch
from hacrl_fed.types import Rollout, RolloutBatch, RoundPlan, TrainReport

log = logging.getLogger(__name__)


class PoolGuard:
    """Signature checks, screening and exclusion for one run (state: the excluded orgs and why)."""

    def __init__(self, cfg: RunConfig, roster: Mapping[str, Any] | None, verify: Callable[[str, str], float]):
        self.cfg, self.roster = cfg, roster
        self.verify = verify if cfg.security.reverify_rewards else None
        self.excluded: dict[str, str] = {}  # org -> why (for logs, metrics and the final table)
        self.signed: dict[str, RolloutBatch] = {}  # this round's accepted orgs' batches, verbatim
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
            self.signed[org] = batch
        metrics[f"round/{org}/shortfall"] = float(out.shortfall)
        if out.checked:
            metrics[f"round/{org}/mismatch_rate"] = out.mismatch_rate
        return out

    def _verified(self, org: str, batch: Any, plan: RoundPlan) -> Screened | None:
        """None when the signature holds (or signing is off); else a Screened that rejects the whole batch."""
        if self.roster is None:
            return None
        from hacrl_fed.security.envelope import RejectedBatch, verify_signed

        try:
            verify_signed(batch, self.roster, run_id=plan.run_id, round=plan.round)
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
        self, learner: str, accepted: Mapping[str, list[Rollout]]
    ) -> tuple[tuple[Rollout, ...], tuple[RolloutBatch, ...]]:
        """``(foreign, source_batches)`` of ``learner``'s TrainRequest."""
        others = [org for org in accepted if org != learner]
        if self.roster is not None:
            return (), tuple(self.signed[org] for org in others)
        return tuple(r for org in others for r in accepted[org]), ()

    def new_round(self) -> None:
        self.signed = {}

    # -- blind mode: what the receivers verified ---------------------------------------------------------------

    def receiver_verified(
        self, round: int, reports: Mapping[str, TrainReport], sources: list[str], metrics: dict[str, float]
    ) -> dict[str, float]:
        """``{source: verified accuracy}`` (median over receivers); excludes sources the receivers caught lying."""
        accuracy: dict[str, float] = {}
        for src in sources:
            accs, rates = [], []
            for learner, rep in reports.items():
                checked = float(rep.metrics.get(f"trust/{src}/checked", 0.0)) if learner != src else 0.0
                if checked > 0:
                    accs.append(float(rep.metrics.get(f"trust/{src}/verified_reward_sum", 0.0)) / checked)
                    rates.append(float(rep.metrics.get(f"trust/{src}/mismatches", 0.0)) / checked)
            if not accs:
                continue
            rate = statistics.median(rates)
            metrics[f"round/{src}/verified_accuracy"] = accuracy[src] = statistics.median(accs)
            metrics[f"round/{src}/mismatch_rate"] = rate
            if rate > self.cfg.security.max_mismatch_rate:
                self.exclude(round, src, f"receivers found reward mismatch rate {rate:.2f} in round {round}")
        return accuracy

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
        return {"excluded": dict(self.excluded), "screened": {k: dict(v) for k, v in self.screened.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.excluded = {str(k): str(v) for k, v in (state.get("excluded") or {}).items()}
        self.screened = {
            str(src): {str(rx): [float(t[0]), float(t[1])] for rx, t in per.items()}
            for src, per in (state.get("screened") or {}).items()
        }

    def metrics(self, orgs: list[str]) -> dict[str, float]:
        return {f"security/{org}/excluded": float(org in self.excluded) for org in orgs}
