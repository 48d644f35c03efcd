"""HACPO's foreign rows under staleness: the decoupled cross loss (docs/ALGORITHM.md "Asynchronous rounds").

``algorithm.cross_staleness: decoupled`` (registry name ``hacpo_decoupled``) splits HACPO's one cross band, which
mixes the model difference between learner and source with the age of the source's batch, in two, as AReaL's
decoupled PPO does for one model's stale rollouts:

- the **trust region** is around the learner's pre-update (proximal) policy ``pi_prox``, the weights it had when
  the round's update began: ``r = exp(lbar - lbar_prox)``, GSPO's clip ``[1 - self_clip_low, 1 + self_clip_high]``
  (the same sequence-level band as the learner's own rows, with PPO's ``min``);
- the **behaviour weight** ``w = pi_prox / mu_source = exp(lbar_prox - lbar_mu)`` (``lbar_mu``: the source's
  published log-prob, normalised like the cross ratio, per token or per byte) is a stop-gradient weight, with an
  explicit filter (``cross_weight_mode: filter``: a row with ``w`` outside ``[cross_weight_min, cross_weight_max]``
  is left out) or clamp (``clamp``: ``w`` clamped into it), raised to ``1 + alpha`` like HACPO's ``sg(c)^alpha``
  and multiplied by the capability coefficient ``v(j, k)``.

Shapes: every input is [N] (one value per row: sequence mean log-probs ``lbar``, advantages, flags, ids).
Per-(source, age) metrics: ``age`` = the learner's version minus the version of the round the row's batch comes
from, in rounds (0 in synchronous rounds).
"""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor

from hacrl_fed.algorithm.losses import PolicyLossConfig, _check_seq_inputs, _fracs, _per_source, _stats, gspo_objective

PREFIX = "hacpo_decoupled"
WEIGHT_MODES = ("filter", "clamp")
DEFAULT_CONFIG = PolicyLossConfig()  # the run config's defaults


def behaviour_weight(
    prox_seq_log_probs: Tensor, behaviour_seq_log_probs: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """The stop-gradient behaviour weight of every row. prox, behaviour [N] → ``(log_w, inside, w_hat)`` [N], all
    detached: ``log_w = clamp(lbar_prox - lbar_mu, -M, M)``, ``inside = w_min <= exp(log_w) <= w_max`` and
    ``w_hat = exp(log_w) * inside`` (filter) or ``clamp(exp(log_w), w_min, w_max)`` (clamp)."""
    if config.cross_weight_mode not in WEIGHT_MODES:
        raise ValueError(f"cross_weight_mode must be one of {WEIGHT_MODES}, got {config.cross_weight_mode!r}")
    if not 0.0 <= config.cross_weight_min <= 1.0 <= config.cross_weight_max:
        raise ValueError(f"need 0 <= cross_weight_min <= 1 <= cross_weight_max, got {config}")
    m = config.max_abs_log_ratio
    log_w = torch.clamp(prox_seq_log_probs.detach() - behaviour_seq_log_probs.detach(), -m, m)  # log w
    w = torch.exp(log_w)  # w = pi_prox / mu_source
    inside = (w >= config.cross_weight_min) & (w <= config.cross_weight_max)
    if config.cross_weight_mode == "filter":
        w_hat = torch.where(inside, w, torch.zeros_like(w))  # filter: rows outside the bounds weigh 0
    else:
        w_hat = torch.clamp(w, config.cross_weight_min, config.cross_weight_max)  # clamp: w into the bounds
    return log_w, inside, w_hat


def proximal_ratio(
    seq_log_probs: Tensor, prox_seq_log_probs: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, Tensor]:
    """``(raw, r)`` [N]: ``raw = lbar - lbar_prox`` (detached) and ``r = exp(clamp(lbar - lbar_prox, -M, M))``
    (carries ``lbar``'s gradient)."""
    prox = prox_seq_log_probs.to(seq_log_probs.dtype).detach()
    m = config.max_abs_log_ratio
    return (seq_log_probs.detach() - prox), torch.exp(torch.clamp(seq_log_probs - prox, -m, m))  # r = pi/pi_prox


def _gradient(raw: Tensor, r: Tensor, adv: Tensor, w_hat: Tensor, config: PolicyLossConfig) -> Tensor:
    """Rows whose decoupled objective has a nonzero gradient: ``A != 0``, ``w_hat > 0``, ``|raw| <= M`` and GSPO's
    clip takes the unclipped term (``A > 0 and r <= 1 + high`` or ``A < 0 and r >= 1 - low``). bool [N]."""
    r, adv = r.detach(), adv.detach()
    gspo = ((adv > 0) & (r <= 1.0 + config.self_clip_high)) | ((adv < 0) & (r >= 1.0 - config.self_clip_low))
    return gspo & (w_hat > 0) & (raw.abs() <= config.max_abs_log_ratio)


def decoupled_gradient_rows(
    seq_log_probs: Tensor,
    prox_seq_log_probs: Tensor,
    old_seq_log_probs: Tensor,
    advantages: Tensor,
    config: PolicyLossConfig,
) -> Tensor:
    """Which rows of :func:`hacpo_decoupled_loss` have a nonzero gradient, from their detached ``lbar``. [N] → bool
    [N] (the trainer's ``skip_no_gradient_rows`` runs forward and backward over these rows only)."""
    raw, r = proximal_ratio(seq_log_probs.detach(), prox_seq_log_probs, config)
    w_hat = behaviour_weight(prox_seq_log_probs, old_seq_log_probs, config)[2]
    return _gradient(raw, r, advantages.to(r.dtype), w_hat, config)


def hacpo_decoupled_loss(
    seq_log_probs: Tensor,
    prox_seq_log_probs: Tensor,
    old_seq_log_probs: Tensor,
    advantages: Tensor,
    is_self: Tensor,
    capability_coefficient: Tensor,
    config: PolicyLossConfig = DEFAULT_CONFIG,
    source_ids: Tensor | None = None,
    ages: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The decoupled HACPO loss of one mini-batch. All inputs [N]; ``seq_log_probs`` (``lbar``) carries gradient.

    ``prox_seq_log_probs``: ``lbar_prox``, the learner's pre-update value of every row (self rows: their published
    ``lbar_old``); ``old_seq_log_probs``: ``lbar_mu``, the behaviour policy's (self rows: ``lbar_old``; cross rows:
    the source's published value); ``capability_coefficient``: ``v(j, k)`` (1 on self rows); ``ages``: each row's
    age in rounds (None: all 0); ``source_ids``: each row's source index (per-source metrics).

      r     = exp(clamp(lbar - lbar_prox, -M, M))                         (trust region around pi_prox)
      w     = exp(clamp(lbar_prox - lbar_mu, -M, M)),  w_hat = filter or clamp of w to [w_min, w_max]
      J     = sg(w_hat ** (1 + alpha)) * v * min(r * A, clamp(r, 1 - self_clip_low, 1 + self_clip_high) * A)
      loss  = -mean over the N rows of J

    On self rows with ``lbar_prox = lbar_mu = lbar_old`` it is GSPO (``w = 1``, ``v = 1``).
    """
    n = _check_seq_inputs(
        seq_log_probs=seq_log_probs,
        prox_seq_log_probs=prox_seq_log_probs,
        old_seq_log_probs=old_seq_log_probs,
        advantages=advantages,
        is_self=is_self,
        capability_coefficient=capability_coefficient,
    )
    is_self, adv = is_self.to(torch.bool), advantages.to(seq_log_probs.dtype)
    raw, r = proximal_ratio(seq_log_probs, prox_seq_log_probs, config)
    log_w, inside, w_hat = behaviour_weight(prox_seq_log_probs, old_seq_log_probs.to(seq_log_probs.dtype), config)
    weight = (w_hat ** (1.0 + config.alpha) * capability_coefficient.to(seq_log_probs.dtype)).detach()  # sg(w^(1+a)) v
    objective = weight * gspo_objective(r, adv, config.self_clip_low, config.self_clip_high)
    loss = -objective.mean()  # seq-mean
    ages = torch.zeros(n, dtype=torch.long, device=seq_log_probs.device) if ages is None else ages
    if ages.shape != (n,) or bool((ages < 0).any()):
        raise ValueError(f"ages must be [N]={n} integers >= 0 (rounds), got {tuple(ages.shape)}")
    cross = ~is_self
    flags = {
        "cross_in_band": inside[cross],
        "cross_prox_clip_low": r.detach()[cross] < 1.0 - config.self_clip_low,
        "cross_prox_clip_high": r.detach()[cross] > 1.0 + config.self_clip_high,
        "cross_grad": _gradient(raw, r, adv, w_hat, config)[cross],
    }
    metrics = _decoupled_metrics(r.detach(), log_w, is_self, objective.detach(), flags, config)
    if source_ids is not None:
        metrics.update(_per_source(PREFIX, source_ids[cross], flags))
    src = None if source_ids is None else source_ids[cross]
    metrics.update(staleness_counts(src, ages[cross], inside[cross], log_w[cross]))
    return loss, metrics


def _decoupled_metrics(
    r: Tensor, log_w: Tensor, is_self: Tensor, objective: Tensor, flags: dict[str, Tensor], config: PolicyLossConfig
) -> dict[str, float]:
    r_self = r[is_self]
    m: dict[str, float] = {f"{PREFIX}/num_self": float(is_self.sum()), f"{PREFIX}/num_cross": float((~is_self).sum())}
    clip = {
        "self_clip_low": r_self < 1.0 - config.self_clip_low,
        "self_clip_high": r_self > 1.0 + config.self_clip_high,
    }
    m.update(_fracs(PREFIX, clip))
    m.update(_fracs(PREFIX, flags))
    m.update(_stats(PREFIX, "self_ratio", r_self))
    m.update(_stats(PREFIX, "cross_prox_ratio", r[~is_self]))
    m.update(_stats(PREFIX, "cross_log_w", log_w[~is_self]))
    n = objective.numel()
    m[f"{PREFIX}/self_objective"] = float(objective[is_self].sum()) / n
    m[f"{PREFIX}/cross_objective"] = float(objective[~is_self].sum()) / n
    return m


def staleness_counts(
    source_ids: Tensor | None, ages: Tensor, inside: Tensor, log_w: Tensor, prefix: str = PREFIX
) -> dict[str, float]:
    """Per age ``a`` (and per source ``j`` when ``source_ids`` is given) of the cross rows, summable counts:
    ``<prefix>/age<a>/num_cross`` (the staleness histogram), ``num_cross_in_band`` (``w`` inside its bounds),
    ``num_log_w_sum`` and ``num_log_w_sq`` (sums of ``log w`` and ``log w ** 2``), each also ``...@<j>``. All [C]
    (the cross rows only). :func:`staleness_summary` turns the summed counts into shares, means and spreads."""
    ages = ages.detach().to("cpu", torch.long)
    inside, log_w = inside.detach().cpu(), log_w.detach().double().cpu()
    src = None if source_ids is None else source_ids.detach().to("cpu", torch.long)
    out: dict[str, float] = {}
    for a in torch.unique(ages).tolist():
        at_age = ages == a
        groups = [("", at_age)]
        if src is not None:
            groups += [(f"@{j}", at_age & (src == j)) for j in torch.unique(src[at_age]).tolist()]
        for tag, sel in groups:
            head = f"{prefix}/age{a}"
            out[f"{head}/num_cross{tag}"] = float(sel.sum())
            out[f"{head}/num_cross_in_band{tag}"] = float(inside[sel].sum())
            out[f"{head}/num_log_w_sum{tag}"] = float(log_w[sel].sum())
            out[f"{head}/num_log_w_sq{tag}"] = float((log_w[sel] ** 2).sum())
    return out


_AGE_COUNT = re.compile(r"^(?P<head>.+/age\d+)/num_cross(?P<tail>/[^/]+)?$")


def staleness_summary(metrics: dict[str, float]) -> dict[str, float]:
    """:func:`staleness_counts`' summed counts (sources already named: ``.../age<a>/num_cross/<org>``) with, for
    each age (and source), ``cross_in_band_frac = num_cross_in_band / num_cross``, ``log_w_mean = sum / n`` and
    ``log_w_std = sqrt(max(0, sq / n - mean ** 2))`` (population spread). Returns a new dict."""
    out = dict(metrics)
    for key, n in metrics.items():
        match = _AGE_COUNT.match(key)
        if match is None or n <= 0:
            continue
        head, tail = match["head"], match["tail"] or ""
        total, sq = metrics.get(f"{head}/num_log_w_sum{tail}"), metrics.get(f"{head}/num_log_w_sq{tail}")
        if f"{head}/num_cross_in_band{tail}" in metrics:
            out[f"{head}/cross_in_band_frac{tail}"] = metrics[f"{head}/num_cross_in_band{tail}"] / n
        if total is not None and sq is not None:
            mean = total / n  # mean of log w
            out[f"{head}/log_w_mean{tail}"] = mean
            out[f"{head}/log_w_std{tail}"] = math.sqrt(max(0.0, sq / n - mean * mean))  # spread of log w
    return out
