"""Staleness-bounded asynchronous rounds on a virtual clock (docs/ARCHITECTURE.md "Asynchronous rounds").

A pure, deterministic event simulation: no I/O, no transport, no model. It states the rules the asynchronous
round driver (:mod:`.async_driver`, in process and over gRPC) follows and says, for given per-org step durations,
who steps when, which round each step plans, which batches each train request carries and which are refused, and
why. The driver's schedule on real replies is this one when every reply is accepted (tested), deaths and rejoins
included (the virtual clock's ``dies`` / ``rejoins``, :mod:`.virtual_clock`); the lock-step round loop (:mod:`.loop`) is
this schedule with ``K = 0`` (tested).

The rules (``K`` = ``staleness``, ``W`` = ``window``, default ``K + 1``):

- An org's **step** is today's fused step: train on its own last batch and the foreign batches its request
  carries (one update), then generate its batch for the round it plans. A step without its own batch (the first,
  the first after a rejoin, or its own batch refused) only generates: foreign batches wait for a later step (a
  worker trains on the round it generated). Its last step (the round after its own last round: ``org_rounds``, by
  default ``rounds``) only trains. A step takes the org's duration.
- Every batch carries a :class:`BatchTag`: its source, the round it answers and the source's **version** (updates
  done) that generated it. The coordinator records the tag of every plan it issues.
- **Staleness bound**: an org may plan round ``t`` only when every live org has published round ``t - K - 1``
  (``t <= floor + K + 1``, ``floor`` = the lowest published round over the live orgs that have rounds left to
  publish: an org that published its last round stops counting, as a dead one does, so an org with fewer rounds
  never holds back one with more; none left: no bound). ``K = 0`` is lock-step.
- **Window**: a step planning round ``t`` takes the batches of rounds ``t - W`` to ``t - 1`` it has not used
  (:func:`offer_verdict`); a batch of a later round waits for a later step; one of an earlier round is refused
  (``beyond_window``); a batch is used at most once per learner (``already_used``); a tag the coordinator never
  issued (``not_issued``) or whose version differs from the issued one (``version_mismatch``) is refused. At the
  end, a batch a learner never reached is counted ``learner_finished`` (or ``learner_dead``): every
  (learner, foreign batch) pair is either taken or counted, never silently dropped.
- **Faults**: an org that dies loses its step in flight and stops counting in ``floor`` (the others run on with the
  batches they have); one that comes back rejoins at the current round: it counts as having published ``floor``
  and plans ``floor + 1`` next.

Ties at one instant: completions first, then deaths and rejoins, then the steps that can start, in config order.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

REASONS = ("beyond_window", "already_used", "not_issued", "version_mismatch", "learner_finished", "learner_dead")
TAKE, HOLD = "take", "hold"


@dataclass(frozen=True, order=True)
class BatchTag:
    """What every batch carries: its ``source`` org, the ``round`` it answers, the source's ``version`` (updates
    done) that generated it."""

    source: str
    round: int
    version: int


@dataclass(frozen=True)
class Step:
    """One org's step: ``[start, end)`` on the virtual clock, the ``round`` it plans (``rounds + 1``: train only),
    its ``version`` before the step's update, the ``own`` batch and the ``foreign`` batches its request carries."""

    org: str
    start: float
    end: float
    round: int
    version: int
    own: BatchTag | None
    foreign: tuple[BatchTag, ...]

    def ages(self) -> tuple[int, ...]:
        """Per foreign batch: ``age = version - batch version`` (the learner's version before the update)."""
        return tuple(self.version - tag.version for tag in self.foreign)


@dataclass(frozen=True)
class ScheduleSpec:
    """``durations``: virtual seconds per step of each org (its order breaks ties); ``rounds``: the rounds each org
    plans at most; ``staleness`` ``K >= 0``; ``window`` ``W >= 1`` (None: ``K + 1``); ``dies`` / ``rejoins``: the
    time an org stops / comes back (a rejoin after its death); ``org_rounds``: an org's own number of rounds
    (default ``rounds``)."""

    durations: Mapping[str, float]
    rounds: int
    staleness: int = 0
    window: int | None = None
    dies: Mapping[str, float] = field(default_factory=dict)
    rejoins: Mapping[str, float] = field(default_factory=dict)
    org_rounds: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.durations or any(not (math.isfinite(d) and d > 0) for d in self.durations.values()):
            raise ValueError("durations: at least one org, every duration finite and > 0")
        if self.rounds < 1 or self.staleness < 0 or (self.window is not None and self.window < 1):
            raise ValueError(f"need rounds >= 1, staleness >= 0, window >= 1; got {self}")
        unknown = (set(self.dies) | set(self.rejoins) | set(self.org_rounds)) - set(self.durations)
        if unknown:
            raise ValueError(f"dies / rejoins / org_rounds name unknown orgs: {sorted(unknown)}")
        if any(n < 1 for n in self.org_rounds.values()):
            raise ValueError(f"org_rounds: every org's rounds >= 1, got {dict(self.org_rounds)}")
        if any(org not in self.dies or not self.rejoins[org] > self.dies[org] for org in self.rejoins):
            raise ValueError("an org rejoins only after it died (rejoins[org] > dies[org])")

    @property
    def effective_window(self) -> int:
        return self.staleness + 1 if self.window is None else self.window

    def rounds_of(self, org: str) -> int:
        """The rounds ``org`` plans at most."""
        return self.org_rounds.get(org, self.rounds)


def offer_verdict(
    tag: BatchTag,
    round: int,
    window: int,
    used: set[tuple[str, int]],
    issued: Mapping[tuple[str, int], int],
) -> str:
    """What a learner whose step plans ``round`` does with a batch tagged ``tag``: :data:`TAKE`, :data:`HOLD` (a
    round after ``round - 1``: a later step) or a refusal reason of :data:`REASONS`. ``used``: the (source, round)
    pairs it has used; ``issued``: the version of every plan the coordinator issued, by (source, round)."""
    key = (tag.source, tag.round)
    if key not in issued:
        return "not_issued"
    if issued[key] != tag.version:
        return "version_mismatch"
    if key in used:
        return "already_used"
    if tag.round > round - 1:
        return HOLD
    if tag.round < round - window:
        return "beyond_window"
    return TAKE


@dataclass
class _Org:
    name: str
    duration: float
    rounds: int  # its last round
    alive: bool = True
    busy: Step | None = None
    planned: int = 0  # the round its last step planned
    level: int = 0  # the round it counts at in the floor: its last published one (on rejoin: the floor)
    version: int = 0
    own: BatchTag | None = None  # its last published batch, not trained on yet
    done: bool = False
    idle_since: float = 0.0
    used: set[tuple[str, int]] = field(default_factory=set)
    seen: set[tuple[str, int]] = field(default_factory=set)  # foreign batches taken or refused


@dataclass
class Schedule:
    """The simulation's result: every step started, in start order; those of them lost to a death; every batch
    published (with its time); each learner's refusals by reason; each org's idle time (waiting on the bound, not
    counting the time it was dead) and finish time."""

    steps: list[Step] = field(default_factory=list)
    lost: list[Step] = field(default_factory=list)
    published: list[tuple[float, BatchTag]] = field(default_factory=list)
    refused: dict[str, Counter[str]] = field(default_factory=dict)  # foreign batches, per learner
    own_refused: dict[str, Counter[str]] = field(default_factory=dict)  # its own batches (after a rejoin)
    idle: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)


class _Simulation:
    def __init__(self, spec: ScheduleSpec):
        self.spec, self.window = spec, spec.effective_window
        self.orgs = {name: _Org(name, float(d), spec.rounds_of(name)) for name, d in spec.durations.items()}
        self.issued: dict[tuple[str, int], int] = {}
        self.out = Schedule(
            refused={o: Counter() for o in self.orgs},
            own_refused={o: Counter() for o in self.orgs},
            idle={o: 0.0 for o in self.orgs},
        )
        self.faults = sorted([(t, 0, o) for o, t in spec.dies.items()] + [(t, 1, o) for o, t in spec.rejoins.items()])

    def floor(self, without: str | None = None) -> int | None:
        levels = [o.level for o in self.orgs.values() if o.alive and o.name != without]
        return min(levels) if levels else None

    def bound(self) -> int | None:
        """The floor of the staleness bound: over the live orgs with rounds left to publish (None: no bound)."""
        levels = [o.level for o in self.orgs.values() if o.alive and o.level < o.rounds]
        return min(levels) if levels else None

    def next_time(self, now: float) -> float | None:
        times = [o.busy.end for o in self.orgs.values() if o.busy is not None]
        times += [t for t, _, _ in self.faults]  # those still to come (advance pops the past ones)
        return min(times) if times else None

    def advance(self, now: float) -> None:
        """Everything that happens at ``now``: completions, then deaths and rejoins."""
        for org in self.orgs.values():
            if org.busy is not None and org.busy.end <= now:
                self.complete(org, now)
        while self.faults and self.faults[0][0] <= now:
            _, kind, name = self.faults.pop(0)
            self.rejoin(self.orgs[name]) if kind else self.die(self.orgs[name])

    def complete(self, org: _Org, now: float) -> None:
        step, org.busy, org.idle_since = org.busy, None, now
        assert step is not None
        if step.own is not None:
            org.version += 1  # the step's update
        if step.round > org.rounds:
            org.done, self.out.finished[org.name] = True, now
            return
        tag = BatchTag(org.name, step.round, org.version)
        self.out.published.append((now, tag))
        org.level, org.own = step.round, tag

    def die(self, org: _Org) -> None:
        if org.busy is not None:  # the step in flight is lost: no batch, no update known
            self.out.lost.append(org.busy)
            org.busy, org.planned = None, org.level
        org.alive = False

    def rejoin(self, org: _Org) -> None:
        floor = self.floor(without=org.name)
        org.alive, org.idle_since = True, self.spec.rejoins[org.name]
        if floor is not None and floor > org.level:  # rejoins at the current round
            org.level = org.planned = floor

    def start_ready(self, now: float) -> None:
        """Start every org that may step at ``now`` (config order)."""
        for org in self.orgs.values():
            floor = self.bound()
            if org.alive and org.busy is None and not org.done:
                if floor is None or org.planned + 1 <= floor + self.spec.staleness + 1:  # the staleness bound
                    self.start(org, now)

    def start(self, org: _Org, now: float) -> None:
        t = org.planned + 1
        own = self.take(org, org.own, t) if org.own is not None else None
        taken: tuple[BatchTag, ...] = ()
        if own is not None:  # a worker trains only on the round it generated: foreign batches wait for a later step
            foreign = [self.take(org, tag, t) for _, tag in self.out.published if tag.source != org.name]
            taken = tuple(tag for tag in foreign if tag is not None)
        step = Step(org.name, now, now + org.duration, t, org.version, own, taken)
        if t <= org.rounds:  # the plan the coordinator issues, with the version that will answer it
            self.issued[(org.name, t)] = org.version + (1 if own is not None else 0)
        self.out.idle[org.name] += now - org.idle_since
        org.busy, org.planned, org.own = step, t, None
        self.out.steps.append(step)

    def take(self, org: _Org, tag: BatchTag, round: int) -> BatchTag | None:
        """``tag`` if ``org``'s step planning ``round`` takes it (marked used); refusals are counted once."""
        key = (tag.source, tag.round)
        if key in org.seen:
            return None
        verdict = offer_verdict(tag, round, self.window, org.used, self.issued)
        if verdict == HOLD:
            return None
        org.seen.add(key)
        if verdict != TAKE:
            (self.out.own_refused if tag.source == org.name else self.out.refused)[org.name][verdict] += 1
            return None
        org.used.add(key)
        return tag

    def close(self) -> Schedule:
        """Count every foreign batch a learner never reached (``learner_finished`` / ``learner_dead``)."""
        for org in self.orgs.values():
            for _, tag in self.out.published:
                if tag.source != org.name and (tag.source, tag.round) not in org.seen:
                    self.out.refused[org.name]["learner_finished" if org.alive else "learner_dead"] += 1
        return self.out


def simulate(spec: ScheduleSpec) -> Schedule:
    """Run the schedule of ``spec`` on the virtual clock until no org can step again (module docstring)."""
    sim = _Simulation(spec)
    now: float | None = 0.0
    while now is not None:
        sim.advance(now)
        sim.start_ready(now)
        now = sim.next_time(now)
    return sim.close()
