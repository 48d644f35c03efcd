"""``InProcessTransport``: the coordinator calls worker objects in this process, one org after another.

No timeouts: a call runs to completion however long it takes (``timeout_s`` is accepted and ignored, since a
Python call cannot be interrupted safely). Use it for unit tests, benchmarks and single-machine runs where a
hung worker means a bug, not a network problem. Any ``Exception`` a worker raises becomes that org's result;
``BaseException`` (KeyboardInterrupt, SystemExit) propagates.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from hacrl_fed.coordinator.transport import Transport
from hacrl_fed.coordinator.virtual_clock import VirtualClock
from hacrl_fed.failures import NoWorker
from hacrl_fed.types import EvalReport, EvalRequest, StepReply, StepRequest
from hacrl_fed.wire import operations as ops
from hacrl_fed.wire.operations import Operation
from hacrl_fed.worker.api import WorkerAPI


class InProcessTransport(Transport):
    """Sequential calls on ``workers`` (``{org_id: WorkerAPI}``).

    After each fan-out ``last_call_seconds`` holds ``{org_id: seconds}`` of that call per org (no bytes: nothing
    is serialized, so there is no ``last_call_bytes``). ``clock``: the virtual clock asynchronous rounds order the
    replies by (:mod:`hacrl_fed.coordinator.virtual_clock`; a benchmark's setting; default: every step 1 virtual
    second, no faults).
    """

    def __init__(self, workers: Mapping[str, WorkerAPI], *, clock: VirtualClock | None = None):
        if not workers:
            raise ValueError("InProcessTransport needs at least one worker")
        self.workers = dict(workers)
        self.clock = clock if clock is not None else VirtualClock()
        self.last_call_seconds: dict[str, float] = {}

    def org_ids(self) -> list[str]:
        return list(self.workers)

    def _fan_out(self, op: Operation, items: Mapping[str, Any]) -> dict[str, Any]:
        results: dict[str, Any] = {}
        self.last_call_seconds = {}
        for org, item in items.items():
            start = time.perf_counter()
            worker = self.workers.get(org)
            if worker is None:
                results[org] = NoWorker(f"no in-process worker for org {org!r}")
            else:
                self.count_messages(op.name, [org])
                try:
                    results[org] = op.call(worker, item)
                except Exception as err:  # one org's failure must not stop the round
                    results[org] = err
            self.last_call_seconds[org] = time.perf_counter() - start
        return results

    def evaluate(self, requests: Mapping[str, EvalRequest], timeout_s: float) -> dict[str, EvalReport | Exception]:
        return self._fan_out(ops.EVALUATE, requests)

    def checkpoint(self, org_ids: list[str], round: int, timeout_s: float) -> dict[str, str | Exception]:
        return self._fan_out(ops.CHECKPOINT, {org: round for org in org_ids})

    def step(self, requests: Mapping[str, StepRequest], timeout_s: float) -> dict[str, StepReply | Exception]:
        return self._fan_out(ops.STEP, requests)

    def health(self, org_ids: list[str], timeout_s: float) -> dict[str, dict[str, str] | Exception]:
        replies = self._fan_out(ops.HEALTH, {org: None for org in org_ids})
        self.note_health(replies)
        return replies

    def close(self) -> None:
        """Call ``close()`` on workers that have one (releases models / engines)."""
        for worker in self.workers.values():
            close = getattr(worker, "close", None)
            if callable(close):
                close()
