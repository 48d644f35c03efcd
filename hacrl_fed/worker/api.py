"""The policy worker's interface: what every transport ends up calling on an organization's side.

``hacrl_fed.worker.PolicyWorker`` (in-process, owns the model) and ``hacrl_fed.wire.grpc_client.GrpcWorkerClient``
(a stub to a ``hacrl-fed worker`` process) both satisfy :class:`WorkerAPI`: the operations a round needs, the
``name`` column of the one table of the operations (:data:`hacrl_fed.wire.operations.OPERATIONS`) less the two
deprecated halves of ``step``. Every round is a step (:func:`run_step`, :mod:`hacrl_fed.worker.step`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from hacrl_fed.types import EvalReport, EvalRequest, StepReply, StepRequest
from hacrl_fed.worker.step import StepWorker, run_step

VERSION_KEY = "version"  # a Health reply's info key: the worker's count of its updates in its run (asynchronous rounds)


@runtime_checkable
class WorkerAPI(Protocol):
    org_id: str

    def step(self, request: StepRequest) -> StepReply:
        """One message of a round: train round ``r - 1``, evaluate and checkpoint it when asked, then generate
        round ``r`` with the updated weights (:func:`run_step`), each part failing alone."""

    def evaluate(self, request: EvalRequest) -> EvalReport:
        """Greedy accuracy on held-out prompts (the evaluation before round 1; later ones ride in a step)."""

    def health(self) -> dict[str, str]:
        """``{"org_id": ..., "status": "ok", "round": "<last completed round>", ...}``; the policy worker adds
        :data:`VERSION_KEY` (the version it signs into its batches), its challenge and its signing key."""

    def checkpoint(self, round: int) -> str:
        """Write weights, optimizer, RNG and round to the worker's checkpoint dir; return the path."""


__all__ = ["VERSION_KEY", "StepWorker", "WorkerAPI", "run_step"]
