"""Cooperative cancellation of a worker call: work stops when its caller cancels or its deadline passes.

A transport that serves a worker (the gRPC server) runs each call inside :func:`cancel_scope` with a predicate
that says whether the caller is still waiting (``grpc.ServicerContext.is_active``) and, optionally, the caller's
deadline. The worker calls :func:`raise_if_cancelled` between units of work (generation batches, scoring,
optimizer steps); outside any scope it never raises, so in-process calls are unaffected.

The scope lives in a :class:`contextvars.ContextVar`, so concurrent calls in other threads do not see it and the
worker API keeps its signatures.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class CallCancelled(RuntimeError):
    """The caller cancelled the call or its deadline passed; the worker stopped before finishing the work."""


@dataclass(frozen=True)
class _Scope:
    is_active: Callable[[], bool] | None
    deadline: float | None  # time.monotonic() value


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("hacrl_fed_cancel_scope", default=None)


@contextmanager
def cancel_scope(is_active: Callable[[], bool] | None = None, *, timeout_s: float | None = None) -> Iterator[None]:
    """Run the body as one cancellable call: ``is_active()`` false, or ``timeout_s`` seconds passed, cancels it."""
    deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
    token = _SCOPE.set(_Scope(is_active, deadline))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def cancelled() -> str | None:
    """Why the current call should stop (``"cancelled"`` / ``"deadline"``), or None to go on."""
    scope = _SCOPE.get()
    if scope is None:
        return None
    if scope.deadline is not None and time.monotonic() >= scope.deadline:
        return "deadline"
    if scope.is_active is not None and not scope.is_active():
        return "cancelled"
    return None


def raise_if_cancelled(where: str = "") -> None:
    """Raise :class:`CallCancelled` when the current call's caller is gone (no-op outside a scope)."""
    why = cancelled()
    if why is not None:
        what = "the caller's deadline passed" if why == "deadline" else "the caller cancelled the call"
        raise CallCancelled(f"{what}; stopped{' ' + where if where else ''}")
