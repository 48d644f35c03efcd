"""Clock-time figures of asynchronous cells against lock-step ones (issue 29, BENCHMARKS.md "Asynchronous rounds").

An asynchronous cell (``federation.staleness >= 1`` on the virtual clock) carries each org's ``clock_curve``:
``[round, clock, accuracy]``, the clock being when the org's weights after that round existed
(``async/<org>/trained_at_s``). A lock-step cell has none; its clock follows from the step durations it would run
under, ``d_x`` = ``federation.virtual_step_s[x]`` of the cell's stored config (the benchmark layer: default 1):

- synchronous HACPO: every round lasts the slowest org's step, and the weights after round ``t`` exist when the
  step that trained it (the one planning ``t + 1``, the fused protocol) ends: ``clock(t) = (t + 1) * max_x d_x``;
- isolated GSPO, org ``x`` alone: ``clock(t) = (t + 1) * d_x``;
- ``clock(0) = 0`` (the warm start).

The same rule gives an asynchronous org that was never held back its ``(t + 1) * d_x`` (tested against the driver),
so the three are on one clock. Accuracy between two evaluations is read linearly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Curve = Sequence[Sequence[float]]  # [[round, clock, accuracy], ...] in round order


def lock_step_clock(curve: Curve, step_s: float) -> list[list[float]]:
    """``[round, rollouts, accuracy]`` points of a lock-step cell -> ``[round, clock, accuracy]`` with
    ``clock(t) = (t + 1) * step_s`` for ``t >= 1`` and ``0`` for the warm start."""
    return [[t, 0.0 if t == 0 else (t + 1) * step_s, acc] for t, _, acc in curve]


def round_step_s(step_s: Mapping[str, float], orgs: Sequence[str]) -> float:
    """A lock-step round's duration: the slowest org's step."""
    return max(float(step_s.get(o, 1.0)) for o in orgs)


def time_to(curve: Curve, target: float) -> float | None:
    """The first clock at which the accuracy reaches ``target``, read linearly between evaluations
    (``None``: never within the run)."""
    prev = None
    for _, clock, acc in curve:
        if acc >= target:
            if prev is None or prev[1] >= target:
                return float(clock)
            (c0, a0), (c1, a1) = prev, (clock, acc)
            return float(c0 + (target - a0) / (a1 - a0) * (c1 - c0))
        prev = (clock, acc)
    return None


def accuracy_at(curve: Curve, clock: float) -> float:
    """The accuracy at ``clock``, read linearly between evaluations; after the last one, the last."""
    prev = None
    for _, c, acc in curve:
        if c >= clock:
            if prev is None or c == prev[0]:
                return float(acc)
            (c0, a0) = prev
            return float(a0 + (clock - c0) / (c - c0) * (acc - a0))
        prev = (c, acc)
    return float(curve[-1][2])
