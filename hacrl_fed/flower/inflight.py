"""Messages in flight over a Flower ``Grid``, each pushed on its own and its reply pulled as it comes.

Asynchronous rounds (``federation.staleness >= 1``) send each org's next step as soon as the staleness bound lets it
(:meth:`hacrl_fed.flower.transport.FlowerTransport.submit_step`): :class:`InFlight` pushes that one message at once
(``grid.push_messages``) and hands back a future; one thread pulls the replies of every message in flight
(``grid.pull_messages`` with their ids) every ``poll_s`` seconds and settles each future with ``(reply Message |
Exception, seconds from push to pull)``. A message the SuperLink refused settles at once with
:class:`~hacrl_fed.flower.transport.OrgUnavailable`; one with no reply by its deadline with
:class:`~hacrl_fed.coordinator.transport.TransportTimeout` (its id is no longer pulled, so a late reply is never
taken). A pulled reply that answers no message in flight, or carries content from another node than the one
addressed, is dropped and counted in ``ignored`` (:data:`~hacrl_fed.flower.transport.IGNORED_REASONS`).

:class:`LockedGrid` puts one lock around every call to the grid: the pulling thread, the driver's pushes and the
rejoin probes' health queries (:mod:`hacrl_fed.coordinator.async_liveness`, a thread of their own) share it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from flwr.app import Message

from hacrl_fed.coordinator.transport import TransportTimeout

log = logging.getLogger(__name__)

Settle = Callable[[Any, float], Any]  # (reply Message | Exception, seconds) -> the future's reply value


class LockedGrid:
    """``grid`` with one lock around each of its calls (``get_node_ids``, ``push_messages``, ``pull_messages``)."""

    def __init__(self, grid: Any) -> None:
        self.inner, self.lock = grid, threading.RLock()

    def get_node_ids(self) -> Any:
        with self.lock:
            return self.inner.get_node_ids()

    def push_messages(self, messages: Any) -> Any:
        with self.lock:
            return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Any) -> Any:
        with self.lock:
            return self.inner.pull_messages(message_ids)


@dataclass
class _Pending:
    node: int
    start: float  # time.monotonic() of the push
    deadline: float
    settle: Settle
    future: Future[tuple[Any, float]]


class InFlight:
    """Single messages pushed over ``grid`` and their replies pulled every ``poll_s`` seconds by one thread
    (started on the first :meth:`push`, stopped by :meth:`close`)."""

    def __init__(self, grid: Any, *, poll_s: float, ignored: Counter[str], unavailable: type[Exception]) -> None:
        self.grid, self.poll_s, self.ignored, self.unavailable = grid, poll_s, ignored, unavailable
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def push(self, node: int, message: Message, timeout_s: float, settle: Settle) -> Future[tuple[Any, float]]:
        """Push ``message`` to ``node`` now; a future of ``(settle(reply | Exception, seconds), seconds)``."""
        future: Future[tuple[Any, float]] = Future()
        start = time.monotonic()
        pushed = set(filter(None, self.grid.push_messages([message])))
        key = message.metadata.message_id
        if not key or key not in pushed:
            why = self.unavailable(f"the SuperLink refused the {message.metadata.message_type} message to node {node}")
            future.set_result((settle(why, 0.0), 0.0))
            return future
        with self._lock:
            self._pending[key] = _Pending(node, start, start + timeout_s, settle, future)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flower-inflight", daemon=True)
                self._thread.start()
        return future

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.pull_once()
            except Exception:  # a failed pull (the SuperLink restarting) is retried at the next poll
                log.exception("pulling the replies of the messages in flight failed; retrying")

    def pull_once(self) -> None:
        """Pull the replies of every message in flight, settle them, then time out those past their deadline."""
        with self._lock:
            ids = list(self._pending)
        replies = list(self.grid.pull_messages(ids)) if ids else []
        now = time.monotonic()
        skipped: Counter[str] = Counter()
        for reply in replies:
            key = getattr(reply.metadata, "reply_to_message_id", "")
            with self._lock:
                item = self._pending.get(key)
                if item is not None and (reply.metadata.src_node_id == item.node or reply.has_error()):
                    del self._pending[key]
                else:
                    skipped["unknown" if item is None else "wrong_node"] += 1
                    continue
            item.future.set_result((item.settle(reply, now - item.start), now - item.start))
        with self._lock:
            late = {key: item for key, item in self._pending.items() if now >= item.deadline}
            for key in late:
                del self._pending[key]
        for item in late.values():
            timeout = now - item.start
            why = TransportTimeout(f"node {item.node}: no reply within {item.deadline - item.start:g} s")
            item.future.set_result((item.settle(why, timeout), timeout))
        if skipped:
            log.warning("messages in flight: ignored pulled replies %s", dict(skipped))
            self.ignored.update(skipped)

    def close(self) -> None:
        """Stop pulling; the messages still in flight settle as :class:`TransportTimeout` (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        with self._lock:
            left, self._pending = self._pending, {}
        for item in left.values():
            if not item.future.done():
                item.future.set_result((item.settle(TransportTimeout("the transport closed"), 0.0), 0.0))
