"""Flower ClientApp: forwards each message to this org's policy worker and replies with the result.

Message types served: one handler per operation of :data:`hacrl_fed.wire.operations.OPERATIONS`
(``train.step``, every message of a round: the train request of one round with its evaluation and checkpoint
and the plan of the next, forwarded to the worker as one call; ``evaluate``, ``query.health``,
``query.checkpoint``; and the deprecated ``query.generate`` and ``train``, served as halves of the worker's step).
Which org this node is and where its worker lives comes from ``context.node_config`` (:mod:`hacrl_fed.flower.node`):

* deployment: ``flower-supernode ... --node-config 'org="acme" worker="127.0.0.1:50051"'`` (gRPC worker);
* simulation: no ``worker`` key; partition ``i`` is the ``i``-th org of the run config, served in-process.

A request that fails (bad payload, worker error, unreachable worker) is answered with a Flower ``Error`` whose
reason names the org and the operation; the ClientApp itself never crashes on it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from hacrl_fed import failures
from hacrl_fed.flower import node
from hacrl_fed.wire.operations import OPERATIONS, Operation

APP_DIR = Path(__file__).resolve().parents[1]
log = logging.getLogger(__name__)

app = ClientApp()


def _remaining_ttl(msg: Message) -> float:
    """Seconds left before ``msg`` expires (at least 1): the deadline for the worker call."""
    meta = msg.metadata
    return max(meta.created_at + meta.ttl - time.time(), 1.0)


def _respond(op: Operation, msg: Message, context: Context) -> Message:
    try:
        content = node.handle(op, msg.content, context, app_dir=APP_DIR, deadline_s=_remaining_ttl(msg))
    except Exception as err:
        log.error("hacrl-fed ClientApp: %s", err, exc_info=True)
        return Message(
            Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=failures.describe(err)), reply_to=msg
        )  # "[cause] NodeError: ...": the cause (stale_round ...) survives the trip
    return Message(content, reply_to=msg)


def _register(op: Operation) -> None:
    """Route ``op.message_type`` (``<category>[.<action>]``) to a handler serving ``op``."""
    category, _, action = op.message_type.partition(".")
    decorator = getattr(app, category)  # app.train / app.evaluate / app.query
    handler = decorator(action) if action else decorator()
    handler(lambda msg, context: _respond(op, msg, context))


for _op in OPERATIONS.values():
    _register(_op)
