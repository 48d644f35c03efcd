"""Who is dead in asynchronous rounds and when a dead org comes back (docs/ALGORITHM.md "Asynchronous rounds").

The rules are :mod:`.async_schedule`'s (a dead org's step in flight is lost, it stops counting in ``floor``; one that
comes back rejoins at the current round); this module only says *when*:

- **Death**: :func:`is_death`, a step whose whole reply is an error caused by the call itself (``timeout`` or
  ``unreachable``, :func:`hacrl_fed.failures.cause_of`): the notion of a failed org of the lock-step loop, for the
  call rather than for one part (a part failing at the worker comes back inside a ``StepReply`` and is no death).
  On the virtual clock also the clock's ``dies`` (fault injection: ``{org: virtual second}``, :mod:`.virtual_clock`).
- **Rejoin**: an org dead from a failed call is asked Health (deadline ``round_timeout_s``) :data:`PROBE_S`
  seconds after its death, then after each failed probe: the reconnect policy of the gRPC client, whose channel
  redials a lost worker at least that often. On the wall clock a probe runs on a thread of its own: the driver
  wakes up for it and never waits on it. On the virtual clock a probe is called at the first event at or after its
  time, and an org killed by ``dies`` comes back at its ``rejoins`` second only (and is asked
  Health then, as a worker that comes back answers it). A reply saying the worker is busy (the gRPC server's
  ``busy``: a call still runs, as the step whose reply was lost may) is no answer yet.
- **Its version** (:func:`reported_version`): the Health reply of a rejoin carries the worker's own count of its
  updates (:data:`~hacrl_fed.worker.api.VERSION_KEY`, the version it signs into its batches); the driver adopts it
  when it is an integer in ``[0, its own count + the org's lost steps that carried a train request]`` (a lost step
  the worker did finish, or a worker restarted fresh or from a checkpoint), so the org's next batches are not
  refused ``version_mismatch``. The reply comes from the worker: anything else is refused, never trusted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from hacrl_fed.failures import TIMEOUT, UNREACHABLE, cause_of
from hacrl_fed.wire.operations import BUSY_KEY
from hacrl_fed.worker.api import VERSION_KEY

log = logging.getLogger(__name__)

MAX_DIGITS = 18  # a reported version longer than this is refused before int() (no huge-number parsing)
PROBE_S = 2.0  # = grpc.max_reconnect_backoff_ms of hacrl_fed.wire.grpc_client: the channel redials at least this often


def is_death(reply: Any) -> bool:
    """Whether a step's reply says the call itself failed or timed out (the org is dead)."""
    return isinstance(reply, BaseException) and cause_of(reply) in (TIMEOUT, UNREACHABLE)


def reported_version(info: Mapping[str, Any] | None, ceiling: int) -> int | None:
    """The update count a rejoining worker's Health ``info`` reports (None: it reports none). Raises ValueError,
    saying why, for anything but a decimal integer in ``[0, ceiling]`` (``ceiling``: the coordinator's count plus
    the org's lost steps that could have trained)."""
    raw = info.get(VERSION_KEY) if isinstance(info, Mapping) else None
    if raw is None:
        return None
    if not (isinstance(raw, str) and raw.isascii() and raw.isdecimal() and len(raw) <= MAX_DIGITS):
        raise ValueError(f"{VERSION_KEY} {str(raw)[:40]!r} is not a decimal integer of at most {MAX_DIGITS} digits")
    if int(raw) > ceiling:
        raise ValueError(f"{VERSION_KEY} {int(raw)} is over {ceiling} (its count plus its lost steps that trained)")
    return int(raw)


def rejoin_version(
    org: str, info: Mapping[str, Any] | None, version: int, unsure: int, metrics: dict[str, float]
) -> int:
    """The version a rejoining ``org`` steps on: the one its Health ``info`` reports when plausible (an integer in
    ``[0, version + unsure]``; ``version``: the coordinator's count of its updates, ``unsure``: its lost steps that
    carried a train request), logged ``async/<org>/version_adopted``; else ``version``, a bad report counted
    (``async/<org>/bad_version_report``) in ``metrics``, the rejoin round's record."""
    try:
        reported = reported_version(info, version + unsure)
    except ValueError as err:
        key = f"async/{org}/bad_version_report"
        metrics[key] = metrics.get(key, 0.0) + 1
        log.warning("asynchronous rounds: org %s keeps version %d: %s", org, version, err)
        return version
    if reported is None:
        return version
    if reported != version:
        log.warning("asynchronous rounds: org %s rejoins at its own version %d (counted %d)", org, reported, version)
    metrics[f"async/{org}/version_adopted"] = float(reported)
    return reported


class Liveness:
    """The virtual faults (``dies`` / ``rejoins``: ``{org: virtual second}``) and the rejoin probes of the orgs dead
    from a failed call, on ``transport``'s Health call; ``wall``: probes run on a thread of their own."""

    def __init__(
        self,
        transport: Any,
        timeout_s: float,
        dies: Mapping[str, float],
        rejoins: Mapping[str, float],
        *,
        wall: bool,
    ):
        self.transport, self.timeout_s, self.wall = transport, timeout_s, wall
        self.dies = dict(dies)
        self.faults = sorted([(t, 0, o) for o, t in dies.items()] + [(t, 1, o) for o, t in rejoins.items()])
        self.probe_at: dict[str, float] = {}  # org dead from a failed call -> when its next probe goes out
        self.probes: dict[str, Future[Mapping[str, Any] | None]] = {}  # the wall clock: probes in flight
        self.infos: dict[str, Mapping[str, Any]] = {}  # org back -> its Health reply, until the driver takes it
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rejoin-probe") if wall else None

    def dies_before(self, org: str, start: float, end: float) -> bool:
        """Whether ``org``'s virtual death falls inside its step ``(start, end)`` (the step is lost; a death at
        ``end`` comes after the step's completion, one at ``start`` before the step)."""
        died = self.dies.get(org)
        return died is not None and start < died < end

    def next_fault(self, now: float) -> list[float]:
        """The next virtual fault's time after ``now`` (none: ``[]``)."""
        return [t for t, _, _ in self.faults if t > now][:1]

    def died(self, org: str, now: float, *, probe: bool) -> None:
        """``org`` died at ``now``; ``probe``: from a failed call (it is probed for a rejoin)."""
        if probe:
            self.probe_at[org] = now + PROBE_S

    def events(self, now: float, dead: list[str]) -> tuple[list[str], list[str]]:
        """The orgs that die and those of ``dead`` that come back at ``now``: virtual faults in time order, then
        the probes that answered."""
        dies: list[str] = []
        rejoins: list[str] = []
        while self.faults and self.faults[0][0] <= now:
            _, kind, org = self.faults.pop(0)
            (rejoins if kind else dies).append(org)
        for org in rejoins:  # a virtual rejoin: asked Health like a worker that comes back
            self.answered(org, self.health(org))
        return dies, rejoins + [org for org in dead if org not in rejoins and self.probed(org, now)]

    def probed(self, org: str, now: float) -> bool:
        """Whether ``org``'s probe answered by ``now``; sends the next one when due."""
        if org not in self.probe_at:
            return False  # a virtual death: back at its clock's rejoins second only
        probe = self.probes.get(org)
        if probe is None and self.probe_at[org] <= now:
            if self.pool is None:
                probe = Future()
                probe.set_result(self.health(org))
            else:
                probe = self.probes[org] = self.pool.submit(self.health, org)
        if probe is None or not probe.done():
            return False
        self.probes.pop(org, None)
        if self.answered(org, probe.result()):
            del self.probe_at[org]
            return True
        self.probe_at[org] = now + PROBE_S
        return False

    def health(self, org: str) -> Mapping[str, Any] | None:
        """``org``'s Health reply (None: no answer, or the worker is still busy with a call, as with the step it
        lost: it is not back until that is over and its count of updates final; ``wire.operations.BUSY_KEY``)."""
        try:
            info = self.transport.health([org], self.timeout_s).get(org)
        except Exception:
            return None
        return info if isinstance(info, Mapping) and not info.get(BUSY_KEY) else None

    def answered(self, org: str, info: Mapping[str, Any] | None) -> bool:
        """Keep ``org``'s Health reply for :meth:`reply`; whether it answered."""
        if info is not None:
            self.infos[org] = info
        return info is not None

    def reply(self, org: str) -> Mapping[str, Any] | None:
        """The Health reply that brought ``org`` back (None: none), once."""
        return self.infos.pop(org, None)

    def pending(self) -> list[Future[Mapping[str, Any] | None]]:
        return list(self.probes.values())

    def wait_s(self, now: float) -> float | None:
        """How long the wall clock may sleep before a probe is due (None: no probe waits to go out)."""
        due = [t for org, t in self.probe_at.items() if org not in self.probes]
        return max(0.0, min(due) - now) if due else None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
