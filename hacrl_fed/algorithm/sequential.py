"""How many validation prompts a guard's paired test reads (issue 44): a sequential test that stops when the answer
is clear, within a budget. Pure math, no I/O; the worker (:mod:`hacrl_fed.worker.outcome`) answers the prompts.

The guard's tests (:func:`hacrl_fed.algorithm.outcome_guard.compare`, the counterfactual's) act when the paired
difference over ``n`` prompts of a private split, ``S_n = lost - gained``, passes a bar ``max(z * sqrt(lost +
gained), margin)``. The prompts are read in looks of ``look`` prompts, in the split's private random order, up to
the budget ``N`` (``val_size``, or ``final_size`` at the last round). After each look the test stops for
**futility** when the bar is out of reach at ``N`` given what the prefix shows (stochastic curtailment):

    mu = S_n / n,   var = (lost + gained + 1) / n - mu^2           (per prompt; +1: a pseudo-count of one
                                                                       discordant prompt, so no prefix is certain)
    bar_N = max(z * sqrt((lost + gained + 1) * N / n), margin)     (the bar at N if discordance keeps its rate)
    CP = Phi((S_n + (N - n) * mu - bar_N) / sqrt((N - n) * var))   (the chance S_N passes it on this trend)
    stop when CP < futility

and the test is then decided on the ``n`` prompts read. It never stops early *for* acting (a rollback, a strike,
an adoption is always decided at a look where the bar could still be passed or at ``N``), so it can only miss harm
whose prefix of ``n`` random prompts showed a trend below the bar at a chance under ``futility``; in exchange, a
check whose weights changed little (the honest case: 3-10 % of 400 prompts discordant in the bench runs) reads a
fraction of the split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

Pairs = Callable[[int], tuple[Sequence[bool], Sequence[bool]]]  # n -> (reference, current) on the first n prompts


def conditional_power(lost: int, gained: int, n: int, budget: int, z: float, margin: int) -> float:
    """``CP`` of the module doc: the chance the paired difference passes the bar at ``budget`` prompts, on the
    trend of the first ``n`` (1.0 once ``n >= budget`` and the bar is passed, else 0.0 there)."""
    s = lost - gained
    if n >= budget:
        return float(s > max(z * math.sqrt(lost + gained), margin))
    d = lost + gained + 1
    mu = s / n
    var = max(d / n - mu * mu, 1e-12)
    bar = max(z * math.sqrt(d * budget / n), margin)
    left = budget - n
    return 0.5 * math.erfc(-(s + left * mu - bar) / math.sqrt(2.0 * left * var))


def prompts_read(pairs: Pairs, *, budget: int, look: int, z: float, margin: int, futility: float) -> int:
    """How many prompts (a multiple of ``look``, at most ``budget``) the test reads: looks until futile (module
    doc) or the budget. ``pairs(n)``: the reference's and the current vectors on the first ``n`` prompts."""
    n = min(look, budget)
    while True:
        ref, cur = pairs(n)
        lost = sum(1 for r, v in zip(ref, cur) if r and not v)
        gained = sum(1 for r, v in zip(ref, cur) if v and not r)
        if n >= budget or conditional_power(lost, gained, n, budget, z, margin) < futility:
            return n
        n = min(n + look, budget)
