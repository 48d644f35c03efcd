"""The intake's one ledger of foreign rows (:mod:`hacrl_fed.worker.intake`): per source, what arrived, what the
update trains on, and what each stage dropped and why.

Every foreign row that reaches a learner ends in exactly one place: kept (the update trains on it) or dropped by
one stage for one reason, so per source ``received == kept + sum(dropped.values())`` (:meth:`Ledger.balance`).
The ledger writes the same metric keys as before it existed (docs/METRICS.md), under their four prefixes:

* ``trust/<source>/...``: the screen (bound, open, ``screen_batch``, exclusion), with the counters of that stage
  (received, accepted, checked, mismatches, verified reward sum, excluded, unscreened, ``rejected/<reason>``);
* ``select/...``: the selection rule's counts (:meth:`~hacrl_fed.algorithm.selection.Selection.metrics`);
* ``train/foreign_unscored`` (re-tokenization: unknown prompt, no tokens or over-long text) and
  ``train/num_too_long`` (rows that do not fit the learner's context; own rows included);
* ``screen/<source>/...``: the likelihood screen;
* ``intake/<source>/...`` (:meth:`Ledger.row_metrics`): the ledger itself, per source: rows received, kept and
  dropped per ``(stage, reason)`` (the learner × source matrix of ``hacrl-fed report``);
* asynchronous rounds in coordinator-blind mode only (:attr:`Ledger.by_round`): ``trust/<source>/round/<round>/
  {checked,mismatches}``, the screen's counts per batch, so an accusation names the batch it is about
  (:mod:`hacrl_fed.wire.accusations`).

Two counters keep their historical meaning where it differs from a row count: a batch rejected whole counts at
least once under ``trust/<source>/rejected/<reason>`` even when it holds no rows (so an empty forged batch stays
visible), and loose unsigned rollouts (source ``coordinator``) are not a batch, so ``trust/coordinator/received``
does not count them. Rows dropped after re-tokenization for no tokens, over-long text or context overflow still
count in their joint group's advantage statistics (docs/ALGORITHM.md), but are not trained on.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from hacrl_fed.plan.screening import Screened
from hacrl_fed.wire.accusations import round_counter, source_counter

UNSIGNED = "unsigned"  # loose rollouts in a signed run: not a batch, not counted received under trust/


@dataclasses.dataclass
class SourceEntry:
    """One source org's rows in the ledger. ``dropped``: rows per ``(stage, reason)``; the trust stage's own
    counters (``rejected``, ``screened``, ``excluded``, ``unscreened``) as the ``trust/...`` metrics report them."""

    received: int = 0
    kept: int = 0
    dropped: Counter = dataclasses.field(default_factory=Counter)
    rejected: Counter = dataclasses.field(default_factory=Counter)
    screened: Screened | None = None
    excluded: bool = False
    unscreened: int | None = None

    def accepted(self) -> int:
        return 0 if self.excluded else len((self.screened or Screened()).accepted)

    def trust_rejected(self) -> Counter:
        return self.rejected + (self.screened or Screened()).rejected  # positive counts only, as Counter adds

    def trust_metrics(self, source: str) -> dict[str, float]:
        s = self.screened or Screened()
        out = {
            f"trust/{source}/received": float(self.received - self.rejected[UNSIGNED]),
            f"trust/{source}/accepted": float(self.accepted()),
            f"trust/{source}/checked": float(s.checked),
            source_counter(source): float(s.mismatches),
            f"trust/{source}/verified_reward_sum": float(s.verified_reward_sum),
            f"trust/{source}/excluded": float(self.excluded),
        }
        if self.unscreened is not None:
            out[f"trust/{source}/unscreened"] = float(self.unscreened)
        out.update({f"trust/{source}/rejected/{why}": float(n) for why, n in self.trust_rejected().items()})
        return out


class Ledger:
    """Per source: received / kept / dropped by stage and reason (module docstring), and the metrics."""

    def __init__(self) -> None:
        self.sources: dict[str, SourceEntry] = {}
        self.select_metrics: dict[str, float] = {}
        self.screen_metrics: dict[str, float] = {}
        self.own_too_long = 0  # the learner's own rows that do not fit its context (train/num_too_long)
        self.by_round = False  # keep the screen's counts per (source, round) (asynchronous rounds, blind mode)
        self.rounds: dict[tuple[str, int], Screened] = {}

    def entry(self, source: str) -> SourceEntry:
        return self.sources.setdefault(source, SourceEntry())

    def receive(self, source: str, rows: int) -> None:
        self.entry(source).received += rows

    def reject(self, source: str, reason: str, rows: int) -> None:
        """The trust stage drops ``rows`` rows of ``source`` whole (a batch counts at least once in the metric)."""
        e = self.entry(source)
        e.rejected[reason] += max(rows, 1)
        self.drop(source, "trust", reason, rows)

    def screened(self, source: str, result: Screened, rows: int) -> None:
        """``screen_batch``'s verdict on the ``rows`` rows of ``source``'s batch."""
        e = self.entry(source)
        e.screened = result
        for why, n in result.rejected.items():
            self.drop(source, "trust", why, n if rows else 0)  # a rejected empty batch counts once, holds no rows

    def screened_round(self, source: str, round: int, result: Screened) -> None:
        """``screen_batch``'s verdict on ``source``'s batch of ``round``, kept apart when :attr:`by_round`."""
        if self.by_round:
            self.rounds[(source, round)] = result

    def exclude(self, source: str) -> None:
        """Too many contradicted rewards: the source's accepted rows are dropped (``source_excluded``)."""
        e = self.entry(source)
        e.excluded = True
        n = len((e.screened or Screened()).accepted)
        e.rejected["source_excluded"] += n
        self.drop(source, "trust", "source_excluded", n)

    def unscreened(self, source: str, rows: int) -> None:
        """Lazy screening: the selection was full before this source was reached (``rows`` never opened)."""
        self.entry(source).unscreened = rows
        self.drop(source, "trust", "unscreened", rows)

    def drop(self, source: str, stage: str, reason: str, rows: int = 1) -> None:
        """Stage ``stage`` (``trust``, ``select``, ``unused``, ``train``, ``screen``) drops ``rows`` of ``source``'s
        rows for ``reason``."""
        if rows:
            self.entry(source).dropped[(stage, reason)] += rows

    def keep(self, source: str, rows: int = 1) -> None:
        self.entry(source).kept += rows

    def dropped(self, stage: str, reason: str | None = None) -> int:
        """Rows dropped by ``stage`` (for ``reason``), over every source."""
        return sum(
            n for e in self.sources.values() for (s, r), n in e.dropped.items() if s == stage and reason in (None, r)
        )

    def balance(self) -> dict[str, tuple[int, int, int]]:
        """Per source ``(received, kept, dropped)``: the ledger holds when ``received == kept + dropped``."""
        return {src: (e.received, e.kept, sum(e.dropped.values())) for src, e in self.sources.items()}

    def row_metrics(self) -> dict[str, float]:
        """Per source ``intake/<source>/received``, ``intake/<source>/kept`` and ``intake/<source>/dropped/<stage>/
        <reason>`` (rows; reasons that dropped none left out): ``received == kept + sum(dropped)``."""
        out: dict[str, float] = {}
        for src, e in self.sources.items():
            out[f"intake/{src}/received"] = float(e.received)
            out[f"intake/{src}/kept"] = float(e.kept)
            out.update({f"intake/{src}/dropped/{stage}/{why}": float(n) for (stage, why), n in e.dropped.items() if n})
        return out

    def trust_metrics(self) -> dict[str, float]:
        """``trust/<source>/...`` per source (and per (source, round) when :attr:`by_round`) and the two totals
        ``trust/foreign_{accepted,rejected}``."""
        out: dict[str, float] = {}
        for src, e in self.sources.items():
            out.update(e.trust_metrics(src))
        for (src, rnd), s in sorted(self.rounds.items()):
            out[round_counter(src, rnd, "checked")] = float(s.checked)
            out[round_counter(src, rnd)] = float(s.mismatches)
        out["trust/foreign_accepted"] = float(sum(e.accepted() for e in self.sources.values()))
        out["trust/foreign_rejected"] = float(sum(sum(e.trust_rejected().values()) for e in self.sources.values()))
        return out

    def unscored(self) -> int:
        """``train/foreign_unscored``: foreign rows not scored after re-tokenization."""
        return sum(self.dropped("train", why) for why in ("unknown_prompt", "no_tokens", "too_long_text"))

    def too_long(self) -> int:
        """``train/num_too_long``: rows (own and foreign) that do not fit the learner's context."""
        return self.own_too_long + self.dropped("train", "context")
