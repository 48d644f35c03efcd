"""``coordinator_state.json``: what a resumed coordinator continues from (docs/ARCHITECTURE.md step 8).

One JSON object, rewritten atomically after every round: the format ``version``, the run id and config hash, the
:class:`~hacrl_fed.coordinator.bookkeeping.RunBook` (round, counts, accuracy history, per-org totals), the
capability tracker's and the trust guard's states (in asynchronous rounds the driver's too), and ``sha256``, the
checksum of the rest (:func:`_checksum`). Before each write the state it replaces, when whole, is copied to
``coordinator_state.json.prev``; :func:`read_state` falls back to that copy, with one warning line, when the
newest file is missing, truncated or fails its checksum. The state after each round every org checkpointed is
kept in ``states/round-NNNNNN.json`` too (the last four), for ``hacrl-fed run --fork`` (:mod:`hacrl_fed.fork`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from hacrl_fed.fsio import write_atomic, write_json_atomic

log = logging.getLogger(__name__)

STATE_VERSION = 1
CHECKSUM = "sha256"
SNAPSHOT_DIR = "states"  # the states after the rounds every org checkpointed (write_state)
SNAPSHOTS_KEPT = 4  # workers keep two checkpoints at least: four states cover them


def previous_path(path: Path) -> Path:
    """Where the state before the newest is kept: ``<path>.prev``."""
    return path.with_name(path.name + ".prev")


def _checksum(state: dict[str, Any]) -> str:
    """SHA-256 of ``state`` less its ``sha256`` field, as compact JSON with sorted keys."""
    body = {k: v for k, v in state.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def _whole(path: Path) -> tuple[dict[str, Any] | None, str]:
    """``(state, "")`` when ``path`` parses and its checksum matches (a state from before the checksum has none),
    else ``(None, what is wrong)``."""
    try:
        state = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None, "missing"
    except (OSError, ValueError) as err:
        return None, f"does not parse ({type(err).__name__})"
    if not isinstance(state, dict):
        return None, "is not a JSON object"
    if CHECKSUM in state and state[CHECKSUM] != _checksum(state):
        return None, "fails its checksum"
    return state, ""


def snapshot_path(run_dir: Path, round: int) -> Path:
    """Where the state after round ``round`` is kept when every org checkpointed that round (a fork's start)."""
    return run_dir / SNAPSHOT_DIR / f"round-{round:06d}.json"


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` (with ``version`` and its checksum) to ``path`` atomically, after copying the whole state
    it replaces to :func:`previous_path`. A state after a round every org checkpointed
    (``worker_checkpoint_round == round``) is also kept as :func:`snapshot_path` (the newest
    :data:`SNAPSHOTS_KEPT`), the coordinator's half of what ``hacrl-fed run --fork RUN_DIR@ROUND`` starts from."""
    if _whole(path)[0] is not None:
        write_atomic(previous_path(path), path.read_bytes())
    body = {"version": STATE_VERSION, **state}
    write_json_atomic(path, {**body, CHECKSUM: _checksum(body)})
    round = state.get("round")
    if type(round) is int and round >= 1 and state.get("worker_checkpoint_round") == round:
        snap = snapshot_path(path.parent, round)
        snap.parent.mkdir(exist_ok=True)
        write_json_atomic(snap, {**body, CHECKSUM: _checksum(body)})
        for old in sorted(snap.parent.glob("round-*.json"))[:-SNAPSHOTS_KEPT]:
            old.unlink(missing_ok=True)


def read_snapshot(run_dir: Path, round: int) -> dict[str, Any]:
    """The state kept after round ``round`` (:func:`write_state`); ValueError naming the file when it is missing
    or not whole."""
    path = snapshot_path(run_dir, round)
    state, why = _whole(path)
    if state is None or state.get("version") != STATE_VERSION:
        have = sorted(int(p.stem.split("-")[1]) for p in path.parent.glob("round-*.json"))
        raise ValueError(f"{path} {why or 'has another version'}: no state of round {round} (kept: {have})")
    state.pop(CHECKSUM, None)
    return dict(state)


def read_state(path: Path, config_hash: str) -> dict[str, Any]:
    """The saved state at ``path`` (else, with one warning line, the previous one); FileNotFoundError when there is
    none, ValueError naming the file when neither is whole, or for another version. A changed config (another
    ``config_hash``) is allowed with a warning: the run keeps its original id."""
    state, why = _whole(path)
    if state is None:
        prev = previous_path(path)
        if why == "missing" and not prev.exists():
            raise FileNotFoundError(f"nothing to resume: {path} does not exist")
        state, prev_why = _whole(prev)
        if state is None:
            raise ValueError(f"{path} {why} and {prev.name} {prev_why}: no whole coordinator state to resume from")
        log.warning("%s %s; resuming from the previous state (%s, round %s)", path, why, prev.name, state.get("round"))
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"{path}: unsupported state version {state.get('version')!r}")
    if state.get("config_hash", config_hash) != config_hash:
        log.warning(
            "resuming run %s with a changed config (hash %s, was %s); keeping the original run id",
            state["run_id"],
            config_hash,
            state["config_hash"],
        )
    state.pop(CHECKSUM, None)
    return dict(state)
