"""Advantage estimators (pure tensor functions; docs/ALGORITHM.md §2 "Capability-aware advantage").

Shapes: ``N`` rows (sequences). ``group_ids[N]`` names each row's prompt group (any integers), ``source_ids[N]``
the agent index that produced the row, ``capability[n_agents]`` the ``Phat`` values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch
from torch import Tensor

from hacrl_fed.config import AlgorithmConfig

DEFAULTS = AlgorithmConfig()  # the documented defaults: the run config's (docs/ALGORITHM.md "Parameters")
ADV_EPS = 1e-6  # epsilon added to the group's reward std in every advantage (a fixed guard, not a setting: issue 42)


def _as_tensor(x: Tensor | Sequence[float], dtype: torch.dtype, name: str) -> Tensor:
    t = torch.as_tensor(x, dtype=dtype)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t


@overload
def _rows(rewards: Tensor, group_ids: Tensor, source_ids: None = None) -> tuple[Tensor, Tensor, None, torch.dtype]: ...
@overload
def _rows(rewards: Tensor, group_ids: Tensor, source_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, torch.dtype]: ...
def _rows(
    rewards: Tensor, group_ids: Tensor, source_ids: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None, torch.dtype]:
    """The row inputs of every advantage estimator, checked: ``(r [N] float64, gid [N] long, src [N] long or None,
    out_dtype)``; ``out_dtype`` is the dtype of ``rewards``, float32 for integer rewards."""
    r_in = torch.as_tensor(rewards)
    out_dtype = r_in.dtype if r_in.is_floating_point() else torch.float32
    r = _as_tensor(r_in, torch.float64, "rewards")
    gid = _as_tensor(group_ids, torch.long, "group_ids")
    src = None if source_ids is None else _as_tensor(source_ids, torch.long, "source_ids")
    n = r.shape[0]
    if gid.shape[0] != n or (src is not None and src.shape[0] != n):
        raise ValueError(
            f"rewards, group_ids and source_ids must have the same length, got {n}, {gid.shape[0]}"
            + (f", {src.shape[0]}" if src is not None else "")
        )
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite")
    return r, gid, src, out_dtype


class _Groups:
    """Per-group reductions via scatter: ``idx[N]`` dense group index, ``G`` groups."""

    def __init__(self, group_ids: Tensor):
        _, self.idx = torch.unique(group_ids, return_inverse=True)
        self.num = int(self.idx.max().item()) + 1 if self.idx.numel() else 0

    def sum(self, values: Tensor) -> Tensor:
        return torch.zeros(self.num, dtype=values.dtype).index_add_(0, self.idx, values)

    def count(self, mask: Tensor | None = None, dtype: torch.dtype = torch.float64) -> Tensor:
        ones = torch.ones(self.idx.shape[0], dtype=dtype) if mask is None else mask.to(dtype)
        return self.sum(ones)

    def amax(self, values: Tensor) -> Tensor:
        out = torch.full((self.num,), -torch.inf, dtype=values.dtype)
        return out.scatter_reduce(0, self.idx, values, reduce="amax")

    def amin(self, values: Tensor) -> Tensor:
        out = torch.full((self.num,), torch.inf, dtype=values.dtype)
        return out.scatter_reduce(0, self.idx, values, reduce="amin")

    def std(self, values: Tensor, mean: Tensor) -> Tensor:
        """Bessel-corrected std per group (NaN-free: groups of one get 0)."""
        n = self.count(dtype=values.dtype)
        sq = self.sum((values - mean[self.idx]) ** 2)
        return torch.sqrt(sq / (n - 1).clamp(min=1))


Capability = Tensor | Sequence[float] | tuple[Any, Any]  # one Phat per agent, or per row (learner, source)


def capability_per_row(capability: Capability, learner: int, source_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Capability in its one per-row form: ``(Phat_learner(t(y)), Phat_source(t(y)))`` [N] float64 each, the
    figures of the round each row answers (docs/ALGORITHM.md "Capability per round"). ``capability`` is that pair
    already (validated: [N] each, finite and > 0), or one ``Phat`` per agent [n_agents] (lock-step rounds: every row
    is of round ``t``), indexed by ``learner`` and ``source_ids`` [N]."""
    src = torch.as_tensor(source_ids, dtype=torch.long)
    if isinstance(capability, tuple):
        lc = _as_tensor(capability[0], torch.float64, "learner_capability")
        sc = _as_tensor(capability[1], torch.float64, "source_capability")
        if lc.shape != sc.shape or src.shape != lc.shape:
            raise ValueError(f"capabilities and source_ids must all be [N], got {lc.shape}, {sc.shape}, {src.shape}")
    else:
        cap = _as_tensor(capability, torch.float64, "capability")
        if not 0 <= learner < cap.shape[0]:
            raise ValueError(f"learner index {learner} out of range for {cap.shape[0]} agents")
        if src.numel() and (src.min() < 0 or src.max() >= cap.shape[0]):
            raise ValueError(f"source_ids must be agent indices in [0, {cap.shape[0]})")
        lc, sc = cap[learner].expand(src.shape[0]), cap[src]
    if not (torch.isfinite(lc).all() and torch.isfinite(sc).all()) or (lc <= 0).any() or (sc <= 0).any():
        raise ValueError("capability values must be finite and > 0 (floored Phat)")
    return lc, sc


def capability_ratios(
    capability: Capability,
    learner: int,
    source_ids: Tensor,
    ratio_min: float = DEFAULTS.ratio_min,
    ratio_max: float = DEFAULTS.ratio_max,
) -> Tensor:
    """``w(k, y) = clamp(Phat_k(t(y)) / Phat_j(t(y)), ratio_min, ratio_max)``, exactly 1 on the learner's own rows
    (``source_ids == learner``); ``capability``: :func:`capability_per_row`'s forms. → [N] float64."""
    lc, sc = capability_per_row(capability, learner, source_ids)
    w = torch.clamp(lc / sc, ratio_min, ratio_max)  # w(k, j) = clamp(Phat_k / Phat_j)
    own = torch.as_tensor(source_ids, dtype=torch.long) == learner
    return torch.where(own, torch.ones_like(w), w)  # w(k, k) = 1


def hacpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    source_ids: Tensor,
    learner: int,
    capability: Capability,
    *,
    reward_max: float = DEFAULTS.reward_max,
    ratio_min: float = DEFAULTS.ratio_min,
    ratio_max: float = DEFAULTS.ratio_max,
    eps: float = ADV_EPS,
    calibrate: bool = DEFAULTS.advantage_calibration,
    baseline_rows: Tensor | None = None,
) -> Tensor:
    """Capability-aware advantage of every row of the joint groups, for learner ``k`` (docs/ALGORITHM.md §2).

    Per joint group ``g`` (all agents' responses to one prompt):
      - all rewards equal → ``A = 0``;
      - ``mu_k = mean_{y in g} w(k, src(y)) * R(y)``; if ``mu_k > reward_max`` use the mean of k's own rewards in
        ``g`` (the plain group mean if k has none there);
      - ``A(y) = (R(y) - mu_k) / (std_bessel(R over g) + eps)``.

    Args: rewards [N], group_ids [N], source_ids [N] (agent indices), capability: one ``Phat`` per agent, or per
    row the figures of the row's round (:func:`capability_per_row`; then ``w`` is each row's own). Returns [N]
    in the dtype of ``rewards`` (float32 for integer rewards). ``calibrate=False`` takes ``w = 1`` for every row
    (the ``algorithm.advantage_calibration`` ablation: the baseline is the plain joint-group mean).
    ``baseline_rows`` [N] bool (``algorithm.baseline_rows: in_band``; None: every row): the rows the group's
    statistics (``mu_k``, the std, "all rewards equal") are taken over; every row gets ``A`` from them
    (:func:`calibrated_advantages`).
    """
    r, gid, src, out_dtype = _rows(rewards, group_ids, source_ids)
    if r.numel() == 0:
        return torch.zeros(0, dtype=out_dtype)
    w = capability_ratios(capability, learner, src, ratio_min, ratio_max)  # validates the capability either way
    if not calibrate:
        w = torch.ones_like(w)
    own = src == learner
    base = baseline_mask(baseline_rows, r.shape[0], own)
    return calibrated_advantages(r, gid, own, w, reward_max=reward_max, eps=eps, baseline_rows=base).to(out_dtype)


def baseline_mask(baseline_rows: Tensor | None, n: int, own: Tensor) -> Tensor | None:
    """``baseline_rows`` checked: None, or a bool [n] that keeps every own row (``own`` [n] bool). → the mask."""
    if baseline_rows is None:
        return None
    b = torch.as_tensor(baseline_rows)
    if b.dtype != torch.bool or tuple(b.shape) != (n,):
        raise ValueError(f"baseline_rows must be a bool [N]={n} mask, got {b.dtype} {tuple(b.shape)}")
    if bool((own & ~b.to(own.device)).any()):
        raise ValueError("baseline_rows must keep every one of the learner's own rows in the baseline")
    return b


def calibrated_advantages(
    r: Tensor,
    gid: Tensor,
    own: Tensor,
    w: Tensor,
    *,
    reward_max: float,
    eps: float,
    baseline_rows: Tensor | None = None,
) -> Tensor:
    """§2's advantage from each row's capability ratio ``w`` [N] (float64): rewards ``r`` [N] float64, ``gid`` [N]
    group ids, ``own`` [N] bool (the learner's rows). → [N] float64. :func:`hacpo_advantages` takes ``w`` from one
    ``Phat`` per agent; :mod:`.capability_rounds` from the figures of each row's round.

    ``baseline_rows`` [N] bool (None: every row; all True gives the same numbers bit for bit): with ``B_g`` the
    group's rows in it, ``n = |B_g|``, ``mean = sum_B R / n``, ``mu_k = sum_B w R / n`` (guard: the mean of k's own
    rows, else ``mean``), ``std = sqrt(sum_B (R - mean)^2 / max(n - 1, 1))``, ``A = 0`` where ``R`` is constant
    over ``B_g`` (or ``B_g`` is empty); every row of the group, in ``B_g`` or not, gets ``A = (R - mu_k) / (std +
    eps)``."""
    g = _Groups(gid)
    b = torch.ones_like(own) if baseline_rows is None else baseline_rows.to(torch.bool)
    rb = torch.where(b, r, 0.0)  # rewards of the baseline rows, 0 elsewhere (adds nothing to a sum)
    n = g.count(b)  # |B_g|
    mean = g.sum(rb) / n  # plain mean over the baseline rows
    mu_w = g.sum(w * rb) / n  # mu_k = mean over B_g of w(k, src) * R
    own_n = g.count(own)
    own_mean = torch.where(own_n > 0, g.sum(torch.where(own, r, 0.0)) / own_n.clamp(min=1), mean)
    mu = torch.where(mu_w > reward_max, own_mean, mu_w)  # baseline guard
    sq = g.sum(torch.where(b, (r - mean[g.idx]) ** 2, 0.0))
    std = torch.sqrt(sq / (n - 1).clamp(min=1))  # Bessel-corrected std of raw rewards over B_g
    adv = (r - mu[g.idx]) / (std[g.idx] + eps)  # A = (R - mu_k) / (std + eps), every row
    uniform = g.amax(torch.where(b, r, -torch.inf)) <= g.amin(torch.where(b, r, torch.inf))  # also: B_g empty
    return torch.where(uniform[g.idx], torch.zeros_like(adv), adv)  # uniform over B_g → 0


def group_advantages(rewards: Tensor, group_ids: Tensor, *, eps: float = ADV_EPS) -> Tensor:
    """Plain group-normalised advantage (GRPO/GSPO; ``naive`` on the joint group). → [N].

    ``A = (R - mean_g(R)) / (std_bessel_g(R) + eps)``; 0 for groups whose rewards are all equal (incl. size 1).
    """
    r, gid, _, out_dtype = _rows(rewards, group_ids)
    if r.numel() == 0:
        return torch.zeros(0, dtype=out_dtype)
    g = _Groups(gid)
    mean = g.sum(r) / g.count()
    std = g.std(r, mean)
    adv = (r - mean[g.idx]) / (std[g.idx] + eps)  # A = (R - mean) / (std + eps)
    uniform = g.amax(r) == g.amin(r)
    return torch.where(uniform[g.idx], torch.zeros_like(adv), adv).to(out_dtype)


def capability_coefficients(
    capability: Capability,
    learner: int,
    source_ids: Tensor,
    ratio_min: float = DEFAULTS.ratio_min,
    ratio_max: float = DEFAULTS.ratio_max,
) -> Tensor:
    """Capability discrepancy coefficient ``v(j, k; y) = clamp(Phat_j(t(y)) / Phat_k(t(y)), ratio_min, ratio_max)``
    per row, 1 on the learner's own rows; ``capability``: :func:`capability_per_row`'s forms. → [N] float32.
    (``v(j,k)`` is the reciprocal of ``w(k,j)`` before clamping.)"""
    lc, sc = capability_per_row(capability, learner, source_ids)
    v = torch.clamp(sc / lc, ratio_min, ratio_max)  # v(j, k) = clamp(Phat_j / Phat_k)
    own = torch.as_tensor(source_ids, dtype=torch.long) == learner
    return torch.where(own, torch.ones_like(v), v).to(torch.float32)


def advantage_metrics(advantages: Tensor, source_ids: Tensor, names: Sequence[str], prefix: str = "hacpo") -> dict:
    """Mean advantage per source: ``{f"{prefix}/adv_mean/{name}": float}`` for sources present."""
    out: dict[str, float] = {}
    src = torch.as_tensor(source_ids, dtype=torch.long)
    for j, name in enumerate(names):
        sel = src == j
        if sel.any():
            out[f"{prefix}/adv_mean/{name}"] = float(advantages[sel].float().mean())
    return out
