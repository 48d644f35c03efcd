"""What a run reports: one :class:`RoundResult` per round (``Coordinator.on_round``, the progress line) and the
final :class:`RunSummary` with an :class:`OrgSummary` per org (the final table, ``summary.txt``).

Plain data, below both the round loop that fills it (:mod:`hacrl_fed.coordinator.loop`) and the formatting that
reads it (:mod:`hacrl_fed.metrics`), so both import it and ``metrics`` imports nothing from ``coordinator/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class OrgSummary:
    accuracy_before: float | None  # held-out accuracy at round 0
    accuracy_after: float | None  # latest held-out accuracy
    rollouts_shared: int  # this org's accepted rollouts (sent to the others)
    rollouts_received: int  # foreign rollouts in this org's successful TrainRequests
    time_s: float  # time spent in this org's calls (per transport timing)
    excluded: str | None = None  # why the org was excluded from the pool (None: it was not)


@dataclass
class RunSummary:
    run_id: str
    run_dir: Path
    rounds_completed: int
    skipped_rounds: int
    orgs: dict[str, OrgSummary]
    eval_history: dict[int, dict[str, float]]
    capability: dict[str, float]
    wall_time_s: float


@dataclass
class RoundResult:
    """What one round did (passed to ``on_round``)."""

    round: int
    skipped: bool
    replied: list[str]  # orgs with at least one accepted rollout
    accuracy: dict[str, float]  # P_k(t) of the replying orgs
    trained: list[str]
    metrics: dict[str, float] = field(default_factory=dict)
    # org -> why it contributed nothing: hacrl_fed.failures.cause_of of its error, or "invalid" / "excluded"
    failed: dict[str, str] = field(default_factory=dict)
