"""Serving one step, the message every round is made of (docs/ARCHITECTURE.md "One round").

:func:`run_step` does the parts of a :class:`~hacrl_fed.types.StepRequest` in the order that keeps every number
what separate messages gave: train round ``r - 1``, evaluate it, generate round ``r`` with the updated weights,
then checkpoint round ``r - 1``. Evaluation reads the state after the train half; generation leaves weights,
optimizer and the global RNG untouched, so the checkpoint holds the same weights as before it, and also what the
generation kept for the next train (its own round; in asynchronous rounds its recent rounds,
:mod:`hacrl_fed.worker.async_checkpoint`): the worker's whole state after the step. Each part fails alone, as
separate calls did.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from hacrl_fed import failures
from hacrl_fed.cancel import CallCancelled
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
from hacrl_fed.worker.guard import RequestRefused

log = logging.getLogger(__name__)


class StepWorker(Protocol):
    """What :func:`run_step` calls: the worker's own round operations (``PolicyWorker``, the test stand-ins)."""

    org_id: str

    def train(self, request: TrainRequest) -> TrainReport: ...

    def evaluate(self, request: EvalRequest) -> EvalReport: ...

    def checkpoint(self, round: int) -> str: ...

    def generate(self, plan: RoundPlan) -> RolloutBatch: ...


def _part(org: str, what: str, round: int, call: Callable[[], Any], raised: dict[str, Exception]) -> tuple[Any, str]:
    """``(call(), "")``, or ``(None, error text)`` when the part failed (:func:`failures.describe`; the exception
    itself goes to ``raised[what]``). A cancelled call (:class:`~hacrl_fed.cancel.CallCancelled`: the caller's
    deadline passed or it gave up) and ``BaseException`` end the whole step."""
    try:
        return call(), ""
    except CallCancelled:
        raise
    except Exception as err:  # this part's failure, reported; the other parts still run
        log.warning("worker %s: the %s part of round %d failed: %s", org, what, round, err)
        raised[what] = err
        return None, failures.describe(err)


def run_step(worker: StepWorker, request: StepRequest) -> StepReply:
    """Serve ``request`` with ``worker``'s own ``train``, ``evaluate``, ``generate`` and ``checkpoint``, in that
    order (module docstring). A failed train half (its error text in ``train_error``) still lets the evaluation,
    the checkpoint and the plan run, with the weights the worker has, and so on for each part."""
    if not request.parts():
        raise RequestRefused("empty_step", "the step request carries no part")
    org, train, evaluate, ckpt, plan = worker.org_id, request.train, request.evaluate, request.checkpoint, request.plan
    raised: dict[str, Exception] = {}
    none: tuple[Any, str] = (None, "")
    report, train_error = _part(org, "train", train.round, lambda: worker.train(train), raised) if train else none
    evaluation, eval_error = (
        _part(org, "evaluate", evaluate.round, lambda: worker.evaluate(evaluate), raised) if evaluate else none
    )
    batch, generate_error = _part(org, "generate", plan.round, lambda: worker.generate(plan), raised) if plan else none
    path, ckpt_error = (
        _part(org, "checkpoint", ckpt, lambda: worker.checkpoint(ckpt), raised) if ckpt is not None else none
    )
    return StepReply(report, batch, train_error, generate_error, evaluation, eval_error, path, ckpt_error, raised)
