"""The ``PolicyWorker`` gRPC service: serves any :class:`~hacrl_fed.worker.api.WorkerAPI` object over the network.

``serve_worker(worker, "127.0.0.1:50051")`` starts a server and returns it; ``main_worker(argv)`` is
``hacrl-fed worker --config RUN.yaml --org ID --listen ADDRESS [--set K=V] [--run-dir DIR] [--resume]``,
which builds the real worker with ``hacrl_fed.worker.build_worker`` and serves it until SIGTERM / SIGINT.

Behaviour:

* Requests are decoded (and checked) by :mod:`hacrl_fed.wire.codec` before the worker sees them.
* Generate / Train / Evaluate / Checkpoint run one at a time under a lock (the worker owns one model); a call
  whose client gave up while waiting for the lock is dropped (CANCELLED) instead of run. Health skips the
  lock so a busy worker still answers it: ``worker.health()`` must be cheap and thread-safe.
* Worker exceptions become gRPC statuses carrying ``"<ExceptionType>: <message>"`` (never a traceback; the
  traceback is logged): ValueError (WireError included) -> INVALID_ARGUMENT, NotImplementedError ->
  UNIMPLEMENTED, other RuntimeError -> FAILED_PRECONDITION, anything else -> INTERNAL. A reply the codec
  cannot encode is the worker's fault: INTERNAL.
* Message size limits (send and receive) are raised to ``max_message_mb`` on the server; the client does the same.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from concurrent import futures
from typing import Any, Callable

import grpc

from hacrl_fed.v1 import worker_pb2_grpc
from hacrl_fed.wire import codec

log = logging.getLogger(__name__)

MAX_DETAILS_CHARS = 2000  # status details travel in trailing metadata (about 8 KiB allowed by default)
_MAX_MESSAGE_MB = 2047  # gRPC lengths are signed 32-bit ints


def message_size_options(max_message_mb: int) -> list[tuple[str, int]]:
    """gRPC channel / server options raising both send and receive limits to ``max_message_mb`` MiB."""
    if not 1 <= max_message_mb <= _MAX_MESSAGE_MB:
        raise ValueError(f"max_message_mb must be in [1, {_MAX_MESSAGE_MB}], got {max_message_mb}")
    n = max_message_mb * 2**20
    return [("grpc.max_send_message_length", n), ("grpc.max_receive_message_length", n)]


def status_for(err: BaseException) -> grpc.StatusCode:
    """The gRPC status a worker exception maps to (see module docstring)."""
    if isinstance(err, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    if isinstance(err, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(err, RuntimeError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


def _details(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= MAX_DETAILS_CHARS else text[: MAX_DETAILS_CHARS - 3] + "..."


class _Abandoned(Exception):
    """The client's deadline passed (or it cancelled) while the call waited for the worker lock."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.CANCELLED):
        super().__init__(message)
        self.code = code


class _BadReply(Exception):
    """The worker returned something the codec cannot encode."""


class PolicyWorkerServicer(worker_pb2_grpc.PolicyWorkerServicer):
    """Delegates each RPC to a WorkerAPI object, one model-touching call at a time."""

    def __init__(self, worker: Any, *, limits: codec.WireLimits = codec.DEFAULT_LIMITS) -> None:
        self._worker = worker
        self._limits = limits
        self._lock = threading.Lock()

    def Generate(self, request, context):  # noqa: N802 (gRPC method names)
        return self._serve("Generate", request, context, self._worker.generate, codec.to_proto)

    def Train(self, request, context):  # noqa: N802
        return self._serve("Train", request, context, self._worker.train, codec.to_proto)

    def Evaluate(self, request, context):  # noqa: N802
        return self._serve("Evaluate", request, context, self._worker.evaluate, codec.to_proto)

    def Checkpoint(self, request, context):  # noqa: N802
        return self._serve("Checkpoint", request, context, self._worker.checkpoint, codec.checkpoint_reply_to_proto)

    def Health(self, request, context):  # noqa: N802
        call = lambda _: self._worker.health()  # noqa: E731
        return self._serve("Health", request, context, call, codec.health_reply_to_proto, locked=False)

    def _serve(self, rpc: str, request, context, call: Callable, encode: Callable, *, locked: bool = True):
        """Decode -> (lock) -> call -> encode; any failure aborts the RPC with a mapped status."""
        try:
            arg = codec.from_proto(request, limits=self._limits)
            result = self._locked_call(call, arg, context) if locked else call(arg)
            try:
                return encode(result)
            except Exception as err:
                raise _BadReply(f"worker returned an unencodable {rpc} reply: {err}") from err
        except _Abandoned as err:
            code, details = err.code, str(err)
            log.warning("%s dropped: %s", rpc, details)
        except _BadReply as err:
            code, details = grpc.StatusCode.INTERNAL, str(err)
            log.error("%s failed: %s", rpc, details, exc_info=err.__cause__)
        except Exception as err:
            code, details = status_for(err), _details(err)
            log.error("%s failed (%s): %s", rpc, code.name, details, exc_info=err)
        context.abort(code, details)

    def _locked_call(self, call: Callable, arg: Any, context) -> Any:
        # wait for the worker no longer than the caller's deadline: a worker stuck for many rounds must not tie
        # up every server thread (then even Health would go unanswered)
        remaining = context.time_remaining()
        timeout = -1 if remaining is None else max(0.0, remaining)
        if not self._lock.acquire(timeout=timeout):
            raise _Abandoned("the caller's deadline passed while the worker was busy with another call",
                             grpc.StatusCode.DEADLINE_EXCEEDED)
        try:
            if not context.is_active():
                raise _Abandoned("the client gave up while the worker was busy with another call")
            return call(arg)
        finally:
            self._lock.release()


class WorkerServer(grpc.Server):
    """A started :class:`grpc.Server` plus ``address``: where it listens (the real port when asked for port 0)."""

    def __init__(self, server: grpc.Server, address: str) -> None:
        self._server = server
        self.address = address

    @property
    def port(self) -> int | None:
        """The TCP port, or None for a unix socket."""
        return None if self.address.startswith("unix:") else int(self.address.rsplit(":", 1)[1])

    def add_generic_rpc_handlers(self, generic_rpc_handlers):
        return self._server.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name, method_handlers):
        return self._server.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address):
        return self._server.add_insecure_port(address)

    def add_secure_port(self, address, server_credentials):
        return self._server.add_secure_port(address, server_credentials)

    def start(self):
        return self._server.start()

    def stop(self, grace):
        return self._server.stop(grace)

    def wait_for_termination(self, timeout=None):
        return self._server.wait_for_termination(timeout)


def _bind(server: grpc.Server, address: str) -> str:
    """Bind ``HOST:PORT`` / ``unix:PATH``; return the bound address (real port for port 0)."""
    if not address.startswith("unix:") and ":" not in address:
        raise ValueError(f"listen address {address!r} must be HOST:PORT or unix:/PATH")
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as err:
        raise RuntimeError(f"cannot listen on {address!r}: {err}") from None
    if address.startswith("unix:"):
        return address
    if port == 0:
        raise RuntimeError(f"cannot listen on {address!r}")
    return f"{address.rsplit(':', 1)[0]}:{port}"


def serve_worker(
    worker: Any,
    address: str,
    *,
    max_message_mb: int = 256,
    ready_event: threading.Event | None = None,
    max_threads: int = 4,
    limits: codec.WireLimits = codec.DEFAULT_LIMITS,
) -> WorkerServer:
    """Start serving ``worker`` on ``address`` (``127.0.0.1:PORT``, ``localhost:0``, ``unix:/path/sock``).

    Returns the started server (``.address`` is where it listens); stop it with ``server.stop(grace)``.
    ``ready_event`` is set once it accepts calls. SO_REUSEPORT is off, so a taken port fails loudly.
    """
    options = message_size_options(max_message_mb) + [("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="policy-worker"),
                         options=options)
    worker_pb2_grpc.add_PolicyWorkerServicer_to_server(PolicyWorkerServicer(worker, limits=limits), server)
    bound = _bind(server, address)
    server.start()
    if ready_event is not None:
        ready_event.set()
    log.info("policy worker %s serving on %s", getattr(worker, "org_id", "?"), bound)
    return WorkerServer(server, bound)


# ------------------------------------------------------------------------------------------- hacrl-fed worker


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hacrl-fed worker", description="Serve one organization's policy worker.")
    p.add_argument("--config", required=True, help="run config YAML (or a one-org config) naming this org")
    p.add_argument("--org", default=None, help="org id in the config (optional when it lists exactly one org)")
    p.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT (port 0 = any free) or unix:/PATH")
    p.add_argument("--set", "--override", dest="overrides", action="append", default=[],
                   metavar="SECTION.FIELD=VALUE", help="config override, as for hacrl-fed run (repeatable)")
    p.add_argument("--run-dir", default=None, help="passed to build_worker (where checkpoints go)")
    p.add_argument("--resume", action="store_true", help="passed to build_worker: resume from the latest checkpoint")
    p.add_argument("--max-message-mb", type=int, default=None, help="default: federation.max_message_mb")
    p.add_argument("--grace-s", type=float, default=10.0, help="how long a stop waits for in-flight calls")
    p.add_argument("--log-level", default="INFO")
    return p


def _pick_org(cfg: Any, org: str | None) -> str:
    ids = [o.id for o in cfg.orgs]
    if org is None:
        if len(ids) != 1:
            raise ValueError(f"--org is required: the config lists {len(ids)} orgs {ids}")
        return ids[0]
    if org not in ids:
        raise ValueError(f"--org {org!r} is not in the config (orgs: {ids})")
    return org


def main_worker(argv: list[str] | None = None) -> int:
    """``hacrl-fed worker``: build this org's worker, serve it, stop gracefully on SIGTERM / SIGINT.

    Prints ``hacrl-fed worker <org> listening on <address>`` (flushed) once it accepts calls.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from hacrl_fed.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, overrides=args.overrides)
        org_id = _pick_org(cfg, args.org)
    except (ConfigError, ValueError) as err:
        parser.exit(2, f"hacrl-fed worker: {err}\n")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    from hacrl_fed.worker import build_worker  # heavy (torch, model); only the real entry point needs it

    extra = {"run_dir": args.run_dir} if args.run_dir is not None else {}
    if args.resume:
        extra["resume"] = True
    worker = build_worker(cfg, org_id, **extra)
    max_mb = args.max_message_mb or cfg.federation.max_message_mb
    server = serve_worker(worker, args.listen, max_message_mb=max_mb)
    print(f"hacrl-fed worker {org_id} listening on {server.address}", flush=True)
    parent = os.environ.get("HACRL_FED_PARENT_PID")  # set by the launcher: stop when it is gone
    while not stop.wait(0.5):
        if parent and os.getppid() != int(parent):
            log.warning("launcher (pid %s) is gone: stopping", parent)
            break
    log.info("stopping (grace %.1f s)", args.grace_s)
    server.stop(args.grace_s).wait()
    close = getattr(worker, "close", None)
    if callable(close):
        close()
    return 0
