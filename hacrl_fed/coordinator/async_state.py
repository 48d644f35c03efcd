"""What a resumed asynchronous run continues from (docs/ALGORITHM.md "Asynchronous rounds", "Resuming").

The asynchronous driver (:mod:`.async_driver`) keeps far more than a lock-step round: per org its planned and
published rounds, version, own batch not trained on yet, the (source, round) pairs it used or saw; the pool of
accepted batches (rows, and with signing the envelopes; in blind mode the plans); the versions issued with each
plan; the per-round capability figures; the rounds collected but not logged yet; the refusal counts, idle times
and the steps run. :func:`driver_state` writes all of it as JSON (typed objects through the wire codec,
:func:`hacrl_fed.wire.codec.encode`, as base64) and :func:`load_driver_state` reads it back.

A state is taken only at a **quiescent instant** (:func:`quiescent`): no step in flight, and every org's last
completed step checkpointed its worker (or the org has completed none). Then every worker's newest checkpoint is
exactly the state the driver saw, so a resume re-runs nothing twice and skips nothing. With the orgs' step
durations equal (the default) every instant after a step that trained is quiescent when
``federation.checkpoint_every`` is 1; with unequal durations the instants their steps end together. A worker that
went on after the state (steps started after it, before the kill) wrote newer checkpoints:
:func:`align_checkpoints` removes them before the workers are built, so each resumes at the state's step.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hacrl_fed.coordinator.async_schedule import BatchTag, Step
from hacrl_fed.fsio import fsync_dir, write_atomic
from hacrl_fed.plan.screening import Screened
from hacrl_fed.types import EvalReport, Rollout, RolloutBatch, RoundPlan
from hacrl_fed.wire.codec import decode, encode

log = logging.getLogger(__name__)

ASYNC_KEY = "async"  # the driver's state inside coordinator_state.json
ORG_FIELDS = ("planned", "level", "version", "unsure", "done", "alive", "idle_since")
VERDICT_FIELDS = ("checked", "mismatches", "verified_reward_sum", "shortfall")  # what a judgement reads of one


@dataclass
class OpenRound:
    """What round ``r`` collected until it is logged."""

    metrics: dict[str, float] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)  # org -> rollouts accepted
    accuracy: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    trained: list[str] = field(default_factory=list)
    evals: dict[str, EvalReport] = field(default_factory=dict)
    refused: dict[str, Counter[str]] = field(default_factory=dict)


class DriverView(Protocol):
    """What this module reads and puts back of the asynchronous driver (:class:`~.async_driver.AsyncDriver`,
    which imports this module)."""

    accusations: Any
    capabilities: Any
    checkpointed: dict[str, bool]
    co: Any
    envelopes: dict[BatchTag, RolloutBatch]
    finished: dict[str, float]
    held: set[BatchTag]
    idle: dict[str, float]
    issued: dict[tuple[str, int], int]
    liveness: Any
    logged: int
    lost: list[Step]
    orgs: Any
    plans: dict[BatchTag, RoundPlan]
    pool: dict[BatchTag, tuple[Rollout, ...]]
    published: list[tuple[float, BatchTag]]
    refused: dict[str, Counter[str]]
    rounds_open: Any
    steps: list[Step]
    worker_round: dict[str, int]


def _b64(obj: Any) -> str:
    return base64.b64encode(encode(obj)).decode()


def _obj(kind: type, text: str) -> Any:
    return decode(kind, base64.b64decode(text))


def _tag(tag: BatchTag | None) -> list[Any] | None:
    return None if tag is None else [tag.source, tag.round, tag.version]


def _untag(raw: Any) -> BatchTag | None:
    return None if raw is None else BatchTag(str(raw[0]), int(raw[1]), int(raw[2]))


def _step(step: Step) -> dict[str, Any]:
    return {**dataclasses.asdict(step), "own": _tag(step.own), "foreign": [_tag(t) for t in step.foreign]}


def _unstep(raw: dict[str, Any]) -> Step:
    own, foreign = _untag(raw["own"]), tuple(_untag(t) for t in raw["foreign"])
    return Step(raw["org"], raw["start"], raw["end"], raw["round"], raw["version"], own, foreign)  # type: ignore[arg-type]


def quiescent(driver: DriverView) -> bool:
    """Whether the driver may be saved now: no step in flight, and every org that completed a step had that step
    checkpoint its worker (module docstring)."""
    excluded = driver.co.guard.excluded  # never steps again: its worker's state no longer matters
    return all(o.busy is None for o in driver.orgs.values()) and all(
        driver.checkpointed.get(name, True) or name in excluded for name in driver.orgs
    )


def driver_state(driver: DriverView, now: float) -> dict[str, Any]:
    """The driver's whole state at the quiescent instant ``now`` (JSON)."""
    orgs = {
        o.name: {
            **{k: getattr(o, k) for k in ORG_FIELDS},
            "own": _tag(o.own),
            "used": sorted(map(list, o.used)),
            "seen": sorted(map(list, o.seen)),
        }
        for o in driver.orgs.values()
    }
    pool = [[_tag(tag), [_b64(r) for r in rows]] for tag, rows in driver.pool.items()]
    rounds = {
        str(r): {
            **{k: getattr(rd, k) for k in ("accepted", "accuracy", "failed", "trained")},
            "metrics": {k: v if math.isfinite(v) else str(v) for k, v in rd.metrics.items()},  # JSON: no nan/inf
            "evals": {org: _b64(e) for org, e in rd.evals.items()},
            "refused": {k: dict(v) for k, v in rd.refused.items()},
        }
        for r, rd in driver.rounds_open.items()
    }
    return {
        "now": now,
        "orgs": orgs,
        "issued": [[s, r, v] for (s, r), v in driver.issued.items()],
        "pool": pool,
        "held": [_tag(t) for t in driver.held],
        "envelopes": [[_tag(t), _b64(b)] for t, b in driver.envelopes.items()],
        "plans": [[_tag(t), _b64(p)] for t, p in driver.plans.items()],
        "steps": [_step(s) for s in driver.steps],
        "lost": [_step(s) for s in driver.lost],
        "published": [[at, _tag(t)] for at, t in driver.published],
        "refused": {o: dict(c) for o, c in driver.refused.items()},
        "idle": driver.idle,
        "finished": driver.finished,
        "rounds_open": rounds,
        "logged": driver.logged,
        "capabilities": driver.capabilities.state_dict(),
        "challenges": {o: c.hex() for o, c in driver.co.challenges.items()},
        "probe_at": driver.liveness.probe_at,
        "worker_rounds": {o.name: driver.worker_round.get(o.name, 0) for o in driver.orgs.values()},
        "verdicts": _verdicts(driver),
    }


def _verdicts(driver: DriverView) -> list[list[Any]]:
    """Blind mode: the coordinator's own count of every batch it opened to judge an accusation (none: [])."""
    verdicts = driver.accusations.verdicts if driver.accusations is not None else {}
    return [[src, rnd, {k: getattr(v, k) for k in VERDICT_FIELDS}] for (src, rnd), v in verdicts.items()]


def load_driver_state(driver: DriverView, state: dict[str, Any]) -> float:
    """Put ``state`` (:func:`driver_state`) back into ``driver``; returns the instant it was taken."""
    for name, raw in state["orgs"].items():
        org = driver.orgs[name]
        for k in ORG_FIELDS:
            setattr(org, k, raw[k])
        org.own = _untag(raw["own"])
        org.used = {(str(s), int(r)) for s, r in raw["used"]}
        org.seen = {(str(s), int(r)) for s, r in raw["seen"]}
    driver.issued = {(str(s), int(r)): int(v) for s, r, v in state["issued"]}
    driver.pool = {_untag(t): tuple(_obj(Rollout, r) for r in rows) for t, rows in state["pool"]}  # type: ignore[misc]
    driver.held = {_untag(t) for t in state["held"]}  # type: ignore[misc]
    driver.envelopes = {_untag(t): _obj(RolloutBatch, b) for t, b in state["envelopes"]}  # type: ignore[misc]
    driver.plans = {_untag(t): _obj(RoundPlan, p) for t, p in state["plans"]}  # type: ignore[misc]
    driver.steps, driver.lost = [_unstep(s) for s in state["steps"]], [_unstep(s) for s in state["lost"]]
    driver.published = [(float(at), _untag(t)) for at, t in state["published"]]  # type: ignore[misc]
    driver.refused = {o: Counter(c) for o, c in state["refused"].items()}
    driver.idle, driver.finished = dict(state["idle"]), dict(state["finished"])
    driver.rounds_open = {int(r): _round(raw) for r, raw in state["rounds_open"].items()}
    driver.logged = int(state["logged"])
    driver.capabilities.load_state_dict(state["capabilities"])
    driver.liveness.probe_at.update({o: float(t) for o, t in state["probe_at"].items()})
    now = float(state["now"])
    driver.liveness.faults = [f for f in driver.liveness.faults if f[0] > now]  # those up to now have happened
    driver.worker_round = {o: int(r) for o, r in state["worker_rounds"].items()}
    # an org's challenge where its worker resumes from a checkpoint (which holds it); a worker back at its start
    # issues a new one, asked by Health as at a run's start
    saved = {o: bytes.fromhex(c) for o, c in state["challenges"].items() if driver.worker_round.get(o)}
    driver.co.challenges.update(saved)
    if driver.accusations is not None:
        driver.accusations.verdicts = {(str(s), int(r)): Screened(**v) for s, r, v in state["verdicts"]}
    return now


def _round(raw: dict[str, Any]) -> OpenRound:
    rd = OpenRound(**{k: raw[k] for k in ("accepted", "accuracy", "failed", "trained")})
    rd.metrics = {k: float(v) for k, v in raw["metrics"].items()}  # "nan" / "inf" back to floats
    rd.evals = {org: _obj(EvalReport, e) for org, e in raw["evals"].items()}
    rd.refused = {k: Counter(v) for k, v in raw["refused"].items()}
    return rd


def align_checkpoints(run_dir: Path) -> list[str]:
    """Before the workers of an asynchronous resume are built: remove every worker checkpoint newer than the one
    the saved state counts on (the steps started after the state was taken wrote them) and point ``LATEST`` at
    that one; returns a line per org changed. A state without the driver's part (lock-step, or saved before the
    first quiescent instant) changes nothing. RuntimeError when the checkpoint the state counts on is gone."""
    from hacrl_fed.coordinator.state_file import read_state
    from hacrl_fed.run_files import STATE_FILE
    from hacrl_fed.worker.checkpoint import CHECKPOINT_NAME, _round_of, run_checkpoint_root

    try:  # its own config hash: the coordinator itself warns about a changed config
        raw = json.loads((run_dir / STATE_FILE).read_bytes())
    except (OSError, ValueError):
        raw = {}
    try:
        state = read_state(run_dir / STATE_FILE, str(raw.get("config_hash", "")) if isinstance(raw, dict) else "")
    except (OSError, ValueError):  # no state, or none whole: the coordinator says so itself
        return []
    rounds = (state.get(ASYNC_KEY) or {}).get("worker_rounds") or {}
    changed = []
    for org, keep in rounds.items():
        root = run_checkpoint_root(run_dir / "orgs" / org / "checkpoints", state["run_id"])
        dirs = [p for p in root.glob("round-*") if CHECKPOINT_NAME.match(p.name)] if root.is_dir() else []
        newer = [p for p in dirs if _round_of(p) > keep]
        if keep and not (root / f"round-{keep:06d}").is_dir():
            raise RuntimeError(f"{root}: the checkpoint of round {keep} the asynchronous state counts on is gone")
        for path in newer:
            shutil.rmtree(path)
        if newer or (root / "LATEST").is_file() and not keep:
            if keep:
                write_atomic(root / "LATEST", f"round-{keep:06d}")
            else:
                (root / "LATEST").unlink(missing_ok=True)
            fsync_dir(root)
            changed.append(f"{org}: back to {'round ' + str(keep) if keep else 'its start'} ({len(newer)} removed)")
    for line in changed:
        log.warning("asynchronous resume: worker checkpoints of %s", line)
    return changed
