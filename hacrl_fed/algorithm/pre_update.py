"""An algorithm's pre-update pass: what it scores once per row, with the learner's pre-update weights, before the
round's first optimizer step (docs/ALGORITHM.md "Baseline rows").

Today one algorithm has one: HACPO with ``algorithm.baseline_rows: in_band`` takes its group statistics over the
learner's own rows and the foreign rows whose ratio at step 0 lies in the cross band,

    s_0 = exp(clamp(lbar_0 - lbar_old, -M, M)),   in band  <=>  lower_0 <= s_0 <= 1

with ``lbar_0`` the learner's pre-update log-prob of the row normalised as the loss does
(:meth:`~hacrl_fed.train_rows.TrainRow.pre_seq_log_prob`). ``lbar_0`` comes from the row's ``pre_log_prob_sum``
where the likelihood screen left its score (the same weights), else from one no-grad pass of the scorer over the
rest. A foreign row without tokens has no ratio and is left out. ``joint`` (the paper) has no pass: every row.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from hacrl_fed.algorithm.losses import PolicyLossConfig, clamped_log_ratio, hacpo_cross_band
from hacrl_fed.train_rows import TrainRow

Scorer = Callable[[Sequence[TrainRow]], list[float]]  # rows -> the learner's log-prob sums [N], no gradient


@dataclasses.dataclass
class PreUpdate:
    """What the pass found: ``statistics_rows`` [N] bool, the rows the advantages' group statistics are taken over
    (None: every row), and its metrics."""

    statistics_rows: Tensor | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def advantage_options(self) -> dict[str, Tensor]:
        """What the advantage estimator takes from the pass (HACPO's ``baseline_rows``; nothing without a mask)."""
        return {} if self.statistics_rows is None else {"baseline_rows": self.statistics_rows}


def pre_update(
    rows: Sequence[TrainRow], algo: Any, loss_cfg: PolicyLossConfig, score: Scorer, names: Sequence[str] | None
) -> PreUpdate:
    """The pre-update pass ``algo`` (an ``algorithm`` config section) asks for over ``rows`` (module doc)."""
    if algo.baseline_rows == "joint":
        return PreUpdate()
    t0 = time.perf_counter()
    mask = in_band_rows(rows, score, algo.max_abs_log_ratio, loss_cfg)
    return PreUpdate(mask, in_band_metrics(rows, mask, names, algo.name, time.perf_counter() - t0))


def with_pre_scores(rows: Sequence[TrainRow], score: Scorer) -> list[TrainRow]:
    """``rows`` with every cross row's pre-update log-prob sum (``pre_log_prob_sum``) where it has none: one
    no-grad pass of ``score`` over those rows with the current (pre-update) weights."""
    todo = [i for i, r in enumerate(rows) if not r.is_self and r.pre_log_prob_sum is None]
    sums = dict(zip(todo, score([rows[i] for i in todo]))) if todo else {}
    return [dataclasses.replace(r, pre_log_prob_sum=sums[i]) if i in sums else r for i, r in enumerate(rows)]


def in_band_rows(rows: Sequence[TrainRow], score: Scorer, max_abs_log_ratio: float, config: PolicyLossConfig) -> Tensor:
    """bool [N]: True on every own row and on each foreign row (with tokens) whose step-0 ratio ``s_0`` lies in the
    cross band of step 0 (:func:`~hacrl_fed.algorithm.losses.hacpo_cross_band`; module doc)."""
    keep = torch.tensor([r.is_self for r in rows], dtype=torch.bool)
    cross = [i for i, r in enumerate(rows) if not r.is_self and r.response_ids]
    if cross:
        scored = with_pre_scores([rows[i] for i in cross], score)  # the screen's scores where it kept them
        lbar0 = torch.tensor([r.pre_seq_log_prob() for r in scored], dtype=torch.float64)
        old = torch.tensor([rows[i].old_seq_log_prob for i in cross], dtype=torch.float64)
        ratio = torch.exp(clamped_log_ratio(lbar0, old, max_abs_log_ratio))  # s_0
        keep[cross] = hacpo_cross_band(ratio, 0, config)[2]
    return keep


def in_band_metrics(
    rows: Sequence[TrainRow], base: Tensor, names: Sequence[str] | None, prefix: str, seconds: float
) -> dict[str, float]:
    """``time/baseline_rows`` (``seconds``, the pass) and, with foreign rows, ``<prefix>/num_baseline_cross`` and
    ``<prefix>/baseline_cross_frac``: the foreign rows in the statistics (of all the round's foreign rows), the
    share per source too (``.../<source>``)."""
    cross = torch.tensor([not r.is_self for r in rows], dtype=torch.bool)
    if not cross.any():
        return {"time/baseline_rows": seconds}
    src = torch.tensor([r.source for r in rows])
    out = {"time/baseline_rows": seconds, f"{prefix}/num_baseline_cross": float((base & cross).sum())}
    out[f"{prefix}/baseline_cross_frac"] = out[f"{prefix}/num_baseline_cross"] / float(cross.sum())
    for j in torch.unique(src[cross]).tolist():
        sel = cross & (src == j)
        name = names[j] if names is not None and j < len(names) else f"src{j}"
        out[f"{prefix}/baseline_cross_frac/{name}"] = float((base & sel).sum()) / float(sel.sum())
    return out
