"""How a selection budget is divided among the sources of a round (``trainer.selection.budget_split``; docs/
ALGORITHM.md "Selecting foreign rows", "A budget per source").

Pure integer functions (no torch, no I/O). ``pooled`` (the default) spends one budget of ``B`` rows on the rule's
order over every source's rows together, so a source offering many eligible rows takes most of it, and the worker
spends that budget *before* its likelihood screen: a doctoring source's rows can fill the budget and then be
dropped by the screen, leaving the learner with fewer foreign rows ("budget squatting", SECURITY.md).
``per_source`` gives every source a share of ``B`` that no other source can spend:

- the demand ``e_s`` of source ``s`` is its rows the rule could take (its eligible rows);
- if ``Σ e_s <= B`` every source gets ``e_s``; otherwise every source gets ``min(e_s, L)`` for the largest level
  ``L`` with ``Σ_s min(e_s, L) <= B`` (max-min fair, "water-filling"), and the ``r = B − Σ_s min(e_s, L)`` slots
  left (``r`` is smaller than the number of sources with ``e_s > L``) go one each to the first ``r`` of those
  sources in a seeded order of the names (``stable_seed(seed, "share", name)``);
- so ``L >= floor(B / n)`` for the ``n`` sources with a demand: a source is guaranteed ``min(e_s, floor(B / n))``
  whatever the others offer, and what a source cannot use (``e_s`` below the level) is what the others share.

The shares are fixed from the demands before any row is re-tokenized or scored: a row the likelihood screen
later drops still counts against its own source's share, and nothing is handed out again after the screen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from hacrl_fed.seeding import stable_seed

BUDGET_SPLITS = ("pooled", "per_source")


def share_level(demands: Iterable[int], budget: int) -> int:
    """The largest ``L`` with ``Σ min(e, L) <= budget`` (``max(demands)`` when every demand fits; 0 when none)."""
    ds = [int(d) for d in demands]
    if budget < 0 or any(d < 0 for d in ds):
        raise ValueError(f"demands and budget must be >= 0, got {ds} and {budget}")
    lo, hi = 0, max(ds, default=0)
    while lo < hi:  # Σ min(e, L) is non-decreasing in L: bisect for the last L that fits
        mid = (lo + hi + 1) // 2
        if sum(min(d, mid) for d in ds) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def source_shares(demands: Mapping[str, int], budget: int, seed: int) -> dict[str, int]:
    """Each source's share of ``budget`` (module docstring): ``min(e_s, L)``, plus one for the first ``r`` sources
    with ``e_s > L`` in the seeded name order, ``r = budget − Σ min(e_s, L)``. Never more than ``e_s``; the shares
    sum to ``min(budget, Σ e_s)``."""
    level = share_level(demands.values(), budget)
    shares = {str(s): min(int(e), level) for s, e in demands.items()}
    left = budget - sum(shares.values())
    hungry = sorted((s for s, e in demands.items() if int(e) > level), key=lambda s: (stable_seed(seed, "share", s), s))
    for s in hungry[: max(left, 0)]:
        shares[str(s)] += 1
    return shares


def take_shares(order: Sequence[int], sources: Sequence[str], shares: Mapping[str, int]) -> list[int]:
    """The rows of ``order`` (indices into ``sources``) that fit their source's share, first come first served
    in ``order``: per source, the first ``shares[source]`` of its rows in ``order``."""
    taken: dict[str, int] = {}
    out = []
    for i in order:
        src = sources[i]
        if taken.get(src, 0) < shares.get(src, 0):
            taken[src] = taken.get(src, 0) + 1
            out.append(i)
    return out


def share_metrics(sources: Sequence[str], selected: Iterable[int], shares: Mapping[str, int]) -> dict[str, float]:
    """``select/<source>/share`` (its share under ``per_source``; under ``pooled`` what it would have been) and
    ``select/<source>/over_share`` (its selected rows beyond that share: other sources' share it took; 0 under
    ``per_source``), for every source of ``sources``."""
    counts: dict[str, int] = dict.fromkeys(sources, 0)
    for i in selected:
        counts[sources[i]] += 1
    out: dict[str, float] = {}
    for src in sorted(counts):
        share = shares.get(src, 0)
        out[f"select/{src}/share"] = float(share)
        out[f"select/{src}/over_share"] = float(max(counts[src] - share, 0))
    return out
