"""The round bookkeeping, apart from the loop and any transport.

:class:`RoundKeeper` takes what a round's messages brought back: it screens the batches (with the trust guard),
updates capability, builds the train requests, records train reports, evaluations and checkpoints, keeps each
org's latest challenge, and closes the round with its summary metrics (keys in :mod:`.round_metrics`).
:class:`RunBook` holds the last finished round, the skipped and consecutive failed rounds, the held-out accuracy
history, per-org totals (rollouts shared / received, call time, last round trained and checkpointed) and the last
round every org checkpointed. It is what ``coordinator_state.json`` saves besides the run id, the capability
tracker and the trust guard (:mod:`hacrl_fed.coordinator.state_file`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hacrl_fed import failures
from hacrl_fed.algorithm import CapabilityTracker
from hacrl_fed.config import RunConfig
from hacrl_fed.coordinator import round_metrics as rm
from hacrl_fed.coordinator.rounds import RoundState
from hacrl_fed.coordinator.trust import PoolGuard
from hacrl_fed.plan.screening import accepted_accuracy
from hacrl_fed.results import RoundResult
from hacrl_fed.security.freshness import HEALTH_KEY, parse_challenge
from hacrl_fed.types import Prompt, Rollout, RolloutBatch, RoundPlan, TrainReport, TrainRequest

log = logging.getLogger(__name__)


def new_totals() -> dict[str, float]:
    """One org's totals: rollouts shared / received, call time, last round it trained and checkpointed."""
    return {"shared": 0, "received": 0, "time_s": 0.0, "trained_round": 0, "checkpoint_round": 0}


@dataclass
class RunBook:
    """The counts of a run (module docstring); ``orgs`` fixes the totals' keys."""

    orgs: list[str]
    round: int = 0
    skipped_rounds: int = 0
    consecutive_failures: int = 0
    eval_history: dict[int, dict[str, float]] = field(default_factory=dict)
    totals: dict[str, dict[str, float]] = field(default_factory=dict)
    worker_checkpoint_round: int = 0  # last round at which every configured org checkpointed
    wall_time_s: float = 0.0

    def __post_init__(self) -> None:
        for org in self.orgs:
            self.totals.setdefault(org, new_totals())

    def note_replies(self, shared: Mapping[str, int], enough: bool) -> None:
        """A round's screened batches: ``shared`` accepted rollouts per org; ``enough``: ``min_orgs`` replied."""
        for org, n in shared.items():
            self.totals[org]["shared"] += n
        if enough:
            self.consecutive_failures = 0
        else:
            self.skipped_rounds += 1
            self.consecutive_failures += 1

    def note_trained(self, org: str, round: int, received: int) -> None:
        self.totals[org]["received"] += received
        self.totals[org]["trained_round"] = round

    def note_call_time(self, seconds: Mapping[str, float]) -> None:
        for org, secs in seconds.items():
            if org in self.totals:
                self.totals[org]["time_s"] += float(secs)

    def note_checkpoints(self, round: int, asked: Iterable[str], failed: Iterable[str]) -> None:
        """Checkpoints of ``round`` asked of ``asked``; every configured org's: ``worker_checkpoint_round``."""
        asked, failed = list(asked), set(failed)
        for org in asked:
            if org not in failed:
                self.totals[org]["checkpoint_round"] = round
        if not failed and len(asked) == len(self.orgs):
            self.worker_checkpoint_round = round

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "skipped_rounds": self.skipped_rounds,
            "consecutive_failures": self.consecutive_failures,
            "eval_history": {str(t): accs for t, accs in sorted(self.eval_history.items())},
            "totals": self.totals,
            "worker_checkpoint_round": self.worker_checkpoint_round,
            "wall_time_s": self.wall_time_s,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.round = int(state["round"])
        self.skipped_rounds = int(state["skipped_rounds"])
        self.consecutive_failures = int(state["consecutive_failures"])
        self.eval_history = {
            int(t): {o: float(a) for o, a in accs.items()} for t, accs in state["eval_history"].items()
        }
        for org, tot in state["totals"].items():
            self.totals.setdefault(org, new_totals()).update(tot)
        self.worker_checkpoint_round = int(state["worker_checkpoint_round"])
        self.wall_time_s = float(state["wall_time_s"])
        self.warn_checkpoint_gaps()

    def warn_checkpoint_gaps(self) -> None:
        """Warn about orgs that trained past their last checkpoint (a worker resumed from it misses rounds)."""
        for org, tot in self.totals.items():
            trained, ckpt = int(tot.get("trained_round", 0)), int(tot.get("checkpoint_round", 0))
            if ckpt < trained:
                log.warning(
                    "resuming after round %d: org %s trained through round %d but last checkpointed at "
                    "round %d; a worker resumed from that checkpoint misses rounds %d..%d",
                    self.round,
                    org,
                    trained,
                    ckpt,
                    ckpt + 1,
                    trained,
                )


class RoundKeeper:
    """The round bookkeeping of a run of ``cfg`` (module docstring): ``guard`` (the trust guard), ``tracker``
    (capabilities) and ``book`` are the coordinator's own; ``challenges`` each org's latest challenge."""

    def __init__(self, cfg: RunConfig, guard: PoolGuard, tracker: CapabilityTracker, book: RunBook) -> None:
        self.cfg, self.guard, self.tracker, self.book = cfg, guard, tracker, book
        self.org_order = list(book.orgs)
        self.challenges: dict[str, bytes] = {}  # replay protection: from train reports and health replies
        self._health_asked: set[str] = set()

    def capability_table(self) -> dict[str, float]:
        """``{org: Phat}`` over every configured org as the workers should use it (1.0 during warm-up)."""
        return dict(zip(self.org_order, self.tracker.effective_capabilities(self.org_order)))

    def refresh_challenges(self, orgs: list[str], transport: Any) -> None:
        """Take every challenge ``transport``'s health replies carried (discovery, joins), and ask Health, once per
        org in this process, of a live org whose challenge is still unknown (its first round;
        :mod:`hacrl_fed.security.freshness`)."""
        take = getattr(transport, "take_health", None)
        infos: dict[str, Any] = dict(take()) if callable(take) else {}
        missing = [o for o in orgs if o not in self.challenges and o not in infos and o not in self._health_asked]
        health = getattr(transport, "health", None)
        if missing and callable(health):
            self._health_asked.update(missing)
            try:
                replies = health(missing, self.cfg.federation.round_timeout_s)
            except Exception as err:  # no challenge: those orgs train their first round on their own rows only
                log.warning("round plans: health of %s failed (%s); no challenge for them yet", missing, err)
                replies = {}
            infos.update({o: r for o, r in replies.items() if isinstance(r, Mapping)})
            if callable(take):
                take()  # recorded by the call just made: already in infos
        for org, info in infos.items():
            if org not in self.book.totals or not isinstance(info, Mapping):
                continue
            challenge = parse_challenge(info.get(HEALTH_KEY))
            if challenge is not None:
                self.challenges[org] = challenge
            elif HEALTH_KEY in info:
                log.warning("org %s: ignoring a malformed challenge in its health reply", org)

    def take_batches(self, rd: RoundState, replies: Mapping[str, Any], run_id: str) -> None:
        """Verify and screen the replies to ``rd``'s plans, update capability, build its train requests (unless
        fewer than ``min_orgs`` orgs replied: then the round's training is skipped)."""
        for org, plan in rd.plans.items():
            reply = replies.get(org, TimeoutError(f"no reply from {org!r}"))
            if org in self.guard.excluded:  # excluded after its plan went out (fused: by the last round's reports)
                rd.failed[org] = "excluded"
            elif isinstance(reply, Exception):
                rd.failed[org] = failures.cause_of(reply)
                log.warning("round %d: org %s skipped (%s): %s", rd.round, org, rd.failed[org], reply)
            elif ok := self.check_batch(rd.round, org, reply, plan, rd.metrics):
                rd.accepted[org] = ok
            else:
                rd.failed[org] = "excluded" if org in self.guard.excluded else "invalid"
        rm.failure_metrics(rd.failed, rd.metrics)
        # P_k(t) of every org with an accepted rollout (accepted holds no empty lists, so never None)
        rd.accuracy = {org: acc for org, rs in rd.accepted.items() if (acc := accepted_accuracy(rs)) is not None}
        min_orgs = self.cfg.federation.min_orgs
        rd.skipped = len(rd.accepted) < min_orgs
        self.book.note_replies({org: len(rs) for org, rs in rd.accepted.items()}, not rd.skipped)
        if rd.skipped:
            log.warning(
                "round %d: only %d valid replies (%s), min_orgs=%d: skipping training",
                *(rd.round, len(rd.accepted), sorted(rd.accepted), min_orgs),
            )
            return
        if not self.guard.blind:
            self.tracker.update(rd.accuracy)
        rd.requests = self.train_requests(run_id, rd.round, next(iter(rd.plans.values())).prompts, rd.accepted)

    def check_batch(
        self, round: int, org: str, batch: RolloutBatch, plan: RoundPlan, metrics: dict[str, float]
    ) -> list[Rollout]:
        t0 = time.perf_counter()
        screened = self.guard.check(round, org, batch, plan, metrics)
        metrics[f"time/trust/{org}"] = time.perf_counter() - t0
        ok, rejected = screened.accepted, screened.rejected
        if rejected:
            log.warning("round %d: dropped %d rollouts of %s: %s", round, sum(rejected.values()), org, dict(rejected))
        metrics.update(rm.batch_metrics(org, batch, ok, rejected, accepted_accuracy(ok)))
        return ok

    def train_requests(
        self, run_id: str, round: int, prompts: tuple[Prompt, ...], accepted: Mapping[str, list[Rollout]]
    ) -> dict[str, TrainRequest]:
        """One TrainRequest per replying org (foreign = the others' accepted rollouts)."""
        table, requests = self.capability_table(), {}
        for org in accepted:
            foreign, sources = self.guard.pool_for(org, round, accepted)
            requests[org] = TrainRequest(run_id, round, org, prompts, foreign, dict(table), sources)
        return requests

    def take_reports(self, rd: RoundState, replies: Mapping[str, Any]) -> None:
        """Record the train replies of ``rd``'s requests: who trained, their metrics (blind mode: capability)."""
        reports = {}
        for org, req in rd.requests.items():
            reply = replies.get(org, TimeoutError(f"no reply from {org!r}"))
            if not isinstance(reply, TrainReport):
                why = failures.cause_of(reply) if isinstance(reply, BaseException) else "error"
                log.warning("round %d: org %s failed to train (%s): %s", rd.round, org, why, reply)
                rm.train_metrics(org, why, {}, rd.metrics)
                continue
            challenge = parse_challenge(reply.challenge) if reply.challenge else None
            if challenge is not None:  # goes into its next plan
                self.challenges[org] = challenge
            elif reply.challenge:  # malformed: counted, the org keeps its older one
                rd.metrics[f"round/{org}/bad_challenge"] = 1.0
            rm.train_metrics(org, None, reply.metrics, rd.metrics)
            self.book.note_trained(org, rd.round, len(req.foreign) + sum(len(b.rollouts) for b in req.source_batches))
            rd.trained.append(org)
            reports[org] = reply
        valid = self.guard.signed_reports(rd.round, reports, rd.metrics)  # only signed verdicts count
        self.guard.receiver_screened(rd.round, valid, list(rd.accepted), rd.metrics)
        if self.guard.blind:  # capability from what the receivers verified (the coordinator cannot read text)
            verified = self.guard.receiver_verified(rd.round, valid, rd.accepted, rd.metrics)
            if verified:
                self.tracker.update(verified)

    def take_evals(self, round: int, replies: Mapping[str, Any], metrics: dict[str, float]) -> dict[str, float]:
        """Record the held-out accuracies of ``replies`` (``{org: EvalReport | Exception}``) in ``eval_history``."""
        reports = {org: reply for org, reply in replies.items() if rm.valid_accuracy(reply) is not None}
        for org in replies.keys() - reports.keys():
            log.warning("round %d: org %s failed to evaluate: %s", round, org, replies[org])
        self.book.eval_history[round] = accs = rm.eval_metrics(reports, metrics)
        return accs

    def take_checkpoints(self, round: int, replies: Mapping[str, Any], metrics: dict[str, float]) -> None:
        failed = [org for org, reply in replies.items() if not isinstance(reply, str)]
        for org in failed:
            log.warning("round %d: org %s failed to checkpoint: %s", round, org, replies[org])
        metrics["checkpoint/failed_orgs"] = float(len(failed))
        self.book.note_checkpoints(round, replies, failed)

    def close_round(self, rd: RoundState, started: float | None = None) -> RoundResult:
        """The round's summary metrics and result. ``started``: where ``time/round`` starts (default: the round's
        opening; fused: the end of the round before, so consecutive rounds do not overlap)."""
        counts = (len(rd.accepted), len(rd.trained), rd.skipped)
        elapsed = time.perf_counter() - (rd.t0 if started is None else started)
        messages = {org: rd.messages[org] for org in self.org_order}
        rm.close_metrics(
            self.capability_table(), self.guard.metrics(self.org_order), counts, elapsed, messages, rd.metrics
        )
        failed = {org: rd.failed[org] for org in self.org_order if org in rd.failed}
        return RoundResult(rd.round, rd.skipped, list(rd.accepted), rd.accuracy, rd.trained, rd.metrics, failed)
