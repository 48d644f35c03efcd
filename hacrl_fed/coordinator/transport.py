"""The coordinator's view of the federation: one small interface, several transports.

A transport fans a request out to orgs and collects what comes back by a deadline. Per org the result is either
the reply dataclass or an ``Exception`` (timeout, connection error, remote error): the round loop decides what a
missing org means (skip it, check ``min_orgs``), never the transport.

The operations are those a round needs, from the one table :data:`hacrl_fed.wire.operations.OPERATIONS`: ``step``
(every message of a round: a train request, an evaluation, a checkpoint and a plan, each optional), ``evaluate``
and ``checkpoint`` (the evaluation before round 1, direct use) and ``health``. Every transport counts the messages
it sends, per operation and org, in :attr:`Transport.messages_sent`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from hacrl_fed.failures import NoWorker
from hacrl_fed.types import EvalReport, EvalRequest, StepReply, StepRequest

R = TypeVar("R")
Replies = dict[str, "R | Exception"]


class TransportTimeout(TimeoutError):
    """The org did not answer before the deadline."""


class Transport(ABC):
    @abstractmethod
    def org_ids(self) -> list[str]:
        """Org ids currently reachable (may change between rounds)."""

    @abstractmethod
    def evaluate(self, requests: Mapping[str, EvalRequest], timeout_s: float) -> dict[str, EvalReport | Exception]: ...

    @abstractmethod
    def checkpoint(self, org_ids: list[str], round: int, timeout_s: float) -> dict[str, str | Exception]: ...

    @abstractmethod
    def step(self, requests: Mapping[str, StepRequest], timeout_s: float) -> dict[str, StepReply | Exception]: ...

    def submit_step(self, org: str, request: StepRequest, timeout_s: float) -> Future[tuple[Any, float]]:
        """One org's step message without waiting for it (asynchronous rounds on the wall clock): a future of
        ``(reply | Exception, seconds)``. This default calls :meth:`step` at once and returns a done future; a
        transport that calls in parallel (gRPC) overrides it."""
        start = time.perf_counter()
        reply = self.step({org: request}, timeout_s).get(org, NoWorker(f"no reply from {org!r}"))
        done: Future[tuple[Any, float]] = Future()
        done.set_result((reply, time.perf_counter() - start))
        return done

    def health(self, org_ids: list[str], timeout_s: float) -> dict[str, dict[str, str] | Exception]:
        """Health replies of ``org_ids`` (``{org: info | Exception}``); a transport without the call answers
        ``NotImplementedError`` per org. Implementations record what they get (:meth:`note_health`)."""
        return {org: NotImplementedError(f"{type(self).__name__} has no health call") for org in org_ids}

    def note_health(self, replies: Mapping[str, object]) -> None:
        """Keep the health infos among ``replies`` (``{org: info | Exception}``) for :meth:`take_health`: the
        coordinator reads each org's latest challenge from them (:mod:`hacrl_fed.security.freshness`)."""
        seen = self.__dict__.setdefault("_health_seen", {})
        seen.update({org: dict(info) for org, info in replies.items() if isinstance(info, Mapping)})

    def take_health(self) -> dict[str, dict[str, str]]:
        """The health infos recorded since the last call, ``{org: info}`` (then forgotten)."""
        return self.__dict__.pop("_health_seen", {})

    @property
    def messages_sent(self) -> Counter[tuple[str, str]]:
        """``{(operation, org): messages sent}`` over this transport's life (every transport counts its own)."""
        return self.__dict__.setdefault("_messages_sent", Counter())

    def count_messages(self, operation: str, orgs: Iterable[str]) -> None:
        """Count one ``operation`` message to each of ``orgs`` (called by the fan-outs, once per message sent)."""
        self.messages_sent.update((operation, org) for org in orgs)

    def close(self) -> None:  # noqa: B027 - optional hook: a transport with nothing to release keeps this no-op
        """Release connections / stop processes this transport started."""
