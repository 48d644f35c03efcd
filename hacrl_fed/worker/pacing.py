"""A slower org in real processes, for benchmarks: the environment variable ``HACRL_FED_BENCH_SLOWDOWN``.

A benchmark's setting, not the run config's (``orgs[].emulate_slowdown`` until issue 42): ``ORG=F[,ORG=F]``
(:func:`slowdowns`), set by the benchmark tools (``scripts/async_grpc_check.py``, :mod:`hacrl_tools.bench.clock_check`)
in the environment of ``hacrl-fed run --transport grpc``, which its worker processes inherit. :func:`paced` wraps the
worker a ``hacrl-fed worker`` process serves (:func:`hacrl_fed.cli.worker.serve_endpoint`; for a sharded org, rank 0's
dispatcher) so that every ``step`` takes ``F`` times its compute time: after the step the worker sleeps ``(F - 1)``
times the step's measured seconds. Every other call (Health, Evaluate, Checkpoint, the attributes the server reads)
goes to the worker untouched. The in-process transport runs its calls one after another and has the virtual clock
for this (:mod:`hacrl_fed.coordinator.virtual_clock`), so a run that builds every worker in one process refuses the
variable (:func:`refuse_emulated_slowdown`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from hacrl_fed.config import ConfigError, RunConfig
from hacrl_fed.types import StepReply, StepRequest

if TYPE_CHECKING:
    from hacrl_fed.worker.api import WorkerAPI

log = logging.getLogger(__name__)

SLOWDOWN_ENV = "HACRL_FED_BENCH_SLOWDOWN"


def slowdowns(cfg: RunConfig, env: Mapping[str, str] = os.environ) -> dict[str, float]:
    """``{org: F}`` from ``env[SLOWDOWN_ENV]`` (``"globex=4"``, ``"acme=2,globex=4"``; unset or empty: ``{}``).
    ConfigError naming the variable for a malformed entry, an org not in ``cfg`` or ``F`` not finite and >= 1."""
    out: dict[str, float] = {}
    for entry in filter(None, (e.strip() for e in env.get(SLOWDOWN_ENV, "").split(","))):
        org, sep, value = entry.partition("=")
        try:
            factor = float(value) if sep else math.nan
        except ValueError:
            factor = math.nan
        if org not in {o.id for o in cfg.orgs} or not (math.isfinite(factor) and factor >= 1.0):
            raise ConfigError(f"{SLOWDOWN_ENV}: {entry!r} is not ORG=F with an org of the run and F >= 1")
        out[org] = factor
    return out


def refuse_emulated_slowdown(cfg: RunConfig, transport: str, env: Mapping[str, str] = os.environ) -> None:
    """ConfigError naming :data:`SLOWDOWN_ENV` when it slows an org (F > 1) but ``transport`` (as the caller names
    it: ``--transport inprocess``, ``the Flower simulation``) builds every worker in this process: the slowdown paces
    a ``hacrl-fed worker`` process; in process the virtual clock does this."""
    slowed = {org: f for org, f in slowdowns(cfg, env).items() if f != 1.0}
    if slowed:
        raise ConfigError(
            f"{SLOWDOWN_ENV} slows {sorted(slowed)} (a hacrl-fed worker process each), but {transport} builds every "
            "worker in this process: use the in-process virtual clock there (or --transport grpc)"
        )


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
        "org %s: every step takes %g x its compute time (%s)",
        getattr(worker, "org_id", "?"),
        factor,
        SLOWDOWN_ENV,
    )
    return PacedWorker(worker, factor)
