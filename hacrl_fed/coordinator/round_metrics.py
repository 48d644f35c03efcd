"""The round's metric keys (docs/METRICS.md), written in one place: pure functions that add entries to a round's
metrics dict from what the round loop collected. No transport and no state: each takes the values it reads."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hacrl_fed.types import FINISH_STOP, EvalReport, Rollout, RolloutBatch


def numeric(metrics: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """``{prefix + name: float(value)}`` for the numeric entries of a reported metrics dict (others dropped)."""
    return {
        f"{prefix}{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def call_metrics(
    phase: str, seconds: Mapping[str, float], sizes: Mapping[str, int], orgs: Any, metrics: dict[str, float]
) -> None:
    """``time/call/<phase>/<org>`` of the orgs in ``orgs`` and ``bytes/<phase>/<org>`` / ``bytes/<phase>/total``
    (summed: a round may send two messages of one phase)."""
    for org, secs in seconds.items():
        if org in orgs:
            metrics[f"time/call/{phase}/{org}"] = float(secs)
    for org, n in sizes.items():
        metrics[f"bytes/{phase}/{org}"] = metrics.get(f"bytes/{phase}/{org}", 0.0) + float(n)
    if sizes:
        metrics[f"bytes/{phase}/total"] = metrics.get(f"bytes/{phase}/total", 0.0) + float(sum(sizes.values()))


def exchange_time(phase: str, org: str, worker_metrics: Mapping[str, Any], metrics: dict[str, float]) -> None:
    """``time/exchange/<phase>/<org>``: the transport's call time minus the worker's own reported compute
    (its ``time/*`` metrics, top-level phases only) = serialization, transport and queueing overhead."""
    call = metrics.get(f"time/call/{phase}/{org}")
    if call is None:
        return
    compute = sum(
        float(v)
        for k, v in worker_metrics.items()
        if k.startswith("time/")
        and k.count("/") == 1
        and k != "time/update"
        and isinstance(v, (int, float))
        and math.isfinite(v)
    )
    metrics[f"time/exchange/{phase}/{org}"] = max(0.0, call - compute)


def batch_metrics(
    org: str, batch: RolloutBatch, ok: list[Rollout], rejected: Mapping[str, int], accuracy: float | None
) -> dict[str, float]:
    """What the coordinator's screening of ``org``'s batch kept and dropped, its ``P_k(t)`` and the worker's own
    metrics."""
    out = {
        f"round/{org}/rollouts_received": float(len(ok) + sum(rejected.values())),
        f"round/{org}/rollouts_accepted": float(len(ok)),
        f"round/{org}/rollouts_rejected": float(sum(rejected.values())),
        f"round/{org}/failed": 0.0 if ok else 1.0,
    }
    out.update({f"round/{org}/rejected/{reason}": float(n) for reason, n in rejected.items()})
    rollouts = getattr(batch, "rollouts", ()) or ()
    if rollouts:  # ended on one of the org's stop ids (finish_reason "stop") before max_new_tokens
        out[f"round/{org}/stopped_frac"] = sum(r.finish_reason == FINISH_STOP for r in rollouts) / len(rollouts)
    if accuracy is not None:
        out[f"round/{org}/accuracy"] = accuracy
        reported = getattr(batch, "accuracy", None)
        if isinstance(reported, (int, float)) and math.isfinite(reported):
            out[f"round/{org}/accuracy_discrepancy"] = float(reported) - accuracy
    out.update(numeric(getattr(batch, "metrics", {}) or {}, f"{org}/"))
    return out


def failure_metrics(failed: Mapping[str, str], metrics: dict[str, float]) -> None:
    """``round/<org>/failed`` and ``round/<org>/failure/<why>`` of every org that contributed nothing."""
    for org, why in failed.items():
        metrics[f"round/{org}/failed"] = 1.0
        metrics[f"round/{org}/failure/{why}"] = 1.0


def train_metrics(org: str, why: str | None, report_metrics: Mapping[str, Any], metrics: dict[str, float]) -> None:
    """``round/<org>/train_failed`` (with ``train_failure/<why>`` when ``why``) and the report's own metrics."""
    metrics[f"round/{org}/train_failed"] = 0.0 if why is None else 1.0
    if why is not None:
        metrics[f"round/{org}/train_failure/{why}"] = 1.0
    metrics.update(numeric(report_metrics, f"{org}/"))


def valid_accuracy(reply: Any) -> float | None:
    """The accuracy of an :class:`EvalReport`, or None for anything else (a failure, a value outside [0, 1])."""
    ok = isinstance(reply, EvalReport) and isinstance(reply.accuracy, (int, float)) and math.isfinite(reply.accuracy)
    return float(reply.accuracy) if ok and 0.0 <= reply.accuracy <= 1.0 else None


def eval_metrics(reports: Mapping[str, EvalReport], metrics: dict[str, float]) -> dict[str, float]:
    """``eval/<org>/accuracy`` and the worker's ``eval/<org>/...`` metrics of the valid ``reports``,
    ``eval/mean_accuracy``; returns ``{org: accuracy}``."""
    accs = {org: float(r.accuracy) for org, r in reports.items()}
    for org, report in reports.items():
        metrics[f"eval/{org}/accuracy"] = accs[org]
        metrics.update(numeric(report.metrics, f"eval/{org}/"))
    if accs:
        metrics["eval/mean_accuracy"] = sum(accs.values()) / len(accs)
    return accs


def close_metrics(
    capability: Mapping[str, float],
    trust: Mapping[str, float],
    counts: tuple[int, int, bool],
    elapsed_s: float,
    messages: Mapping[str, int],
    metrics: dict[str, float],
) -> None:
    """A round's summary: capabilities, the trust guard's counters, ``round/orgs_replied`` / ``orgs_trained`` /
    ``skipped`` (``counts``), ``time/round`` and ``round/<org>/messages``."""
    replied, trained, skipped = counts
    metrics.update({f"capability/{org}": v for org, v in capability.items()})
    metrics.update(trust)
    metrics.update(
        {
            "round/orgs_replied": float(replied),
            "round/orgs_trained": float(trained),
            "round/skipped": float(skipped),
            "time/round": elapsed_s,
        }
    )
    metrics.update({f"round/{org}/messages": float(n) for org, n in messages.items()})
