"""Policy losses (pure tensor functions; docs/ALGORITHM.md "Self samples", §3-4 and "Loss and update schedule").

Sequence-level losses take per-sequence mean token log-probs (``lbar``, see :func:`sequence_mean_log_prob`).
Every loss returns ``(loss, metrics)``: a scalar tensor to minimise and a dict of floats with namespaced keys.

Every default here is the run config's (:class:`hacrl_fed.config.AlgorithmConfig`, the one place the numbers are
written); a run builds its :class:`PolicyLossConfig` once from its algorithm section
(:meth:`PolicyLossConfig.from_algorithm`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from hacrl_fed.config import AlgorithmConfig

DEFAULTS = AlgorithmConfig()  # the documented defaults (docs/ALGORITHM.md "Parameters")
GRPO_AGG_MODES = ("token-mean", "seq-mean-token-mean")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Every policy loss's knobs, named as in the ``algorithm`` config section (defaults: its defaults).

    ``self_clip_*``: GSPO band ``[1 - low, 1 + high]`` on self rows (hacpo, gspo, naive); ``cross_clip_delta`` and
    ``cross_clip_step``: the stepwise cross band ``[min(1, 1 - delta + m * step), 1]``; ``alpha``: the exponent of
    ``stopgrad(c)``; ``max_abs_log_ratio``: clamp of every log-ratio before ``exp``; ``grpo_clip_*``: GRPO's
    token-level band; ``grpo_loss_agg_mode``: how GRPO averages over tokens (:data:`GRPO_AGG_MODES`).
    """

    self_clip_low: float = DEFAULTS.self_clip_low
    self_clip_high: float = DEFAULTS.self_clip_high
    cross_clip_delta: float = DEFAULTS.cross_clip_delta
    cross_clip_step: float = DEFAULTS.cross_clip_step
    alpha: float = DEFAULTS.alpha
    max_abs_log_ratio: float = DEFAULTS.max_abs_log_ratio
    grpo_clip_low: float = DEFAULTS.grpo_clip_low
    grpo_clip_high: float = DEFAULTS.grpo_clip_high
    grpo_loss_agg_mode: str = DEFAULTS.grpo_loss_agg_mode

    @classmethod
    def from_algorithm(cls, algo: Any) -> PolicyLossConfig:
        """The loss configuration of an ``algorithm`` config section (an :class:`AlgorithmConfig`)."""
        return cls(**{f.name: getattr(algo, f.name) for f in fields(cls)})


def sequence_mean_log_prob(token_log_probs: Tensor, mask: Tensor) -> Tensor:
    """``lbar = sum_t(lp[b,t] * mask[b,t]) / max(1, sum_t mask[b,t])``. token_log_probs [B,T], mask [B,T] → [B]."""
    if token_log_probs.shape != mask.shape or token_log_probs.dim() != 2:
        raise ValueError(
            f"token_log_probs and mask must both be [B, T], got {tuple(token_log_probs.shape)} and {tuple(mask.shape)}"
        )
    m = mask.to(token_log_probs.dtype)
    return (token_log_probs * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` where ``mask`` is set (0 when the mask is empty)."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


def cross_lower_bound(
    minibatch_index: int, delta: float = DEFAULTS.cross_clip_delta, delta_step: float = DEFAULTS.cross_clip_step
) -> float:
    """Stepwise lower clip bound of cross rows: ``lower_m = min(1, 1 - delta + m * delta_step)``."""
    if minibatch_index < 0:
        raise ValueError(f"minibatch_index must be >= 0, got {minibatch_index}")
    return min(1.0, 1.0 - delta + minibatch_index * delta_step)


def _stats(prefix: str, name: str, x: Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {}
    x = x.detach().float()
    return {
        f"{prefix}/{name}_mean": float(x.mean()),
        f"{prefix}/{name}_min": float(x.min()),
        f"{prefix}/{name}_max": float(x.max()),
    }


def _frac(x: Tensor) -> float:
    return float(x.float().mean()) if x.numel() else 0.0


def _check_seq_inputs(**tensors: Tensor) -> int:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    n = next(iter(tensors.values())).shape[0] if tensors else 0
    if any(len(s) != 1 or s[0] != n for s in shapes.values()):
        raise ValueError(f"sequence-level inputs must all be [N] with the same N, got {shapes}")
    if n == 0:
        raise ValueError("empty batch: a loss needs at least one sequence")
    return n


def gspo_objective(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """GSPO per-sequence objective ``min(s * A, clamp(s, 1 - low, 1 + high) * A)``. → [N]."""
    return torch.minimum(ratio * advantages, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages)


def hacpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    is_self: Tensor,
    cross_weight: Tensor,
    minibatch_index: int,
    config: PolicyLossConfig = PolicyLossConfig(),
) -> tuple[Tensor, dict[str, float]]:
    """HACPO loss of one mini-batch (sequence level). All inputs [N]; ``log_probs`` carries gradient.

    ``log_probs``: learner's current mean token log-prob ``lbar_k``; ``old_log_probs``: learner's pre-update
    ``lbar`` for self rows, the source's published ``lbar_j`` for cross rows; ``cross_weight``: ``v(j,k)``
    (ignored on self rows).

      s = exp(clamp(lbar - lbar_old, -M, M))
      self:  min(s * A, clamp(s, 1 - self_clip_low, 1 + self_clip_high) * A)            (GSPO)
      cross: c * stopgrad(c) ** alpha * v * A,  c = clamp(s, lower_m, 1),  lower_m = min(1, 1 - delta + m * step)
      loss = -mean over the N rows of the objective.
    """
    _check_seq_inputs(
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        is_self=is_self,
        cross_weight=cross_weight,
    )
    is_self = is_self.to(torch.bool)
    adv = advantages.to(log_probs.dtype)
    log_ratio = torch.clamp(
        log_probs - old_log_probs.to(log_probs.dtype), -config.max_abs_log_ratio, config.max_abs_log_ratio
    )
    ratio = torch.exp(log_ratio)  # s = exp(lbar_new - lbar_old)
    self_obj = gspo_objective(ratio, adv, config.self_clip_low, config.self_clip_high)
    lower = cross_lower_bound(minibatch_index, config.cross_clip_delta, config.cross_clip_step)
    c = torch.clamp(ratio, lower, 1.0)  # hard clamp: zero gradient outside [lower_m, 1]
    cross_obj = c * c.detach() ** config.alpha * cross_weight.to(log_probs.dtype) * adv  # c * sg(c)^alpha * v * A
    objective = torch.where(is_self, self_obj, cross_obj)
    loss = -objective.mean()  # seq-mean (each lbar is already a token mean)
    return loss, _hacpo_metrics(ratio, is_self, objective, lower, config)


def _hacpo_metrics(
    ratio: Tensor, is_self: Tensor, objective: Tensor, lower: float, config: PolicyLossConfig
) -> dict[str, float]:
    s_self, s_cross = ratio[is_self].detach(), ratio[~is_self].detach()
    m: dict[str, float] = {
        "hacpo/num_self": float(s_self.numel()),
        "hacpo/num_cross": float(s_cross.numel()),
        "hacpo/cross_lower_bound": lower,
        "hacpo/self_clip_low_frac": _frac(s_self < 1.0 - config.self_clip_low),
        "hacpo/self_clip_high_frac": _frac(s_self > 1.0 + config.self_clip_high),
        "hacpo/cross_clip_low_frac": _frac(s_cross < lower),
        "hacpo/cross_clip_high_frac": _frac(s_cross > 1.0),
        "hacpo/cross_in_band_frac": _frac((s_cross >= lower) & (s_cross <= 1.0)),
    }
    m.update(_stats("hacpo", "self_ratio", s_self))
    m.update(_stats("hacpo", "cross_ratio", s_cross))
    n = objective.numel()
    m["hacpo/self_objective"] = float(objective[is_self].detach().sum()) / n
    m["hacpo/cross_objective"] = float(objective[~is_self].detach().sum()) / n
    return m


def gspo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = DEFAULTS.self_clip_low,
    clip_high: float = DEFAULTS.self_clip_high,
    max_abs_log_ratio: float = DEFAULTS.max_abs_log_ratio,
    prefix: str = "gspo",
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (sequence-level IS) on every row: ``-mean(min(s A, clamp(s, 1-low, 1+high) A))``. Inputs [N].

    Used by ``gspo`` (own rows) and ``naive`` (every row against its source's ``lbar``, prefix ``naive``).
    """
    _check_seq_inputs(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)
    log_ratio = torch.clamp(log_probs - old_log_probs.to(log_probs.dtype), -max_abs_log_ratio, max_abs_log_ratio)
    ratio = torch.exp(log_ratio)  # s = exp(lbar_new - lbar_old)
    loss = -gspo_objective(ratio, advantages.to(log_probs.dtype), clip_low, clip_high).mean()
    r = ratio.detach()
    metrics = {
        f"{prefix}/clip_low_frac": _frac(r < 1.0 - clip_low),
        f"{prefix}/clip_high_frac": _frac(r > 1.0 + clip_high),
        **_stats(prefix, "ratio", r),
    }
    return loss, metrics


def naive_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = DEFAULTS.self_clip_low,
    clip_high: float = DEFAULTS.self_clip_high,
    max_abs_log_ratio: float = DEFAULTS.max_abs_log_ratio,
) -> tuple[Tensor, dict[str, float]]:
    """``naive`` sharing: GSPO's ratio and clip on every row (own and foreign) against its source's ``lbar``,
    with none of HACPO's mechanisms (no capability weight, no stepwise band). Inputs [N]; metrics ``naive/...``."""
    return gspo_loss(
        log_probs,
        old_log_probs,
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        max_abs_log_ratio=max_abs_log_ratio,
        prefix="naive",
    )


def grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = DEFAULTS.grpo_clip_low,
    clip_high: float = DEFAULTS.grpo_clip_high,
    max_abs_log_ratio: float = DEFAULTS.max_abs_log_ratio,
    loss_agg_mode: str = DEFAULTS.grpo_loss_agg_mode,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO token-level PPO-clip loss. log_probs, old_log_probs, response_mask [B,T]; advantages [B].

    r_t = exp(clamp(lp_t - old_lp_t, -M, M));  obj_t = min(r_t A, clamp(r_t, 1 - low, 1 + high) A)
    loss = -token-mean over all masked tokens (``"token-mean"``) or -mean over sequences of the per-sequence
    token mean (``"seq-mean-token-mean"``).
    """
    if log_probs.dim() != 2 or old_log_probs.shape != log_probs.shape or response_mask.shape != log_probs.shape:
        raise ValueError("log_probs, old_log_probs and response_mask must all be [B, T] of one shape")
    if advantages.shape != log_probs.shape[:1]:
        raise ValueError(f"advantages must be [B]={log_probs.shape[0]}, got {tuple(advantages.shape)}")
    mask = response_mask.to(log_probs.dtype)
    log_ratio = torch.clamp(log_probs - old_log_probs.to(log_probs.dtype), -max_abs_log_ratio, max_abs_log_ratio)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(log_probs.dtype)[:, None]
    obj = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv)
    if loss_agg_mode == "token-mean":
        loss = -masked_mean(obj, mask)
    elif loss_agg_mode == "seq-mean-token-mean":
        loss = -sequence_mean_log_prob(obj, mask).mean()
    else:
        raise ValueError(f"loss_agg_mode must be one of {GRPO_AGG_MODES}, got {loss_agg_mode!r}")
    sel = mask.bool()
    r = ratio.detach()[sel]
    metrics = {
        "grpo/clip_low_frac": _frac(r < 1.0 - clip_low),
        "grpo/clip_high_frac": _frac(r > 1.0 + clip_high),
        **_stats("grpo", "ratio", r),
    }
    return loss, metrics


def kl_k3(log_probs: Tensor, ref_log_probs: Tensor, max_abs_log_ratio: float = DEFAULTS.max_abs_log_ratio) -> Tensor:
    """k3 KL estimator per token: ``exp(r) - r - 1`` with ``r = clamp(ref_lp - lp, -M, M)``. Same shape as inputs.

    Non-negative; its gradient w.r.t. ``log_probs`` is ``1 - exp(r)``.
    """
    r = torch.clamp(ref_log_probs.to(log_probs.dtype) - log_probs, -max_abs_log_ratio, max_abs_log_ratio)
    return torch.exp(r) - r - 1.0  # k3 = e^r - r - 1
