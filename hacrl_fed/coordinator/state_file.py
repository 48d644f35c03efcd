"""``coordinator_state.json``: what a resumed coordinator continues from (docs/ARCHITECTURE.md step 8).

One JSON object, rewritten atomically after every round: the format ``version``, the run id and config hash, the
:class:`~hacrl_fed.coordinator.bookkeeping.RunBook` (round, counts, accuracy history, per-org totals), the
capability tracker's and the trust guard's states.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hacrl_fed.fsio import write_json_atomic

log = logging.getLogger(__name__)

STATE_VERSION = 1


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` (with ``version``) to ``path`` atomically."""
    write_json_atomic(path, {"version": STATE_VERSION, **state})


def read_state(path: Path, config_hash: str) -> dict[str, Any]:
    """The saved state at ``path``; FileNotFoundError when there is none, ValueError for another version. A
    changed config (another ``config_hash``) is allowed with a warning: the run keeps its original id."""
    if not path.exists():
        raise FileNotFoundError(f"nothing to resume: {path} does not exist")
    state = json.loads(path.read_text())
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"{path}: unsupported state version {state.get('version')!r}")
    if state.get("config_hash", config_hash) != config_hash:
        log.warning(
            "resuming run %s with a changed config (hash %s, was %s); keeping the original run id",
            state["run_id"],
            config_hash,
            state["config_hash"],
        )
    return dict(state)
