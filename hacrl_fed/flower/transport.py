"""``FlowerTransport``: the coordinator's :class:`~hacrl_fed.coordinator.transport.Transport` over a Flower ``Grid``.

One Flower message per org and call (types and record layout in :mod:`hacrl_fed.flower.records`), pushed with
``grid.push_messages`` and collected with ``grid.pull_messages`` until every reply arrived or ``timeout_s``
passed, all in :func:`exchange`. Polling starts at 50 ms and backs off to ``max_poll_s`` (default 0.1 s, the run
config's ``reply-poll``): ``grid.send_and_receive`` polls the deployment SuperLink only every 3 s, which would add
up to 3 s to every phase of every round (with a 1 s cap, simulated phases ended on the backoff schedule, up to
~0.9 s late). Replies are matched to requests by ``reply_to_message_id``; a reply to no message of the call, a
second reply to one, or a content reply from another node than the one addressed is ignored and counted
(:class:`FlowerTransport`'s ``ignored_replies``). Per org the result is

* the decoded reply (checked field by field by :mod:`hacrl_fed.wire.codec`);
* :class:`~hacrl_fed.coordinator.transport.TransportTimeout` when no reply came by the deadline;
* :class:`FlowerRemoteError` (code, reason) when the reply is a Flower error (the ClientApp's worker failed,
  the node is unavailable, the message expired);
* :class:`OrgUnavailable` when no connected node serves that org, or the SuperLink refused the message;
* the ``RecordError`` / ``WireError`` of a malformed reply.

Every message carries ``ttl = timeout_s + ttl_grace_s``, so a node that comes back late does not run stale
work. ``last_call_bytes`` (``{org: request + reply payload bytes}``, successful calls only) and
``last_call_seconds`` (``{org: seconds until its reply was pulled}``; this includes queueing: in simulation the
orgs share one ClientApp actor and run one after another) describe the latest call.

Node -> org: :func:`discover_orgs` sends ``query.health`` to every connected node and reads the org id from the
reply (the ClientApp answers with its own org, see :mod:`hacrl_fed.flower.node`). :meth:`FlowerTransport.org_ids`
repeats that for nodes that joined since, and forgets nodes that left.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message

from hacrl_fed import failures
from hacrl_fed.coordinator.transport import Transport, TransportTimeout
from hacrl_fed.flower import records
from hacrl_fed.flower.inflight import InFlight, LockedGrid
from hacrl_fed.types import EvalReport, EvalRequest, StepReply, StepRequest
from hacrl_fed.wire import codec
from hacrl_fed.wire import operations as ops
from hacrl_fed.wire.operations import Operation

log = logging.getLogger(__name__)

FIRST_POLL_S = 0.05
POLL_BACKOFF = 1.5
MAX_POLL_S = 0.1  # a reply waits at most this long to be noticed; one cheap pull per 0.1 s in steady state
IGNORED_REASONS = ("unknown", "duplicate", "wrong_node")  # why exchange() ignored a pulled reply


NODE_UNAVAILABLE = 5  # flwr.common.constant.ErrorCode.NODE_UNAVAILABLE


class FlowerRemoteError(RuntimeError):
    """A Flower error reply from ``source`` ("org 'acme'", "node 42"): ``code`` (flwr ErrorCode), ``reason``.

    ``failure_cause`` (:mod:`hacrl_fed.failures`): the cause the ClientApp put in front of its reason, else
    ``unreachable`` for NODE_UNAVAILABLE, else ``error``."""

    def __init__(self, source: str, code: int, reason: str | None) -> None:
        super().__init__(f"{source} replied with Flower error {code}: {reason or '(no reason)'}")
        self.source, self.code, self.reason = source, code, reason
        self.failure_cause = failures.parse(reason) or (
            failures.UNREACHABLE if code == NODE_UNAVAILABLE else failures.ERROR
        )


class OrgUnavailable(ConnectionError):
    """No connected Flower node serves the org (or the SuperLink refused the message)."""


class DiscoveryError(RuntimeError):
    """Node -> org discovery failed (too few orgs by the deadline, or two nodes claiming one org)."""


def exchange(
    grid: Any,
    op: Operation,
    contents: Mapping[int, Any],
    timeout_s: float,
    *,
    group_id: str = "",
    ttl_grace_s: float = 30.0,
    max_poll_s: float = MAX_POLL_S,
    done: Callable[[dict[int, tuple[Any, float]]], bool] | None = None,
    ignored: Counter[str] | None = None,
    clock: Callable[[], float] | None = None,
    sleep: Callable[[float], None] | None = None,
) -> dict[int, tuple[Any, float]]:
    """Send one ``op`` message per node (``{node_id: RecordDict}``) and collect replies until ``timeout_s``.

    Returns ``{node_id: (reply Message | Exception, seconds until pulled)}`` for every node in ``contents``:
    :class:`TransportTimeout` for missing replies (a reply the SuperLink gets after the deadline is never pulled),
    :class:`OrgUnavailable` for messages the SuperLink refused. ``done(replies so far)`` returning True stops
    waiting early (the rest then count as timed out). Pulls happen after 50 ms, then 1.5x longer waits up to
    ``max_poll_s``, and once more at the deadline. A pulled reply that answers no message of this call
    (``unknown``), answers one already answered (``duplicate``), or carries content from another node than the
    one addressed (``wrong_node``; Flower's own error replies come from the SuperLink) is dropped and counted in
    ``ignored``. ``clock`` / ``sleep`` are injectable for tests (default: the module's ``time``, looked up per call).
    """
    clock = clock or time.monotonic
    sleep = sleep or time.sleep
    start = clock()
    out, waiting = _push(grid, op, contents, group_id, timeout_s + ttl_grace_s)
    answered: dict[str, int] = {}
    skipped: Counter[str] = Counter()
    poll = min(FIRST_POLL_S, max_poll_s)
    while waiting:
        for reply in grid.pull_messages(list(waiting)):
            why = _mismatch(reply, waiting, answered)
            if why:
                skipped[why] += 1
                continue
            key = reply.metadata.reply_to_message_id
            node = answered[key] = waiting.pop(key)
            out[node] = (reply, clock() - start)
        left = start + timeout_s - clock()
        if not waiting or left <= 0 or (done is not None and done(out)):
            break
        sleep(min(poll, left))
        poll = min(poll * POLL_BACKOFF, max_poll_s)
    for node in waiting.values():
        out[node] = (TransportTimeout(f"node {node}: no reply to {op.message_type} within {timeout_s:g} s"), timeout_s)
    if skipped:
        log.warning("%s: ignored pulled replies %s", op.message_type, dict(skipped))
        if ignored is not None:
            ignored.update(skipped)
    return out


def _push(
    grid: Any, op: Operation, contents: Mapping[int, Any], group_id: str, ttl: float
) -> tuple[dict[int, tuple[Any, float]], dict[str, int]]:
    """Push one ``op`` message per node; ``({node: (OrgUnavailable, 0.0)}`` for messages the SuperLink refused,
    ``{message id: node}`` of the pushed ones)."""
    messages = {
        node: Message(content, dst_node_id=node, message_type=op.message_type, group_id=group_id, ttl=ttl)
        for node, content in contents.items()
    }
    pushed = set(filter(None, grid.push_messages(list(messages.values())))) if messages else set()
    out: dict[int, tuple[Any, float]] = {}
    waiting: dict[str, int] = {}
    for node, msg in messages.items():
        if msg.metadata.message_id and msg.metadata.message_id in pushed:
            waiting[msg.metadata.message_id] = node
        else:
            out[node] = (OrgUnavailable(f"the SuperLink refused the {op.message_type} message to node {node}"), 0.0)
    return out, waiting


def _mismatch(reply: Any, waiting: Mapping[str, int], answered: Mapping[str, int]) -> str:
    """Why a pulled ``reply`` is not one :func:`exchange` waits for (one of :data:`IGNORED_REASONS`), or ""."""
    key = getattr(reply.metadata, "reply_to_message_id", "")
    if key in answered:
        return "duplicate"
    if key not in waiting:
        return "unknown"
    if reply.metadata.src_node_id != waiting[key] and not reply.has_error():
        return "wrong_node"
    return ""


def decode_reply(op: Operation, source: str, reply: Any, limits: codec.WireLimits = codec.DEFAULT_LIMITS) -> Any:
    """A pulled reply (or the exception standing for it) -> decoded value or exception (never raises)."""
    if isinstance(reply, Exception):
        return reply
    if reply.has_error():
        return FlowerRemoteError(source, reply.error.code, reply.error.reason)
    try:
        return records.unpack(reply.content, op.reply_kind, limits=limits)
    except Exception as err:
        return err


def query_health(
    grid: Any, node_ids: Iterable[int], timeout_s: float, **kw: Any
) -> dict[int, dict[str, str] | Exception]:
    """``query.health`` to every node: ``{node_id: health info (with "org_id") | Exception}``."""
    contents = {node: records.pack(codec.health_request()) for node in node_ids}
    replies = exchange(grid, ops.HEALTH, contents, timeout_s, group_id="health", **kw)
    return {node: decode_reply(ops.HEALTH, f"node {node}", reply) for node, (reply, _) in replies.items()}


@dataclass
class Assignment:
    """Health replies sorted out: ``new`` ``{node: org}``; rejected nodes by cause, ``{node: reason}``."""

    new: dict[int, str] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)  # the query failed or timed out: ask again later
    unknown: dict[int, str] = field(default_factory=dict)  # serves an org that is not configured
    duplicate: dict[int, str] = field(default_factory=dict)  # claims an org another node already serves


def assign_orgs(
    infos: Mapping[int, dict[str, str] | Exception], expected: Iterable[str], known: Mapping[int, str] | None = None
) -> Assignment:
    """Health replies (``{node: info | Exception}``) -> :class:`Assignment`.

    The first claim of an org wins: orgs in ``known`` first, then nodes in increasing id order.
    """
    expected = set(expected)
    taken = set((known or {}).values())
    out = Assignment()
    for node in sorted(infos):
        info = infos[node]
        if isinstance(info, Exception):
            out.failed[node] = f"health query failed: {info}"
            continue
        org = info.get("org_id", "")
        if org not in expected:
            out.unknown[node] = f"serves org {org!r}, not one of the configured {sorted(expected)}"
        elif org in taken:
            out.duplicate[node] = f"claims org {org!r}, already served by another node"
        else:
            out.new[node] = org
            taken.add(org)
    return out


def _orgs_answered(replies: Mapping[int, tuple[Any, float]]) -> set[str]:
    infos = (decode_reply(ops.HEALTH, "", reply) for reply, _ in replies.values())
    return {info.get("org_id", "") for info in infos if isinstance(info, dict)}


def discover_orgs(
    grid: Any,
    expected: list[str],
    timeout_s: float,
    *,
    min_orgs: int | None = None,
    poll_s: float = 1.0,
    query_timeout_s: float = 120.0,
    max_poll_s: float = MAX_POLL_S,
) -> dict[int, str]:
    """Wait (at most ``timeout_s``) until every ``expected`` org has a connected node; return ``{node: org}``.

    New nodes are asked for their org with ``query.health`` (waiting at most ``query_timeout_s``, less once every
    expected org answered: in simulation the first query also builds the in-process workers); nodes whose
    query failed are asked again on the next poll. At the deadline, returns
    what was found if it covers ``min_orgs`` (default: all) orgs, else raises :class:`DiscoveryError` naming
    the missing orgs and the rejected nodes. Two nodes claiming the same org raise (a misconfigured
    ``--node-config``).
    """
    need = len(expected) if min_orgs is None else min_orgs
    deadline = time.monotonic() + timeout_s
    found: dict[int, str] = {}
    unknown: dict[int, str] = {}
    failed: dict[int, str] = {}
    while True:
        fresh = [n for n in grid.get_node_ids() if n not in found and n not in unknown]
        left = deadline - time.monotonic()
        if fresh and left > 0:
            done = lambda replies: (set(found.values()) | _orgs_answered(replies)) >= set(expected)  # noqa: E731
            infos = query_health(grid, fresh, min(left, query_timeout_s), max_poll_s=max_poll_s, done=done)
            got = assign_orgs(infos, expected, found)
            if got.duplicate:
                raise DiscoveryError(f"two Flower nodes claim the same org: {got.duplicate} (orgs found: {found})")
            found.update(got.new)
            unknown.update(got.unknown)
            failed = {**{n: r for n, r in failed.items() if n not in got.new}, **got.failed}
            for node, why in {**got.unknown, **got.failed}.items():
                log.warning("Flower node %s: %s", node, why)
        if set(found.values()) >= set(expected) or time.monotonic() >= deadline:
            break
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))
    missing = sorted(set(expected) - set(found.values()))
    if not missing:
        return found
    if len(found) >= need:
        log.warning("starting without orgs %s: no node answered for them within %g s", missing, timeout_s)
        return found
    raise DiscoveryError(
        f"only {len(found)} of {len(expected)} orgs connected within {timeout_s:g} s "
        f"(need {need}); missing {missing}; rejected nodes: {({**unknown, **failed}) or 'none'}"
    )


class FlowerTransport(Transport):
    """Transport over a Flower ``grid`` whose nodes serve the orgs in ``org_by_node`` (``{node_id: org_id}``).

    ``expected_orgs`` (default: the orgs of ``org_by_node``) fixes which orgs may join later and the order of
    :meth:`org_ids`; ``rejoin_timeout_s`` bounds the health query sent to nodes that connect mid-run, and a node
    whose query failed is asked again only after ``retry_failed_s``. ``max_poll_s``: the longest wait between two
    pulls of replies (:func:`exchange`); ``ignored_replies`` counts, by reason, the pulled replies it dropped.
    Every grid call goes through one lock (:class:`~hacrl_fed.flower.inflight.LockedGrid`): asynchronous rounds
    pull the replies of the steps in flight on a thread (:meth:`submit_step`) while rejoin probes query health.
    """

    def __init__(
        self,
        grid: Any,
        org_by_node: Mapping[int, str],
        *,
        expected_orgs: Iterable[str] | None = None,
        ttl_grace_s: float = 30.0,
        max_poll_s: float = MAX_POLL_S,
        rejoin_timeout_s: float = 30.0,
        retry_failed_s: float = 60.0,
        limits: codec.WireLimits = codec.DEFAULT_LIMITS,
    ) -> None:
        self.grid = grid if isinstance(grid, LockedGrid) else LockedGrid(grid)
        self._org_by_node = dict(org_by_node)
        self.expected_orgs = list(expected_orgs) if expected_orgs is not None else list(self._org_by_node.values())
        self._unknown: dict[int, str] = {}  # nodes serving an org that is not configured: not asked again
        self._duplicate: dict[int, str] = {}  # nodes claiming an org already served: asked again when one leaves
        self._failed: dict[int, float] = {}  # node -> time.monotonic() of its last failed health query
        self.ttl_grace_s, self.max_poll_s, self.rejoin_timeout_s = ttl_grace_s, max_poll_s, rejoin_timeout_s
        self.retry_failed_s = retry_failed_s
        self.limits = limits
        self.last_call_bytes: dict[str, int] = {}
        self.last_call_seconds: dict[str, float] = {}
        self.ignored_replies: Counter[str] = Counter()  # pulled replies exchange() dropped, by reason
        self.inflight = InFlight(self.grid, poll_s=max_poll_s, ignored=self.ignored_replies, unavailable=OrgUnavailable)

    @property
    def org_by_node(self) -> dict[int, str]:
        return dict(self._org_by_node)

    def refresh(self) -> None:
        """Forget nodes that left; ask nodes that joined which org they serve."""
        connected = set(self.grid.get_node_ids())
        for node in [n for n in self._org_by_node if n not in connected]:
            log.warning("Flower node %s (org %s) disconnected", node, self._org_by_node.pop(node))
            self._duplicate.clear()  # a spare node of that org may take over
        self._unknown = {n: why for n, why in self._unknown.items() if n in connected}
        self._duplicate = {n: why for n, why in self._duplicate.items() if n in connected}
        now = time.monotonic()
        self._failed = {n: t for n, t in self._failed.items() if n in connected and now - t < self.retry_failed_s}
        fresh = sorted(
            connected - set(self._org_by_node) - set(self._unknown) - set(self._duplicate) - set(self._failed)
        )
        if not fresh:
            return
        infos = query_health(
            self.grid, fresh, self.rejoin_timeout_s, max_poll_s=self.max_poll_s, ignored=self.ignored_replies
        )
        got = assign_orgs(infos, self.expected_orgs, self._org_by_node)
        for node, org in got.new.items():
            log.info("Flower node %s joined as org %s", node, org)
        self._org_by_node.update(got.new)
        self.note_health({org: infos[node] for node, org in got.new.items()})  # a joiner's challenge (freshness)
        self._unknown.update(got.unknown)
        self._duplicate.update(got.duplicate)
        self._failed.update({node: time.monotonic() for node in got.failed})
        for node, why in {**got.unknown, **got.duplicate, **got.failed}.items():
            log.warning("Flower node %s: %s", node, why)

    def org_ids(self) -> list[str]:
        self.refresh()
        served = set(self._org_by_node.values())
        return [org for org in self.expected_orgs if org in served]

    def _call(self, op: Operation, requests: Mapping[str, Any], timeout_s: float, group_id: str) -> dict[str, Any]:
        node_of = {org: node for node, org in self._org_by_node.items()}
        out: dict[str, Any] = {}
        contents: dict[int, Any] = {}
        sent_bytes: dict[str, int] = {}
        for org, request in requests.items():
            if org not in node_of:
                out[org] = OrgUnavailable(f"org {org!r} has no connected Flower node")
                continue
            try:
                contents[node_of[org]] = records.pack(request)
            except Exception as err:  # an unencodable request is that org's failure, not the round's
                out[org] = err
                continue
            sent_bytes[org] = records.payload_size(contents[node_of[org]])
        self.count_messages(op.name, sent_bytes)
        replies = exchange(
            self.grid,
            op,
            contents,
            timeout_s,
            group_id=group_id,
            ttl_grace_s=self.ttl_grace_s,
            max_poll_s=self.max_poll_s,
            ignored=self.ignored_replies,
        )
        self.last_call_bytes, self.last_call_seconds = {}, {}
        for node, (reply, seconds) in replies.items():
            org = self._org_by_node[node]
            out[org] = decode_reply(op, f"org {org!r}", reply, self.limits)
            self.last_call_seconds[org] = seconds
            if not isinstance(out[org], Exception):
                self.last_call_bytes[org] = sent_bytes[org] + records.payload_size(reply.content)
        return out

    def evaluate(self, requests: Mapping[str, EvalRequest], timeout_s: float) -> dict[str, EvalReport | Exception]:
        return self._call(ops.EVALUATE, requests, timeout_s, _group(requests))

    def checkpoint(self, org_ids: list[str], round: int, timeout_s: float) -> dict[str, str | Exception]:
        request = codec.checkpoint_request_to_proto(round)
        return self._call(ops.CHECKPOINT, {org: request for org in org_ids}, timeout_s, str(round))

    def step(self, requests: Mapping[str, StepRequest], timeout_s: float) -> dict[str, StepReply | Exception]:
        return self._call(ops.STEP, requests, timeout_s, _group(requests))

    def submit_step(self, org: str, request: StepRequest, timeout_s: float) -> Future[tuple[Any, float]]:
        """``org``'s step message pushed now, not waited for (asynchronous rounds): a future of ``(decoded reply |
        Exception, seconds from push to pull)``; its reply is pulled as it comes, every ``max_poll_s`` seconds
        (:class:`~hacrl_fed.flower.inflight.InFlight`), a :class:`TransportTimeout` after ``timeout_s``."""
        node = next((n for n, o in self._org_by_node.items() if o == org), None)
        failed: Exception | None = None
        if node is None:
            failed = OrgUnavailable(f"org {org!r} has no connected Flower node")
        else:
            try:
                content = records.pack(request)
            except Exception as err:  # an unencodable request is that org's failure, not the run's
                failed = err
        if node is None or failed is not None:
            done: Future[tuple[Any, float]] = Future()
            done.set_result((failed, 0.0))
            return done
        self.count_messages(ops.STEP.name, [org])
        ttl = timeout_s + self.ttl_grace_s
        message = Message(
            content, dst_node_id=node, message_type=ops.STEP.message_type, group_id=_group({org: request}), ttl=ttl
        )
        settle = lambda reply, _s: decode_reply(ops.STEP, f"org {org!r}", reply, self.limits)  # noqa: E731
        return self.inflight.push(node, message, timeout_s, settle)

    def close(self) -> None:
        """Stop pulling the replies of the steps in flight (idempotent)."""
        self.inflight.close()

    def health(self, org_ids: list[str], timeout_s: float) -> dict[str, dict[str, str] | Exception]:
        """``query.health`` to the given orgs: ``{org: health info | Exception}``."""
        request = codec.health_request()
        replies = self._call(ops.HEALTH, {org: request for org in org_ids}, timeout_s, "health")
        self.note_health(replies)
        return replies


def _group(requests: Mapping[str, Any]) -> str:
    """Flower group id of a call: the round of its requests ("" if none, or several)."""
    rounds = {_round(r) for r in requests.values()}
    return str(rounds.pop()) if len(rounds) == 1 and None not in rounds else ""


def _round(request: Any) -> int | None:
    """The round a request names; a step's: its plan's, else its train request's, evaluation's or checkpoint's."""
    for part in (request, *(getattr(request, name, None) for name in ("plan", "train", "evaluate"))):
        if isinstance(getattr(part, "round", None), int):
            return int(part.round)
    checkpoint = getattr(request, "checkpoint", None)
    return checkpoint if isinstance(checkpoint, int) else None
