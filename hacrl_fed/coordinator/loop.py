"""The transport-agnostic round loop (docs/ARCHITECTURE.md "One round").

Every message of a round is a step (:class:`~hacrl_fed.types.StepRequest`), sent to the orgs together and
awaited at one place, :meth:`Coordinator.round_barrier`. Per round ``t`` (1-based):

1. ``B = federation.prompts_per_round`` train ids from :class:`PromptSampler` (a function of (seed, t)) become one
   :class:`RoundPlan` per live org (:mod:`.run_plans`), the ``plan`` part of a step.
2. Every batch is verified and screened by :class:`~hacrl_fed.coordinator.trust.PoolGuard` (signature against
   the pinned roster, plan bounds, exactly G samples per prompt, rewards re-verified; an org caught lying is
   excluded for the rest of the run); an org *replied* when at least one rollout was accepted. Its ``P_k(t)``
   is the mean verified reward of its accepted rollouts (in coordinator-blind mode what the receivers
   verified). Fewer than ``min_orgs`` replies: the round's training is skipped; ``federation.max_failed_rounds``
   such rounds in a row abort with :class:`FederationError`.
3. The :class:`CapabilityTracker` records the replies; each replying org gets a :class:`TrainRequest` (the
   ``train`` part of a step) with the accepted rollouts of every *other* replying org and ``{org: Phat}``.
4. Held-out evaluation (greedy, first ``task.eval_size`` test prompts) before round 1 (its own call, logged as
   round 0), every ``eval_every`` rounds and after the last round, and worker checkpoints every
   ``checkpoint_every`` rounds and at the end: the ``evaluate`` and ``checkpoint`` parts of the step that carries
   the round's train requests. ``coordinator_state.json`` (:mod:`.state_file`) after every round, so
   ``resume=True`` continues at the next round with the same prompts and capability history.

How the parts travel (``federation.protocol``): ``fused`` (default) sends one step per org and round, round
``t - 1``'s train request (with its evaluation and checkpoint) with round ``t``'s plan; round ``t - 1`` is
finished (reports, evaluation, checkpoints, state) before round ``t``'s batches are screened. ``two_message``
sends a plan-only step, then a train-only step. Both give the same numbers.

Orgs that fail a part are skipped for it and receive the next round's plan. Every gap is in the round's metrics
(:mod:`.round_metrics`): ``round/<org>/failure/<why>``, ``round/<org>/train_failure/<why>``; ``<why>`` is
:func:`hacrl_fed.failures.cause_of` or ``invalid`` (a reply without a single valid rollout).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hacrl_fed.algorithm import CapabilityTracker
from hacrl_fed.config import BuildError, RunConfig, config_hash, org_generation
from hacrl_fed.coordinator import round_metrics as rm
from hacrl_fed.coordinator.async_state import ASYNC_KEY
from hacrl_fed.coordinator.bookkeeping import RoundKeeper, RunBook
from hacrl_fed.coordinator.rounds import RoundState, StepOutcome, split_reply
from hacrl_fed.coordinator.run_plans import make_run_id, sampling_params
from hacrl_fed.coordinator.state_file import read_state, write_state
from hacrl_fed.coordinator.transport import Transport
from hacrl_fed.coordinator.trust import PoolGuard
from hacrl_fed.metrics import RunLogger, drop_rows_after, format_eval, format_round
from hacrl_fed.plan.sampler import PromptSampler, eval_ids
from hacrl_fed.results import OrgSummary, RoundResult, RunSummary
from hacrl_fed.run_files import STATE_FILE
from hacrl_fed.types import (
    EvalRequest,
    Prompt,
    RoundPlan,
    StepRequest,
)
from hacrl_fed.wire.operations import STEP

log = logging.getLogger(__name__)


class FederationError(RuntimeError):
    """The federation cannot make progress (too many consecutive rounds below ``min_orgs``)."""


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
        from hacrl_fed.security.keyring import load_run_roster
        from hacrl_fed.tasks import get_task

        self.cfg, self.transport, self.logger, self.on_round = cfg, transport, logger, on_round
        self.run_dir, self.org_order = Path(run_dir), [o.id for o in cfg.orgs]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.task = task = get_task(cfg.task.name, cfg.task.params, seed=cfg.seed) if task is None else task
        if cfg.federation.prompts_per_round > task.size("train"):
            raise BuildError(
                f"federation.prompts_per_round={cfg.federation.prompts_per_round} exceeds the "
                f"{task.size('train')} train prompts of task {cfg.task.name!r}"
            )
        self.sampler = PromptSampler(task.size("train"), cfg.seed)
        self.eval_prompts = tuple(task.prompts("test", eval_ids(task.size("test"), cfg.task.eval_size)))
        self.tracker = CapabilityTracker.from_algorithm(cfg.algorithm)
        self.run_id, self.book = make_run_id(cfg), RunBook(list(self.org_order))
        self.state_path = self.run_dir / STATE_FILE
        self.guard = PoolGuard(cfg, load_run_roster(cfg, self.run_dir), task.verify)
        self.keeper = RoundKeeper(cfg, self.guard, self.tracker, self.book)
        self.challenges = self.keeper.challenges  # each org's latest, for its next plan (replay protection)
        self.async_snapshot: dict[str, Any] | None = None  # asynchronous rounds: the last quiescent state
        if resume:
            state = read_state(self.state_path, config_hash(cfg))
            self.run_id, self.resume_async = state["run_id"], state.get(ASYNC_KEY)  # .async_state
            self.tracker.load_state_dict(state["tracker"])
            self.guard.load_state_dict(state.get("trust") or {})
            self.book.load_state_dict(state)
            drop_rows_after(self.run_dir, self.round)  # logged after the state's round: they run again
        elif self.state_path.exists():
            raise FileExistsError(
                f"{self.run_dir} already holds a run ({STATE_FILE}); resume it or use another run directory"
            )

    round = property(lambda self: self.book.round, doc="The last round finished (0: none yet).")
    eval_history = property(lambda self: self.book.eval_history, doc="``{round: {org: held-out accuracy}}``.")
    skipped_rounds = property(lambda self: self.book.skipped_rounds)
    consecutive_failures = property(lambda self: self.book.consecutive_failures)

    def state_dict(self) -> dict[str, Any]:
        """What ``coordinator_state.json`` holds (:mod:`.state_file`; asynchronous rounds: the last quiescent one)."""
        if self.async_snapshot is not None:
            return self.async_snapshot
        ids = {"run_id": self.run_id, "config_hash": config_hash(self.cfg), "tracker": self.tracker.state_dict()}
        return {**ids, **self.book.state_dict(), "trust": self.guard.state_dict()}

    # -- what goes out -----------------------------------------------------------------------------------------

    def live_orgs(self) -> list[str]:
        """Configured orgs the transport can reach now and not excluded from the pool, in config order."""
        reachable = set(self.transport.org_ids())
        return [o for o in self.org_order if o in reachable and o not in self.guard.excluded]

    def plan_for(
        self, round: int, org_id: str, prompts: tuple[Prompt, ...], challenges: Mapping[str, bytes] | None = None
    ) -> RoundPlan:
        sampling = sampling_params(self.cfg, org_id, round)
        return RoundPlan(self.run_id, round, self.cfg.task.name, prompts, sampling, dict(challenges or {}))

    def round_prompts(self, round: int) -> tuple[Prompt, ...]:
        ids = self.sampler.round_ids(round, self.cfg.federation.prompts_per_round)
        return tuple(self.task.prompts("train", ids))

    def capability_table(self) -> dict[str, float]:
        """``{org: Phat}`` over every configured org as the workers should use it (1.0 during warm-up); in
        asynchronous rounds the per-round table's figures at the last round."""
        driver = getattr(self, "async_driver", None)
        if driver is not None:
            return driver.capabilities.table(self.cfg.federation.last_round, self.org_order)
        return self.keeper.capability_table()

    def eval_request(self, round: int, org: str) -> EvalRequest:
        max_new = org_generation(self.cfg, org).eval_max_new_tokens
        return EvalRequest(self.run_id, round, self.cfg.task.name, self.eval_prompts, max_new)

    def extras_due(self, round: int, org: str | None = None) -> tuple[bool, bool]:
        """Whether ``round`` evaluates and whether it checkpoints (every N rounds, and the last round: ``org``'s own,
        ``federation.org_rounds``, when given)."""
        fed = self.cfg.federation
        every, last = (fed.eval_every, fed.checkpoint_every), fed.rounds if org is None else fed.rounds_of(org)
        return tuple(bool(n) and round % n == 0 or round == last for n in every)  # type: ignore[return-value]

    # -- what comes back ---------------------------------------------------------------------------------------

    def _open_round(self, round: int) -> RoundState:
        """Who gets round ``round``'s plan (the live orgs) and who is already out of it (excluded, unreachable)."""
        orgs = self.live_orgs()
        self.guard.new_round(round)
        out = {o: ("excluded" if o in self.guard.excluded else "unreachable") for o in self.org_order if o not in orgs}
        unreachable = sorted(org for org, why in out.items() if why == "unreachable")
        if unreachable:
            log.warning("round %d: orgs %s are not reachable", round, unreachable)
        prompts = self.round_prompts(round) if orgs else ()
        self.keeper.refresh_challenges(orgs, self.transport)
        challenges = {org: self.challenges[org] for org in orgs if org in self.challenges}
        plans = {org: self.plan_for(round, org, prompts, challenges) for org in orgs}
        return RoundState(round, time.perf_counter(), {}, out, plans)

    def evaluate(self, round: int, metrics: dict[str, float]) -> dict[str, float]:
        """Greedy held-out accuracy of every reachable org, as a call of its own (the evaluation before round 1)."""
        requests = {org: self.eval_request(round, org) for org in self.live_orgs()}
        t0 = time.perf_counter()
        replies = self.transport.evaluate(requests, self.cfg.federation.round_timeout_s)
        metrics["time/eval"] = time.perf_counter() - t0
        self._account("eval", metrics)
        return self.keeper.take_evals(round, {org: replies.get(org) for org in requests}, metrics)

    def _account(self, phase: str, metrics: dict[str, float]) -> None:
        """The transport's per-org time of the last call into the totals and metrics, with its bytes when known."""
        seconds = getattr(self.transport, "last_call_seconds", None) or {}
        self.book.note_call_time(seconds)
        rm.call_metrics(
            phase, seconds, getattr(self.transport, "last_call_bytes", None) or {}, self.book.totals, metrics
        )

    # -- the driver --------------------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Run (or resume) until ``federation.rounds``; returns the summary."""
        fed = self.cfg.federation
        how = f"resumed after round {self.round}" if self.round else "new"
        ways = (self.org_order, fed.protocol)
        first = self.round + 1
        log.info("run %s (%s): rounds %d to %d, orgs %s, %s protocol", self.run_id, how, first, fed.last_round, *ways)
        if self.round == 0 and 0 not in self.eval_history:
            start, metrics = time.perf_counter(), dict[str, float]()
            log.info(format_eval(0, self.evaluate(0, metrics)))
            self.book.wall_time_s += time.perf_counter() - start
            self._log(0, metrics)
            write_state(self.state_path, self.state_dict())
        if fed.staleness >= 1:  # asynchronous rounds: their own driver (docs/ALGORITHM.md "Asynchronous rounds")
            return self._run_async()
        fused, last, mark = fed.protocol == "fused", None, time.perf_counter()
        for t in range(self.round + 1, fed.rounds + 2):  # the one loop over rounds; t = rounds + 1 only closes
            rd = self._open_round(t) if t <= fed.rounds else None
            for closing, opening in [(last, rd)] if fused else [(None, rd), (rd, None)] if rd else []:
                outcomes = self._send(closing, opening, True, "step" if fused else "train" if closing else "generate")
                if closing is not None:
                    start = mark if fused else closing.t0
                    self.finish_round(self.keeper.close_round(closing, start), start)
                    mark = time.perf_counter()
                if opening is not None:
                    self.keeper.take_batches(opening, {org: out.batch for org, out in outcomes.items()}, self.run_id)
            last = rd
        return self.summary()

    def _run_async(self) -> RunSummary:
        """``federation.staleness >= 1``: :class:`~hacrl_fed.coordinator.async_driver.AsyncDriver` in process (virtual
        clock), or on a transport that sends a step without waiting for it (wall clock: gRPC, Flower)."""
        from hacrl_fed.coordinator.async_driver import AsyncDriver
        from hacrl_fed.coordinator.grpc_transport import GrpcTransport
        from hacrl_fed.coordinator.inprocess import InProcessTransport
        from hacrl_fed.flower.transport import FlowerTransport

        k, name = self.cfg.federation.staleness, type(self.transport).__name__
        if not isinstance(self.transport, (InProcessTransport, GrpcTransport, FlowerTransport)):
            raise BuildError(f"federation.staleness={k}: asynchronous rounds run in process, on gRPC or Flower: {name}")
        if self.round and not isinstance(self.transport, InProcessTransport):  # docs/ALGORITHM.md "Resuming"
            raise BuildError(f"federation.staleness={k}: an asynchronous run resumes in process only, not on {name}")
        self.async_driver = AsyncDriver(self)  # the wall time goes into the run book round by round
        self.async_driver.run()
        return self.summary()

    def run_round(self, round: int) -> RoundResult:
        """Round ``round`` alone as two steps, plan then train, without evaluation, checkpoint or saved state."""
        rd = self._open_round(round)
        batches = {org: out.batch for org, out in self._send(None, rd, False, "generate").items()}
        self.keeper.take_batches(rd, batches, self.run_id)
        self._send(rd, None, False, "train")
        return self.keeper.close_round(rd)

    def _send(self, closing: RoundState | None, opening: RoundState | None, due: bool, phase: str) -> dict[str, Any]:
        """One step per org: ``closing``'s train requests (and, when ``due``, its evaluation and checkpoint) with
        ``opening``'s plans; takes ``closing``'s parts of the replies and returns every org's :class:`StepOutcome`."""
        trains, plans = (closing.requests if closing else {}), (opening.plans if opening else {})
        round = closing.round if closing is not None else 0
        evaluate, ckpt = self.extras_due(round) if closing is not None and due else (False, False)
        extra = (list(plans) if opening is not None else self.live_orgs()) if evaluate or ckpt else []
        requests = {
            org: StepRequest(
                trains.get(org),
                plans.get(org),
                self.eval_request(round, org) if evaluate and org in extra else None,
                round if ckpt and org in extra else None,
            )
            for org in self.org_order
            if org in trains or org in plans or org in extra
        }
        owner = opening or closing
        outcomes = self.round_barrier(requests, phase, owner) if owner is not None else {}
        if closing is not None:
            self.keeper.take_reports(closing, {org: out.train for org, out in outcomes.items() if out.train})
            asked = [org for org in extra if org not in self.guard.excluded]  # excluded by these reports: unasked
            if evaluate:
                evals = {org: outcomes[org].evaluation for org in asked}
                self.keeper.take_evals(round, evals, closing.metrics)
            if ckpt:
                self.keeper.take_checkpoints(round, {org: outcomes[org].checkpoint for org in asked}, closing.metrics)
        return outcomes

    def round_barrier(
        self, requests: Mapping[str, StepRequest], phase: str, owner: RoundState
    ) -> dict[str, StepOutcome]:
        """The round barrier: every org's step goes out at once and every reply is awaited (or its deadline: each
        part keeps its own ``round_timeout_s``). The timing, traffic and messages go to ``owner``'s metrics."""
        if not requests:
            return {}
        before = self.transport.messages_sent.copy()
        timeout = self.cfg.federation.round_timeout_s * max(r.parts() for r in requests.values())
        t0 = time.perf_counter()
        replies = self.transport.step(requests, timeout)
        owner.metrics[f"time/{phase}"] = owner.metrics.get(f"time/{phase}", 0.0) + time.perf_counter() - t0
        for org, request in requests.items():  # round traffic: messages with a train request or a plan
            if request.train is not None or request.plan is not None:
                owner.messages[org] += self.transport.messages_sent[STEP.name, org] - before[STEP.name, org]
        self._account(phase, owner.metrics)
        outcomes = {}
        for org, request in requests.items():
            outcomes[org] = out = split_reply(request, replies.get(org, TimeoutError(f"no reply from {org!r}")))
            parts = [getattr(part, "metrics", None) for part in (out.train, out.batch, out.evaluation)]
            rm.exchange_time(phase, org, {k: v for m in parts if m for k, v in m.items()}, owner.metrics)
        return outcomes

    def finish_round(self, result: RoundResult, start: float) -> None:
        """Log line, metrics, state and ``on_round`` after round ``result.round``; stop after too many failures."""
        fed, t = self.cfg.federation, result.round
        self.book.round = t
        self.book.wall_time_s += time.perf_counter() - start
        log.info(format_round(result, fed.last_round, time.perf_counter() - start, self.guard.excluded))
        if any(self.extras_due(t, org)[0] for org in self.org_order):
            log.info(format_eval(t, self.eval_history.get(t, {}), self.eval_history.get(0)))
        self._log(t, result.metrics)
        write_state(self.state_path, self.state_dict())
        if self.on_round is not None:
            self.on_round(result)
        if self.book.consecutive_failures >= fed.max_failed_rounds:
            raise FederationError(
                f"{self.book.consecutive_failures} consecutive rounds (up to round {t}) had fewer than "
                f"federation.min_orgs={fed.min_orgs} valid replies; last round: {result.replied or 'none'}"
            )

    def _log(self, round: int, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(round, metrics)

    def summary(self) -> RunSummary:
        latest = sorted(self.eval_history, reverse=True)

        def acc_at(org: str, rounds: list[int]) -> float | None:
            return next((self.eval_history[t][org] for t in rounds if org in self.eval_history.get(t, {})), None)

        orgs = {
            org: OrgSummary(
                acc_at(org, [0]),
                acc_at(org, latest),
                int(tot["shared"]),
                int(tot["received"]),
                float(tot["time_s"]),
                self.guard.excluded.get(org),
            )
            for org, tot in self.book.totals.items()
        }
        done = (self.round, self.skipped_rounds)
        history, table = dict(self.eval_history), self.capability_table()
        return RunSummary(self.run_id, self.run_dir, *done, orgs, history, table, self.book.wall_time_s)
