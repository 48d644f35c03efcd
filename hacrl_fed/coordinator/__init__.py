"""The coordinator: round loop (:mod:`.loop`) with its books (:mod:`.bookkeeping`, :mod:`.round_metrics`,
:mod:`.state_file`), the pool's trust checks (:mod:`.trust`), and transports; what a run reports is
:mod:`hacrl_fed.results`. Prompt sampling and batch screening, shared with the workers, are in
:mod:`hacrl_fed.plan`.

Names are imported lazily so that ``import hacrl_fed.coordinator`` stays cheap and the gRPC transport (grpcio)
and launcher load only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Coordinator": ".loop",
    "FederationError": ".loop",
    "RoundResult": "hacrl_fed.results",
    "RunSummary": "hacrl_fed.results",
    "OrgSummary": "hacrl_fed.results",
    "Transport": ".transport",
    "TransportTimeout": ".transport",
    "InProcessTransport": ".inprocess",
    "GrpcTransport": ".grpc_transport",
    "WorkerProcesses": ".launcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
