"""The capability table per (org, round) (docs/ALGORITHM.md "Asynchronous rounds", "Capability per round").

:class:`~hacrl_fed.algorithm.capability.CapabilityTracker` keeps one running ``Phat`` per org, right for lock-step
rounds where every row a learner trains on comes from the round just played. With rows from several rounds (a
staleness window) each row's capability ratio and coefficient use the figures **of the round the row comes from**:

    Phat_x(t)  = max(floor, mean of the last `window` recorded P_x(t') with t' <= t)   (1 when x has none yet)
    warm-up(t) = (rounds recorded with t' <= t) <= warmup_rounds                        (then every Phat is 1)
    row y of round t(y) from source j, learner k:
      w(k, y)    = clamp(Phat_k(t(y)) / Phat_j(t(y)), ratio_min, ratio_max),  1 on k's own rows     (§2 baseline)
      v(j, k; y) = clamp(Phat_j(t(y)) / Phat_k(t(y)), ratio_min, ratio_max),  1 on k's own rows     (§3)

With every row from the current round ``t`` and the rounds recorded in order these are the tracker's numbers bit
for bit (tested): the same values averaged in the same order and the same float operations per row.
Shapes: ``N`` rows; ``learner_capability`` / ``source_capability`` [N] hold ``Phat_k(t(y))`` / ``Phat_j(t(y))``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hacrl_fed.algorithm.capability import CAPABILITY_FLOOR, DEFAULTS, CapabilityTracker, _accuracy, _phat


class RoundCapabilities:
    """``P_x(t)`` per (org, round), recorded in any order; ``Phat_x(t)`` and the warm-up as of any round ``t``."""

    def __init__(
        self,
        window: int = DEFAULTS.capability_window,
        floor: float = CAPABILITY_FLOOR,
        ratio_min: float = DEFAULTS.ratio_min,
        ratio_max: float = DEFAULTS.ratio_max,
        warmup_rounds: int = DEFAULTS.warmup_rounds,
    ):
        CapabilityTracker(window, floor, ratio_min, ratio_max, warmup_rounds)  # the one place the settings are checked
        self.window, self.floor = int(window), float(floor)
        self.ratio_min, self.ratio_max = float(ratio_min), float(ratio_max)
        self.warmup_rounds = int(warmup_rounds)
        self._history: dict[str, dict[int, float]] = {}
        self._rounds: set[int] = set()  # rounds recorded (a round with a record counts once for the warm-up)

    @classmethod
    def from_algorithm(cls, algo: Any) -> RoundCapabilities:
        """The table an ``algorithm`` config section (:class:`~hacrl_fed.config.AlgorithmConfig`) asks for."""
        return cls(
            algo.capability_window, ratio_min=algo.ratio_min, ratio_max=algo.ratio_max, warmup_rounds=algo.warmup_rounds
        )

    def record(self, round: int, accuracies: Mapping[str, float]) -> None:
        """Record round ``round`` (>= 1): ``{org: P_org(round)}``. An (org, round) already recorded is refused."""
        if isinstance(round, bool) or not isinstance(round, int) or round < 1:
            raise ValueError(f"round must be an integer >= 1, got {round!r}")
        clean = {}
        for org, acc in accuracies.items():
            acc = _accuracy(org, acc)
            if round in self._history.get(str(org), {}):
                raise ValueError(f"round {round} of {org!r} is already recorded")
            clean[str(org)] = acc
        for org, acc in clean.items():
            self._history.setdefault(org, {})[round] = acc
        self._rounds.add(round)

    def revise(self, round: int, org: str, accuracy: float) -> None:
        """Replace ``P_org(round)`` (recorded or not) by ``accuracy``: coordinator-blind asynchronous rounds, where
        the claimed accuracy recorded at acceptance gives way to the coordinator's own re-verification of that
        batch after a proven accusation (docs/ALGORITHM.md "Capability per round")."""
        if isinstance(round, bool) or not isinstance(round, int) or round < 1:
            raise ValueError(f"round must be an integer >= 1, got {round!r}")
        self._history.setdefault(str(org), {})[round] = _accuracy(org, accuracy)
        self._rounds.add(round)

    def in_warmup(self, round: int) -> bool:
        """True while ``Phat`` is reported as 1 at ``round``: at most ``warmup_rounds`` rounds recorded up to it."""
        return sum(1 for t in self._rounds if t <= round) <= self.warmup_rounds

    def capability(self, org: str, round: int) -> float:
        """``Phat_org(round)``: floored mean of the last ``window`` values recorded at rounds ``<= round`` (1: none)."""
        hist = self._history.get(str(org), {})
        return _phat([hist[t] for t in sorted(t for t in hist if t <= round)], self.window, self.floor)

    def effective(self, org: str, round: int) -> float:
        """``Phat_org(round)`` as the advantage and loss see it: 1 during the warm-up."""
        return 1.0 if self.in_warmup(round) else self.capability(org, round)

    def table(self, round: int, orgs: Sequence[str]) -> dict[str, float]:
        """``{org: Phat_org(round)}`` for ``orgs`` as the workers should use it (all 1 during the warm-up)."""
        return {org: self.effective(org, round) for org in orgs}

    def row_figures(self, learner: str, rows: Sequence[tuple[str, int]]) -> tuple[list[float], list[float]]:
        """Per row ``(source, round)``: ``([Phat_learner(round)], [Phat_source(round)])``, as the workers see them."""
        return [self.effective(learner, t) for _, t in rows], [self.effective(src, t) for src, t in rows]

    def state_dict(self) -> dict[str, Any]:
        settings = (self.window, self.floor, self.ratio_min, self.ratio_max, self.warmup_rounds)
        history = {org: {str(t): p for t, p in sorted(h.items())} for org, h in self._history.items()}
        return {"settings": list(settings), "rounds": sorted(self._rounds), "history": history}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (settings included), validating it first."""
        fresh = RoundCapabilities(*state["settings"])
        for t in state["rounds"]:
            fresh.record(int(t), {})
        for org, hist in dict(state["history"]).items():
            for t, p in dict(hist).items():
                fresh.record(int(t), {str(org): p})
        self.__dict__.update(fresh.__dict__)
