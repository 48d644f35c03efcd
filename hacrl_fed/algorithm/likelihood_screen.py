"""The learner's likelihood screen of foreign rows (docs/ALGORITHM.md "Likelihood screen"; SECURITY.md).

Pure math on one round's rows, no I/O. Every row ``i`` carries the learner's own sequence log-prob ``s_i`` (sum over
its response tokens, under the learner's pre-update weights) and a length ``n_i`` (the learner's tokens, or the
response's UTF-8 bytes with ``norm="per_byte"``, comparable across tokenizers), so its length-normalised likelihood
is ``l_i = s_i / n_i``. A foreign row also carries its source's claimed sum ``c_i`` (``Rollout.logprob_sum``, in
the source's own tokens) normalised by the same length in bytes, or by the source's token count per token.

Two tests, each on foreign rows only (own rows are never dropped):

1. **low likelihood**: with ``ref_g`` the ``quantile`` of the learner's own rows' ``l`` in the row's group (the
   same prompt), or over all own rows of the round where the group has none,
   ``l_i < ref_g - margin_nats`` drops row ``i`` (``dropped_low_likelihood``). Text the learner itself would
   almost never write for that prompt (a fixed string inserted into an answer) falls here whatever is claimed.
2. **claim outlier**: the gap ``d_i = c_i / n_i - l_i`` (claimed minus learner, per unit) of honest rows of one
   source is a stable population (the source's model against the learner's). Against the source's running
   history ``(center, scale)`` (or this round's median and 1.4826 * MAD when there is none yet),
   ``|d_i - center| > claim_z * max(scale, min_scale) + claim_margin_nats`` drops row ``i``
   (``dropped_claim_outlier``): a source that claims, for doctored rows, about the log-prob the learner gives them
   (so that HACPO's cross ratio lands in its band) moves those rows' gap away from its honest rows'.
   The history is updated with the kept rows' median and scaled MAD (an EMA with ``history_decay``).

What it cannot see: a doctored text that the learner itself finds as likely as its own answers, and a source that
lies on every row from its first round on (its history then is the lie; test 1 still applies). SECURITY.md says so.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MAD_TO_SIGMA = 1.4826  # a normal population's standard deviation per median absolute deviation

REASONS = ("low_likelihood", "claim_outlier")


@dataclass(frozen=True)
class ScreenParams:
    """The thresholds (docs/ALGORITHM.md "Likelihood screen"): ``margin_nats`` and ``claim_z`` are the config's
    (``trainer.likelihood_screen``); the others are fixed constants (research knobs with no measured use, taken
    out of the config in issue 42)."""

    margin_nats: float = 4.0
    quantile: float = 0.0
    claim_z: float = 8.0
    claim_margin_nats: float = 0.5
    min_scale: float = 0.05
    history_decay: float = 0.8
    min_rows: int = 4


@dataclass
class GapHistory:
    """One source's running claimed-minus-learner gap: EMA of its rounds' median (``center``) and scaled MAD."""

    center: float
    scale: float
    rounds: int = 1


@dataclass
class ScreenResult:
    """``keep`` per row (own rows always True); ``dropped[source][reason]`` and ``checked[source]`` counts; the
    updated ``history``; ``gap_median[source]``: this round's median gap of the source's rows; ``deficit_max[source]``:
    the largest ``ref_g - l_i`` over the source's rows (how close test 1 came to dropping; diagnostics)."""

    keep: list[bool]
    dropped: dict[int, dict[str, int]]
    checked: dict[int, int]
    history: dict[int, GapHistory]
    gap_median: dict[int, float] = field(default_factory=dict)
    deficit_max: dict[int, float] = field(default_factory=dict)


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile ``q`` in [0, 1] of a non-empty list (q=0: the minimum)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _robust(values: Sequence[float]) -> tuple[float, float]:
    """``(median, 1.4826 * MAD)`` of a non-empty list."""
    med = statistics.median(values)
    return med, MAD_TO_SIGMA * statistics.median(abs(v - med) for v in values)


def likelihood_screen(
    learner_lp: Sequence[float],
    lengths: Sequence[float],
    is_self: Sequence[bool],
    groups: Sequence[int],
    sources: Sequence[int],
    claimed_lp: Sequence[float | None],
    params: ScreenParams,
    history: Mapping[int, GapHistory] | None = None,
) -> ScreenResult:
    """Which foreign rows to keep (module doc).

    All sequences have one entry per row (``N``). ``learner_lp``: the learner's sequence log-prob sums ``s_i``;
    ``lengths``: ``n_i > 0`` (tokens or bytes); ``claimed_lp``: the source's claimed sums already normalised to
    the same unit (``c_i / n_i``), None for own rows or where no claim is compared. ``history``: per source id,
    from the previous rounds (not modified). Returns :class:`ScreenResult`; a row dropped by test 1 is not tested
    again by test 2. With no own rows test 1 is skipped; sources with fewer than ``min_rows`` rows this round and
    no history skip test 2.
    """
    n = len(learner_lp)
    for name, seq in (("lengths", lengths), ("is_self", is_self), ("groups", groups), ("sources", sources)):
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} rows, learner_lp has {n}")
    if len(claimed_lp) != n:
        raise ValueError(f"claimed_lp has {len(claimed_lp)} rows, learner_lp has {n}")
    per_unit = [float(s) / max(float(u), 1e-9) for s, u in zip(learner_lp, lengths)]
    res = ScreenResult([True] * n, {}, {}, dict(history or {}))
    own_by_group: dict[int, list[float]] = {}
    for i in range(n):
        if is_self[i]:
            own_by_group.setdefault(int(groups[i]), []).append(per_unit[i])
        else:
            res.checked[int(sources[i])] = res.checked.get(int(sources[i]), 0) + 1
    if own_by_group:  # test 1 needs own rows
        _low_likelihood(res, per_unit, is_self, groups, sources, own_by_group, params)
    for src in sorted(res.checked):
        _claim_outliers(res, src, per_unit, is_self, sources, claimed_lp, params)
    return res


def _drop(res: ScreenResult, i: int, source: int, reason: str) -> None:
    res.keep[i] = False
    counts = res.dropped.setdefault(source, dict.fromkeys(REASONS, 0))
    counts[reason] += 1


def _low_likelihood(
    res: ScreenResult,
    per_unit: Sequence[float],
    is_self: Sequence[bool],
    groups: Sequence[int],
    sources: Sequence[int],
    own_by_group: Mapping[int, list[float]],
    params: ScreenParams,
) -> None:
    """Test 1: a foreign row whose per-unit log-prob is more than ``margin_nats`` below the ``quantile`` of the
    learner's own rows of its group (of all own rows when the group has none) is dropped (``low_likelihood``)."""
    pooled = _quantile([v for vs in own_by_group.values() for v in vs], params.quantile)
    for i in range(len(per_unit)):
        if not is_self[i]:
            own = own_by_group.get(int(groups[i]))
            deficit = (_quantile(own, params.quantile) if own else pooled) - per_unit[i]
            src = int(sources[i])
            res.deficit_max[src] = max(res.deficit_max.get(src, -math.inf), deficit)
            if deficit > params.margin_nats:
                _drop(res, i, src, "low_likelihood")


def _claim_outliers(
    res: ScreenResult,
    src: int,
    per_unit: Sequence[float],
    is_self: Sequence[bool],
    sources: Sequence[int],
    claimed_lp: Sequence[float | None],
    params: ScreenParams,
) -> None:
    """Test 2 for source ``src``: a row whose claimed-minus-learner gap is far from the source's centre (its
    history, else this round's robust centre when it has ``min_rows`` rows) is dropped (``claim_outlier``); the
    source's history then moves towards this round's kept gaps."""
    rows = [i for i in range(len(per_unit)) if not is_self[i] and int(sources[i]) == src and claimed_lp[i] is not None]
    gaps = {i: float(claimed_lp[i]) - per_unit[i] for i in rows}  # type: ignore[arg-type]
    if not gaps:
        return
    res.gap_median[src] = statistics.median(gaps.values())
    past = res.history.get(src)
    if past is not None:
        center, scale = past.center, past.scale
    elif len(gaps) >= params.min_rows:
        center, scale = _robust(list(gaps.values()))
    else:
        return
    bound = params.claim_z * max(scale, params.min_scale) + params.claim_margin_nats
    for i, d in gaps.items():
        if res.keep[i] and abs(d - center) > bound:
            _drop(res, i, src, "claim_outlier")
    kept = [d for i, d in gaps.items() if res.keep[i]]
    if kept:
        med, mad = _robust(kept)
        if past is None:
            res.history[src] = GapHistory(med, mad)
        else:
            a = params.history_decay
            res.history[src] = GapHistory(
                a * past.center + (1 - a) * med, a * past.scale + (1 - a) * mad, past.rounds + 1
            )
