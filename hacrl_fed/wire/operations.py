"""The one table of the operations a coordinator sends to an organization's policy worker.

Every layer derives its names from :data:`OPERATIONS`: the gRPC server's handlers and the client's calls
(:mod:`hacrl_fed.wire.grpc_server`, :mod:`hacrl_fed.wire.grpc_client`), the Flower message types and the
ClientApp's dispatch (:mod:`hacrl_fed.flower.records`, ``client/app.py``), and the transports' fan-outs. An
operation's ``name`` is the :class:`~hacrl_fed.worker.api.WorkerAPI` method (and the
:class:`~hacrl_fed.coordinator.transport.Transport` method), ``rpc`` the method of the ``PolicyWorker`` service in
``proto/hacrl_fed/v1/worker.proto``, whose request and reply message names are read from the generated descriptor
(as is :data:`SERVICE`), never typed here. ``tests/test_operations.py`` checks that table, proto service and
WorkerAPI agree.

=============  ==========  ======================  ===================  =================
operation      rpc         Flower message type     request              reply
=============  ==========  ======================  ===================  =================
generate       Generate    ``query.generate``      RoundPlan            RolloutBatch
train          Train       ``train``               TrainRequest         TrainReport
evaluate       Evaluate    ``evaluate``            EvalRequest          EvalReport
health         Health      ``query.health``        HealthRequest        HealthReply
checkpoint     Checkpoint  ``query.checkpoint``    CheckpointRequest    CheckpointReply
step           Step        ``train.step``          StepRequest          StepReply
=============  ==========  ======================  ===================  =================

``step`` is the fused round (``federation.protocol: fused``): round ``r - 1``'s train request and round ``r``'s
plan in one message, the train report and the next batch in one reply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from hacrl_fed.v1 import worker_pb2 as pb
from hacrl_fed.wire import codec

SERVICE_DESCRIPTOR = pb.DESCRIPTOR.services_by_name["PolicyWorker"]
SERVICE = SERVICE_DESCRIPTOR.full_name  # "hacrl_fed.v1.PolicyWorker"


@dataclass(frozen=True)
class Operation:
    """One request/reply exchange with a worker (module docstring).

    ``encode_request``: the request value the coordinator holds -> its protobuf message; ``encode_reply``: what the
    worker method returns -> its protobuf message (both :mod:`hacrl_fed.wire.codec`). ``locked``: served one at
    a time under the worker's lock (Health is not: a busy worker still answers it). ``takes_request``: the worker
    method takes the decoded request (Health takes nothing).
    """

    name: str
    rpc: str
    message_type: str
    encode_request: Callable[[Any], Message]
    encode_reply: Callable[[Any], Message]
    locked: bool = True
    takes_request: bool = True

    @property
    def request_kind(self) -> str:
        """The protobuf message name of the request, from the service descriptor."""
        return str(SERVICE_DESCRIPTOR.methods_by_name[self.rpc].input_type.name)

    @property
    def reply_kind(self) -> str:
        """The protobuf message name of the reply, from the service descriptor."""
        return str(SERVICE_DESCRIPTOR.methods_by_name[self.rpc].output_type.name)

    def call(self, worker: Any, request: Any) -> Any:
        """Run this operation on ``worker`` (a WorkerAPI object) with the decoded ``request``."""
        method = getattr(worker, self.name)
        return method(request) if self.takes_request else method()


GENERATE = Operation("generate", "Generate", "query.generate", codec.to_proto, codec.to_proto)
TRAIN = Operation("train", "Train", "train", codec.to_proto, codec.to_proto)
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

OPERATIONS: dict[str, Operation] = {op.name: op for op in (GENERATE, TRAIN, EVALUATE, HEALTH, CHECKPOINT, STEP)}
BY_RPC: dict[str, Operation] = {op.rpc: op for op in OPERATIONS.values()}
