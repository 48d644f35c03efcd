"""Rank 0 hands each request to every rank of its org's group; every rank calls the same method, rank 0 replies.

:class:`RankDispatcher` is what rank 0's gRPC servicer (:mod:`hacrl_fed.wire.grpc_server`) serves: a
:class:`~hacrl_fed.worker.api.WorkerAPI`. Its ``step`` / ``evaluate`` / ``checkpoint`` take the next request
number ``seq`` (one lock: requests arriving at once are handed on in one order), write the request to the group's
store as ``req/<seq>`` (``RPC\\n`` + the protobuf bytes the wire codec makes, so no rank unpickles anything), run
rank 0's own share in a thread, and wait for every rank's outcome under the
:class:`~hacrl_fed.sharded.watchdog.Watchdog`. The reply is rank 0's return value (or its exception); a rank fault
(:class:`~hacrl_fed.sharded.watchdog.RankFault`: a rank died, hung, ran out of memory or raised where rank 0 did
not) is the reply's error instead, the dispatcher is ``failed`` from then on and the endpoint stops every rank.
``health`` is rank 0's alone (cheap, never handed on).

Every other rank runs :func:`rank_loop`: wait for ``req/<seq>``, decode it with the wire codec, call the same
method on its own worker, write ``done/<seq>/<rank>``; ``shutdown`` ends the loop.

A call's cancellation (the caller gave up, its deadline passed) does not reach the ranks: a started request runs
to its end on every rank, so the ranks never part ways; the reply of a call nobody waits for is dropped.

:func:`rank_worker` is the one place that picks the worker object each rank serves.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hacrl_fed.sharded.watchdog import (
    ACK_WAIT_S,
    POLL_S,
    Heartbeat,
    RankFault,
    Watchdog,
    outcome,
    poll_pauses,
    post_outcome,
)
from hacrl_fed.wire import codec
from hacrl_fed.wire import operations as ops
from hacrl_fed.wire.operations import BY_RPC, Operation

if TYPE_CHECKING:
    from hacrl_fed.worker.api import WorkerAPI

log = logging.getLogger(__name__)
SHUTDOWN = b"shutdown"


def rank_worker(cfg: Any, org_id: str, run_dir: str | Path | None, resume: bool) -> Any:
    """The worker object this rank serves: the collective
    :class:`~hacrl_fed.sharded.worker.ShardedPolicyWorker` on every rank when the group has more than one rank (all
    ranks share ``run_dir``: its checkpoints are sharded), the plain worker of :func:`hacrl_fed.worker.build_worker`
    otherwise. A problem with what the config names is a BuildError starting with the org, as for a plain worker."""
    import torch.distributed as dist

    from hacrl_fed.config import BuildError
    from hacrl_fed.worker import build_worker

    base = Path("runs/default" if run_dir is None else run_dir)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return build_worker(cfg, org_id, run_dir=base, resume=resume)
    from hacrl_fed.sharded.worker import ShardedPolicyWorker

    try:
        return ShardedPolicyWorker(cfg, org_id, run_dir=base, resume=resume)
    except BuildError as err:
        if str(err).startswith(f"org {org_id!r}:"):
            raise
        raise BuildError(f"org {org_id!r}: {err}") from err


def request_message(op: Operation, request: Any) -> bytes:
    """``req/<seq>``'s value: ``RPC\\n`` and the request's protobuf bytes."""
    return op.rpc.encode() + b"\n" + op.encode_request(request).SerializeToString()


def read_message(data: bytes, limits: codec.WireLimits) -> tuple[Operation, Any] | None:
    """The operation and decoded request of a ``req/<seq>`` value; None for ``shutdown``."""
    rpc, _, payload = data.partition(b"\n")
    if rpc == SHUTDOWN:
        return None
    op = BY_RPC[rpc.decode()]
    return op, codec.decode(op.request_kind, payload, limits=limits)


class _Share:
    """Rank 0's share of one request, run in its own thread so that the watchdog can fail the reply meanwhile."""

    def __init__(self, op: Operation, worker: WorkerAPI, request: Any) -> None:
        self.op, self.result = op, None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(worker, request), name="rank0-request", daemon=True)

    def _run(self, worker: WorkerAPI, request: Any) -> None:
        try:
            self.result = self.op.call(worker, request)
        except BaseException as err:  # the request's own failure, re-raised by value()
            self.error = err
        finally:
            self.done.set()

    def outcome(self) -> dict[str, str] | None:
        return outcome(self.op.name, self.result, self.error) if self.done.is_set() else None

    def value(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class RankDispatcher:
    """Rank 0's :class:`~hacrl_fed.worker.api.WorkerAPI` over the whole group (module docstring)."""

    def __init__(self, group: Any, worker: WorkerAPI, heartbeat: Heartbeat) -> None:
        self.group, self.worker, self.heartbeat = group, worker, heartbeat
        self.org_id = worker.org_id
        self.failed = threading.Event()
        self.fault: RankFault | None = None
        self._lock = threading.Lock()
        self._seq = 0
        self._store = group.connect()
        self.watchdog = Watchdog(group, self._store)

    def step(self, request: Any) -> Any:
        return self._dispatch(ops.STEP, request)

    def evaluate(self, request: Any) -> Any:
        return self._dispatch(ops.EVALUATE, request)

    def checkpoint(self, round: int) -> Any:
        return self._dispatch(ops.CHECKPOINT, round)

    def health(self) -> dict[str, str]:
        if self.fault is not None:
            raise RuntimeError(f"the org's ranks stopped: {self.fault}")
        return dict(self.worker.health())

    def _dispatch(self, op: Operation, request: Any) -> Any:
        with self._lock:
            if self.fault is not None:
                raise RuntimeError(f"the org's ranks stopped: {self.fault}")
            self._seq += 1
            seq = self._seq
            self._store.set(f"req/{seq}", request_message(op, request))
            share = _Share(op, self.worker, request)
            share.thread.start()
            self.heartbeat.enter(seq, op.name, share.thread.ident)
            try:
                self.watchdog.wait(seq, op.name, share.outcome, self.group.hang_timeout_s)
            except RankFault as fault:
                self._fail(fault)
                raise
            finally:
                self.heartbeat.leave()
            self.watchdog.forget(seq)
            return share.value()

    def _fail(self, fault: RankFault) -> None:
        log.error("%s; stopping the org's %d ranks", fault, self.group.world_size)
        self.fault = fault
        self.watchdog.ack(fault.rank)
        self.failed.set()

    def shutdown(self) -> None:
        """Tell every other rank to leave its loop (a clean stop; after a fault torchrun's agent ends them)."""
        with self._lock:
            self._seq += 1
            self._store.set(f"req/{self._seq}", SHUTDOWN + b"\n")

    def close(self) -> None:
        """A clean stop (nothing after a fault): the other ranks leave their loops, rank 0 closes its worker and
        leaves the group."""
        if self.fault is not None:
            return
        self.shutdown()
        close_worker(self.worker)
        self.heartbeat.stop()
        self.group.close()


def close_worker(worker: WorkerAPI) -> None:
    close = getattr(worker, "close", None)
    if callable(close):
        close()


def _next_request(store: Any, seq: int, alive: Callable[[], bool]) -> bytes | None:
    key, pauses = f"req/{seq}", poll_pauses()
    while not store.check([key]):
        if not alive():
            return None
        time.sleep(next(pauses))
    return bytes(store.get(key))


def wait_ack(store: Any, rank: int) -> None:
    """Wait up to :data:`~hacrl_fed.sharded.watchdog.ACK_WAIT_S` for rank 0 to have read this rank's fault."""
    deadline = time.monotonic() + ACK_WAIT_S
    while time.monotonic() < deadline and not store.check([f"ack/{rank}"]):
        time.sleep(POLL_S)


def rank_loop(
    group: Any, worker: WorkerAPI, heartbeat: Heartbeat, limits: codec.WireLimits, alive: Callable[[], bool]
) -> int:
    """A rank other than 0: serve the requests rank 0 hands on until ``shutdown`` (0), a fault of this rank (1,
    after rank 0's acknowledgement or :data:`~hacrl_fed.sharded.watchdog.ACK_WAIT_S`) or ``alive()`` false (1:
    torchrun's agent is gone)."""
    store, seq = group.connect(), 1
    while True:
        data = _next_request(store, seq, alive)
        if data is None:
            log.warning("rank %d of %s: torchrun's agent is gone; stopping", group.rank, group.org_id)
            return 1
        message = read_message(data, limits)
        if message is None:
            return 0
        op, request = message
        heartbeat.enter(seq, op.name)
        try:
            state = outcome(op.name, op.call(worker, request))
        except Exception as err:  # reported to rank 0, which decides (module docstring)
            state = outcome(op.name, error=err)
        finally:
            heartbeat.leave()
        post_outcome(store, seq, group.rank, state)
        if "fault" in state:
            log.error("rank %d of %s: %s", group.rank, group.org_id, state["fault"])
            wait_ack(store, group.rank)
            return 1
        seq += 1


def parent_alive(parent: int | None = None) -> Callable[[], bool]:
    """A check that this process's parent (torchrun's agent) is still the one it had at start."""
    first = os.getppid() if parent is None else parent
    return lambda: os.getppid() == first
