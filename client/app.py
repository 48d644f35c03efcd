"""Flower ClientApp: forwards each message to this org's policy worker and replies with the result.

Message types served (see :mod:`hacrl_fed.flower.records`): ``query.generate``, ``train``, ``evaluate``,
``query.health``, ``query.checkpoint``. Which org this node is and where its worker lives comes from
``context.node_config`` (:mod:`hacrl_fed.flower.node`):

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
from hacrl_fed.flower import node, records
from hacrl_fed.flower.records import Operation

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


@app.query("generate")
def generate(msg: Message, context: Context) -> Message:
    return _respond(records.GENERATE, msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _respond(records.TRAIN, msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _respond(records.EVALUATE, msg, context)


@app.query("health")
def health(msg: Message, context: Context) -> Message:
    return _respond(records.HEALTH, msg, context)


@app.query("checkpoint")
def checkpoint(msg: Message, context: Context) -> Message:
    return _respond(records.CHECKPOINT, msg, context)
