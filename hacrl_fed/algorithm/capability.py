"""Capability estimate ``Phat`` per agent (docs/ALGORITHM.md §1). Pure Python: no torch, no I/O."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from hacrl_fed.config import AlgorithmConfig

DEFAULTS = AlgorithmConfig()  # the documented defaults: the run config's (docs/ALGORITHM.md "Parameters")
CAPABILITY_FLOOR = 1e-8  # lower bound of every Phat, no division by 0 (a fixed guard, not a setting: issue 42)


def _accuracy(agent: object, acc: float) -> float:
    """One reported ``P_k(t)`` as a float, refused unless finite and >= 0."""
    acc = float(acc)
    if not math.isfinite(acc) or acc < 0:
        raise ValueError(f"accuracy of {agent!r} must be finite and >= 0, got {acc}")
    return acc


def _phat(history: Sequence[float], window: int, floor: float) -> float:
    """``Phat = max(floor, mean of the last `window` values of history)``; 1.0 for an empty history (§1)."""
    recent = history[-window:]
    if not recent:
        return 1.0
    return max(floor, sum(recent) / len(recent))


class CapabilityTracker:
    """Tracks each agent's per-round accuracy ``P_k(t)`` and serves ``Phat_k`` and capability ratios.

    ``Phat_k = max(floor, mean of the last `window` values of P_k)``; an agent with no history has ``Phat = 1``.
    ``ratio(k, j) = clamp(Phat_k / Phat_j, ratio_min, ratio_max)``, 1 for ``k == j`` and during the first
    ``warmup_rounds`` rounds (counted in :meth:`update` calls).
    """

    def __init__(
        self,
        window: int = DEFAULTS.capability_window,
        floor: float = CAPABILITY_FLOOR,
        ratio_min: float = DEFAULTS.ratio_min,
        ratio_max: float = DEFAULTS.ratio_max,
        warmup_rounds: int = DEFAULTS.warmup_rounds,
    ):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not floor > 0:
            raise ValueError(f"floor must be > 0, got {floor}")
        if not 0 < ratio_min <= ratio_max:
            raise ValueError(f"need 0 < ratio_min <= ratio_max, got {ratio_min}, {ratio_max}")
        if warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {warmup_rounds}")
        self.window, self.floor = int(window), float(floor)
        self.ratio_min, self.ratio_max = float(ratio_min), float(ratio_max)
        self.warmup_rounds = int(warmup_rounds)
        self.rounds_seen = 0
        self._history: dict[str, list[float]] = {}

    @classmethod
    def from_algorithm(cls, algo: Any) -> CapabilityTracker:
        """The tracker an ``algorithm`` config section (:class:`~hacrl_fed.config.AlgorithmConfig`) asks for."""
        return cls(
            algo.capability_window, ratio_min=algo.ratio_min, ratio_max=algo.ratio_max, warmup_rounds=algo.warmup_rounds
        )

    def update(self, accuracies: Mapping[str, float]) -> None:
        """Record one round: ``{agent: P_k(t)}``. Agents absent this round keep their history unchanged."""
        clean = {}
        for agent, acc in accuracies.items():
            clean[str(agent)] = _accuracy(agent, acc)
        for agent, acc in clean.items():
            self._history.setdefault(agent, []).append(acc)
        self.rounds_seen += 1

    @property
    def in_warmup(self) -> bool:
        """True while ratios are forced to 1 (the first ``warmup_rounds`` rounds)."""
        return self.rounds_seen <= self.warmup_rounds

    def capability(self, agent: str) -> float:
        """``Phat_k``: floored mean of the last ``window`` recorded accuracies; 1.0 when never seen."""
        return _phat(self._history.get(str(agent), []), self.window, self.floor)

    def ratio(self, num: str, den: str) -> float:
        """``clamp(Phat_num / Phat_den, ratio_min, ratio_max)``; 1 for ``num == den`` or during warm-up."""
        if str(num) == str(den) or self.in_warmup:
            return 1.0
        return min(self.ratio_max, max(self.ratio_min, self.capability(num) / self.capability(den)))

    def effective_capabilities(self, agents: Sequence[str]) -> list[float]:
        """``Phat`` per agent as the advantage/loss functions should see it: all 1.0 during warm-up."""
        return [1.0 if self.in_warmup else self.capability(a) for a in agents]

    def table(self) -> dict[str, float]:
        """``{agent: Phat}`` for every agent seen."""
        return {a: self.capability(a) for a in sorted(self._history)}

    def history(self, agent: str) -> list[float]:
        return list(self._history.get(str(agent), []))

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "floor": self.floor,
            "ratio_min": self.ratio_min,
            "ratio_max": self.ratio_max,
            "warmup_rounds": self.warmup_rounds,
            "rounds_seen": self.rounds_seen,
            "history": {a: list(h) for a, h in self._history.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (settings included), validating it first."""
        fresh = CapabilityTracker(
            state["window"], state["floor"], state["ratio_min"], state["ratio_max"], state["warmup_rounds"]
        )
        history = {str(a): [float(x) for x in h] for a, h in dict(state["history"]).items()}
        if any(not math.isfinite(x) or x < 0 for h in history.values() for x in h):
            raise ValueError("capability history values must be finite and >= 0")
        self.__dict__.update(fresh.__dict__)
        self.rounds_seen = int(state["rounds_seen"])
        self._history = history
