"""The asynchronous round driver, in process and over gRPC (docs/ALGORITHM.md "Asynchronous rounds").

``federation.staleness`` ``K >= 1``: each org steps as soon as the staleness bound lets it, instead of every org
waiting at :meth:`~hacrl_fed.coordinator.loop.Coordinator.round_barrier`. The rules are those of
:mod:`.async_schedule` (the bound on ``floor``, the window ``W``, :func:`~.async_schedule.offer_verdict`), followed
on the workers' real replies:

- An org's step planning round ``t`` carries its train request for round ``t - 1`` (its own accepted batch of
  ``t - 1``, held by its worker, plus every foreign batch of rounds ``t - W … t - 1`` it has not used, each with
  its tag ``(source, round, version)``, and the capability figures of each of those rounds from
  :class:`~hacrl_fed.algorithm.capability_rounds.RoundCapabilities`), the evaluation and checkpoint of round
  ``t - 1`` when due, and the plan of round ``t``.
- **Virtual clock**: one step of org ``x`` takes the in-process transport's ``clock.step_s[x]`` virtual seconds
  (default 1; :mod:`.virtual_clock`, a benchmark's setting).
  In-process calls run one after another, so the driver calls the worker when the step starts and takes its reply
  at ``start + duration``; events at one instant: completions (config order), then the steps that may start
  (config order). The schedule is therefore :func:`~.async_schedule.simulate`'s for the same durations (tested)
  whenever every reply comes back and is accepted.
- **Wall clock** (any other transport the coordinator accepts: gRPC): a step is sent without waiting
  (:meth:`~hacrl_fed.coordinator.transport.Transport.submit_step`, the round deadline times its parts as gRPC
  deadline), the driver sleeps until a reply comes, takes every reply in by then (config order), then starts what
  the bound lets start; a step's ``end`` is its reply's arrival (seconds since the run's start).
- A batch enters the pool when the trust guard accepts it; its tag's version is, with ``security.signing``, the
  version the source signed in the batch (``RolloutBatch.version``), else the source's count of successful train
  reports. A tag whose version differs from the one issued with its plan (a train half failed, or a forged
  version) is refused ``version_mismatch``. With signing the trust guard also requires the batch to sign the
  plan sent to its org (digest and challenges, ``stale_plan``), and a train request carries the accepted batches
  verbatim (``source_batches``) with their tags, so the learner checks each end to end
  (:mod:`hacrl_fed.worker.late_signed`).
- A step trains only with its own batch of ``t - 1`` accepted (the worker trains on the round it generated); foreign
  batches not offered then wait for a later step or are refused when they leave the window, so every
  (learner, foreign batch) pair is taken or counted (``round/<learner>/refused/<reason>``), never dropped silently.
- A step whose reply came back with a failed part still advances the org's published round (it counts in ``floor``);
  an org the trust guard excludes stops stepping and its unused batches are refused ``source_excluded``.
- Coordinator-blind mode (``security.encrypt``): each train report's accusations name the (source, round) batch
  they are about and are judged against that batch's kept envelope and plan (:mod:`.async_accusations`); a proven
  one replaces that batch's capability input by the coordinator's own re-verified accuracy.
- **Deaths and rejoins** (:mod:`.async_liveness`, the rules of :mod:`.async_schedule`): a step whose *call* fails or
  times out (the reply is a ``timeout`` / ``unreachable`` error, :mod:`hacrl_fed.failures`), or on the virtual clock
  the org's ``clock.dies`` second, kills the org: its step in flight is lost (no batch, no update
  known), it stops counting in ``floor``, the others run on with the batches they have. A dead org is asked
  Health again every :data:`~.async_liveness.PROBE_S` seconds, off the round (on the wall clock on a thread of its
  own, never holding a step), or on the virtual clock comes back at its ``clock.rejoins`` second; it rejoins at the
  current round (it counts as having published ``floor``, plans ``floor + 1`` next, its first step only generates),
  at the version its worker's Health reports when plausible (:func:`~.async_liveness.rejoin_version`: a lost step
  may have trained at the worker, or the worker restarted).
  When no live org has a step in flight the run ends; a batch a dead learner never reached is ``learner_dead``.

- **An org's own number of rounds** (``federation.org_rounds``, default ``federation.rounds``): org ``x`` plans
  rounds ``1 … R_x`` and its last step trains ``R_x`` only; it evaluates and checkpoints at its own rounds
  (:meth:`~hacrl_fed.coordinator.loop.Coordinator.extras_due` with the org); an org that published its last round no
  longer counts in the bound (:meth:`AsyncDriver.bound`), as a dead one does. The run ends after the largest ``R_x``.

Round ``r``'s metrics (its batches, the train reports of round ``r``, its evaluations, the refusals made by the steps
that train ``r``) are logged once every org still stepping (live, not finished) has trained round ``r``, so a round
after an org's last holds only the orgs that ran it; the last round after the end.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from hacrl_fed import failures
from hacrl_fed.algorithm.capability_rounds import RoundCapabilities
from hacrl_fed.coordinator import round_metrics as rm
from hacrl_fed.coordinator.async_accusations import LateAccusations
from hacrl_fed.coordinator.async_liveness import Liveness, is_death, rejoin_version
from hacrl_fed.coordinator.async_schedule import HOLD, TAKE, BatchTag, Step, offer_verdict
from hacrl_fed.coordinator.async_state import ASYNC_KEY, OpenRound, driver_state, load_driver_state, quiescent
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.coordinator.rounds import StepOutcome, split_reply
from hacrl_fed.coordinator.state_file import write_state
from hacrl_fed.coordinator.virtual_clock import VirtualClock
from hacrl_fed.plan.screening import accepted_accuracy
from hacrl_fed.results import RoundResult
from hacrl_fed.security.freshness import parse_challenge
from hacrl_fed.types import Rollout, RolloutBatch, RoundPlan, StepRequest, TrainReport, TrainRequest

if TYPE_CHECKING:
    from pathlib import Path

    from hacrl_fed.config import RunConfig
    from hacrl_fed.coordinator.bookkeeping import RoundKeeper, RunBook
    from hacrl_fed.coordinator.transport import Transport
    from hacrl_fed.coordinator.trust import PoolGuard
    from hacrl_fed.types import EvalRequest, Prompt


class Coordinator(Protocol):
    """What the driver uses of :class:`~hacrl_fed.coordinator.loop.Coordinator`, which hands itself over in
    ``_run_async`` (a protocol, so this module does not import the loop that imports it)."""

    cfg: RunConfig
    org_order: list[str]
    transport: Transport
    book: RunBook
    guard: PoolGuard
    keeper: RoundKeeper
    challenges: dict[str, bytes]
    run_id: str
    state_path: Path
    async_snapshot: dict[str, Any] | None

    def state_dict(self) -> dict[str, Any]: ...

    def live_orgs(self) -> list[str]: ...

    def round_prompts(self, round: int) -> tuple[Prompt, ...]: ...

    def plan_for(
        self, round: int, org_id: str, prompts: tuple[Prompt, ...], challenges: Mapping[str, bytes] | None = None
    ) -> RoundPlan: ...

    def extras_due(self, round: int, org: str | None = None) -> tuple[bool, bool]: ...

    def eval_request(self, round: int, org: str) -> EvalRequest: ...

    def finish_round(self, result: RoundResult, start: float) -> None: ...


log = logging.getLogger(__name__)

EXCLUDED = "source_excluded"  # the driver's one refusal beyond async_schedule.REASONS


@dataclass
class _Flight:
    """A step in flight: its schedule entry, the request sent and the reply (taken at ``step.end``; on the wall
    clock ``future`` holds ``(reply, seconds)`` until it comes, and ``index`` is the step's place in ``steps``)."""

    step: Step
    request: StepRequest
    reply: Any
    seconds: float
    future: Future[tuple[Any, float]] | None = None
    index: int = 0
    lost: bool = False  # the virtual clock: the org dies before the step's end (the worker is not called)


@dataclass
class _Org:
    name: str
    duration: float
    rounds: int  # its last round (federation.org_rounds, default federation.rounds)
    busy: _Flight | None = None
    planned: int = 0  # the round its last step planned
    level: int = 0  # its last published round (counts in the floor)
    version: int = 0  # updates done (successful train reports; a rejoin may adopt the worker's own count)
    unsure: int = 0  # its steps lost since it last rejoined that carried a train request (the worker may have trained)
    own: BatchTag | None = None  # its last accepted batch, not trained on yet
    done: bool = False
    alive: bool = True  # False from its death to its rejoin
    idle_since: float = 0.0
    used: set[tuple[str, int]] = field(default_factory=set)
    seen: set[tuple[str, int]] = field(default_factory=set)


class AsyncDriver:
    """Runs ``coordinator``'s rounds asynchronously (module docstring); the coordinator keeps the trust guard, the
    run book, the logger and the state file. ``steps`` / ``published`` / ``refused`` / ``idle`` / ``finished``
    mirror :class:`~.async_schedule.Schedule`'s fields."""

    def __init__(self, coordinator: Coordinator):
        self.co, cfg = coordinator, coordinator.cfg
        fed = cfg.federation
        self.last, self.staleness, self.window = fed.last_round, fed.staleness, fed.effective_window
        order = coordinator.org_order
        # the wall clock on a transport that calls in parallel (gRPC); the virtual clock in process
        self.wall = not isinstance(coordinator.transport, InProcessTransport)
        clock = VirtualClock() if self.wall else coordinator.transport.clock  # type: ignore[attr-defined]
        clock.check(order, self.staleness)
        self.orgs = {o: _Org(o, clock.duration(o), fed.rounds_of(o)) for o in order}
        self.capabilities = RoundCapabilities.from_algorithm(cfg.algorithm)
        self.issued: dict[tuple[str, int], int] = {}
        self.pool: dict[BatchTag, tuple[Rollout, ...]] = {}  # accepted batches, publish order
        self.held: set[BatchTag] = set()  # the pooled batches whose rows are still kept (forget_spent)
        self.signing = cfg.security.signing
        self.envelopes: dict[BatchTag, RolloutBatch] = {}  # signing on: each accepted batch verbatim
        self.plans: dict[BatchTag, RoundPlan] = {}  # blind mode: the plan each accepted batch answered
        # blind mode: the receivers' accusations, each judged against the batch it names (.async_accusations)
        self.accusations = (
            LateAccusations(coordinator.guard, self.accused_batch, self.capabilities.revise)
            if cfg.security.encrypt
            else None
        )
        self.steps: list[Step] = []
        self.lost: list[Step] = []  # the steps lost to a death
        self.published: list[tuple[float, BatchTag]] = []
        self.refused: dict[str, Counter[str]] = {o: Counter() for o in order}
        self.idle = {o: 0.0 for o in order}
        self.finished: dict[str, float] = {}
        self.rounds_open: dict[int, OpenRound] = {}
        self.liveness = Liveness(coordinator.transport, fed.round_timeout_s, clock.dies, clock.rejoins, wall=self.wall)
        self.logged = 0  # the last round logged
        self.mark = time.perf_counter()  # when the last round was logged (time/round: the wall time since)
        self.checkpointed: dict[str, bool] = {}  # org -> whether its last completed step checkpointed its worker
        self.worker_round: dict[str, int] = {}  # org -> the round of its worker's newest checkpoint
        saved = getattr(coordinator, "resume_async", None)  # a resume: the state of a quiescent instant
        self.start_at = load_driver_state(self, saved) if saved else 0.0

    # -- the clock ---------------------------------------------------------------------------------------------

    def run(self) -> None:
        """Step every org until each has trained the last round (or stopped); log every round."""
        if self.co.book.round >= self.last:  # a resume of a run that finished
            return
        self.co.keeper.refresh_challenges(self.co.live_orgs(), self.co.transport)
        try:
            self.run_wall() if self.wall else self.run_virtual()
        finally:
            self.liveness.close()
        self.close()
        self.flush(final=True)  # each round's state is the last quiescent one's until every round is in
        self.co.async_snapshot = None
        write_state(self.co.state_path, self.co.state_dict())  # the finished run: nothing left to resume

    def run_virtual(self) -> None:
        """Events at one instant: completions (config order), deaths and rejoins, then the steps that may start."""
        now: float | None = self.start_at
        while now is not None:
            for org in self.orgs.values():  # completions at this instant, config order
                if org.busy is not None and not org.busy.lost and org.busy.step.end <= now:
                    self.complete(org, now)
            self.faults(now)
            self.forget_spent()
            self.flush(final=False)
            if quiescent(self):  # what a resume continues from (.async_state)
                self.save(now)
            self.start_ready(now)
            ends = [o.busy.step.end for o in self.orgs.values() if o.busy is not None and not o.busy.lost]
            now = min(ends + self.liveness.next_fault(now), default=None)

    def run_wall(self) -> None:
        """The wall clock: every step is sent without waiting; each reply is taken as it comes (those come by the
        same wake-up in config order), then the deaths and rejoins (a rejoin probe also wakes it up), then every org the
        bound lets step starts. Times: seconds since the start."""
        origin = time.monotonic()
        self.start_ready(0.0)
        while pending := [o.busy.future for o in self.orgs.values() if o.busy is not None and o.busy.future]:
            waiting: list[Future[Any]] = [*pending, *self.liveness.pending()]
            wait(waiting, timeout=self.liveness.wait_s(time.monotonic() - origin), return_when=FIRST_COMPLETED)
            now = time.monotonic() - origin
            for org in self.orgs.values():
                if org.busy is not None and org.busy.future is not None and org.busy.future.done():
                    self.complete(org, now)
            self.faults(now)
            self.forget_spent()
            self.flush(final=False)
            self.start_ready(now)

    def save(self, now: float) -> None:
        """Write the coordinator's state with the driver's (:func:`~.async_state.driver_state`) at ``now``."""
        co = self.co
        co.async_snapshot = None  # the coordinator's own parts as they are now
        co.async_snapshot = {**co.state_dict(), ASYNC_KEY: driver_state(self, now)}
        write_state(co.state_path, co.async_snapshot)

    def faults(self, now: float) -> None:
        """The deaths and rejoins at ``now`` (:class:`~.async_liveness.Liveness`): the virtual faults in time order,
        then the orgs whose rejoin probe answered, in config order."""
        dies, rejoins = self.liveness.events(now, [o.name for o in self.orgs.values() if not o.alive])
        for name in dies:
            if self.orgs[name].alive:
                self.die(self.orgs[name], now, "virtual")
        for name in rejoins:
            self.rejoin(self.orgs[name], now)

    def die(self, org: _Org, now: float, why: str) -> None:
        """``org`` is dead from ``now`` (``why``: the failed call's cause, or ``virtual``): its step in flight is
        lost, it stops counting in ``floor``."""
        if org.busy is not None:
            step = org.busy.step
            self.lost.append(step)
            org.unsure += step.own is not None
            rd = self.bucket(min(step.round, org.rounds))
            rd.metrics[f"async/{org.name}/lost_steps"] = rd.metrics.get(f"async/{org.name}/lost_steps", 0.0) + 1
            if why != "virtual" and step.round <= org.rounds:
                rd.failed[org.name] = why  # round/<org>/failure/<why>, as in lock-step rounds
            org.busy, org.planned = None, org.level
        org.alive = False
        self.liveness.died(org.name, now, probe=why != "virtual")
        log.warning("asynchronous rounds: org %s is dead at %.2f s (%s); the others run on", org.name, now, why)

    def rejoin(self, org: _Org, now: float) -> None:
        """``org`` is back at ``now``: it rejoins at the current round (counts as having published ``floor``)."""
        floor = self.floor()  # over the others: org is not counted yet
        org.alive, org.idle_since = True, now
        self.co.keeper.refresh_challenges(self.co.live_orgs(), self.co.transport)  # a restarted worker's new one
        if floor is not None and floor > org.level:
            org.level = org.planned = floor
        rd = self.bucket(min(org.planned + 1, self.last))
        rd.metrics[f"async/{org.name}/rejoined_at"] = float(org.planned + 1)
        log.warning("asynchronous rounds: org %s rejoins at %.2f s, planning round %d", org.name, now, org.planned + 1)
        # the worker's own count of its updates, when plausible (async_liveness.rejoin_version)
        org.version = rejoin_version(org.name, self.liveness.reply(org.name), org.version, org.unsure, rd.metrics)
        org.unsure = 0

    def alive(self, org: _Org) -> bool:
        return org.alive and org.name not in self.co.guard.excluded and org.name in self.co.transport.org_ids()

    def floor(self) -> int | None:
        """The lowest published round over the live orgs (None: none is live): where a rejoining org comes back."""
        levels = [o.level for o in self.orgs.values() if self.alive(o)]
        return min(levels) if levels else None

    def bound(self) -> int | None:
        """The floor of the staleness bound: over the live orgs with rounds left to publish (an org that published
        its last round stops counting, as a dead one does); None: no bound."""
        levels = [o.level for o in self.orgs.values() if self.alive(o) and o.level < o.rounds]
        return min(levels) if levels else None

    def start_ready(self, now: float) -> None:
        """Start every org the bound lets step at ``now`` (config order), as :mod:`.async_schedule` does."""
        for org in self.orgs.values():
            floor = self.bound()
            if self.alive(org) and org.busy is None and not org.done:
                if floor is None or org.planned + 1 <= floor + self.staleness + 1:  # the staleness bound
                    self.start(org, now)

    # -- one step ----------------------------------------------------------------------------------------------

    def start(self, org: _Org, now: float) -> None:
        """Build org's step planning ``t = planned + 1``, send it, and put it in flight until ``now + duration``."""
        t = org.planned + 1
        own = self.take(org, org.own, t) if org.own is not None else None
        foreign: tuple[BatchTag, ...] = ()
        if own is not None:  # a worker trains only on the round it generated: no own batch, no train request
            offered = [self.take(org, tag, t) for tag in self.pool if tag.source != org.name]
            foreign = tuple(tag for tag in offered if tag is not None)
        step = Step(org.name, now, now + org.duration, t, org.version, own, foreign)
        if t <= org.rounds:  # the version that will answer the plan
            self.issued[(org.name, t)] = org.version + (1 if own is not None else 0)
        request = self.request(org, t, own, foreign)
        timeout = self.co.cfg.federation.round_timeout_s * request.parts()
        if self.wall:  # its end is known when its reply comes
            future = self.co.transport.submit_step(org.name, request, timeout)
            flight = _Flight(step, request, None, 0.0, future, len(self.steps))
        elif self.liveness.dies_before(org.name, now, step.end):  # lost: the worker is not called
            flight = _Flight(step, request, None, 0.0, lost=True)
        else:
            t0 = time.perf_counter()
            reply = self.co.transport.step({org.name: request}, timeout)
            flight = _Flight(step, request, reply.get(org.name), time.perf_counter() - t0)
        self.idle[org.name] += now - org.idle_since
        org.busy, org.planned, org.own = flight, t, None
        self.steps.append(step)

    def take(self, org: _Org, tag: BatchTag, round: int) -> BatchTag | None:
        """``tag`` if org's step planning ``round`` takes it (marked used); a refusal is counted once, in the
        round the step trains (``round - 1``)."""
        key = (tag.source, tag.round)
        if key in org.seen:
            return None
        verdict = EXCLUDED if tag.source in self.co.guard.excluded else None
        verdict = verdict or offer_verdict(tag, round, self.window, org.used, self.issued)
        if verdict == HOLD:
            return None
        org.seen.add(key)
        if verdict != TAKE:
            self.refuse(org.name, max(round - 1, 1), verdict, own=tag.source == org.name)
            return None
        org.used.add(key)
        return tag

    def refuse(self, learner: str, round: int, reason: str, *, own: bool = False) -> None:
        what = "own_refused" if own else "refused"
        counts = self.bucket(round).refused.setdefault(f"{what}/{reason}", Counter())
        counts[learner] += 1
        if not own:
            self.refused[learner][reason] += 1

    def request(self, org: _Org, t: int, own: BatchTag | None, foreign: tuple[BatchTag, ...]) -> StepRequest:
        """The step message: round ``t - 1``'s train request (with its tags and per-round capability table), its
        evaluation and checkpoint when due, and round ``t``'s plan."""
        co, train = self.co, None
        if own is not None:
            rounds = sorted({own.round, *(tag.round for tag in foreign)})
            table = {r: self.capabilities.table(r, co.org_order) for r in rounds}
            signed = self.signing  # the batches verbatim, so the learner verifies them end to end
            train = TrainRequest(
                co.run_id,
                own.round,
                org.name,
                co.round_prompts(own.round),
                () if signed else tuple(r for tag in foreign for r in self.pool[tag]),
                dict(table[own.round]),
                tuple(self.envelopes[tag] for tag in foreign) if signed else (),
                round_capability=table,
                tags=tuple((tag.source, tag.round, tag.version) for tag in foreign),
                version=org.version,
            )
        evaluate, ckpt = co.extras_due(t - 1, org.name) if t > 1 else (False, False)
        challenges = {o: co.challenges[o] for o in co.live_orgs() if o in co.challenges}  # each org's latest
        plan = co.plan_for(t, org.name, co.round_prompts(t), challenges) if t <= org.rounds else None
        eval_request = co.eval_request(t - 1, org.name) if evaluate else None
        return StepRequest(train, plan, eval_request, t - 1 if ckpt else None)

    def complete(self, org: _Org, now: float) -> None:
        """Take org's reply at ``now``: its train report, evaluation and checkpoint of ``t - 1``, its batch of ``t``."""
        flight, org.busy, org.idle_since = org.busy, None, now
        assert flight is not None
        if flight.future is not None:  # the wall clock: the step ends now
            flight.reply, flight.seconds = flight.future.result()
            flight.step = self.steps[flight.index] = dataclasses.replace(flight.step, end=now)
        step, request = flight.step, flight.request
        self.co.book.note_call_time({org.name: flight.seconds})
        if is_death(flight.reply):  # the call failed or timed out: the org is dead, the step lost
            org.busy = flight
            self.die(org, now, failures.cause_of(flight.reply))
            return
        out = split_reply(request, flight.reply)
        if request.train is not None:
            self.take_train(org, request.train, out)
            self.bucket(request.train.round).metrics[f"async/{org.name}/trained_at_s"] = now
        self.take_extras(org.name, step.round - 1, request, out)
        if step.round > org.rounds:
            org.done, self.finished[org.name] = True, now
            return
        org.level = step.round  # published (or failed): counts in the floor either way
        assert request.plan is not None
        self.take_batch(org, request.plan, out, now, flight.seconds)

    def take_train(self, org: _Org, train: TrainRequest, out: StepOutcome) -> None:
        rd = self.bucket(train.round)
        reply = out.train
        if not isinstance(reply, TrainReport):
            why = failures.cause_of(reply) if isinstance(reply, BaseException) else "error"
            log.warning("round %d: org %s failed to train (%s): %s", train.round, org.name, why, reply)
            rm.train_metrics(org.name, why, {}, rd.metrics)
            return
        org.version += 1
        rd.metrics[f"async/{org.name}/version"] = float(org.version)
        challenge = parse_challenge(reply.challenge) if reply.challenge else None
        if challenge is not None:  # goes into its next plans (freshness, hacrl_fed.security.freshness)
            self.co.challenges[org.name] = challenge
        elif reply.challenge:
            rd.metrics[f"round/{org.name}/bad_challenge"] = 1.0
        rm.train_metrics(org.name, None, reply.metrics, rd.metrics)
        offered = len(train.foreign) + sum(len(b.rollouts) for b in train.source_batches)
        self.co.book.note_trained(org.name, train.round, offered)
        rd.trained.append(org.name)
        valid = self.co.guard.signed_reports(train.round, {org.name: reply}, rd.metrics)
        sources = sorted({tag[0] for tag in train.tags})
        self.co.guard.receiver_screened(train.round, valid, sources, rd.metrics)
        if self.accusations is not None and org.name in valid:
            self.accusations.take(train, valid[org.name], rd.metrics)

    def accused_batch(self, source: str, round: int, version: int) -> tuple[RolloutBatch, RoundPlan] | None:
        """Blind mode: the kept envelope of the batch tagged ``(source, round, version)`` and its plan."""
        tag = BatchTag(source, round, version)
        if tag not in self.envelopes or tag not in self.plans:
            return None
        return self.envelopes[tag], self.plans[tag]

    def take_extras(self, org: str, round: int, request: StepRequest, out: StepOutcome) -> None:
        """The evaluation and checkpoint parts of round ``round``."""
        rd = self.bucket(round) if round >= 1 else None
        if request.evaluate is not None and rd is not None:
            if rm.valid_accuracy(out.evaluation) is not None:
                rd.evals[org] = out.evaluation
            else:
                log.warning("round %d: org %s failed to evaluate: %s", round, org, out.evaluation)
        saved = request.checkpoint is not None and isinstance(out.checkpoint, str)
        self.checkpointed[org] = saved  # the worker's state after this step is on disk (.async_state.quiescent)
        if saved:
            self.worker_round[org] = round
        if request.checkpoint is not None and rd is not None:
            failed = [] if isinstance(out.checkpoint, str) else [org]
            rd.metrics["checkpoint/failed_orgs"] = rd.metrics.get("checkpoint/failed_orgs", 0.0) + len(failed)
            self.co.book.note_checkpoints(round, [org], failed)

    def take_batch(self, org: _Org, plan: RoundPlan, out: StepOutcome, now: float, seconds: float) -> None:
        """Screen org's batch of ``plan.round``; accepted, it enters the pool with its tag."""
        t, rd = plan.round, self.bucket(plan.round)
        rd.metrics[f"async/{org.name}/clock_s"] = now
        rd.metrics[f"async/{org.name}/idle_s"] = self.idle[org.name]
        rd.metrics[f"async/{org.name}/step_s"] = seconds
        batch = out.batch
        if isinstance(batch, Exception):
            rd.failed[org.name] = failures.cause_of(batch)
            log.warning("round %d: org %s skipped (%s): %s", t, org.name, rd.failed[org.name], batch)
            return
        ok = self.co.keeper.check_batch(t, org.name, batch, plan, rd.metrics)
        if not ok:
            rd.failed[org.name] = "excluded" if org.name in self.co.guard.excluded else "invalid"
            return
        tag = BatchTag(org.name, t, batch.version if self.signing else org.version)  # signed: the source's word
        self.pool[tag], org.own = tuple(ok), tag
        self.held.add(tag)
        if self.signing:
            self.envelopes[tag] = batch
        if self.accusations is not None:
            self.plans[tag] = plan
        self.published.append((now, tag))
        rd.accepted[org.name] = len(ok)
        acc = accepted_accuracy(ok)
        if acc is not None:
            rd.accuracy[org.name] = acc
            self.capabilities.record(t, {org.name: acc})

    def forget_spent(self) -> None:
        """Drop the rows, envelope and plan of every pooled batch no learner can take any more, so the
        coordinator's memory is bounded by the window, not the run's length; its tag stays in ``pool`` (an empty
        tuple), so a learner that never saw it still counts it (``beyond_window`` at its next step, or at the end).
        A batch is spent for org ``o`` when ``o`` is the source, is done, has seen it, or can no longer take it:
        ``o`` plans ``level + 1`` or later (a death or a rejoin never lowers ``level``), so a batch of a round below
        ``level + 1 - W`` is outside every window it will have. A batch in a step in flight is kept: its learner's
        report may still accuse it (blind mode)."""
        flying = {tag for o in self.orgs.values() if o.busy is not None for tag in o.busy.step.foreign}
        for tag in sorted(self.held - flying):
            if all(self.spent(o, tag) for o in self.orgs.values()):
                self.pool[tag] = ()
                self.envelopes.pop(tag, None)
                self.plans.pop(tag, None)
                self.held.discard(tag)

    def spent(self, org: _Org, tag: BatchTag) -> bool:
        """Whether ``org`` can never take ``tag`` again (:meth:`forget_spent`)."""
        seen = (tag.source, tag.round) in org.seen
        return org.done or tag.source == org.name or seen or tag.round < org.level + 1 - self.window

    # -- the end and the logs ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Count every accepted foreign batch a learner never reached (``learner_finished`` / ``learner_dead``), in
        the last round's metrics (an org with fewer rounds: its own last round may be logged already)."""
        for org in self.orgs.values():
            for tag in self.pool:
                if tag.source != org.name and (tag.source, tag.round) not in org.seen:
                    why = "learner_finished" if org.done else "learner_dead"
                    self.refuse(org.name, self.last, why)

    def bucket(self, round: int) -> OpenRound:
        return self.rounds_open.setdefault(round, OpenRound())

    def trained_through(self) -> int:
        """The last round every live org still stepping (not finished) has trained (its step planning the next one
        came back); rounds after an org's last one hold only the orgs that ran them."""
        live = [o for o in self.orgs.values() if self.alive(o) and not o.done]
        rounds = [o.planned - (1 if o.busy is not None else 0) - 1 for o in live]
        return min(rounds) if rounds else self.last

    def flush(self, *, final: bool) -> None:
        """Log every round whose parts are all in, in order (``final``: every round left)."""
        last = self.last if final else min(self.trained_through(), self.last - 1)
        while self.logged < last:
            self.logged += 1
            self.log_round(self.logged)

    def log_round(self, r: int) -> None:
        co, rd = self.co, self.rounds_open.pop(r, OpenRound())
        co.guard.new_round(r + 1)  # every report on round r is in: the guard forgets the batches before it
        if rd.evals:
            co.book.eval_history[r] = rm.eval_metrics(rd.evals, rd.metrics)
        rm.failure_metrics(rd.failed, rd.metrics)
        for key, per_learner in rd.refused.items():
            for learner, n in per_learner.items():
                rd.metrics[f"round/{learner}/{key}"] = float(n)
        co.book.note_replies(rd.accepted, bool(rd.accepted))
        table = self.capabilities.table(r, co.org_order)
        counts = (len(rd.accepted), len(rd.trained), not rd.accepted)
        start, self.mark = self.mark, time.perf_counter()
        rm.close_metrics(table, co.guard.metrics(co.org_order), counts, self.mark - start, {}, rd.metrics)
        failed = {org: rd.failed[org] for org in co.org_order if org in rd.failed}
        result = RoundResult(r, not rd.accepted, list(rd.accepted), rd.accuracy, rd.trained, rd.metrics, failed)
        co.finish_round(result, start)
