"""A round in flight and the parts of a step's reply (:mod:`hacrl_fed.coordinator.loop`'s per-round state).

Every message of a round is a :class:`~hacrl_fed.types.StepRequest`; :func:`split_reply` turns its
:class:`~hacrl_fed.types.StepReply` into one outcome per part sent (:class:`StepOutcome`), and
:class:`RoundState` holds what a round has collected until it is closed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hacrl_fed.failures import PartFailed
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


@dataclass(frozen=True)
class StepOutcome:
    """One org's outcome of a step, per part: the reply or an exception, None for a part it was not sent."""

    train: Any = None  # TrainReport | Exception | None
    batch: Any = None  # RolloutBatch | Exception | None
    evaluation: Any = None  # EvalReport | Exception | None
    checkpoint: Any = None  # str (the path) | Exception | None


# StepRequest field -> (StepReply field of its reply, of its error text, the part's name in StepReply.raised)
_PARTS = {
    "train": ("report", "train_error", "train"),
    "plan": ("batch", "generate_error", "generate"),
    "evaluate": ("eval_report", "eval_error", "evaluate"),
    "checkpoint": ("checkpoint", "checkpoint_error", "checkpoint"),
}


def _part(request: StepRequest, reply: Any, sent: str) -> Any:
    if getattr(request, sent) is None:
        return None
    if isinstance(reply, Exception):  # a failed call fails every part it carried: how far the worker got is unknown
        return reply
    if not isinstance(reply, StepReply):
        return TypeError(f"a step reply must be a StepReply, got {type(reply).__name__}")
    value_field, error_field, name = _PARTS[sent]
    value = getattr(reply, value_field)
    if value is not None:
        return value
    error = getattr(reply, error_field)
    if not error:
        return ValueError(f"the step reply carries no {value_field}")
    return reply.raised.get(name) or PartFailed(error)  # the worker's own exception when it ran in this process


def split_reply(request: StepRequest, reply: Any) -> StepOutcome:
    """The :class:`StepOutcome` of a step reply (or of the exception that stands for it: docs/ARCHITECTURE.md,
    "One round")."""
    train, batch, evaluation, checkpoint = (_part(request, reply, sent) for sent in _PARTS)
    return StepOutcome(train, batch, evaluation, checkpoint)
