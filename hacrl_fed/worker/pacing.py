"""A slower org in real processes, for benchmarks (``orgs[].emulate_slowdown``).

:func:`paced` wraps the worker a ``hacrl-fed worker`` process serves (:func:`hacrl_fed.cli.worker.serve_endpoint`;
for a sharded org, rank 0's dispatcher) so that every ``step`` takes ``factor`` times its compute time: after the
step the worker sleeps ``(factor - 1)`` times the step's measured seconds. Every other call (Health, Evaluate,
Checkpoint, the attributes the server reads) goes to the worker untouched. The in-process transport runs its calls
one after another and has the virtual clock for this (``federation.virtual_step_s``), so the config refuses the
field there (:func:`hacrl_fed.config.refuse_emulated_slowdown`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hacrl_fed.types import StepReply, StepRequest

if TYPE_CHECKING:
    from hacrl_fed.worker.api import WorkerAPI

log = logging.getLogger(__name__)


class PacedWorker:
    """``worker`` whose ``step`` takes ``factor`` times its compute time (``factor > 1``); the rest delegated.

    ``clock`` / ``sleep`` are :func:`time.perf_counter` / :func:`time.sleep` (tests pass their own)."""

    def __init__(
        self,
        worker: WorkerAPI,
        factor: float,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not factor > 1.0:
            raise ValueError(f"a paced worker needs a slowdown factor > 1, got {factor}")
        self.worker, self.factor = worker, factor
        self._clock, self._sleep = clock, sleep
        self.slept_s = 0.0  # the seconds added so far

    def step(self, request: StepRequest) -> StepReply:
        """The worker's step, then a sleep of ``(factor - 1)`` times its measured seconds (also when it raised)."""
        t0 = self._clock()
        try:
            return self.worker.step(request)
        finally:
            extra = (self.factor - 1.0) * max(self._clock() - t0, 0.0)
            self.slept_s += extra
            self._sleep(extra)

    def __getattr__(self, name: str) -> Any:  # only reached for what this object does not hold
        if name == "worker":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.worker, name)


def paced(worker: WorkerAPI, factor: float) -> Any:
    """``worker`` itself when ``factor == 1`` (no wrapper), else a :class:`PacedWorker`."""
    if factor == 1.0:
        return worker
    log.info(
        "org %s: every step takes %g x its compute time (orgs[].emulate_slowdown)",
        getattr(worker, "org_id", "?"),
        factor,
    )
    return PacedWorker(worker, factor)
