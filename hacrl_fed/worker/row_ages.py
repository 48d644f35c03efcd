"""The staleness histogram of the foreign rows a learner trains on (docs/METRICS.md "Staleness"), for every algorithm
in asynchronous rounds (``federation.staleness >= 1``).

A foreign row's *age* is the learner's version before the update minus the version of the round its batch comes
from, in rounds (:func:`hacrl_fed.worker.late_rounds.set_rounds` sets it; 0 for a batch of the learner's own
version). The rows counted are the ones the update trains on: the foreign rows admitted by the intake (past
selection, the likelihood screen and the context fit) that still hold response tokens, once per round whatever the
number of epochs. Pure: ages and source names in, summable counts out; no torch, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

PREFIX = "staleness"


def staleness_histogram(ages: Sequence[int], sources: Sequence[str]) -> dict[str, float]:
    """Per age ``a`` of the ``N`` rows (``ages[i]`` >= 0, ``sources[i]`` the org that produced row ``i``):

    - ``staleness/age<a>/rows``: rows of age ``a``; ``staleness/age<a>/rows/<source>``: those from ``<source>``;
    - ``staleness/rows``: ``N``; ``staleness/age_mean``: ``sum(ages) / N``; ``staleness/age_max``: ``max(ages)``.

    Nothing when ``N = 0`` (a mean over no rows is not a number). ValueError on a negative age or a length mismatch.
    """
    if len(ages) != len(sources):
        raise ValueError(f"ages and sources must have the same length, got {len(ages)} and {len(sources)}")
    if any(a < 0 for a in ages):
        raise ValueError(f"ages must be >= 0 (rounds), got {sorted(set(ages))}")
    if not ages:
        return {}
    out: dict[str, float] = {}
    for (age, source), n in sorted(Counter(zip(ages, sources)).items()):
        out[f"{PREFIX}/age{age}/rows/{source}"] = float(n)
    for age, n in sorted(Counter(ages).items()):
        out[f"{PREFIX}/age{age}/rows"] = float(n)
    out[f"{PREFIX}/rows"] = float(len(ages))
    out[f"{PREFIX}/age_mean"] = sum(ages) / len(ages)  # mean age = sum(a_i) / N
    out[f"{PREFIX}/age_max"] = float(max(ages))
    return out


def trained_row_ages(rows: Sequence[Any], agents: Sequence[str]) -> dict[str, float]:
    """:func:`staleness_histogram` of the foreign rows of ``rows`` (``TrainRow``: ``is_self``, ``age``, ``source``
    indexing ``agents``) that hold response tokens: the rows the update trains on."""
    trained = [r for r in rows if not r.is_self and r.response_ids]
    return staleness_histogram([int(r.age) for r in trained], [agents[r.source] for r in trained])
