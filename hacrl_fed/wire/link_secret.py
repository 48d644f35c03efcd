"""A per-launch secret for a plaintext loopback worker link (``hacrl-fed worker --insecure``).

Loopback TCP is reachable by every process on the host, so ``--insecure`` alone would let any local process drive
the worker. With a secret, every call must carry it in the call metadata ``hacrl-link-secret``; the worker's
server interceptor (:class:`SecretInterceptor`) compares it in constant time (:func:`hmac.compare_digest`) before
anything else runs and answers UNAUTHENTICATED otherwise (the request is never decoded).

The secret lives in a file of mode 0600 (64 hex characters, 256 random bits): the launcher
(:class:`~hacrl_fed.coordinator.launcher.WorkerProcesses`) and ``hacrl-fed deploy-local`` create a fresh one per
launch and pass ``--secret-file`` to the worker; a hand-started ``--insecure`` worker without ``--secret-file``
creates one in a fresh private directory and prints its path. Clients read the same file
(``GrpcWorkerClient(secret=...)``, ``hacrl-fed run --worker-secret ORG=FILE``, the SuperNode's
``worker-secret-file``). A unix socket (owner-only) and mutual TLS need no secret.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Any

import grpc

METADATA_KEY = "hacrl-link-secret"
SECRET_BYTES = 32


class SecretError(ValueError):
    """A secret file that cannot be used (unreadable, readable by group/others, not a secret); one line."""


def create_secret_file(path: str | Path) -> str:
    """Write a fresh secret to ``path`` (mode 0600, replacing an older file); returns the secret."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_hex(SECRET_BYTES)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.replace(tmp, path)
    return secret


def read_secret_file(path: str | Path) -> str:
    """The secret in ``path``; SecretError when it is missing, group/other-readable or not 64 hex characters."""
    path = Path(path)
    try:
        st = path.stat()
        text = path.read_text(errors="replace").strip() if st.st_size <= 1024 else ""
    except OSError as err:
        raise SecretError(f"secret file {path}: cannot read it ({err.strerror or err})") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(
            f"secret file {path} is readable by group/others (mode {stat.S_IMODE(st.st_mode):o}): chmod 600"
        )
    if len(text) != 2 * SECRET_BYTES or any(c not in "0123456789abcdef" for c in text):
        raise SecretError(f"secret file {path} does not hold a secret (64 hex characters)")
    return text


def worker_secret(path: str | Path | None) -> tuple[str, Path]:
    """``(secret, file)`` for a worker: read ``path`` when it exists, else create it there; with no path, create
    it in a fresh private directory (``hacrl-worker-*`` in the temp dir)."""
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="hacrl-worker-")) / "link.secret"  # mkdtemp: mode 0700
        return create_secret_file(path), path
    path = Path(path)
    return (read_secret_file(path) if path.exists() else create_secret_file(path)), path


def call_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with every call (none without a secret)."""
    return ((METADATA_KEY, secret),) if secret else ()


def _deny(request: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong link secret (see --secret-file)")


class SecretInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose ``hacrl-link-secret`` metadata is not the worker's secret.

    ``refused`` counts the refused calls (a spy for tests and logs)."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("SecretInterceptor needs a non-empty secret")
        self._secret = secret.encode()
        self.refused = 0
        self._deny = grpc.unary_unary_rpc_method_handler(_deny)  # the request stays raw bytes, never decoded

    def intercept_service(self, continuation, handler_call_details):
        given = next((v for k, v in handler_call_details.invocation_metadata or () if k == METADATA_KEY), "")
        raw = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(raw, self._secret):
            return continuation(handler_call_details)
        self.refused += 1
        return self._deny
