"""Run outputs: per-round metrics (JSONL + TensorBoard), the held-out accuracy plot and the final table.

Files under ``run_dir``:

- ``metrics.jsonl``: one JSON object per :meth:`RunLogger.log` call, ``{"round": t, "wall_time": unix_s,
  <name>: value, ...}``; non-finite values are written as ``null`` (strict JSON).
- ``tb/``: TensorBoard event files, one scalar per metric name with ``step = round``.
- ``wandb/``: with ``wandb.enabled``, the W&B run of the same metrics (:mod:`hacrl_fed.loggers.wandb`).
- ``accuracy.png``: ``eval/<org>/accuracy`` against round, one line per org (:func:`plot_accuracy`).

Also the progress lines every entry point logs: :func:`format_round` (one per round), :func:`format_eval` (after
each evaluation) and :func:`format_table` (the final table).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hacrl_fed.results import RoundResult, RunSummary
from hacrl_fed.run_files import METRICS_FILE

log = logging.getLogger(__name__)

EVAL_KEY = re.compile(r"^eval/(?P<org>[^/]+)/accuracy$")


def _clean(value: Any) -> float | None:
    """A metric value as a JSON-safe float (None for NaN/inf); raises TypeError for non-numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"metric values must be numbers, got {type(value).__name__}")
    number = float(value)
    return number if math.isfinite(number) else None


class RunLogger:
    """Appends metrics to ``run_dir/metrics.jsonl`` and TensorBoard scalars to ``run_dir/tb``.

    ``tensorboard=False`` skips the event files (and the torch import they need). ``sinks``: further loggers
    (:mod:`hacrl_fed.loggers`, e.g. W&B), each given every round's metrics (``log(round, metrics)``, the keys and
    values of the JSONL line) and closed with this one.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._writer = None
        self.sinks: list[Any] = []
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # heavy import: only when asked for

            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tb"))

    def log(self, round: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` for ``round``: one JSONL line and one TensorBoard scalar per finite value."""
        clean: dict[str, float | None] = {}
        for name, value in metrics.items():
            try:
                clean[str(name)] = _clean(value)
            except TypeError as err:
                raise TypeError(f"metric {name!r}: {err}") from None
        record = {"round": int(round), "wall_time": time.time(), **clean}
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        if self._writer is not None:
            for name, scalar in clean.items():
                if scalar is not None:
                    self._writer.add_scalar(name, scalar, global_step=int(round))
            self._writer.flush()
        for sink in self.sinks:
            sink.log(int(round), clean)

    def close(self) -> None:
        while self.sinks:
            self.sinks.pop().close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``run_dir/metrics.jsonl`` in file order (empty list when there is none)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def drop_rows_after(run_dir: str | Path, round: int) -> int:
    """Rewrite ``run_dir/metrics.jsonl`` (atomically) without the rows of rounds after ``round`` and any line that
    does not parse (a kill mid-append); returns how many lines went. A resume from the state after ``round`` runs
    the later rounds again: a kill between a round's metrics line and its state write would log it twice."""
    from hacrl_fed.fsio import write_atomic

    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    keep = [line for line in lines if line.strip() and _row_round(line) <= round]
    if len(keep) < len(lines):
        write_atomic(path, "".join(line if line.endswith("\n") else line + "\n" for line in keep))
        log.warning("resume: dropped the metric rows after round %d (they are run again)", round)
    return len(lines) - len(keep)


def _row_round(line: str) -> float:
    """The ``round`` of a metrics line; infinity for a line that does not parse."""
    try:
        return int(json.loads(line)["round"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def eval_curves(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """``{org: [(round, accuracy), ...]}`` from ``eval/<org>/accuracy`` entries, sorted by round.

    A round logged twice (a resumed run re-evaluating) keeps the later value.
    """
    curves: dict[str, dict[int, float]] = {}
    for rec in records:
        for key, value in rec.items():
            m = EVAL_KEY.match(key)
            if m and value is not None:
                curves.setdefault(m["org"], {})[int(rec["round"])] = float(value)
    return {org: sorted(points.items()) for org, points in sorted(curves.items())}


def plot_accuracy(run_dir: str | Path, title: str | None = None) -> Path:
    """Write ``run_dir/accuracy.png``: held-out accuracy vs round per org (Agg backend), titled ``title`` (default:
    the run dir's name), rounds on integer ticks; returns its path."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    curves = eval_curves(read_metrics(run_dir))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for org, points in curves.items():
        rounds, accs = zip(*points)
        ax.plot(rounds, accs, marker="o", label=org)
    ax.set_title(title or f"held-out accuracy: {Path(run_dir).absolute().name}")
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no evaluations logged", ha="center", va="center", transform=ax.transAxes)
    out = Path(run_dir) / "accuracy.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3f}"


def format_table(summary: RunSummary) -> str:
    """The final per-org table: accuracy before → after (held-out, greedy), delta, rollouts shared (accepted
    from this org), rollouts received (foreign rollouts it trained on), worker time in seconds; then one line per
    org excluded from the pool, with why."""
    header = ("org", "accuracy before -> after", "delta", "shared", "received", "time_s")
    rows = [header]
    for org, s in summary.orgs.items():
        before, after = s.accuracy_before, s.accuracy_after
        delta = None if before is None or after is None else after - before
        rows.append(
            (
                org,
                f"{_fmt(before)} -> {_fmt(after)}",
                "n/a" if delta is None else f"{delta:+.3f}",
                str(s.rollouts_shared),
                str(s.rollouts_received),
                f"{s.time_s:.1f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    foot = (
        f"run {summary.run_id}: {summary.rounds_completed} rounds ({summary.skipped_rounds} skipped), "
        f"{summary.wall_time_s:.1f} s"
    )
    excluded = [
        f"{org} EXCLUDED from the pool: {s.excluded}" for org, s in summary.orgs.items() if getattr(s, "excluded", None)
    ]
    return "\n".join(lines + [foot] + excluded)


def format_round(result: RoundResult, total: int, seconds: float, excluded: Mapping[str, str] | None = None) -> str:
    """One progress line for a finished round (a :class:`~hacrl_fed.results.RoundResult`): batch reward
    (mean verified reward of the accepted rollouts) per replying org, accepted / rejected rollouts per org, orgs
    that contributed nothing and why, orgs excluded from the pool, and the round's wall time."""
    m = result.metrics
    parts = [f"round {result.round}/{total} in {seconds:.1f} s"]
    if result.skipped:
        parts.append(f"SKIPPED ({len(result.replied)} valid replies)")
    if result.accuracy:
        parts.append("reward " + " ".join(f"{org} {acc:.3f}" for org, acc in result.accuracy.items()))

    def counts(key: str) -> str:
        found = {
            k.split("/")[1]: int(v)
            for k, v in m.items()
            if k.startswith("round/") and k.endswith(f"/rollouts_{key}") and v
        }
        return " ".join(f"{org} {n}" for org, n in found.items())

    for key in ("accepted", "rejected"):
        text = counts(key)
        if text:
            parts.append(f"{key} {text}")
    failed = {org: why for org, why in result.failed.items() if why != "excluded"}
    if failed:
        parts.append("no rollouts from " + " ".join(f"{org} ({why})" for org, why in failed.items()))
    if result.trained:
        parts.append("trained " + " ".join(result.trained))
    if excluded:
        parts.append("excluded " + " ".join(f"{org} ({why})" for org, why in excluded.items()))
    return " | ".join(parts)


def format_eval(round: int, accuracy: Mapping[str, float], before: Mapping[str, float] | None = None) -> str:
    """The held-out accuracy table logged after an evaluation: one line per org, with its round-0 accuracy and the
    change since when ``before`` (round 0's accuracies) is given and ``round > 0``."""
    if not accuracy:
        return f"eval at round {round}: no org answered"
    mean = sum(accuracy.values()) / len(accuracy)
    head = f"eval at round {round}: held-out accuracy (greedy), mean {mean:.3f}"
    width = max(len(org) for org in accuracy)
    lines = [head]
    for org, acc in accuracy.items():
        start = (before or {}).get(org)
        if round > 0 and start is not None:
            lines.append(f"  {org.ljust(width)}  {start:.3f} -> {acc:.3f}  ({acc - start:+.3f})")
        else:
            lines.append(f"  {org.ljust(width)}  {acc:.3f}")
    return "\n".join(lines)


def round_progress(total: int, *, enabled: bool = True):
    """A tqdm bar over rounds and the Coordinator ``on_round`` callback that advances it (postfix: per-org
    batch accuracy, or why the round was skipped)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="rounds", unit="round", disable=not enabled, dynamic_ncols=True)

    def on_round(result: RoundResult) -> None:
        if result.skipped:
            bar.set_postfix_str(f"round {result.round} skipped ({len(result.replied)} replies)")
        else:
            bar.set_postfix({org: f"{acc:.2f}" for org, acc in result.accuracy.items()})
        bar.update(1)

    return bar, on_round
