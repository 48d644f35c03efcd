"""Who is dead in asynchronous rounds and when a dead org comes back (docs/ALGORITHM.md "Asynchronous rounds").

The rules are :mod:`.async_schedule`'s (a dead org's step in flight is lost, it stops counting in ``floor``; one that
comes back rejoins at the current round); this module only says *when*:

- **Death**: :func:`is_death`, a step whose whole reply is an error caused by the call itself (``timeout`` or
  ``unreachable``, :func:`hacrl_fed.failures.cause_of`): the notion of a failed org of the lock-step loop, for the
  call rather than for one part (a part failing at the worker comes back inside a ``StepReply`` and is no death).
  On the virtual clock also ``federation.virtual_dies`` (fault injection: ``{org: virtual second}``).
- **Rejoin**: an org dead from a failed call is asked Health (deadline ``round_timeout_s``) :data:`PROBE_S`
  seconds after its death, then after each failed probe: the reconnect policy of the gRPC client, whose channel
  redials a lost worker at least that often. On the wall clock a probe runs on a thread of its own: the driver
  wakes up for it and never waits on it. On the virtual clock a probe is called at the first event at or after its
  time, and an org killed by ``virtual_dies`` comes back at its ``virtual_rejoins`` second only.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from hacrl_fed.failures import TIMEOUT, UNREACHABLE, cause_of

PROBE_S = 2.0  # = grpc.max_reconnect_backoff_ms of hacrl_fed.wire.grpc_client: the channel redials at least this often


def is_death(reply: Any) -> bool:
    """Whether a step's reply says the call itself failed or timed out (the org is dead)."""
    return isinstance(reply, BaseException) and cause_of(reply) in (TIMEOUT, UNREACHABLE)


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
        self.probes: dict[str, Future[bool]] = {}  # the wall clock: probes in flight
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
        return dies, rejoins + [org for org in dead if org not in rejoins and self.probed(org, now)]

    def probed(self, org: str, now: float) -> bool:
        """Whether ``org``'s probe answered by ``now``; sends the next one when due."""
        if org not in self.probe_at:
            return False  # a virtual death: back at its virtual_rejoins second only
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
        if probe.result():
            del self.probe_at[org]
            return True
        self.probe_at[org] = now + PROBE_S
        return False

    def health(self, org: str) -> bool:
        try:
            return isinstance(self.transport.health([org], self.timeout_s).get(org), Mapping)
        except Exception:
            return False

    def pending(self) -> list[Future[bool]]:
        return list(self.probes.values())

    def wait_s(self, now: float) -> float | None:
        """How long the wall clock may sleep before a probe is due (None: no probe waits to go out)."""
        due = [t for org, t in self.probe_at.items() if org not in self.probes]
        return max(0.0, min(due) - now) if due else None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
