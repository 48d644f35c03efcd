"""Where a Flower deployment message's seconds go, read from a SuperNode's log (flwr 1.42, ``FLWR_LOG_LEVEL=DEBUG``).

With ``FLWR_LOG_LEVEL=DEBUG`` every Flower log line carries a millisecond timestamp, and the SuperNode's log also
holds the output of the SuperExec it starts and of each ``flwr-clientapp`` process. One message leaves, in order:

==================================  =====================================================================
``Receiving: TYPE message (ID: X)``  the SuperNode's pull found the message (``pull``)
``Received successfully``            its objects are stored (``stored``)
``Runtime.AcquireTask``              the SuperExec's next task poll (``acquired``; it then starts the process)
``Start `flwr-clientapp` process``   the new process has imported Flower (``started``)
``Start `ClientApp` Loading.``       token, task input and FAB installed (``loading``)
``Runtime.PushMessages``             the ClientApp pushed its reply (``replied``; our app ran in between)
``Sending: TYPE message``            the SuperNode noticed the reply (``noticed``)
``Sent successfully``                the reply is on the SuperLink (``sent``)
==================================  =====================================================================

:func:`pieces` turns those into durations; ``idle`` is the gap from the previous reply being sent to this pull:
the SuperNode's 3 s sleep after a pull that found nothing (``flwr/supernode/start_client_internal.py``), behind
which the ServerApp's own turnaround (pulling the reply, the coordinator's work, pushing the next message) hides.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
RECEIVING = re.compile(r"Receiving: (?P<type>\S+) message \(ID: (?P<id>\w+)\)")
EVENTS = (  # (event, line marker), in the order one message passes them
    ("stored", "Received successfully"),
    ("acquired", "Runtime.AcquireTask"),
    ("started", "Start `flwr-clientapp` process"),
    ("loading", "Start `ClientApp` Loading."),
    ("replied", "Runtime.PushMessages"),
    ("noticed", "Sending: "),
    ("sent", "Sent successfully"),
)
PIECES = (  # (piece, from event, to event): consecutive, so they add up to the message's cycle
    ("idle", "prev_sent", "pull"),
    ("receive", "pull", "stored"),
    ("superexec_poll", "stored", "acquired"),
    ("clientapp_start", "acquired", "started"),
    ("fab_install", "started", "loading"),
    ("app", "loading", "replied"),
    ("reply_poll", "replied", "noticed"),
    ("send", "noticed", "sent"),
)
NOT_ROUND = frozenset({"query.health", "evaluate", "query.checkpoint"})  # message types outside a round's steps


def _seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def parse(log_text: str) -> list[dict[str, Any]]:
    """The messages of one SuperNode log: ``{"type", "id", event: epoch seconds, ...}`` in arrival order.

    Each event is the first line with its marker after the previous event of the same message; a message whose
    events are incomplete (the log ended, a ClientApp failed before pushing) keeps the events found.
    """
    messages: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    step = 0
    for raw in log_text.splitlines():
        line = ANSI.sub("", raw)
        stamp = STAMP.search(line)
        if stamp is None:
            continue
        t = _seconds(stamp.group(1))
        got = RECEIVING.search(line)
        if got:
            current = {"type": got["type"], "id": got["id"], "pull": t}
            messages.append(current)
            step = 0
            continue
        if current is not None and step < len(EVENTS) and EVENTS[step][1] in line:
            current[EVENTS[step][0]] = t
            step += 1
    for prev, msg in zip(messages, messages[1:]):
        if "sent" in prev:
            msg["prev_sent"] = prev["sent"]
    return messages


def pieces(messages: Iterable[Mapping[str, Any]], skip_types: frozenset[str] = NOT_ROUND) -> list[dict[str, Any]]:
    """Per message (types not in ``skip_types``, with every event): ``{"type", piece: seconds, "cycle": sum}``."""
    out = []
    for msg in messages:
        if msg["type"] in skip_types or any(a not in msg or b not in msg for _, a, b in PIECES):
            continue
        row: dict[str, Any] = {"type": msg["type"], **{p: msg[b] - msg[a] for p, a, b in PIECES}}
        row["cycle"] = sum(row[p] for p, _, _ in PIECES)
        out.append(row)
    return out


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Median of every piece (and ``cycle``) over ``rows``, the standard error of its mean as ``<piece>_se``
    (0 for one row), and ``messages``: how many rows."""
    out: dict[str, float] = {}
    for key in [p for p, _, _ in PIECES] + ["cycle"]:
        values = [r[key] for r in rows]
        if values:
            out[key] = statistics.median(values)
            out[f"{key}_se"] = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return {**out, "messages": float(len(rows))}


def timeline(log_texts: Iterable[str]) -> dict[str, float]:
    """:func:`summarize` over the round messages of several SuperNode logs."""
    return summarize([row for text in log_texts for row in pieces(parse(text))])
