"""What a worker of an asynchronous run keeps beyond weights, optimizer and RNG, in its checkpoints
(docs/ALGORITHM.md "Resuming"): the round it generated and has not trained yet (:class:`~.intake.OwnRound`), its
last ``W`` rounds (:class:`~.recent_rounds.RecentRounds`: its own rounds, the foreign rows it admitted of each, the
(source, round) pairs it used) and its challenges (:class:`~hacrl_fed.security.freshness.ChallengeBook`). Written
into the checkpoint's ``state.json`` under ``"async"`` (covered by its manifest, :mod:`.checkpoint_manifest`); the
prompts through the wire codec (base64), the rows as plain JSON. A checkpoint is written after the step's
generation (:func:`hacrl_fed.worker.step.run_step`), so it holds the worker's whole state after the step.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections import deque
from pathlib import Path
from typing import Any

from hacrl_fed.security.freshness import ChallengeBook
from hacrl_fed.train_rows import TrainRow
from hacrl_fed.types import Prompt
from hacrl_fed.wire.codec import decode, encode
from hacrl_fed.worker.intake import OwnRound
from hacrl_fed.worker.recent_rounds import KeptRound, RecentRounds

ASYNC_KEY = "async"


def _own(own: OwnRound | None) -> dict[str, Any] | None:
    if own is None:
        return None
    return {
        **{k: getattr(own, k) for k in ("run_id", "round", "task", "max_new_tokens")},
        "prompts": [base64.b64encode(encode(p)).decode() for p in own.prompts],
        "tokens_by_prompt": {str(k): v for k, v in own.tokens_by_prompt.items()},
        "rows": [dataclasses.asdict(r) for r in own.rows],
        "fresh_digest": None if own.fresh_digest is None else own.fresh_digest.hex(),
    }


def _load_own(raw: dict[str, Any] | None) -> OwnRound | None:
    if raw is None:
        return None
    return OwnRound(
        raw["run_id"],
        int(raw["round"]),
        raw["task"],
        tuple(decode(Prompt, base64.b64decode(p)) for p in raw["prompts"]),
        int(raw["max_new_tokens"]),
        {int(k): list(v) for k, v in raw["tokens_by_prompt"].items()},
        [TrainRow(**r) for r in raw["rows"]],
        None if raw["fresh_digest"] is None else bytes.fromhex(raw["fresh_digest"]),
    )


def worker_async_state(own: OwnRound | None, recent: RecentRounds, book: ChallengeBook) -> dict[str, Any]:
    """A worker's own round ``own``, recent rounds ``recent`` and challenges ``book`` as JSON (module docstring)."""
    rounds = {
        str(r): {"own": _own(kept.own), "taken": [[src, dataclasses.asdict(row)] for src, row in kept.taken]}
        for r, kept in recent.rounds.items()
    }
    return {
        "own": _own(own),
        "recent": {"run_id": recent.run_id, "rounds": rounds, "used": sorted(map(list, recent.used))},
        "challenges": {
            "latest": None if book.latest is None else book.latest.hex(),
            "recent": [c.hex() for c in book.recent],
        },
    }


def restore_async_state(checkpoint: Path, recent: RecentRounds, book: ChallengeBook) -> OwnRound | None:
    """Put back into ``recent`` and ``book`` what :func:`worker_async_state` wrote into ``checkpoint``; → the own
    round it held (a checkpoint without it: nothing put back, None)."""
    raw = json.loads((checkpoint / "state.json").read_text()).get(ASYNC_KEY)
    if not isinstance(raw, dict):
        return None
    own = _load_own(raw["own"])
    recent.run_id = raw["recent"]["run_id"]
    recent.rounds = {
        int(r): KeptRound(_load_own(kept["own"]), [(src, TrainRow(**row)) for src, row in kept["taken"]])  # type: ignore[arg-type]
        for r, kept in raw["recent"]["rounds"].items()
    }
    recent.used = {(str(s), int(r)) for s, r in raw["recent"]["used"]}
    saved = raw["challenges"]
    book.latest = None if saved["latest"] is None else bytes.fromhex(saved["latest"])
    book.recent = deque((bytes.fromhex(c) for c in saved["recent"]), maxlen=book.recent.maxlen)
    return own
