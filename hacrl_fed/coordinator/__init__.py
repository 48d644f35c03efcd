"""The coordinator: round loop (:mod:`.loop`), its results (:mod:`.results`), the pool's trust checks
(:mod:`.trust`), and transports. Prompt sampling and batch screening, shared with the workers, are in
:mod:`hacrl_fed.plan`.

Names are imported lazily so that ``import hacrl_fed.coordinator`` stays cheap and the gRPC transport (grpcio)
and launcher load only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Coordinator": "loop",
    "FederationError": "loop",
    "RoundResult": "results",
    "RunSummary": "results",
    "OrgSummary": "results",
    "Transport": "transport",
    "TransportTimeout": "transport",
    "InProcessTransport": "inprocess",
    "GrpcTransport": "grpc_transport",
    "WorkerProcesses": "launcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
