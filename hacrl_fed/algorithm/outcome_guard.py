"""The learner's outcome guard (docs/ALGORITHM.md "Outcome guard", SECURITY.md): harm bounded by what the learner's
own accuracy does, not by what doctored text looks like. Pure decision logic, no I/O and no tensors; the worker
(:mod:`hacrl_fed.worker.outcome`) runs the validation, keeps the weights and applies the verdicts.

On a schedule the learner answers a small private validation split of its own task greedily and gets a per-prompt
correctness vector ``v`` (``V`` prompts, drawn with its private seed from the train split, so disjoint from the
held-out evaluation). It keeps a **reference**: the vector ``r`` of the best weights it validated (its initial
weights first) and those weights (in memory). The paired comparison on the same prompts (McNemar):

    lost   = #{p : r_p and not v_p}            gained = #{p : v_p and not r_p}
    regressed  <=>  lost - gained > max(z * sqrt(lost + gained), margin)

* **regressed, and a foreign source was trained on since the reference**: roll back to the reference weights (and
  optimizer state) and quarantine every such source: ``strikes_j`` grows by one and source ``j`` is left out
  through round ``t + probation * backoff ** (strikes_j - 1)``. With the shadow's
  vector ``s`` on the same prompts (:mod:`hacrl_fed.algorithm.counterfactual`), only when the weights are also
  significantly worse than training alone (``compare(s, v).regressed``, the counterfactual's own test); otherwise
  (``spared``) nothing changes: the reference stays, the sources stay implicated. A learning dip that training
  alone matches is not a member's harm (measured: every rollback of an honest run at 4 and 8 orgs had the learner
  within the slack of its shadow or above it; each struck every peer, and the rollback alone, unstruck, still
  threw away rounds the federated run would have recovered from). Without a shadow (``counterfactual: false``) every
  such regression rolls back and strikes;
* **regressed on the learner's own rows alone** (no foreign row since the reference): that is training alone, not a
  member's harm; the current weights become the reference (``rebased``);
* **no worse** (``gained >= lost``): the current weights become the reference, the sources are cleared;
* otherwise (worse within the slack, or ``spared``): nothing changes, the sources stay implicated until the next
  verdict.

Validation is due after every ``every``-th round's update, after the last round's, after each of the first
``every`` rounds (every source is new then) and after every round while a source is **on trial**: a source whose
quarantine ended is readmitted one at a time (no two sources with strikes on trial together, so the next regression
is attributed to it alone) for ``every`` rounds, after which a validation that is not a regression clears it (it
keeps its strikes). A source with no strike is always admitted. A source **with strikes** is held to the regression
test like any source (a stricter "no worse than the reference" bar for them, measured in issue 27's first attack
matrix and removed after c30f784, was a coin toss for an honest peer: an honest org 6.2 points below its run
without the guard at 4 orgs); the slack keeps harm bounded (rows that keep costing accuracy reach a regression
against the same reference, and the counterfactual compares with training alone).

Why an adaptive attacker gains little (SECURITY.md): at every validation after foreign rows the weights the learner
keeps are within the test's slack of its best, or within it of the shadow, or reached by its own
rows only (the final round is always validated); harm that accumulates slowly or shows late is measured against the
same reference and blamed on every source trained since it; a source that alternates honest and doctored windows
keeps its strikes, and each strike multiplies its next quarantine, so once struck it causes at most
``1 + log_backoff(rounds / probation)`` rollbacks in a run. With a shadow, a source whose harm keeps the
learner within the shadow's slack is never struck nor rolled back: the learner may sit that slack below training
alone mid-run, and the last round's choice takes the shadow's weights when they are better by more than ``last_z``
standard deviations. What it cannot see alone: harm that costs no validation accuracy (a trigger that leaves answers
right), harm within the slack, the rounds a rollback throws away, and a slower climb than training alone would give
(it compares with its own best); the counterfactual (:mod:`hacrl_fed.algorithm.counterfactual`,
``counterfactual: true``) compares with a shadow that trains alone, for the last two.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


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
    """What one validation decided: ``rollback`` to the reference weights, or make the current ones the reference
    (``new_reference``; ``rebased`` when they regressed on the learner's own rows alone), the sources
    ``quarantined`` by it (source -> last round it is left out), and the sources a regression ``spared`` (trained on
    since the reference; no rollback, no strike: the weights were not significantly worse than the shadow's)."""

    comparison: Comparison
    rollback: bool
    new_reference: bool
    rebased: bool
    quarantined: dict[str, int]
    spared: tuple[str, ...] = ()


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
    first validation); ``strikes``/``until``: per source; ``implicated``: sources trained since the reference;
    ``trial``: the source with strikes readmitted, by the round its trial began; ``passed``: sources with strikes
    that completed a trial (admitted until their next strike); ``since_shadow``: sources trained since the learner
    last took its shadow's weights (:mod:`hacrl_fed.algorithm.counterfactual`), or since the start."""

    params: OutcomeParams
    reference: list[bool] | None = None
    strikes: dict[str, int] = field(default_factory=dict)
    until: dict[str, int] = field(default_factory=dict)
    implicated: set[str] = field(default_factory=set)
    trial: dict[str, int] = field(default_factory=dict)
    passed: set[str] = field(default_factory=set)
    since_shadow: set[str] = field(default_factory=set)

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
        sources = list(sources)
        self.implicated.update(sources)
        self.since_shadow.update(sources)

    def needs_shadow(self, current: Sequence[bool]) -> bool:
        """Whether :meth:`judge`'s verdict on ``current`` waits on the shadow's vector: a regression after foreign
        rows (the worker validates the shadow for it only then, where it keeps one)."""
        if self.reference is None or not self.implicated:
            return False
        return compare(self.reference[: len(current)], current, self.params.z, self.params.margin).regressed

    def judge(self, round: int, current: Sequence[bool], shadow: Sequence[bool] | None = None) -> Verdict:
        """The verdict on the weights after ``round``'s update (module doc); the first call sets the reference.
        ``shadow``: the shadow's vector on the same prompts now, which gates a regression; None:
        no shadow, every regression after foreign rows rolls back and strikes. ``current`` may cover a prefix of the
        split (the sequential test, :mod:`hacrl_fed.algorithm.sequential`): the reference's vector on the same
        prefix is compared (the worker reads the reference's answers that far first)."""
        if self.reference is None:
            self.reference = list(current)
            return Verdict(Comparison(0, 0, False), False, True, False, {})
        cmp = compare(self.reference[: len(current)], current, self.params.z, self.params.margin)
        done = [s for s, start in self.trial.items() if round >= start + self.params.every - 1]
        harmed = cmp.regressed and bool(self.implicated)  # a regression after foreign rows
        spared = harmed and self._spares(current, shadow)
        if harmed and not spared:
            return Verdict(cmp, True, False, False, self._strike(sorted(self.implicated), round))
        self.passed.update(done)
        for src in done:
            del self.trial[src]
        if spared:
            return Verdict(cmp, False, False, False, {}, tuple(sorted(self.implicated)))
        if cmp.regressed or cmp.not_worse:  # regressed here: on the learner's own rows alone
            self.reference = list(current)
            self.implicated.clear()
        return Verdict(cmp, False, cmp.regressed or cmp.not_worse, cmp.regressed, {})

    def _spares(self, current: Sequence[bool], shadow: Sequence[bool] | None) -> bool:
        """A regression after foreign rows does nothing: there is a shadow and the weights are not significantly
        worse than its (the counterfactual's test, module doc)."""
        if shadow is None:
            return False
        return not compare(shadow, current, self.params.z, self.params.margin).regressed

    def adopt(self, round: int, shadow: Sequence[bool], strike: bool) -> dict[str, int]:
        """The learner took its shadow's weights after ``round``'s update (:mod:`hacrl_fed.algorithm.counterfactual`):
        their vector ``shadow`` becomes the reference; with ``strike`` every source trained since the last adoption
        gets a strike (quarantined through the round returned per source), unless it is quarantined past ``round``
        already (struck by this validation's rollback: one event, one strike)."""
        blamed = sorted(s for s in self.since_shadow if self.until.get(s, 0) <= round) if strike else []
        quarantined = self._strike(blamed, round) if blamed else {}
        self.reference = list(shadow)
        self.implicated.clear()
        self.since_shadow.clear()
        return quarantined

    def state(self) -> dict[str, Any]:
        """Everything but ``params`` as plain data (sets as sorted lists): what a checkpoint keeps."""
        return {
            "reference": None if self.reference is None else list(self.reference),
            "strikes": dict(self.strikes),
            "until": dict(self.until),
            "implicated": sorted(self.implicated),
            "trial": dict(self.trial),
            "passed": sorted(self.passed),
            "since_shadow": sorted(self.since_shadow),
        }

    @classmethod
    def from_state(cls, params: OutcomeParams, state: dict[str, Any]) -> OutcomeGuard:
        """The guard :meth:`state` describes, with ``params`` (the config's, not the checkpoint's)."""
        ref = state["reference"]
        return cls(
            params,
            reference=None if ref is None else [bool(v) for v in ref],
            strikes={str(k): int(v) for k, v in state["strikes"].items()},
            until={str(k): int(v) for k, v in state["until"].items()},
            implicated={str(s) for s in state["implicated"]},
            trial={str(k): int(v) for k, v in state["trial"].items()},
            passed={str(s) for s in state["passed"]},
            since_shadow={str(s) for s in state["since_shadow"]},
        )

    def _strike(self, sources: Sequence[str], round: int) -> dict[str, int]:
        """A strike for each of ``sources`` (quarantined through the round returned per source); the weights go
        back to the reference, so no source stays implicated."""
        quarantined: dict[str, int] = {}
        for src in sources:
            self.strikes[src] = self.strikes.get(src, 0) + 1
            self.passed.discard(src)
            self.trial.pop(src, None)
            span = self.params.probation * self.params.backoff ** (self.strikes[src] - 1)
            self.until[src] = quarantined[src] = round + int(math.ceil(span))
        self.implicated.clear()
        return quarantined
