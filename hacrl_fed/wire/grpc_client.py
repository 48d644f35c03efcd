"""``GrpcWorkerClient``: a :class:`~hacrl_fed.worker.api.WorkerAPI` whose calls go to a ``hacrl-fed worker`` process.

Every call has a deadline (the client's ``timeout_s`` unless overridden per call with ``timeout_s=``); a failed
call raises :class:`WorkerCallError` carrying the gRPC status code and details (:class:`WorkerCallTimeout`, also a
``TimeoutError``, when the deadline passed). Replies are decoded and checked by :mod:`hacrl_fed.wire.codec`, so a
malformed reply raises :class:`~hacrl_fed.wire.codec.WireError` naming the bad field.

The link: a ``unix:`` socket or a loopback ``HOST:PORT`` may be plaintext; any other address needs
``tls=ClientTLS(ca=..., cert=..., key=...)`` (mutual TLS: the worker's CA, and this client's certificate and key).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from hacrl_fed import failures
from hacrl_fed.limits import MAX_MESSAGE_MB
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
from hacrl_fed.v1 import worker_pb2_grpc
from hacrl_fed.wire import codec
from hacrl_fed.wire import operations as ops
from hacrl_fed.wire.grpc_server import is_local_address, message_size_options, read_pem
from hacrl_fed.wire.link_secret import call_metadata
from hacrl_fed.wire.operations import Operation

# Reconnect quickly after a worker (re)start instead of gRPC's default 1 s .. 120 s exponential backoff.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True)
class ClientTLS:
    """Mutual TLS towards a worker: the CA that signed its certificate, and this client's certificate and key.

    ``server_name`` overrides the name checked against the worker's certificate (``grpc.ssl_target_name_override``):
    needed when the dialled host is not among its SANs; a ``unix:`` address is checked as ``localhost``.
    """

    ca: str | Path
    cert: str | Path
    key: str | Path
    server_name: str | None = None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """grpc credentials presenting the client certificate (ValueError naming an unreadable file)."""
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "worker CA"),
            private_key=read_pem(self.key, "client key"),
            certificate_chain=read_pem(self.cert, "client certificate"),
        )

    def channel_options(self, address: str) -> list[tuple[str, str]]:
        """The target-name override for ``address`` (none when the address itself is to be checked)."""
        name = self.server_name or ("localhost" if address.startswith("unix:") else None)
        return [("grpc.ssl_target_name_override", name)] if name else []


def open_channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    """A channel to ``address``: mutual TLS with ``tls``, else plaintext, which only a local address may use."""
    if tls is not None:
        return grpc.secure_channel(
            address, tls.channel_credentials(), options=[*options, *tls.channel_options(address)]
        )
    if not is_local_address(address):
        raise ValueError(
            f"worker address {address!r} is neither unix: nor loopback: plaintext is refused there; "
            "use mutual TLS (ClientTLS: worker CA, client certificate and key)"
        )
    return grpc.insecure_channel(address, options=list(options))


_CAUSE_OF_STATUS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: failures.TIMEOUT,
    grpc.StatusCode.UNAVAILABLE: failures.UNREACHABLE,
}


class WorkerCallError(Exception):
    """A PolicyWorker RPC failed: ``code`` (grpc.StatusCode), ``details`` (server's message), ``rpc``, ``address``.

    ``failure_cause`` (:mod:`hacrl_fed.failures`): the cause the worker put in front of its details, else the one
    the status code implies (DEADLINE_EXCEEDED: timeout, UNAVAILABLE: unreachable), else ``error``."""

    def __init__(self, rpc: str, code: grpc.StatusCode, details: str, address: str) -> None:
        super().__init__(f"{rpc} on {address} failed: {code.name}: {details}")
        self.rpc = rpc
        self.code = code
        self.details = details
        self.address = address
        self.failure_cause = failures.parse(details) or _CAUSE_OF_STATUS.get(code, failures.ERROR)


class WorkerCallTimeout(WorkerCallError, TimeoutError):
    """The call's deadline passed (status DEADLINE_EXCEEDED)."""


def _call_error(rpc: str, err: grpc.RpcError, address: str) -> WorkerCallError:
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (err.details() if callable(getattr(err, "details", None)) else None) or str(err)
    cls = WorkerCallTimeout if code == grpc.StatusCode.DEADLINE_EXCEEDED else WorkerCallError
    return cls(rpc, code, details, address)


class GrpcWorkerClient:
    """WorkerAPI over gRPC to ``address`` (``HOST:PORT`` or ``unix:/PATH``).

    ``org_id`` is the org expected at that address ("" until learned from :meth:`health` / :meth:`wait_ready`,
    which also check that a given ``org_id`` matches the worker's). ``timeout_s=None`` means no deadline.
    ``tls`` switches the channel to mutual TLS; without it the address must be local (``unix:`` or loopback).
    ``secret``: the worker's link secret (:mod:`hacrl_fed.wire.link_secret`), sent with every call.
    """

    def __init__(
        self,
        address: str,
        *,
        org_id: str | None = None,
        timeout_s: float | None = 600.0,
        max_message_mb: int = MAX_MESSAGE_MB,
        limits: codec.WireLimits = codec.DEFAULT_LIMITS,
        tls: ClientTLS | None = None,
        secret: str | None = None,
    ) -> None:
        self.address = address
        self._metadata = call_metadata(secret)
        self.org_id = org_id or ""
        self.timeout_s = timeout_s
        self._limits = limits
        options = message_size_options(max_message_mb) + _RECONNECT_OPTIONS
        self._channel = open_channel(address, tls, options)
        self._stub = worker_pb2_grpc.PolicyWorkerStub(self._channel)
        self._closed = False

    # -- WorkerAPI ---------------------------------------------------------------------------------------------

    def step(self, request: StepRequest, *, timeout_s: float | None = None) -> StepReply:
        return self._call(ops.STEP, request, timeout_s)

    def evaluate(self, request: EvalRequest, *, timeout_s: float | None = None) -> EvalReport:
        return self._call(ops.EVALUATE, request, timeout_s)

    def health(self, *, timeout_s: float | None = None) -> dict[str, str]:
        return self._learn_org(self._call(ops.HEALTH, None, timeout_s))

    def checkpoint(self, round: int, *, timeout_s: float | None = None) -> str:
        return self._call(ops.CHECKPOINT, round, timeout_s)

    # -- the deprecated halves of Step (still served by every worker) ------------------------------------------

    def generate(self, plan: RoundPlan, *, timeout_s: float | None = None) -> RolloutBatch:
        """Deprecated ``Generate``: the worker's step with ``plan`` alone."""
        return self._call(ops.GENERATE, plan, timeout_s)

    def train(self, request: TrainRequest, *, timeout_s: float | None = None) -> TrainReport:
        """Deprecated ``Train``: the worker's step with ``request`` alone."""
        return self._call(ops.TRAIN, request, timeout_s)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float = 30.0) -> dict[str, str]:
        """Block until the worker answers Health (waiting for it to start listening); return its health dict.

        Raises :class:`WorkerCallTimeout` if it does not answer within ``timeout_s``.
        """
        info = self._call(ops.HEALTH, None, timeout_s, wait_for_ready=True)
        return self._learn_org(info)

    def close(self) -> None:
        """Close the channel (idempotent); later calls raise WorkerCallError(CANCELLED)."""
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> GrpcWorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GrpcWorkerClient({self.address!r}, org_id={self.org_id!r})"

    # -- internals ---------------------------------------------------------------------------------------------

    def _call(self, op: Operation, request: Any, timeout_s: float | None, *, wait_for_ready: bool = False) -> Any:
        if self._closed:
            raise WorkerCallError(op.rpc, grpc.StatusCode.CANCELLED, "client is closed", self.address)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        message = op.encode_request(request)
        try:
            reply = getattr(self._stub, op.rpc)(
                message, timeout=timeout, wait_for_ready=wait_for_ready, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise _call_error(op.rpc, err, self.address) from None
        return codec.from_proto(reply, limits=self._limits)

    def _learn_org(self, info: dict[str, str]) -> dict[str, str]:
        reported = info.get("org_id", "")
        if self.org_id and reported and reported != self.org_id:
            raise WorkerCallError(
                "Health",
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker serves org {reported!r}, expected {self.org_id!r}",
                self.address,
            )
        if not self.org_id:
            self.org_id = reported
        return info
