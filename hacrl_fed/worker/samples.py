"""An org's sample book: the rollouts it keeps for the run report (config section ``samples``).

Each round the org's worker appends to ``<run dir>/orgs/<org>/samples.jsonl`` (one JSON object a line), written
by the org itself, so in coordinator-blind mode the coordinator never sees the text:

* ``kind: "own"``: a seeded choice of :data:`OWN_PER_ROUND` of its own rollouts of the round (prompt,
  response, reward, stop reason, length in its own tokens);
* ``kind: "foreign"``: as a learner, up to :data:`FOREIGN_PER_ROUND` rows per source of the foreign rows it
  received (those it can read: a sealed batch it could not open has no text), each with its ``fate``: ``kept``
  (the update trained on it) or ``dropped`` with the intake ledger's ``stage`` and ``reason``
  (:mod:`hacrl_fed.worker.ledger`; where the ledger counts several reasons of one stage for a source, the row
  names them all, ``a|b``, since the ledger counts rows, not which row).

Bounded: text is cut at :data:`MAX_TEXT_CHARS` characters; the file never exceeds :data:`MAX_BYTES`, and round ``t``
of ``R`` may fill it only to ``t / R`` of that (later rounds keep their share; a row that does not fit is not
written, counted in :attr:`SampleBook.skipped`). Everything here is best effort: an I/O error is logged once and
never fails the round.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from hacrl_fed.config import RunConfig
from hacrl_fed.seeding import stable_seed
from hacrl_fed.types import Prompt, Rollout, RoundPlan, TrainRequest

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
# fixed since issue 42 (no default path, paper form or measured win set them): read when a round is recorded
OWN_PER_ROUND = 4  # own rollouts kept per round (a seeded choice)
FOREIGN_PER_ROUND = 2  # foreign rows kept per round and source, with their fate (kept / dropped)
MAX_TEXT_CHARS = 600  # prompt and response text longer than this is cut (marked …)
MAX_BYTES = 1_000_000  # the most bytes of samples.jsonl per org (fits a 150-round, 3-org demo)
# the ledger's stages in intake order, grouped by where a row leaves the intake (the fate a row can be given)
BEFORE_SCREEN_ACCEPT = "trust"  # bound, open, screen_batch (every trust reason but source_excluded)
AFTER_SCREEN = {("trust", "source_excluded"), ("outcome", "quarantined")}
SELECT_STAGES = ("select", "unused")
LATE_STAGES = ("screen", "train")

RowKey = tuple[str, int, int, int]  # (source, round, prompt_id, sample_index)


def samples_path(run_dir: str | Path, org_id: str) -> Path:
    """``<run dir>/orgs/<org>/samples.jsonl``."""
    return Path(run_dir) / "orgs" / org_id / SAMPLES_FILE


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _prompt_text(prompt: Prompt | None) -> str:
    """The prompt's last user message (the whole chat when it has none)."""
    if prompt is None:
        return ""
    users = [m.content for m in prompt.messages if m.role == "user"]
    return users[-1] if users else "\n".join(m.content for m in prompt.messages)


def _key(r: Rollout) -> RowKey:
    return (str(r.org_id), int(r.round), int(r.prompt_id), int(r.sample_index))


class SampleBook:
    """One org's ``samples.jsonl`` (module docstring)."""

    def __init__(self, cfg: RunConfig, org_id: str, run_dir: str | Path) -> None:
        self.cfg, self.org_id = cfg, org_id
        self.path = samples_path(run_dir, org_id)
        self.rounds = max(cfg.federation.rounds_of(org_id), 1)
        self.seed = stable_seed(cfg.seed, "samples", org_id)
        self.skipped = 0
        self.enabled = cfg.samples.enabled  # False: every record is a no-op (off, or not this process's to write)
        self._failed = False

    # -- what is recorded ------------------------------------------------------------------------------------
    def record_generate(self, plan: RoundPlan, rollouts: Sequence[Rollout]) -> None:
        """A seeded choice of this round's own rollouts."""
        if not self.enabled:
            return
        prompts = {p.prompt_id: p for p in plan.prompts}
        rng = random.Random(stable_seed(self.seed, "own", plan.run_id, plan.round))
        chosen = sorted(rng.sample(range(len(rollouts)), min(OWN_PER_ROUND, len(rollouts))))
        rows = [self._row("own", rollouts[i], prompts.get(rollouts[i].prompt_id), plan.run_id) for i in chosen]
        self._write(plan.round, rows)

    def record_train(self, request: TrainRequest, prompts: Sequence[Prompt], admitted: Any) -> None:
        """Up to :data:`FOREIGN_PER_ROUND` readable foreign rows per source, each with its fate (module docstring);
        ``admitted``: the intake's :class:`~hacrl_fed.worker.intake.Admitted`."""
        if not self.enabled:
            return
        by_id = {p.prompt_id: p for p in prompts}
        rng = random.Random(stable_seed(self.seed, "foreign", request.run_id, request.round))
        fates = RowFates(admitted)
        rows = []
        for src, received in sorted(_by_source(readable_foreign(request, admitted.offered)).items()):
            take = sorted(rng.sample(range(len(received)), min(FOREIGN_PER_ROUND, len(received))))
            for i in take:
                r = received[i]
                row = self._row("foreign", r, by_id.get(r.prompt_id), request.run_id)
                row.update(learner=self.org_id, source=src, **fates.fate(r))
                rows.append(row)
        self._write(request.round, rows)

    def _row(self, kind: str, r: Rollout, prompt: Prompt | None, run_id: str) -> dict[str, Any]:
        limit = MAX_TEXT_CHARS
        return {
            "kind": kind,
            "org": self.org_id,
            "run_id": run_id,
            "round": int(r.round),
            "source": str(r.org_id)[:64],
            "prompt_id": int(r.prompt_id),
            "sample_index": int(r.sample_index),
            "prompt": _cut(_prompt_text(prompt), limit),
            "response": _cut(str(r.response), limit),
            "reward": float(r.reward),
            "stop_reason": str(r.finish_reason)[:16],
            "length": int(r.token_count),
        }

    # -- the bounded file ------------------------------------------------------------------------------------
    def allowance(self, round: int) -> int:
        """The most bytes the file may hold once round ``round`` is written: ``MAX_BYTES × min(t / R, 1)``."""
        return int(MAX_BYTES * min(max(round, 1) / self.rounds, 1.0))

    def _write(self, round: int, rows: Iterable[dict[str, Any]]) -> None:
        if self._failed or not self.enabled:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            size = self.path.stat().st_size if self.path.exists() else 0
            limit = self.allowance(round)
            with self.path.open("a", encoding="utf-8") as f:
                for row in rows:
                    line = json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n"
                    n = len(line.encode("utf-8"))
                    if size + n > limit:
                        self.skipped += 1
                        continue
                    f.write(line)
                    size += n
        except (OSError, ValueError) as err:  # best effort: the samples never fail a round
            self._failed = True
            log.warning("samples: %s not written further (%s: %s)", self.path, type(err).__name__, err)


def readable_foreign(request: TrainRequest, opened: Sequence[Rollout]) -> list[Rollout]:
    """The foreign rows of ``request`` this learner can read: the loose rows, the plain rows of every source batch
    and, for sealed batches, the rows it opened (``opened``, those that passed the screen); one per key."""
    seen: dict[RowKey, Rollout] = {}
    for r in list(request.foreign) + [r for b in request.source_batches for r in getattr(b, "rollouts", ())]:
        if isinstance(r, Rollout) and not r.sealed_response:
            seen.setdefault(_key(r), r)
    for r in opened:
        seen[_key(r)] = r  # the opened text (sealed batches) or the same row
    return list(seen.values())


def _by_source(rows: Iterable[Rollout]) -> dict[str, list[Rollout]]:
    out: dict[str, list[Rollout]] = {}
    for r in rows:
        out.setdefault(str(r.org_id)[:64], []).append(r)
    return out


class RowFates:
    """What became of each foreign row in one learner's intake, from the :class:`Admitted` rows: ``kept`` when it is
    among the rows the update trains on, else the stage it left at (by which lists still hold it: stages 1-4
    ``offered``, stage 5 ``selected``) with that stage's reasons for its source in the ledger."""

    def __init__(self, admitted: Any) -> None:
        self.ledger = admitted.ledger
        self.offered = {_key(r) for r in admitted.offered}
        self.selected = {_key(r) for r in admitted.selected}
        self.screen_accepted = {  # passed screen_batch (then excluded or quarantined, or offered)
            _key(r) for e in admitted.ledger.sources.values() for r in (e.screened.accepted if e.screened else ())
        }
        # the rows trained on, by what a re-tokenized row still carries of its rollout (a multiset)
        self.kept: Counter = Counter(
            (admitted.agents[r.source], r.group, r.n_bytes, r.claimed_log_prob_sum)
            for r in admitted.rows
            if not r.is_self and r.response_ids
        )

    def fate(self, r: Rollout) -> dict[str, str]:
        src, k = str(r.org_id), _key(r)
        if k in self.selected:
            kept_key = (src, r.prompt_id, len(r.response.encode("utf-8")), float(r.logprob_sum))
            if self.kept[kept_key] > 0:
                self.kept[kept_key] -= 1
                return {"fate": "kept", "stage": "update", "reason": "trained"}
            return self._dropped(src, lambda stage, why: stage in LATE_STAGES)
        if k in self.offered:
            return self._dropped(src, lambda stage, why: stage in SELECT_STAGES)
        if k in self.screen_accepted:
            return self._dropped(src, lambda stage, why: (stage, why) in AFTER_SCREEN)
        return self._dropped(src, lambda stage, why: stage == "trust" and (stage, why) not in AFTER_SCREEN)

    def _dropped(self, src: str, where: Callable[[str, str], bool]) -> dict[str, str]:
        entry = self.ledger.sources.get(src)
        found = sorted((s, w) for (s, w), n in (entry.dropped.items() if entry else ()) if n and where(s, w))
        if not found:  # e.g. a whole request refused (source "*")
            star = self.ledger.sources.get("*")
            found = sorted((s, w) for (s, w), n in (star.dropped.items() if star else ()) if n)
        stages = sorted({s for s, _ in found})
        return {
            "fate": "dropped",
            "stage": "|".join(stages) or "unknown",
            "reason": "|".join(w for _, w in found) or "unknown",
        }
