"""``GrpcTransport``: one :class:`GrpcWorkerClient` per org, calls fanned out in parallel with a thread pool.

Every call carries the round deadline as its gRPC deadline, so a slow org costs at most ``timeout_s``; its
result is then a :class:`~hacrl_fed.wire.grpc_client.WorkerCallTimeout` (a ``TimeoutError``). Any other
failure (connection refused, remote exception, malformed reply) is that org's result as an exception value.

``last_call_bytes`` (``{org: request bytes + reply bytes}``, protobuf-serialized sizes) and
``last_call_seconds`` describe the latest fan-out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from hacrl_fed.coordinator.transport import Transport, TransportTimeout
from hacrl_fed.failures import NoWorker
from hacrl_fed.limits import MAX_MESSAGE_MB
from hacrl_fed.types import EvalReport, EvalRequest, StepReply, StepRequest
from hacrl_fed.wire import codec
from hacrl_fed.wire import operations as ops
from hacrl_fed.wire.grpc_client import ClientTLS, GrpcWorkerClient
from hacrl_fed.wire.operations import Operation

_EXTRA_WAIT_S = 5.0  # beyond the gRPC deadline, before the transport itself gives up on a stuck client call


def message_bytes(obj: Any) -> int:
    """Serialized protobuf size of a protocol dataclass (0 for plain values such as a checkpoint path)."""
    try:
        return codec.to_proto(obj).ByteSize()
    except Exception:  # health/checkpoint replies are plain values, not dataclasses
        return len(obj.encode()) if isinstance(obj, str) else 0


class GrpcTransport(Transport):
    """Talks to ``addresses`` (``{org_id: "HOST:PORT" | "unix:/PATH"}``) over gRPC.

    ``tls``: mutual TLS for every worker (one :class:`ClientTLS`) or per org (``{org: ClientTLS}``); an org
    without one is dialled in plaintext, which only a ``unix:`` or loopback address allows (ValueError otherwise).
    ``secrets``: ``{org: link secret}`` for workers started with ``--insecure``
    (:attr:`~hacrl_fed.coordinator.launcher.WorkerProcesses.secrets`).
    """

    def __init__(
        self,
        addresses: Mapping[str, str],
        *,
        max_message_mb: int = MAX_MESSAGE_MB,
        tls: ClientTLS | Mapping[str, ClientTLS] | None = None,
        secrets: Mapping[str, str] | None = None,
    ):
        if not addresses:
            raise ValueError("GrpcTransport needs at least one worker address")
        self.addresses = dict(addresses)
        per_org = tls if isinstance(tls, Mapping) else {org: tls for org in self.addresses}
        self.clients = {
            org: GrpcWorkerClient(
                addr,
                org_id=org,
                timeout_s=None,
                max_message_mb=max_message_mb,
                tls=per_org.get(org),
                secret=(secrets or {}).get(org),
            )
            for org, addr in self.addresses.items()
        }
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="grpc-transport")
        self.last_call_bytes: dict[str, int] = {}
        self.last_call_seconds: dict[str, float] = {}

    def org_ids(self) -> list[str]:
        return list(self.clients)

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, dict[str, str] | Exception]:
        """Health-check every worker in parallel (waiting for them to listen); ``{org: health dict | error}``.

        A worker that serves another org id than the one it is registered under is an error.
        """
        replies = self._fan_out({org: None for org in self.clients}, lambda c, _: c.wait_ready(timeout_s), timeout_s)
        self.note_health(replies)
        return replies

    def health(self, org_ids: list[str], timeout_s: float) -> dict[str, dict[str, str] | Exception]:
        replies = self._fan_out({org: None for org in org_ids}, lambda c, _: c.health(timeout_s=timeout_s), timeout_s)
        self.note_health(replies)
        return replies

    def _fan_out(
        self, items: Mapping[str, Any], call: Callable[[GrpcWorkerClient, Any], Any], timeout_s: float
    ) -> dict[str, Any]:
        def timed(client: GrpcWorkerClient, item: Any) -> tuple[Any, float]:
            start = time.perf_counter()
            try:
                return call(client, item), time.perf_counter() - start
            except Exception as err:
                return err, time.perf_counter() - start

        futures = {}
        results: dict[str, Any] = {}
        for org, item in items.items():
            client = self.clients.get(org)
            if client is None:
                results[org] = NoWorker(f"no gRPC worker address for org {org!r}")
            else:
                futures[org] = self._pool.submit(timed, client, item)
        self.last_call_bytes, self.last_call_seconds = {}, {}
        deadline = time.monotonic() + timeout_s + _EXTRA_WAIT_S
        for org, fut in futures.items():
            try:
                results[org], self.last_call_seconds[org] = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                fut.cancel()
                results[org] = TransportTimeout(f"org {org!r} did not answer within {timeout_s:.1f} s")
                continue
            reply = results[org]
            if not isinstance(reply, Exception):
                self.last_call_bytes[org] = message_bytes(items[org]) + message_bytes(reply)
        return results

    def _call(self, op: Operation, items: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        """One ``op`` message per org, each with the round deadline ``timeout_s`` (counted in messages_sent)."""
        self.count_messages(op.name, [org for org in items if org in self.clients])
        method = op.name
        return self._fan_out(items, lambda c, item: getattr(c, method)(item, timeout_s=timeout_s), timeout_s)

    def evaluate(self, requests: Mapping[str, EvalRequest], timeout_s: float) -> dict[str, EvalReport | Exception]:
        return self._call(ops.EVALUATE, requests, timeout_s)

    def checkpoint(self, org_ids: list[str], round: int, timeout_s: float) -> dict[str, str | Exception]:
        return self._call(ops.CHECKPOINT, {org: round for org in org_ids}, timeout_s)

    def step(self, requests: Mapping[str, StepRequest], timeout_s: float) -> dict[str, StepReply | Exception]:
        return self._call(ops.STEP, requests, timeout_s)

    def submit_step(self, org: str, request: StepRequest, timeout_s: float) -> Future[tuple[Any, float]]:
        """``org``'s step message on the pool, not waited for (asynchronous rounds take the replies as they come):
        a future of ``(reply | Exception, seconds)``; the gRPC deadline ``timeout_s`` bounds it."""
        client = self.clients.get(org)
        if client is None:
            missing: Future[tuple[Any, float]] = Future()
            missing.set_result((NoWorker(f"no gRPC worker address for org {org!r}"), 0.0))
            return missing
        self.count_messages(ops.STEP.name, [org])

        def timed() -> tuple[Any, float]:
            start = time.perf_counter()
            try:
                return client.step(request, timeout_s=timeout_s), time.perf_counter() - start
            except Exception as err:
                return err, time.perf_counter() - start

        return self._pool.submit(timed)

    def close(self) -> None:
        """Close every channel and the thread pool (idempotent)."""
        for client in self.clients.values():
            client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
