"""The policy worker's interface: what every transport ends up calling on an organization's side.

``hacrl_fed.worker.PolicyWorker`` (in-process, owns the model) and ``hacrl_fed.wire.grpc_client.GrpcWorkerClient``
(a stub to a ``hacrl-fed worker`` process) both satisfy :class:`WorkerAPI`; its methods are the ``name`` column of
the one table of the operations, :data:`hacrl_fed.wire.operations.OPERATIONS`.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from hacrl_fed import failures
from hacrl_fed.types import (
    EvalReport,
    EvalRequest,
    RolloutBatch,
    RoundPlan,
    StepReply,
    StepRequest,
    TrainReport,
    TrainRequest,
)
from hacrl_fed.worker.cancel import CallCancelled

log = logging.getLogger(__name__)


@runtime_checkable
class WorkerAPI(Protocol):
    org_id: str

    def generate(self, plan: RoundPlan) -> RolloutBatch:
        """Sample G responses per prompt with the pre-update weights, verify them, publish rollouts."""

    def train(self, request: TrainRequest) -> TrainReport:
        """Score foreign rollouts, run this round's update on own + foreign rollouts (needs this round's generate)."""

    def evaluate(self, request: EvalRequest) -> EvalReport:
        """Greedy accuracy on held-out prompts."""

    def health(self) -> dict[str, str]:
        """``{"org_id": ..., "status": "ok", "round": "<last completed round>"}``."""

    def checkpoint(self, round: int) -> str:
        """Write weights, optimizer, RNG and round to the worker's checkpoint dir; return the path."""

    def step(self, request: StepRequest) -> StepReply:
        """The fused round: :meth:`train` on ``request.train``, then :meth:`generate` on ``request.plan`` with the
        updated weights (see :func:`run_step`)."""


def run_step(worker: WorkerAPI, request: StepRequest) -> StepReply:
    """Serve a :class:`StepRequest` with ``worker``'s own ``train`` then ``generate``: the same order of work as a
    Train followed by the next round's Generate.

    Each half fails alone, as the two calls did: a failed train half (its error text, :func:`failures.describe`, in
    ``train_error``) still lets the plan be generated, with the weights the worker has, and a failed generate half
    keeps the train report. A cancelled call (:class:`~hacrl_fed.worker.cancel.CallCancelled`: the caller's
    deadline passed or it gave up) and ``BaseException`` end the whole call.
    """
    report, batch, train_error, generate_error = None, None, "", ""
    if request.train is not None:
        try:
            report = worker.train(request.train)
        except CallCancelled:
            raise
        except Exception as err:  # this half's failure, reported; the plan still gets its batch
            train_error = failures.describe(err)
            log.warning("worker %s: the train half of round %d failed: %s", worker.org_id, request.train.round, err)
    if request.plan is not None:
        try:
            batch = worker.generate(request.plan)
        except CallCancelled:
            raise
        except Exception as err:
            generate_error = failures.describe(err)
            log.warning("worker %s: the generate half of round %d failed: %s", worker.org_id, request.plan.round, err)
    return StepReply(report, batch, train_error, generate_error)
