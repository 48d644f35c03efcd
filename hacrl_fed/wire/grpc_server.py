"""The ``PolicyWorker`` gRPC service: serves any :class:`~hacrl_fed.worker.api.WorkerAPI` object over the network.

``serve_worker(worker, "unix:/run/hacrl/acme.sock")`` starts a server and returns it; ``hacrl-fed worker --config
RUN.yaml --org ID --listen ADDRESS [LINK FLAGS] [--set K=V] [--run-dir DIR] [--resume]`` (:mod:`hacrl_fed.cli.worker`),
which builds the real worker with ``hacrl_fed.worker.build_worker`` and serves it until SIGTERM /
SIGINT.

The link (who may call the worker):

* ``--listen unix:/PATH`` (recommended: the worker and its SuperNode share a host): the socket is chmod 0600
  right after bind; its directory is created 0700 when missing, and refused when it is group/other-writable or
  belongs to another user.
* ``--listen HOST:PORT`` needs mutual TLS, ``--tls-cert PEM --tls-key PEM --tls-ca PEM`` (the worker's
  certificate and key, and the CA that signs allowed clients; a client without a certificate from that CA fails
  the handshake), optionally pinned to client certificate common names with ``--tls-client-name NAME``; or, on a
  loopback host only (127.0.0.0/8, ``::1``, ``localhost``), ``--insecure``, and then every call must carry the
  per-launch link secret (``--secret-file``, :mod:`hacrl_fed.wire.link_secret`): another local process cannot
  drive the worker. Anything else exits 2.
* The Python API (:func:`serve_worker`) takes ``tls=WorkerTLS(...)`` / ``insecure=``; a plaintext loopback TCP
  address is allowed there without ``insecure`` (tests), a non-loopback one never. ``insecure=True`` is the CLI's
  ``--insecure`` and needs its ``secret=`` too (ListenError without one: no unauthenticated plaintext by flag).

Behaviour:

* Requests arrive as raw bytes and are decoded (and checked) by :func:`hacrl_fed.wire.codec.decode` before the
  worker sees them: undecodable bytes or a failed check -> INVALID_ARGUMENT naming the problem, logged as one line.
* One handler per operation of :data:`hacrl_fed.wire.operations.OPERATIONS` (the service name and message kinds
  come from the generated descriptor). Generate / Train / Evaluate / Checkpoint / Step run one at a time under a
  lock (the worker owns one model); a call whose client gave up while waiting for the lock is dropped (CANCELLED)
  instead of run. A running call is inside :func:`hacrl_fed.cancel.cancel_scope`, so worker code that
  calls ``raise_if_cancelled()`` stops once the client cancels or its deadline passes (CANCELLED /
  DEADLINE_EXCEEDED). Health skips the lock so a busy worker still answers it: ``worker.health()`` must be cheap
  and thread-safe; while a locked call runs its reply carries ``busy: "1"`` (``operations.BUSY_KEY``: a rejoin
  waits until the worker is idle). The deprecated Generate / Train are served by the worker's ``step`` with that
  half alone (:func:`hacrl_fed.wire.operations.serve_half`).
* Every call is logged as one line: a successful one at INFO with its rpc, round and seconds (Health only at
  DEBUG: clients poll it), a failed one as below.
* Worker exceptions become gRPC statuses carrying ``"<ExceptionType>: <message>"`` (never a traceback):
  ValueError (WireError included) -> INVALID_ARGUMENT, NotImplementedError -> UNIMPLEMENTED, other RuntimeError
  -> FAILED_PRECONDITION, all logged as one line; anything else -> INTERNAL, logged with its traceback. A reply
  the codec cannot encode is the worker's fault: INTERNAL.
* Message size limits (send and receive) are raised to ``max_message_mb`` on the server; the client does the same.
  ``hacrl-fed worker`` lowers the receive limit to what its plan can need (:func:`hacrl_fed.wire.bounds.
  max_request_bytes`), so an oversized request is refused before it is read into memory, and with signing on the
  unsigned ``TrainRequest.foreign`` (ignored then) is counted, never decoded.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from hacrl_fed import failures
from hacrl_fed.cancel import CallCancelled, cancel_scope, cancelled
from hacrl_fed.limits import MAX_MESSAGE_MB
from hacrl_fed.wire import codec
from hacrl_fed.wire.operations import BUSY_KEY, BY_RPC, HEALTH, SERVICE

# a WorkerAPI object (hacrl_fed.worker.api): the wire never imports the worker (tests/test_layers.py)
WorkerAPI = Any

log = logging.getLogger(__name__)

MAX_DETAILS_CHARS = 2000  # status details travel in trailing metadata (about 8 KiB allowed by default)
_MAX_MESSAGE_MB = 2047  # gRPC lengths are signed 32-bit ints
_NO_DEADLINE_S = 1e9  # grpc reports "no deadline" as a huge time_remaining() (about 9.2e18 s)
_DEADLINE_SLACK_S = 0.05  # a call cancelled this close to its deadline was cancelled by the deadline
LOOPBACK_NAMES = ("localhost",)


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
    """The status details of a failed call: ``[cause] Type: message`` (:func:`hacrl_fed.failures.describe`), so the
    caller gets the failure's cause (``stale_round`` ...) without reading the message."""
    text = failures.describe(err)
    return text if len(text) <= MAX_DETAILS_CHARS else text[: MAX_DETAILS_CHARS - 3] + "..."


# ------------------------------------------------------------------------------------------- the link


class ListenError(ValueError):
    """A listen address / TLS setting this worker refuses (one line saying what to change)."""


def read_pem(path: str | Path, what: str) -> bytes:
    """The bytes of PEM file ``path``; ListenError naming ``what`` (e.g. ``--tls-cert``) when unreadable / not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ListenError(f"{what} {path}: cannot read it ({err.strerror or err})") from None
    if b"-----BEGIN " not in data:
        raise ListenError(f"{what} {path}: not a PEM file")
    return data


@dataclass(frozen=True)
class WorkerTLS:
    """Mutual TLS for a worker: its certificate and key, and the CA whose certificates clients must present.

    ``client_names``: if not empty, a client certificate's common name must also be one of these (e.g.
    ``acme-client``: with one CA for every org, this keeps other orgs' clients out).
    """

    cert: str | Path
    key: str | Path
    ca: str | Path
    client_names: tuple[str, ...] = ()

    def server_credentials(self) -> grpc.ServerCredentials:
        """grpc credentials requiring a client certificate signed by ``ca`` (ListenError for unreadable files)."""
        pair = (read_pem(self.key, "--tls-key"), read_pem(self.cert, "--tls-cert"))
        return grpc.ssl_server_credentials(
            [pair], root_certificates=read_pem(self.ca, "--tls-ca"), require_client_auth=True
        )


def tcp_host(address: str) -> str:
    """The host of ``HOST:PORT`` / ``[V6]:PORT`` (ListenError when there is no ``:PORT``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ListenError(f"listen address {address!r} must be HOST:PORT or unix:/PATH")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ``::1`` or ``localhost``; anything else (``0.0.0.0``, ``""``, other names) is not."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_address(address: str) -> bool:
    """Whether plaintext to ``address`` stays on this host: a ``unix:`` socket or a loopback ``HOST:PORT``."""
    if address.startswith("unix:"):
        return True
    try:
        return is_loopback_host(tcp_host(address))
    except ListenError:
        return False


def unix_path(address: str) -> Path:
    """The socket path of ``unix:PATH`` / ``unix:///PATH``, absolute."""
    path = address[len("unix://") :] if address.startswith("unix://") else address[len("unix:") :]
    if not path:
        raise ListenError(f"listen address {address!r}: no socket path after 'unix:'")
    return Path(path).absolute()


def check_socket_dir(directory: Path) -> None:
    """ListenError when ``directory`` exists but others could swap the socket in it (see module docstring)."""
    try:
        st = directory.stat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise ListenError(f"socket directory {directory} is not a directory")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ListenError(
            f"socket directory {directory} is writable by group/others (mode "
            f"{stat.S_IMODE(st.st_mode):o}): use a private directory (chmod 700)"
        )
    if st.st_uid not in (os.getuid(), 0):
        raise ListenError(f"socket directory {directory} belongs to uid {st.st_uid}, not to this user")


def check_listen(
    address: str, *, tls: WorkerTLS | None = None, insecure: bool = False, require_flag: bool = False
) -> None:
    """Refuse (ListenError) a listen address the link rules forbid (module docstring); binds nothing.

    ``require_flag`` (the CLI): plaintext loopback TCP needs ``insecure``; without it (the Python API) a
    loopback address is itself the opt-in.
    """
    if tls is not None and insecure:
        raise ListenError("--insecure and --tls-cert/--tls-key/--tls-ca exclude each other: pick one")
    if address.startswith("unix-abstract:"):
        raise ListenError(f"listen address {address!r}: abstract sockets have no file permissions; use unix:/PATH")
    if address.startswith("unix:"):
        check_socket_dir(unix_path(address).parent)
        return
    host = tcp_host(address)
    if tls is not None:
        return
    if not is_loopback_host(host):
        raise ListenError(
            f"listen address {address!r} is not loopback: plaintext is refused there; add --tls-cert, "
            "--tls-key and --tls-ca (mutual TLS) or listen on unix:/PATH"
        )
    if require_flag and not insecure:
        raise ListenError(
            f"listen address {address!r} is TCP without TLS: add --tls-cert, --tls-key and --tls-ca "
            "(mutual TLS), or --insecure (loopback only), or listen on unix:/PATH"
        )


def _prepare_socket_dir(path: Path) -> None:
    """Create the socket's directory 0700 if missing, then re-check it (ListenError)."""
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chmod(path.parent, 0o700)
    check_socket_dir(path.parent)


# ------------------------------------------------------------------------------------------- the service


class _Abandoned(Exception):
    """The client cancelled or its deadline passed: before the worker lock was free, or while the worker ran."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.CANCELLED):
        super().__init__(message)
        self.code = code


class _BadReply(Exception):
    """The worker returned something the codec cannot encode."""


class _Denied(Exception):
    """The client's certificate name is not one this worker accepts."""


def _remaining_s(context) -> float | None:
    """Seconds left before the caller's deadline, None when it set none."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > _NO_DEADLINE_S else max(0.0, remaining)


class PolicyWorkerServicer:
    """Delegates each RPC (raw request bytes in, reply bytes out) to a WorkerAPI object, one model call at a time."""

    def __init__(
        self, worker: WorkerAPI, *, limits: codec.WireLimits = codec.DEFAULT_LIMITS, client_names: tuple[str, ...] = ()
    ) -> None:
        self._worker = worker
        self._limits = limits
        self._client_names = tuple(client_names)
        self._lock = threading.Lock()

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """The ``hacrl_fed.v1.PolicyWorker`` handlers, one per operation of :mod:`hacrl_fed.wire.operations`;
        requests stay bytes until :meth:`_serve` decodes them."""
        handlers = {
            rpc: grpc.unary_unary_rpc_method_handler(self._handler(rpc), request_deserializer=bytes) for rpc in BY_RPC
        }
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def _handler(self, rpc: str) -> Callable[[bytes, Any], bytes]:
        return lambda data, context: self._serve(rpc, data, context)

    def _invoke(self, rpc: str, arg: Any) -> Any:
        return BY_RPC[rpc].call(self._worker, arg)

    def _serve(self, rpc: str, data: bytes, context) -> bytes:
        """Authorize -> decode -> (lock + cancel scope) -> call -> encode; a failure aborts with a mapped status."""
        op = BY_RPC[rpc]
        start = time.perf_counter()
        try:
            self._authorize(context)
            arg = codec.decode(op.request_kind, data, limits=self._limits)
            result = self._locked_call(rpc, arg, context) if op.locked else self._invoke(rpc, arg)
            if op is HEALTH and self._lock.locked():  # a rejoin waits for the call it lost (async_liveness)
                result = {**result, BUSY_KEY: "1"}
            try:
                reply = op.encode_reply(result).SerializeToString()
            except Exception as err:
                raise _BadReply(f"worker returned an unencodable {rpc} reply: {err}") from err
            log.log(
                logging.DEBUG if rpc == "Health" else logging.INFO,
                "%s%s ok in %.2f s",
                rpc,
                _round_of(arg),
                time.perf_counter() - start,
            )
            return reply
        except Exception as err:
            code, details = self._fail(rpc, err)
        context.abort(code, details)  # raises: the RPC ends here with the status
        raise AssertionError("grpc context.abort returned")  # unreachable; keeps the return type honest

    @staticmethod
    def _fail(rpc: str, err: Exception) -> tuple[grpc.StatusCode, str]:
        """Status and details for ``err``, logged: one line, or with the traceback for INTERNAL."""
        if isinstance(err, _Abandoned):
            log.warning("%s stopped (%s): %s", rpc, err.code.name, err)
            return err.code, str(err)
        if isinstance(err, _Denied):
            log.warning("%s refused (PERMISSION_DENIED): %s", rpc, err)
            return grpc.StatusCode.PERMISSION_DENIED, str(err)
        if isinstance(err, _BadReply):
            log.error("%s failed (INTERNAL): %s", rpc, err, exc_info=err.__cause__)
            return grpc.StatusCode.INTERNAL, str(err)
        code, details = status_for(err), _details(err)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed (INTERNAL): %s", rpc, details, exc_info=err)
        elif code == grpc.StatusCode.INVALID_ARGUMENT:
            log.warning("%s refused (INVALID_ARGUMENT): %s", rpc, details)
        else:
            log.error("%s failed (%s): %s", rpc, code.name, details)
        return code, details

    def _authorize(self, context) -> None:
        if not self._client_names:
            return
        names = [n.decode(errors="replace") for n in context.auth_context().get("x509_common_name", [])]
        if not any(n in self._client_names for n in names):
            raise _Denied(f"client certificate name {names or '(none)'} is not one of {list(self._client_names)}")

    def _locked_call(self, rpc: str, arg: Any, context) -> Any:
        # wait for the worker no longer than the caller's deadline: a worker stuck for many rounds must not tie
        # up every server thread (then even Health would go unanswered)
        remaining = _remaining_s(context)
        if not self._lock.acquire(timeout=-1 if remaining is None else remaining):
            raise _Abandoned(
                "the caller's deadline passed while the worker was busy with another call",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
        try:
            if not context.is_active():
                raise _Abandoned("the client gave up while the worker was busy with another call")
            with cancel_scope(context.is_active, timeout_s=_remaining_s(context)):
                try:
                    return self._invoke(rpc, arg)
                except CallCancelled as err:
                    raise _stopped(err, context) from None
        finally:
            self._lock.release()


def _round_of(request: Any) -> str:
    """`` round N`` (or ``run R round N``) for a decoded request, "" when it names no round."""
    if isinstance(request, int) and not isinstance(request, bool):  # a CheckpointRequest decodes to its round
        return f" round {request}"
    if hasattr(request, "parts"):  # a StepRequest: the rounds of its train and plan, and what rides with them
        halves = [(name, getattr(request, name)) for name in ("train", "plan") if getattr(request, name) is not None]
        rides = [f" + {name}" for name in ("evaluate", "checkpoint") if getattr(request, name) is not None]
        return "".join(f" {name} round {h.round}" for name, h in halves) + "".join(rides)
    round_ = getattr(request, "round", None)
    return "" if round_ is None else f" round {round_}"


def _stopped(err: CallCancelled, context) -> _Abandoned:
    """The worker stopped on :func:`~hacrl_fed.cancel.raise_if_cancelled`: say whether deadline or cancel.

    grpc and the cancel scope race at the deadline (either may notice first), so the time left decides.
    """
    remaining = _remaining_s(context)
    if cancelled() == "deadline" or (remaining is not None and remaining < _DEADLINE_SLACK_S):
        return _Abandoned(
            f"the caller's deadline passed; the worker stopped ({err})", grpc.StatusCode.DEADLINE_EXCEEDED
        )
    return _Abandoned(f"the caller cancelled the call; the worker stopped ({err})")


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


def _add_port(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as err:
        raise RuntimeError(f"cannot listen on {address!r}: {err}") from None


def _bind(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None) -> str:
    """Bind ``HOST:PORT`` / ``unix:PATH``; return the bound address (real port for port 0)."""
    if address.startswith("unix:"):
        path = unix_path(address)
        _prepare_socket_dir(path)
        _add_port(server, address, credentials)
        os.chmod(path, 0o600)  # grpc creates it with the umask's mode; the 0700 directory already guards it
        return address
    port = _add_port(server, address, credentials)
    if port == 0:
        raise RuntimeError(f"cannot listen on {address!r}")
    return f"{address.rsplit(':', 1)[0]}:{port}"


def serve_worker(
    worker: WorkerAPI,
    address: str,
    *,
    tls: WorkerTLS | None = None,
    insecure: bool = False,
    max_message_mb: int = MAX_MESSAGE_MB,
    ready_event: threading.Event | None = None,
    max_threads: int = 4,
    limits: codec.WireLimits = codec.DEFAULT_LIMITS,
    secret: str | None = None,
    max_receive_bytes: int | None = None,
) -> WorkerServer:
    """Start serving ``worker`` on ``address`` (``unix:/path/sock``, or ``HOST:PORT`` with ``tls`` / on loopback).

    Returns the started server (``.address`` is where it listens); stop it with ``server.stop(grace)``.
    ``ready_event`` is set once it accepts calls. SO_REUSEPORT is off, so a taken port fails loudly. Raises
    :class:`ListenError` (a ValueError) for an address or TLS setting the link rules refuse (module docstring).
    ``secret``: every call must carry it (:mod:`hacrl_fed.wire.link_secret`), else UNAUTHENTICATED.
    ``max_receive_bytes``: gRPC's receive limit, below ``max_message_mb`` (the plan's bound,
    :func:`hacrl_fed.wire.bounds.max_request_bytes`): a larger request is refused (RESOURCE_EXHAUSTED) before
    it is decoded.
    """
    check_listen(address, tls=tls, insecure=insecure)
    if insecure and secret is None:
        raise ListenError("insecure=True needs secret= (the link secret every call must carry, as --insecure makes)")
    credentials = tls.server_credentials() if tls is not None else None
    options = message_size_options(max_message_mb) + [("grpc.so_reuseport", 0)]
    if max_receive_bytes is not None:
        receive = ("grpc.max_receive_message_length", min(max_receive_bytes, max_message_mb * 2**20))
        options = [receive if k == receive[0] else (k, v) for k, v in options]
    interceptors = []
    if secret is not None:
        from hacrl_fed.wire.link_secret import SecretInterceptor

        interceptors.append(SecretInterceptor(secret))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="policy-worker"),
        options=options,
        interceptors=interceptors,
    )
    servicer = PolicyWorkerServicer(worker, limits=limits, client_names=tls.client_names if tls else ())
    server.add_generic_rpc_handlers((servicer.generic_handler(),))
    bound = _bind(server, address, credentials)
    server.start()
    if ready_event is not None:
        ready_event.set()
    link = "mutual TLS" if tls is not None else ("unix socket" if address.startswith("unix:") else "plaintext")
    log.debug("policy worker %s serving on %s (%s)", getattr(worker, "org_id", "?"), bound, link)
    return WorkerServer(server, bound)


def describe_worker(worker: WorkerAPI) -> str:
    """What a worker serves, for its start-up line: org, model (zoo name or path), parameter count, device, dtype,
    engine and where its checkpoints go."""
    org = getattr(worker, "org_id", "?")
    model, cfg = getattr(worker, "model", None), getattr(worker, "cfg", None)
    parts = [f"org {org}"]
    try:
        source = cfg.org(org).model  # type: ignore[union-attr]  # a stand-in without cfg lands in the except
        parts.append(f"model zoo:{source.zoo}" if source.zoo else f"model {source.path}")
    except Exception:  # not a PolicyWorker (a stand-in): say what is known
        pass
    if model is not None:
        params = list(model.parameters())
        n, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
        size = f"{n / 1e6:.2f} M parameters" + (f" ({trainable / 1e6:.2f} M trainable)" if trainable != n else "")
        parts += [
            size,
            f"device {params[0].device}" if params else "device ?",
            f"dtype {str(params[0].dtype).replace('torch.', '')}" if params else "dtype ?",
        ]
    gen = getattr(worker, "gen_cfg", None)
    if gen is not None:
        parts.append(f"engine {gen.engine}")
    ckpt = getattr(worker, "ckpt_base", None)
    if ckpt is not None:
        parts.append(f"checkpoints in {ckpt}")
    return ", ".join(parts)
