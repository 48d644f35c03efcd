"""Why an org's call failed: a typed cause carried with the error, never read back from free text.

The causes are the ``<why>`` of the metrics ``round/<org>/failure/<why>`` and ``round/<org>/train_failure/<why>``
(docs/METRICS.md):

* ``stale_round``: the worker already trained that round of that run (its refusal ``RequestRefused`` with reason
  ``stale_round``, e.g. :class:`~hacrl_fed.worker.guard.StaleRoundError`);
* ``round_ahead``: the worker trained that run further than any restart of the coordinator explains (its refusal
  with reason ``round_ahead``, :class:`~hacrl_fed.worker.guard.RoundAheadError`): another client drove it
  ahead, an attack, not a restart;
* ``timeout``: no reply by the deadline;
* ``unreachable``: no connection, or no worker / node for the org;
* ``error``: anything else.

In one process, :func:`cause_of` reads an exception's ``failure_cause`` attribute (set by the worker's refusals and
by the transports' own error types, :class:`NoWorker` included), walking the explicit ``raise ... from`` chain, and
falls back on the type: ``TimeoutError`` is a timeout, ``ConnectionError`` unreachable.

Across a process boundary the cause travels as a stable prefix of the error text, ``[stale_round] ...`` (none for
``error``, the default): the one producer is :func:`describe` (the gRPC worker server's status details, the Flower
ClientApp's error reason), the one parser is :func:`parse` (the gRPC client's ``WorkerCallError``, the Flower
transport's ``FlowerRemoteError``).
"""

from __future__ import annotations

import re

STALE_ROUND, TIMEOUT, UNREACHABLE, ERROR = "stale_round", "timeout", "unreachable", "error"
ROUND_AHEAD = "round_ahead"
CAUSES = (STALE_ROUND, ROUND_AHEAD, TIMEOUT, UNREACHABLE, ERROR)
_PREFIX = re.compile(r"^\[(" + "|".join(CAUSES) + r")\] ")


class NoWorker(KeyError):
    """A transport has no worker (in-process object, gRPC address) for the org: ``unreachable``."""

    failure_cause = UNREACHABLE

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class PartFailed(RuntimeError):
    """One part of a step failed at the worker (``StepReply.train_error`` ...): its text is the worker's
    :func:`describe` of the failure, ``failure_cause`` the cause at its start."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.failure_cause = parse(text) or ERROR


def cause_of(err: BaseException) -> str:
    """The cause of ``err`` (module docstring): its own ``failure_cause``, else the first one along its ``__cause__``
    chain, else by type."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "failure_cause", None)
        if cause in CAUSES:
            return cause
        if isinstance(e, TimeoutError):
            return TIMEOUT
        if isinstance(e, ConnectionError):
            return UNREACHABLE
        e = e.__cause__
    return ERROR


def describe(err: BaseException) -> str:
    """``[cause] Type: message`` (just ``Type: message`` for ``error``): the text that carries ``err`` and its cause
    across a process boundary."""
    if isinstance(err, PartFailed):  # already the worker's describe() text
        return str(err)
    cause = cause_of(err)
    return f"{'' if cause == ERROR else f'[{cause}] '}{type(err).__name__}: {err}"


def parse(text: str | None) -> str | None:
    """The cause at the start of a text made by :func:`describe` (None when it carries none)."""
    match = _PREFIX.match(text or "")
    return match.group(1) if match else None
