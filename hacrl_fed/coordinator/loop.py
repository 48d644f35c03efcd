"""The transport-agnostic round loop (docs/ARCHITECTURE.md "One round").

Per round ``t`` (1-based):

1. ``B = federation.prompts_per_round`` train ids from :class:`PromptSampler` (a function of (seed, t)) become
   one :class:`RoundPlan` per reachable configured org (sampling from the org's generation settings, seed
   ``stable_seed("sampling", cfg.seed, t)``), sent with ``transport.generate``.
2. Every reply is verified and screened by :class:`~hacrl_fed.coordinator.trust.PoolGuard` (signature against
   the pinned roster, plan bounds, exactly G samples per prompt, rewards re-verified; an org caught lying is
   excluded for the rest of the run); an org *replied* when at least one rollout was accepted. Its ``P_k(t)``
   is the mean verified reward of its accepted rollouts (the reported accuracy is only compared, as
   ``round/<org>/accuracy_discrepancy``); in coordinator-blind mode it is what the receivers verified. Fewer than
   ``min_orgs`` replies: the round's training is skipped (logged, counted); ``federation.max_failed_rounds`` such rounds
   in a row abort with :class:`FederationError`.
3. The :class:`CapabilityTracker` records the replies; each replying org gets a :class:`TrainRequest` with the
   accepted rollouts of every *other* replying org and ``{org: Phat}`` over all configured orgs (effective:
   1.0 during warm-up).
4. Held-out evaluation (greedy, first ``task.eval_size`` test prompts) before round 1 (logged as round 0), every
   ``eval_every`` rounds and after the last round; worker checkpoints every ``checkpoint_every`` rounds and at the
   end; ``coordinator_state.json`` (atomic) after every round, so ``resume=True`` continues at the next round
   with the same prompts and capability history.

How the steps travel (``federation.protocol``): ``fused`` (default) sends one message per org and round, the
TrainRequest of round ``t - 1`` with the RoundPlan of round ``t`` (:class:`StepRequest`; the worker trains, then
generates); round ``t - 1`` is finished (reports, evaluation, checkpoints, state) before round ``t``'s batches are
screened. ``two_message`` sends the plans, then the train requests. Both give the same numbers
(docs/ARCHITECTURE.md "One round").

Orgs that fail a call are skipped for that phase and simply receive the next round's plan. Every gap is in the
round's metrics: ``round/<org>/failed`` (1 when the org contributed no rollouts) with
``round/<org>/failure/<why>``, and ``round/<org>/train_failure/<why>`` for a failed train; ``<why>`` is
:func:`hacrl_fed.failures.cause_of` (``timeout``, ``unreachable``, ``stale_round``, ``error``) or ``invalid`` (a
reply without a single valid rollout). A worker refuses a round it already trained (``stale_round``: this
coordinator restarted from a state older than the worker's), so no round is ever trained twice by one worker.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hacrl_fed import failures
from hacrl_fed.algorithm import CapabilityTracker
from hacrl_fed.config import BuildError, RunConfig, config_hash, org_generation
from hacrl_fed.coordinator.results import OrgSummary, RoundResult, RunSummary
from hacrl_fed.coordinator.rounds import RoundState, split_reply
from hacrl_fed.coordinator.transport import Transport
from hacrl_fed.coordinator.trust import PoolGuard
from hacrl_fed.fsio import write_json_atomic
from hacrl_fed.metrics import RunLogger, format_eval, format_round
from hacrl_fed.plan.sampler import PromptSampler, eval_ids
from hacrl_fed.plan.screening import accepted_accuracy
from hacrl_fed.run_files import STATE_FILE
from hacrl_fed.security.freshness import HEALTH_KEY, parse_challenge
from hacrl_fed.seeding import stable_seed
from hacrl_fed.types import (
    EvalReport,
    EvalRequest,
    Prompt,
    Rollout,
    RolloutBatch,
    RoundPlan,
    SamplingParams,
    StepRequest,
    TrainReport,
    TrainRequest,
)

log = logging.getLogger(__name__)

STATE_VERSION = 1


class FederationError(RuntimeError):
    """The federation cannot make progress (too many consecutive rounds below ``min_orgs``)."""


_ROUND_OPERATIONS = ("generate", "train", "step")  # the messages counted in round/<org>/messages


def _new_totals() -> dict[str, float]:
    return {"shared": 0, "received": 0, "time_s": 0.0, "trained_round": 0, "checkpoint_round": 0}


def make_run_id(cfg: RunConfig) -> str:
    """A new run's id, ``<name>-<config hash>-<6 random hex digits>``: every new run gets its own, even with an
    identical config (a resumed run keeps the id saved in ``coordinator_state.json``)."""
    return f"{cfg.name}-{config_hash(cfg)}-{secrets.token_hex(3)}"


def sampling_params(cfg: RunConfig, org_id: str, round: int) -> SamplingParams:
    """The org's generation settings as SamplingParams, seed derived from (cfg.seed, round) (same for every org;
    workers mix in their own id)."""
    gen = org_generation(cfg, org_id)
    return SamplingParams(
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        max_new_tokens=gen.max_new_tokens,
        num_samples=gen.num_samples,
        seed=stable_seed("sampling", cfg.seed, round) % 2**31,
    )


def _numeric(metrics: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """``{prefix + name: float(value)}`` for the numeric entries of a reported metrics dict (others dropped)."""
    return {
        f"{prefix}{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class Coordinator:
    """Drives ``cfg.federation.rounds`` rounds over ``transport``; see the module docstring.

    ``task`` defaults to ``get_task(cfg.task.name, cfg.task.params, seed=cfg.seed)``; ``on_round`` is called
    with each :class:`RoundResult` (progress bars). ``logger=None`` logs no metrics (state is still saved).
    """

    def __init__(
        self,
        cfg: RunConfig,
        transport: Transport,
        run_dir: str | Path,
        *,
        logger: RunLogger | None = None,
        resume: bool = False,
        task: Any = None,
        on_round: Callable[[RoundResult], None] | None = None,
    ):
        self.cfg, self.transport, self.logger, self.on_round = cfg, transport, logger, on_round
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.org_order = [o.id for o in cfg.orgs]
        if task is None:
            from hacrl_fed.tasks import get_task

            task = get_task(cfg.task.name, cfg.task.params, seed=cfg.seed)
        self.task = task
        fed = cfg.federation
        train_size = task.size("train")
        if fed.prompts_per_round > train_size:
            raise BuildError(
                f"federation.prompts_per_round={fed.prompts_per_round} exceeds the "
                f"{train_size} train prompts of task {cfg.task.name!r}"
            )
        self.sampler = PromptSampler(train_size, cfg.seed)
        self.eval_prompts = tuple(task.prompts("test", eval_ids(task.size("test"), cfg.task.eval_size)))
        self.tracker = CapabilityTracker.from_algorithm(cfg.algorithm)
        self.run_id = make_run_id(cfg)
        self.round = 0
        self.skipped_rounds = 0
        self.consecutive_failures = 0
        self.eval_history: dict[int, dict[str, float]] = {}
        # per org: rollouts shared / received, call time, last round it trained, round of its last checkpoint
        self.totals = {org: _new_totals() for org in self.org_order}
        self.worker_checkpoint_round = 0  # last round at which every configured org checkpointed
        self.wall_time_s = 0.0
        self.state_path = self.run_dir / STATE_FILE
        # replay protection: each org's latest challenge, from its train reports and health replies (this process)
        self.challenges: dict[str, bytes] = {}
        self._health_asked: set[str] = set()
        from hacrl_fed.security.keyring import load_run_roster

        self.guard = PoolGuard(cfg, load_run_roster(cfg, self.run_dir), task.verify)
        if resume:
            self._load_state()
        elif self.state_path.exists():
            raise FileExistsError(
                f"{self.run_dir} already holds a run ({STATE_FILE}); resume it or use another run directory"
            )

    # -- state -------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "run_id": self.run_id,
            "config_hash": config_hash(self.cfg),
            "round": self.round,
            "tracker": self.tracker.state_dict(),
            "skipped_rounds": self.skipped_rounds,
            "consecutive_failures": self.consecutive_failures,
            "eval_history": {str(t): accs for t, accs in sorted(self.eval_history.items())},
            "totals": self.totals,
            "worker_checkpoint_round": self.worker_checkpoint_round,
            "wall_time_s": self.wall_time_s,
            "trust": self.guard.state_dict(),
        }

    def _save_state(self) -> None:
        write_json_atomic(self.state_path, self.state_dict())

    def _load_state(self) -> None:
        if not self.state_path.exists():
            raise FileNotFoundError(f"nothing to resume: {self.state_path} does not exist")
        state = json.loads(self.state_path.read_text())
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"{self.state_path}: unsupported state version {state.get('version')!r}")
        if state.get("config_hash", config_hash(self.cfg)) != config_hash(self.cfg):
            log.warning(
                "resuming run %s with a changed config (hash %s, was %s); keeping the original run id",
                state["run_id"],
                config_hash(self.cfg),
                state["config_hash"],
            )
        self.run_id = state["run_id"]
        self.round = int(state["round"])
        self.tracker.load_state_dict(state["tracker"])
        self.skipped_rounds = int(state["skipped_rounds"])
        self.consecutive_failures = int(state["consecutive_failures"])
        self.eval_history = {
            int(t): {o: float(a) for o, a in accs.items()} for t, accs in state["eval_history"].items()
        }
        for org, tot in state["totals"].items():
            self.totals.setdefault(org, _new_totals()).update(tot)
        self.worker_checkpoint_round = int(state["worker_checkpoint_round"])
        self.guard.load_state_dict(state.get("trust") or {})
        self.wall_time_s = float(state["wall_time_s"])
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

    # -- helpers -----------------------------------------------------------------------------------------------

    def live_orgs(self) -> list[str]:
        """Configured orgs the transport can reach now and not excluded from the pool, in config order."""
        reachable = set(self.transport.org_ids())
        return [o for o in self.org_order if o in reachable and o not in self.guard.excluded]

    def plan_for(
        self, round: int, org_id: str, prompts: tuple[Prompt, ...], challenges: Mapping[str, bytes] | None = None
    ) -> RoundPlan:
        return RoundPlan(
            run_id=self.run_id,
            round=round,
            task=self.cfg.task.name,
            prompts=prompts,
            sampling=sampling_params(self.cfg, org_id, round),
            challenges=dict(challenges or {}),
        )

    def _refresh_challenges(self, orgs: list[str]) -> None:
        """Take every challenge the transport's health replies carried (discovery, joins), and ask Health, once per
        org in this process, of a live org whose challenge is still unknown (its first round;
        :mod:`hacrl_fed.security.freshness`)."""
        take = getattr(self.transport, "take_health", None)
        infos: dict[str, Any] = dict(take()) if callable(take) else {}
        missing = [o for o in orgs if o not in self.challenges and o not in infos and o not in self._health_asked]
        health = getattr(self.transport, "health", None)
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
            if org not in self.totals or not isinstance(info, Mapping):
                continue
            challenge = parse_challenge(info.get(HEALTH_KEY))
            if challenge is not None:
                self.challenges[org] = challenge
            elif HEALTH_KEY in info:
                log.warning("org %s: ignoring a malformed challenge in its health reply", org)

    def _note_challenge(self, org: str, report: TrainReport, metrics: dict[str, float]) -> None:
        """The fresh challenge of ``org``'s train report goes into its next plan; a malformed one is counted
        (``round/<org>/bad_challenge``) and the org keeps its older one."""
        raw = getattr(report, "challenge", b"")
        if not raw:
            return
        challenge = parse_challenge(raw)
        if challenge is None:
            metrics[f"round/{org}/bad_challenge"] = 1.0
            return
        self.challenges[org] = challenge

    def round_prompts(self, round: int) -> tuple[Prompt, ...]:
        ids = self.sampler.round_ids(round, self.cfg.federation.prompts_per_round)
        return tuple(self.task.prompts("train", ids))

    def _account(self, phase: str, metrics: dict[str, float]) -> None:
        """Add the transport's per-org time of the last call to totals; log its bytes when it reports them."""
        for org, secs in (getattr(self.transport, "last_call_seconds", None) or {}).items():
            if org in self.totals:
                self.totals[org]["time_s"] += float(secs)
                metrics[f"time/call/{phase}/{org}"] = float(secs)
        sizes = getattr(self.transport, "last_call_bytes", None) or {}
        for org, n in sizes.items():  # summed: the fused protocol's last round has two step messages
            metrics[f"bytes/{phase}/{org}"] = metrics.get(f"bytes/{phase}/{org}", 0.0) + float(n)
        if sizes:
            metrics[f"bytes/{phase}/total"] = metrics.get(f"bytes/{phase}/total", 0.0) + float(sum(sizes.values()))

    def capability_table(self) -> dict[str, float]:
        """``{org: Phat}`` over every configured org as the workers should use it (1.0 during warm-up)."""
        return dict(zip(self.org_order, self.tracker.effective_capabilities(self.org_order)))

    # -- phases ------------------------------------------------------------------------------------------------

    def _open_round(self, round: int) -> RoundState:
        """Who gets round ``round``'s plan (the live orgs) and who is already out of it (excluded, unreachable)."""
        orgs = self.live_orgs()
        self.guard.new_round()
        failed = {
            org: ("excluded" if org in self.guard.excluded else "unreachable")
            for org in self.org_order
            if org not in orgs
        }  # excluded, or no connection right now
        unreachable = sorted(org for org, why in failed.items() if why == "unreachable")
        if unreachable:
            log.warning("round %d: orgs %s are not reachable", round, unreachable)
        prompts = self.round_prompts(round) if orgs else ()
        self._refresh_challenges(orgs)
        challenges = {org: self.challenges[org] for org in orgs if org in self.challenges}
        plans = {org: self.plan_for(round, org, prompts, challenges) for org in orgs}
        return RoundState(round, time.perf_counter(), {}, failed, plans)

    def _take_batches(self, rd: RoundState, replies: Mapping[str, Any]) -> None:
        """Verify and screen the replies to ``rd``'s plans, update capability, build its train requests (unless
        fewer than ``min_orgs`` orgs replied: then the round's training is skipped)."""
        round, metrics, failed = rd.round, rd.metrics, rd.failed
        for org, plan in rd.plans.items():
            reply = replies.get(org, TimeoutError(f"no reply from {org!r}"))
            if org in self.guard.excluded:  # excluded after its plan went out (fused: by the last round's reports)
                failed[org] = "excluded"
            elif isinstance(reply, Exception):
                failed[org] = failures.cause_of(reply)
                log.warning("round %d: org %s skipped (%s): %s", round, org, failed[org], reply)
            elif ok := self._check_batch(round, org, reply, plan, metrics):
                rd.accepted[org] = ok
            else:
                failed[org] = "excluded" if org in self.guard.excluded else "invalid"
        for org, why in failed.items():
            metrics[f"round/{org}/failed"] = 1.0
            metrics[f"round/{org}/failure/{why}"] = 1.0
        # P_k(t) of every org with an accepted rollout (accepted holds no empty lists, so never None)
        rd.accuracy = {org: acc for org, rs in rd.accepted.items() if (acc := accepted_accuracy(rs)) is not None}
        for org, rs in rd.accepted.items():
            self.totals[org]["shared"] += len(rs)
        min_orgs = self.cfg.federation.min_orgs
        rd.skipped = len(rd.accepted) < min_orgs
        if rd.skipped:
            self.skipped_rounds += 1
            self.consecutive_failures += 1
            log.warning(
                "round %d: only %d valid replies (%s), min_orgs=%d: skipping training",
                round,
                len(rd.accepted),
                sorted(rd.accepted),
                min_orgs,
            )
            return
        self.consecutive_failures = 0
        if not self.guard.blind:
            self.tracker.update(rd.accuracy)
        rd.requests = self._train_requests(round, next(iter(rd.plans.values())).prompts, rd.accepted)

    def _check_batch(
        self, round: int, org: str, batch: RolloutBatch, plan: RoundPlan, metrics: dict[str, float]
    ) -> list[Rollout]:
        t0 = time.perf_counter()
        screened = self.guard.check(round, org, batch, plan, metrics)
        metrics[f"time/trust/{org}"] = time.perf_counter() - t0
        ok, rejected = screened.accepted, screened.rejected
        received = len(ok) + sum(rejected.values())
        metrics.update(
            {
                f"round/{org}/rollouts_received": float(received),
                f"round/{org}/rollouts_accepted": float(len(ok)),
                f"round/{org}/rollouts_rejected": float(sum(rejected.values())),
                f"round/{org}/failed": 0.0 if ok else 1.0,
            }
        )
        metrics.update({f"round/{org}/rejected/{reason}": float(n) for reason, n in rejected.items()})
        if rejected:
            log.warning("round %d: dropped %d rollouts of %s: %s", round, sum(rejected.values()), org, dict(rejected))
        acc = accepted_accuracy(ok)
        if acc is not None:
            metrics[f"round/{org}/accuracy"] = acc
            reported = getattr(batch, "accuracy", None)
            if isinstance(reported, (int, float)) and math.isfinite(reported):
                metrics[f"round/{org}/accuracy_discrepancy"] = float(reported) - acc
            metrics.update(_numeric(getattr(batch, "metrics", {}) or {}, f"{org}/"))
            _exchange_time("generate", org, getattr(batch, "metrics", {}) or {}, metrics)
        return ok

    def _train_requests(
        self, round: int, prompts: tuple[Prompt, ...], accepted: Mapping[str, list[Rollout]]
    ) -> dict[str, TrainRequest]:
        """One TrainRequest per replying org (foreign = the others' accepted rollouts)."""
        table = self.capability_table()
        requests = {}
        for org in accepted:
            foreign, sources = self.guard.pool_for(org, accepted)
            requests[org] = TrainRequest(
                run_id=self.run_id,
                round=round,
                org_id=org,
                prompts=prompts,
                foreign=foreign,
                capability=dict(table),
                source_batches=sources,
            )
        return requests

    def _take_reports(self, rd: RoundState, replies: Mapping[str, Any]) -> None:
        """Record the train replies of ``rd``'s requests: who trained, their metrics (blind mode: capability)."""
        round, metrics, reports = rd.round, rd.metrics, {}
        for org, req in rd.requests.items():
            reply = replies.get(org, TimeoutError(f"no reply from {org!r}"))
            if not isinstance(reply, TrainReport):
                why = failures.cause_of(reply) if isinstance(reply, BaseException) else "error"
                log.warning("round %d: org %s failed to train (%s): %s", round, org, why, reply)
                metrics[f"round/{org}/train_failed"] = 1.0
                metrics[f"round/{org}/train_failure/{why}"] = 1.0
                continue
            metrics[f"round/{org}/train_failed"] = 0.0
            self._note_challenge(org, reply, metrics)
            metrics.update(_numeric(reply.metrics, f"{org}/"))
            _exchange_time("train", org, reply.metrics, metrics)
            self.totals[org]["received"] += len(req.foreign) + sum(len(b.rollouts) for b in req.source_batches)
            self.totals[org]["trained_round"] = round
            rd.trained.append(org)
            reports[org] = reply
        valid = self.guard.signed_reports(round, reports, metrics)  # only signed verdicts count
        self.guard.receiver_screened(round, valid, list(rd.accepted), metrics)
        if self.guard.blind:  # capability from what the receivers verified (the coordinator cannot read text)
            verified = self.guard.receiver_verified(round, valid, rd.accepted, metrics)
            if verified:
                self.tracker.update(verified)

    def _close_round(self, rd: RoundState, started: float | None = None) -> RoundResult:
        """The round's summary metrics and result. ``started``: where ``time/round`` starts (default: the round's
        opening; fused: the end of the round before, so consecutive rounds do not overlap)."""
        metrics = rd.metrics
        metrics.update({f"capability/{org}": v for org, v in self.capability_table().items()})
        metrics.update(self.guard.metrics(self.org_order))
        metrics.update(
            {
                "round/orgs_replied": float(len(rd.accepted)),
                "round/orgs_trained": float(len(rd.trained)),
                "round/skipped": float(rd.skipped),
                "time/round": time.perf_counter() - (rd.t0 if started is None else started),
            }
        )
        metrics.update({f"round/{org}/messages": float(rd.messages[org]) for org in self.org_order})
        return RoundResult(
            rd.round,
            rd.skipped,
            list(rd.accepted),
            rd.accuracy,
            rd.trained,
            metrics,
            {org: rd.failed[org] for org in self.org_order if org in rd.failed},
        )

    def evaluate(self, round: int, metrics: dict[str, float]) -> dict[str, float]:
        """Greedy held-out accuracy of every reachable org; recorded in ``eval_history[round]``."""
        requests = {
            org: EvalRequest(
                run_id=self.run_id,
                round=round,
                task=self.cfg.task.name,
                prompts=self.eval_prompts,
                max_new_tokens=org_generation(self.cfg, org).eval_max_new_tokens,
            )
            for org in self.live_orgs()
        }
        t0 = time.perf_counter()
        replies = self.transport.evaluate(requests, self.cfg.federation.round_timeout_s)
        metrics["time/eval"] = time.perf_counter() - t0
        self._account("eval", metrics)
        accs: dict[str, float] = {}
        for org in requests:
            reply = replies.get(org)
            if not (
                isinstance(reply, EvalReport)
                and isinstance(reply.accuracy, (int, float))
                and math.isfinite(reply.accuracy)
                and 0.0 <= reply.accuracy <= 1.0
            ):
                log.warning("round %d: org %s failed to evaluate: %s", round, org, reply)
                continue
            accs[org] = float(reply.accuracy)
            metrics[f"eval/{org}/accuracy"] = accs[org]
            metrics.update(_numeric(reply.metrics, f"eval/{org}/"))
        if accs:
            metrics["eval/mean_accuracy"] = sum(accs.values()) / len(accs)
        self.eval_history[round] = accs
        return accs

    def checkpoint_workers(self, round: int, metrics: dict[str, float]) -> None:
        orgs = self.live_orgs()
        replies = self.transport.checkpoint(orgs, round, self.cfg.federation.round_timeout_s)
        self._account("checkpoint", metrics)
        failed = [org for org in orgs if not isinstance(replies.get(org), str)]
        for org in orgs:
            if org not in failed:
                self.totals[org]["checkpoint_round"] = round
        for org in failed:
            log.warning("round %d: org %s failed to checkpoint: %s", round, org, replies.get(org))
        metrics["checkpoint/failed_orgs"] = float(len(failed))
        if not failed and len(orgs) == len(self.org_order):
            self.worker_checkpoint_round = round

    # -- the loop ----------------------------------------------------------------------------------------------

    def run_round(self, round: int) -> RoundResult:
        """Generate → validate → (capability, train) for ``round`` with two messages per org (``two_message``)."""
        rd = self._open_round(round)
        timeout = self.cfg.federation.round_timeout_s
        replies: dict[str, Any] = {}
        if rd.plans:
            t0 = time.perf_counter()
            replies = self._counted(rd, lambda: self.transport.generate(rd.plans, timeout))
            rd.metrics["time/generate"] = time.perf_counter() - t0
            self._account("generate", rd.metrics)
        self._take_batches(rd, replies)
        if not rd.skipped:
            t0 = time.perf_counter()
            replies = self._counted(rd, lambda: self.transport.train(rd.requests, timeout))
            rd.metrics["time/train"] = time.perf_counter() - t0
            self._account("train", rd.metrics)
            self._take_reports(rd, replies)
        return self._close_round(rd)

    def _step(self, last: RoundState | None, rd: RoundState | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """One fused message per org (``fused``): ``last``'s train requests with ``rd``'s plans. Returns the
        replies split into ``({org: train outcome}, {org: generate outcome})`` (:func:`.rounds.split_reply`); the
        message's timing and traffic go to ``rd``'s metrics (to ``last``'s for the closing train-only message)."""
        trains = last.requests if last is not None else {}
        plans = rd.plans if rd is not None else {}
        requests = {
            org: StepRequest(train=trains.get(org), plan=plans.get(org))
            for org in self.org_order
            if org in trains or org in plans
        }
        owner = rd if rd is not None else last
        if owner is None or not requests:
            return {}, {}
        # each half keeps its own round_timeout_s, as it had as a message of its own
        halves = 2 if any(r.train is not None and r.plan is not None for r in requests.values()) else 1
        t0 = time.perf_counter()
        replies = self._counted(
            owner, lambda: self.transport.step(requests, self.cfg.federation.round_timeout_s * halves)
        )
        owner.metrics["time/step"] = owner.metrics.get("time/step", 0.0) + time.perf_counter() - t0
        self._account("step", owner.metrics)
        reports, batches = {}, {}
        for org, request in requests.items():
            reports[org], batches[org] = split_reply(request, replies.get(org, TimeoutError(f"no reply from {org!r}")))
            parts = [getattr(reports[org], "metrics", None), getattr(batches[org], "metrics", None)]
            _exchange_time("step", org, {k: v for m in parts if m for k, v in m.items()}, owner.metrics)
        return reports, batches

    def _counted(self, rd: RoundState, send: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``send()``, adding the round-traffic messages the transport counted for it to ``rd.messages``."""
        before = self.transport.messages_sent.copy()
        out = send()
        after = self.transport.messages_sent
        for op in _ROUND_OPERATIONS:
            for org in self.org_order:
                rd.messages[org] += after[op, org] - before[op, org]
        return out

    def _finish(self, t: int, result: RoundResult, start: float) -> None:
        """Evaluation, worker checkpoints, log line, metrics, state and ``on_round`` after round ``t``."""
        fed = self.cfg.federation
        accs = None
        if (fed.eval_every and t % fed.eval_every == 0) or t == fed.rounds:
            accs = self.evaluate(t, result.metrics)
        if (fed.checkpoint_every and t % fed.checkpoint_every == 0) or t == fed.rounds:
            self.checkpoint_workers(t, result.metrics)
        self.round = t
        self.wall_time_s += time.perf_counter() - start
        log.info(format_round(result, fed.rounds, time.perf_counter() - start, self.guard.excluded))
        if accs is not None:
            log.info(format_eval(t, accs, self.eval_history.get(0)))
        self._log(t, result.metrics)
        self._save_state()
        if self.on_round is not None:
            self.on_round(result)
        if self.consecutive_failures >= fed.max_failed_rounds:
            raise FederationError(
                f"{self.consecutive_failures} consecutive rounds (up to round {t}) had fewer than "
                f"federation.min_orgs={fed.min_orgs} valid replies; last round: {result.replied or 'none'}"
            )

    def run(self) -> RunSummary:
        """Run (or resume) until ``federation.rounds``; returns the summary."""
        fed = self.cfg.federation
        log.info(
            "run %s (%s): rounds %d to %d, orgs %s, %s protocol",
            self.run_id,
            f"resumed after round {self.round}" if self.round else "new",
            self.round + 1,
            fed.rounds,
            self.org_order,
            fed.protocol,
        )
        if self.round == 0 and 0 not in self.eval_history:
            start, metrics = time.perf_counter(), dict[str, float]()
            log.info(format_eval(0, self.evaluate(0, metrics)))
            self.wall_time_s += time.perf_counter() - start
            self._log(0, metrics)
            self._save_state()
        if fed.protocol == "fused":
            self._run_fused()
        else:
            for t in range(self.round + 1, fed.rounds + 1):
                start = time.perf_counter()
                self._finish(t, self.run_round(t), start)
        return self.summary()

    def _run_fused(self) -> None:
        """Rounds as one message per org: the message of round ``t`` carries round ``t - 1``'s train requests and
        round ``t``'s plans (round ``self.round + 1``: plans alone; after the last round: train requests alone).

        Round ``t - 1`` is finished (its train reports, evaluation, checkpoints, state) before round ``t``'s
        batches are screened, so the saved state after round ``t - 1`` holds nothing of round ``t`` and a resumed
        run sends round ``t``'s plan again, exactly as the two-message protocol does.
        """
        fed = self.cfg.federation
        last: RoundState | None = None
        mark = time.perf_counter()
        for t in range(self.round + 1, fed.rounds + 2):
            rd = self._open_round(t) if t <= fed.rounds else None
            reports, batches = self._step(last, rd)
            if last is not None:
                self._take_reports(last, reports)
                self._finish(last.round, self._close_round(last, mark), mark)
                mark = time.perf_counter()
            if rd is not None:
                self._take_batches(rd, batches)
            last = rd

    def _log(self, round: int, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(round, metrics)

    def summary(self) -> RunSummary:
        def acc_at(org: str, rounds: list[int]) -> float | None:
            for t in rounds:
                if org in self.eval_history.get(t, {}):
                    return self.eval_history[t][org]
            return None

        latest = sorted(self.eval_history, reverse=True)
        orgs = {
            org: OrgSummary(
                acc_at(org, [0]),
                acc_at(org, latest),
                int(tot["shared"]),
                int(tot["received"]),
                float(tot["time_s"]),
                self.guard.excluded.get(org),
            )
            for org, tot in self.totals.items()
        }
        return RunSummary(
            self.run_id,
            self.run_dir,
            self.round,
            self.skipped_rounds,
            orgs,
            dict(self.eval_history),
            self.capability_table(),
            self.wall_time_s,
        )


def _exchange_time(phase: str, org: str, worker_metrics: Mapping[str, Any], metrics: dict[str, float]) -> None:
    """``time/exchange/<phase>/<org>``: the transport's call time minus the worker's own reported compute
    (its ``time/*`` metrics, top-level phases only) = serialization, transport and queueing overhead."""
    call = metrics.get(f"time/call/{phase}/{org}")
    if call is None:
        return
    compute = sum(
        float(v)
        for k, v in worker_metrics.items()
        if k.startswith("time/")
        and k.count("/") == 1
        and k != "time/update"
        and isinstance(v, (int, float))
        and math.isfinite(v)
    )
    metrics[f"time/exchange/{phase}/{org}"] = max(0.0, call - compute)
