"""The one table of the operations a coordinator sends to an organization's policy worker.

Every layer derives its names from :data:`OPERATIONS`: the gRPC server's handlers and the client's calls
(:mod:`hacrl_fed.wire.grpc_server`, :mod:`hacrl_fed.wire.grpc_client`), the Flower message types and the
ClientApp's dispatch (:mod:`hacrl_fed.flower.records`, ``client/app.py``), and the transports' fan-outs. An
operation's ``name`` is the :class:`~hacrl_fed.worker.api.WorkerAPI` method (and the
:class:`~hacrl_fed.coordinator.transport.Transport` method; the deprecated halves excepted), ``rpc`` the method of
the ``PolicyWorker`` service in
``proto/hacrl_fed/v1/worker.proto``, whose request and reply message names are read from the generated descriptor
(as is :data:`SERVICE`), never typed here. ``tests/test_fused.py`` checks that table, proto service and
WorkerAPI agree.

=============  ==========  ======================  ===================  =================
operation      rpc         Flower message type     request              reply
=============  ==========  ======================  ===================  =================
step           Step        ``train.step``          StepRequest          StepReply
evaluate       Evaluate    ``evaluate``            EvalRequest          EvalReport
health         Health      ``query.health``        HealthRequest        HealthReply
checkpoint     Checkpoint  ``query.checkpoint``    CheckpointRequest    CheckpointReply
generate       Generate    ``query.generate``      RoundPlan            RolloutBatch
train          Train       ``train``               TrainRequest         TrainReport
=============  ==========  ======================  ===================  =================

Every round is a ``step`` (docs/ARCHITECTURE.md "One round"): round ``r - 1``'s train request, its evaluation and
checkpoint when due, and round ``r``'s plan in one message; the reply carries one outcome per part. ``evaluate``
and ``checkpoint`` serve the evaluation before round 1 and direct use. ``generate`` and ``train`` are deprecated
(``option deprecated`` in the proto) and still served, as halves of ``step`` (:attr:`Operation.part`): the worker's
``step`` with the plan alone or the train request alone, its failure re-raised. The
:class:`~hacrl_fed.worker.api.WorkerAPI` and the :class:`~hacrl_fed.coordinator.transport.Transport` have the
operations without a ``part``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from hacrl_fed import failures
from hacrl_fed.types import StepRequest
from hacrl_fed.v1 import worker_pb2 as pb
from hacrl_fed.wire import codec

# a WorkerAPI object (hacrl_fed.worker.api): the wire never imports the worker (tests/test_layers.py)
WorkerAPI = Any

SERVICE_DESCRIPTOR = pb.DESCRIPTOR.services_by_name["PolicyWorker"]
SERVICE = SERVICE_DESCRIPTOR.full_name  # "hacrl_fed.v1.PolicyWorker"


@dataclass(frozen=True)
class Operation:
    """One request/reply exchange with a worker (module docstring).

    ``encode_request``: the request value the coordinator holds -> its protobuf message; ``encode_reply``: what the
    worker method returns -> its protobuf message (both :mod:`hacrl_fed.wire.codec`). ``locked``: served one at
    a time under the worker's lock (Health is not: a busy worker still answers it). ``takes_request``: the worker
    method takes the decoded request (Health takes nothing). ``part``: a deprecated half of ``step``, the
    :class:`~hacrl_fed.types.StepRequest` field its request fills (served by the worker's ``step``).
    """

    name: str
    rpc: str
    message_type: str
    encode_request: Callable[[Any], Message]
    encode_reply: Callable[[Any], Message]
    locked: bool = True
    takes_request: bool = True
    part: str = ""

    @property
    def request_kind(self) -> str:
        """The protobuf message name of the request, from the service descriptor."""
        return str(SERVICE_DESCRIPTOR.methods_by_name[self.rpc].input_type.name)

    @property
    def reply_kind(self) -> str:
        """The protobuf message name of the reply, from the service descriptor."""
        return str(SERVICE_DESCRIPTOR.methods_by_name[self.rpc].output_type.name)

    def call(self, worker: WorkerAPI, request: Any) -> Any:
        """Run this operation on ``worker`` (a WorkerAPI object) with the decoded ``request``."""
        if self.part:
            return serve_half(worker, self.part, request)
        method = getattr(worker, self.name)
        return method(request) if self.takes_request else method()


# a deprecated half of step: the StepRequest field it fills -> (the StepReply field of its reply, the part's name)
_HALVES = {"plan": ("batch", "generate", "generate_error"), "train": ("report", "train", "train_error")}


def serve_half(worker: WorkerAPI, part: str, request: Any) -> Any:
    """Serve a deprecated ``Generate`` / ``Train``: ``worker.step`` with ``request`` as its only ``part``; returns
    that part's reply or raises its failure (the worker's own exception in one process, else
    :class:`~hacrl_fed.failures.PartFailed` with its text)."""
    field, name, error_field = _HALVES[part]
    reply = worker.step(StepRequest(**{part: request}))
    value = getattr(reply, field)
    if value is not None:
        return value
    raised = getattr(reply, "raised", {}).get(name)
    if raised is not None:
        raise raised
    raise failures.PartFailed(getattr(reply, error_field) or f"the step reply carries no {field}")


GENERATE = Operation("generate", "Generate", "query.generate", codec.to_proto, codec.to_proto, part="plan")
TRAIN = Operation("train", "Train", "train", codec.to_proto, codec.to_proto, part="train")
EVALUATE = Operation("evaluate", "Evaluate", "evaluate", codec.to_proto, codec.to_proto)
HEALTH = Operation(
    "health",
    "Health",
    "query.health",
    lambda _: codec.health_request(),
    codec.health_reply_to_proto,
    locked=False,
    takes_request=False,
)
CHECKPOINT = Operation(
    "checkpoint", "Checkpoint", "query.checkpoint", codec.checkpoint_request_to_proto, codec.checkpoint_reply_to_proto
)
STEP = Operation("step", "Step", "train.step", codec.to_proto, codec.to_proto)

# a Health reply's info key the gRPC server adds ("1") while a locked call runs on the worker: a rejoin waits until
# it is idle, as the step it lost may still be changing its count of updates (hacrl_fed.coordinator.async_liveness)
BUSY_KEY = "busy"

OPERATIONS: dict[str, Operation] = {op.name: op for op in (GENERATE, TRAIN, EVALUATE, HEALTH, CHECKPOINT, STEP)}
BY_RPC: dict[str, Operation] = {op.rpc: op for op in OPERATIONS.values()}
