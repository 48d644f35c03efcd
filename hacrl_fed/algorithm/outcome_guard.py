"""The learner's outcome guard (docs/ALGORITHM.md "Outcome guard", SECURITY.md): harm bounded by what the learner's
own accuracy does, not by what doctored text looks like. Pure decision logic, no I/O and no tensors; the worker
(:mod:`hacrl_fed.worker.outcome`) runs the validation, keeps the weights and applies the verdicts.

On a schedule the learner answers a small private validation split of its own task greedily and gets a per-prompt
correctness vector ``v`` (``V`` prompts, drawn with its private seed from the train split, so disjoint from the
held-out evaluation). It keeps a **reference** vector ``r``: that of the best weights it validated (its initial
weights first; it moves only up), and the last weights that **passed** (kept in memory). The paired comparison on
the same prompts (McNemar):

    lost   = #{p : r_p and not v_p}            gained = #{p : v_p and not r_p}
    regressed  <=>  lost - gained > max(z * sqrt(lost + gained), margin)

* **regressed**: roll back to the last passing weights (and optimizer state) and quarantine every source whose rows
  the update trained on since they passed: source ``j``'s ``strikes_j`` grows by one and it is left out through
  round ``t + probation * backoff ** (strikes_j - 1)``;
* otherwise the weights **pass**: they become the rollback target and the sources trained since are cleared; when
  also no worse (``gained >= lost``) their vector becomes the reference.

Validation is due after every ``every``-th round's update, after the last round's, after each of the first
``every`` rounds (every source is new then) and after every round while a source is **on trial**: a source whose
quarantine ended is readmitted one at a time (no two sources with strikes on trial together, so the next regression
is attributed to it alone) for ``every`` rounds, after which a passing validation clears it (it keeps its strikes).
A source with no strike is always admitted.

Why an adaptive attacker gains little (SECURITY.md): every weights the learner keeps have passed the comparison with
its best validated ones, and the final round is always validated, so whatever a source publishes the learner ends
within the test's slack of its best validated accuracy; harm that accumulates slowly is measured against the same
reference (it moves only up) until it is significant; a source that alternates honest and doctored windows keeps
its strikes, and each strike multiplies its next quarantine, so it causes at most ``1 + log_backoff(rounds /
probation)`` rollbacks in a run, each losing at most ``every`` rounds of the learner's own progress (one round on
trial). What it cannot see: harm that costs no validation accuracy (a trigger that leaves answers right), harm
within the slack, and a slower climb than training alone would give (it compares with its own best, not with a
counterfactual learner).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OutcomeParams:
    """The thresholds (config ``trainer.outcome_guard``; docs/ALGORITHM.md)."""

    every: int = 4
    z: float = 2.5
    margin: int = 2
    probation: int = 8
    backoff: float = 2.0


@dataclass(frozen=True)
class Comparison:
    """The paired comparison of a validation vector with the reference's (module doc)."""

    lost: int
    gained: int
    regressed: bool

    @property
    def not_worse(self) -> bool:
        return self.gained >= self.lost


@dataclass(frozen=True)
class Verdict:
    """What one validation decided: ``rollback`` to the last passing weights, or ``save`` the current ones as the
    rollback target (``new_reference``: their vector is the new reference), and the sources ``quarantined`` by it
    (source -> last round it is left out)."""

    comparison: Comparison
    rollback: bool
    save: bool
    new_reference: bool
    quarantined: dict[str, int]


def compare(reference: Sequence[bool], current: Sequence[bool], z: float, margin: int) -> Comparison:
    """Paired (McNemar) comparison of two correctness vectors over the same prompts (module doc)."""
    if len(reference) != len(current):
        raise ValueError(f"reference has {len(reference)} prompts, current {len(current)}")
    lost = sum(1 for r, v in zip(reference, current) if r and not v)
    gained = sum(1 for r, v in zip(reference, current) if v and not r)
    return Comparison(lost, gained, lost - gained > max(z * math.sqrt(lost + gained), float(margin)))


@dataclass
class OutcomeGuard:
    """One learner's guard state for one run (module doc). ``reference``: the reference vector (None until the
    first validation); ``strikes``/``until``: per source; ``implicated``: sources trained since the last passing
    weights; ``trial``: the source with strikes readmitted, by the round its trial began; ``passed``: sources with
    strikes that completed a trial (admitted until their next strike)."""

    params: OutcomeParams
    reference: list[bool] | None = None
    strikes: dict[str, int] = field(default_factory=dict)
    until: dict[str, int] = field(default_factory=dict)
    implicated: set[str] = field(default_factory=set)
    trial: dict[str, int] = field(default_factory=dict)
    passed: set[str] = field(default_factory=set)

    def due(self, round: int, last_round: int) -> bool:
        """Validate after the update of ``round`` (module doc)."""
        every = self.params.every
        return round % every == 0 or round >= last_round or round <= every or bool(self.trial)

    def admits(self, source: str, round: int) -> bool:
        """Whether ``source``'s rows may enter the update of ``round``; a readmitted source with strikes is put on
        trial here, unless another one already is."""
        if round <= self.until.get(source, 0):
            return False
        if self.strikes.get(source, 0) == 0 or source in self.trial or source in self.passed:
            return True
        if self.trial:
            return False  # one source on trial at a time: the next regression names it alone
        self.trial[source] = round
        return True

    def trained(self, sources: Iterable[str]) -> None:
        """The update of this round trained on rows of ``sources``."""
        self.implicated.update(sources)

    def judge(self, round: int, current: Sequence[bool]) -> Verdict:
        """The verdict on the weights after ``round``'s update (module doc); the first call sets the reference."""
        if self.reference is None:
            self.reference = list(current)
            return Verdict(Comparison(0, 0, False), False, True, True, {})
        cmp = compare(self.reference, current, self.params.z, self.params.margin)
        quarantined: dict[str, int] = {}
        if cmp.regressed:
            for src in sorted(self.implicated):
                self.strikes[src] = self.strikes.get(src, 0) + 1
                self.passed.discard(src)
                self.trial.pop(src, None)
                span = self.params.probation * self.params.backoff ** (self.strikes[src] - 1)
                self.until[src] = quarantined[src] = round + int(math.ceil(span))
        else:
            done = [s for s, start in self.trial.items() if round >= start + self.params.every - 1]
            self.passed.update(done)
            for src in done:
                del self.trial[src]
            if cmp.not_worse:
                self.reference = list(current)
        self.implicated.clear()
        return Verdict(cmp, cmp.regressed, not cmp.regressed, cmp.not_worse and not cmp.regressed, quarantined)
