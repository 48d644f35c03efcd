"""How an update's metrics combine over its optimizer steps and micro-batches (:class:`MetricAccumulator`)."""

from __future__ import annotations

import math


class MetricAccumulator:
    """Averages metrics over steps; ``*_min``/``*_max`` keys keep the extreme, ``num_*`` keys sum."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, metrics: dict[str, float], weight: float = 1.0) -> None:
        for k, v in metrics.items():
            v = float(v)
            if k.endswith("_min"):
                self.sums[k] = min(self.sums.get(k, math.inf), v)
            elif k.endswith("_max"):
                self.sums[k] = max(self.sums.get(k, -math.inf), v)
            elif k.rsplit("/", 1)[-1].startswith("num_"):
                self.sums[k] = self.sums.get(k, 0.0) + v
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * weight
                self.counts[k] = self.counts.get(k, 0.0) + weight

    def merge(self, other: MetricAccumulator) -> None:
        """Fold in another accumulator's sums and counts (another rank's share of the same steps)."""
        for k, v in other.sums.items():
            if k.endswith("_min"):
                self.sums[k] = min(self.sums.get(k, math.inf), v)
            elif k.endswith("_max"):
                self.sums[k] = max(self.sums.get(k, -math.inf), v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v
        for k, c in other.counts.items():
            self.counts[k] = self.counts.get(k, 0.0) + c

    def result(self) -> dict[str, float]:
        return {k: (v / self.counts[k] if k in self.counts else v) for k, v in self.sums.items()}
