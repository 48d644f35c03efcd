"""The policy worker's interface: what every transport ends up calling on an organization's side.

``hacrl_fed.worker.PolicyWorker`` (in-process, owns the model) and ``hacrl_fed.wire.grpc_client.GrpcWorkerClient``
(a stub to a ``hacrl-fed worker`` process) both satisfy :class:`WorkerAPI`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from hacrl_fed.types import EvalReport, EvalRequest, RolloutBatch, RoundPlan, TrainReport, TrainRequest


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
