"""A round in flight and the fused reply's two halves (:mod:`hacrl_fed.coordinator.loop`'s bookkeeping).

With ``federation.protocol: fused`` one :class:`~hacrl_fed.types.StepReply` carries round ``t - 1``'s train outcome
and round ``t``'s batch; :func:`split_reply` turns it into one outcome per half, and :class:`RoundState` holds what a
round has collected until it is closed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hacrl_fed import failures
from hacrl_fed.types import Rollout, RoundPlan, StepReply, StepRequest, TrainRequest


@dataclass
class RoundState:
    """A round in flight: its plans, what came back, its train requests and who trained."""

    round: int
    t0: float
    metrics: dict[str, float]
    failed: dict[str, str]  # org -> why it contributed nothing
    plans: dict[str, RoundPlan]
    accepted: dict[str, list[Rollout]] = field(default_factory=dict)
    accuracy: dict[str, float] = field(default_factory=dict)
    skipped: bool = False
    requests: dict[str, TrainRequest] = field(default_factory=dict)
    trained: list[str] = field(default_factory=list)
    messages: Counter[str] = field(default_factory=Counter)  # round-traffic messages sent to each org (transport)


class StepHalfFailed(RuntimeError):
    """One half of a fused reply failed at the worker (``StepReply.train_error`` / ``generate_error``);
    ``failure_cause`` is the cause the worker put in front of the text (:func:`hacrl_fed.failures.parse`)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.failure_cause = failures.parse(text) or failures.ERROR


def split_reply(request: StepRequest, reply: Any) -> tuple[Any, Any]:
    """``(train outcome, generate outcome)`` of a fused reply: the TrainReport / RolloutBatch or an exception, for
    each half the request carried (None for a half it did not carry). A failed call fails both of its halves: the
    coordinator cannot tell how far the worker got (docs/ARCHITECTURE.md, "One round")."""
    if isinstance(reply, Exception):
        return (reply if request.train is not None else None), (reply if request.plan is not None else None)
    if not isinstance(reply, StepReply):
        bad = TypeError(f"a step reply must be a StepReply, got {type(reply).__name__}")
        return (bad if request.train is not None else None), (bad if request.plan is not None else None)

    def half(sent: object, value: object, error: str, what: str) -> Any:
        if sent is None:
            return None
        if value is not None:
            return value
        return StepHalfFailed(error) if error else ValueError(f"the step reply carries no {what}")

    return (
        half(request.train, reply.report, reply.train_error, "train report"),
        half(request.plan, reply.batch, reply.generate_error, "rollout batch"),
    )
