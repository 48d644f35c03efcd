"""Policy losses (pure tensor functions; docs/ALGORITHM.md "Self samples", §3-4 and "Loss and update schedule").

Sequence-level losses take per-sequence mean token log-probs (``lbar``, see :func:`sequence_mean_log_prob`).
Every loss returns ``(loss, metrics)``: a scalar tensor to minimise and a dict of floats with namespaced keys.

Every default here is the run config's (:class:`hacrl_fed.config.AlgorithmConfig`, the one place the numbers are
written); a run builds its :class:`PolicyLossConfig` once from its algorithm section
(:meth:`PolicyLossConfig.from_algorithm`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from hacrl_fed.config import AlgorithmConfig

DEFAULTS = AlgorithmConfig()  # the documented defaults (docs/ALGORITHM.md "Parameters")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Every policy loss's knobs, named as in the ``algorithm`` config section (defaults: its defaults).

    ``self_clip_*``: GSPO band ``[1 - low, 1 + high]`` on self rows (hacpo, gspo, naive); ``cross_clip_delta`` and
    ``cross_clip_step``: the stepwise cross band ``[min(1, 1 - delta + m * cross_clip_step), 1]`` at optimizer step
    ``m``; ``alpha``: the exponent of
    ``stopgrad(c)``; ``cross_clip``: False takes ``c = s`` on cross rows (no band at all: an ablation);
    ``max_abs_log_ratio``: clamp of every log-ratio before ``exp``; ``grpo_clip_*``: GRPO's token-level band.
    """

    self_clip_low: float = DEFAULTS.self_clip_low
    self_clip_high: float = DEFAULTS.self_clip_high
    cross_clip_delta: float = DEFAULTS.cross_clip_delta
    cross_clip_step: float = DEFAULTS.cross_clip_step
    alpha: float = DEFAULTS.alpha
    cross_clip: bool = DEFAULTS.cross_clip
    max_abs_log_ratio: float = DEFAULTS.max_abs_log_ratio
    grpo_clip_low: float = DEFAULTS.grpo_clip_low
    grpo_clip_high: float = DEFAULTS.grpo_clip_high

    @classmethod
    def from_algorithm(cls, algo: Any) -> PolicyLossConfig:
        """The loss configuration of an ``algorithm`` config section (an :class:`AlgorithmConfig`)."""
        return cls(**{f.name: getattr(algo, f.name) for f in fields(cls)})


def sequence_mean_log_prob(token_log_probs: Tensor, mask: Tensor, lengths: Tensor | None = None) -> Tensor:
    """``lbar = sum_t(lp[b,t] * mask[b,t]) / max(1, n_b)``. token_log_probs [B,T], mask [B,T], lengths [B] → [B].

    ``n_b`` is the row's token count ``sum_t mask[b,t]`` (the paper's per-token mean), or ``lengths[b]`` where
    given and positive (``algorithm.logprob_norm: per_byte`` passes the response's UTF-8 bytes on cross rows;
    a row with ``lengths[b] <= 0`` keeps its token count).
    """
    if token_log_probs.shape != mask.shape or token_log_probs.dim() != 2:
        raise ValueError(
            f"token_log_probs and mask must both be [B, T], got {tuple(token_log_probs.shape)} and {tuple(mask.shape)}"
        )
    m = mask.to(token_log_probs.dtype)
    n = m.sum(-1)
    if lengths is not None:
        if lengths.shape != n.shape:
            raise ValueError(f"lengths must be [B]={n.shape[0]}, got {tuple(lengths.shape)}")
        lengths = lengths.to(device=n.device, dtype=n.dtype)
        n = torch.where(lengths > 0, lengths, n)
    return (token_log_probs * m).sum(-1) / n.clamp(min=1.0)  # lbar = sum(lp * mask) / n


def clamped_log_ratio(log_p: Tensor, log_q: Tensor, max_abs_log_ratio: float) -> Tensor:
    """``clamp(log_p - log_q, -M, M)`` (``log_q`` cast to ``log_p``'s dtype), the one log-ratio every ratio and the
    KL term take before ``exp``: outside ``[-M, M]`` it carries no gradient. Same shape as the inputs."""
    return torch.clamp(log_p - log_q.to(log_p.dtype), -max_abs_log_ratio, max_abs_log_ratio)  # clamp(lp - lq, -M, M)


def gspo_has_gradient(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """Where GSPO's ``min(s A, clamp(s, 1 - low, 1 + high) A)`` takes the unclipped term, so its gradient is nonzero:
    ``A > 0 and s <= 1 + high`` or ``A < 0 and s >= 1 - low``. ratio, advantages [N] → bool [N]."""
    return ((advantages > 0) & (ratio <= 1.0 + clip_high)) | ((advantages < 0) & (ratio >= 1.0 - clip_low))


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` where ``mask`` is set (0 when the mask is empty)."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


def cross_lower_bound(
    step: int, delta: float = DEFAULTS.cross_clip_delta, delta_step: float = DEFAULTS.cross_clip_step
) -> float:
    """Stepwise lower clip bound of cross rows at optimizer step ``m = step`` (0-based within the round, counted
    across epochs): ``lower_m = min(1, 1 - delta + m * delta_step)``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return min(1.0, 1.0 - delta + step * delta_step)


def hacpo_cross_band(ratio: Tensor, step: int, config: PolicyLossConfig) -> tuple[float, Tensor, Tensor]:
    """HACPO's stepwise cross band, the one definition its users share (the loss's clamp, its band metrics and
    :func:`rows_with_gradient`). ``ratio`` [N]: ``s`` per row. Returns ``(lower_m, c, inside)``: the band's lower
    bound at step ``m`` (:func:`cross_lower_bound`), ``c = clamp(s, lower_m, 1)`` [N] (carries ``s``'s gradient
    inside the band, none outside) and ``inside`` bool [N] (``lower_m <= s <= 1``). ``config.cross_clip`` False (an
    ablation): no band, ``c = s`` and every row inside."""
    lower = cross_lower_bound(step, config.cross_clip_delta, config.cross_clip_step)
    if not config.cross_clip:
        return lower, ratio, torch.ones_like(ratio, dtype=torch.bool)
    return lower, torch.clamp(ratio, lower, 1.0), (ratio >= lower) & (ratio <= 1.0)


def _stats(prefix: str, name: str, x: Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {}
    x = x.detach().float()
    return {
        f"{prefix}/{name}_mean": float(x.mean()),
        f"{prefix}/{name}_min": float(x.min()),
        f"{prefix}/{name}_max": float(x.max()),
    }


def _fracs(prefix: str, fracs: dict[str, Tensor]) -> dict[str, float]:
    """``{prefix/num_<name>: count, prefix/<name>_frac: share}`` per boolean tensor; nothing over an empty set.

    The counts (``num_*`` keys sum over micro-batches and steps) let the trainer recompute every share over the
    whole update (:func:`fractions_from_counts`, denominators in :data:`FRACTION_COUNTS`) instead of averaging
    per-step shares (a self-only mini-batch would otherwise average a 0 into every cross share).
    """
    out: dict[str, float] = {}
    for name, x in fracs.items():
        if x.numel():
            out[f"{prefix}/num_{name}"] = float(x.sum())
            out[f"{prefix}/{name}_frac"] = float(x.float().mean())
    return out


def _per_source(prefix: str, source_ids: Tensor | None, flags: dict[str, Tensor]) -> dict[str, float]:
    """Per-source counts of foreign rows, ``{prefix/num_<name>@<j>: count}`` for each source index ``j`` present.

    ``source_ids`` [C] and every flag [C] cover the foreign rows only; ``num_cross@<j>`` (their number) is always
    added. The trainer renames ``@<j>`` to ``/<org>`` and derives the per-source shares from these counts
    (:func:`fractions_from_counts`), so a share is over one (learner, source) pair's rows of the whole update.
    """
    if source_ids is None or source_ids.numel() == 0:
        return {}
    src = source_ids.detach().to("cpu", torch.long)
    cpu_flags = {name: x.detach().cpu() for name, x in flags.items()}
    out: dict[str, float] = {}
    for j in torch.unique(src).tolist():
        sel = src == j
        out[f"{prefix}/num_cross@{j}"] = float(sel.sum())
        for name, x in cpu_flags.items():
            out[f"{prefix}/num_{name}@{j}"] = float(x[sel].sum())
    return out


def name_sources(metrics: dict[str, float], names: Sequence[str] | None) -> dict[str, float]:
    """``prefix/num_<name>@<j>`` keys renamed ``prefix/num_<name>/<names[j]>`` (``src<j>`` without names)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        base, at, j = key.rpartition("@")
        if at and j.isdigit():
            idx = int(j)
            key = f"{base}/{names[idx] if names is not None and idx < len(names) else f'src{idx}'}"
        out[key] = value
    return out


def _fraction_table() -> dict[str, tuple[str, str]]:
    table = {}
    for prefix, den, names in (
        ("hacpo", "num_self", ("self_clip_low", "self_clip_high")),
        ("hacpo", "num_cross", ("cross_clip_low", "cross_clip_high", "cross_in_band", "cross_grad")),
        ("gspo", "num_rows", ("clip_low", "clip_high")),
        ("naive", "num_rows", ("clip_low", "clip_high")),
        ("naive", "num_cross", ("cross_grad",)),
        ("grpo", "num_tokens", ("clip_low", "clip_high")),
    ):
        table.update({f"{prefix}/{n}_frac": (f"{prefix}/num_{n}", f"{prefix}/{den}") for n in names})
    return table


# every share a loss reports -> (its count key, its denominator's count key)
FRACTION_COUNTS: dict[str, tuple[str, str]] = _fraction_table()


def fractions_from_counts(metrics: dict[str, float]) -> dict[str, float]:
    """Every ``*_frac`` share recomputed from its summed counts: ``num_<name> / <denominator>``; a share whose
    denominator is 0 or absent is dropped (a share of an empty set is not 0). Per-source counts (keys ending in
    ``/<org>``, e.g. ``hacpo/num_cross_in_band/globex`` over ``hacpo/num_cross/globex``) get their share too
    (``hacpo/cross_in_band_frac/globex``). Returns a new dict."""
    out = dict(metrics)
    for frac, (num, den) in FRACTION_COUNTS.items():
        suffixes = [""] + [k[len(num) :] for k in metrics if k.startswith(num + "/")]
        for sfx in suffixes:
            share, count, total = frac + sfx, num + sfx, den + sfx
            if share not in out and not sfx:
                continue  # a whole-update share is only recomputed when the loss reported it
            if out.get(total, 0.0) > 0 and count in out:
                out[share] = out[count] / out[total]
            else:
                out.pop(share, None)
    return out


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
    seq_log_probs: Tensor,
    old_seq_log_probs: Tensor,
    advantages: Tensor,
    is_self: Tensor,
    capability_coefficient: Tensor,
    step: int,
    config: PolicyLossConfig = PolicyLossConfig(),
    source_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """HACPO loss of one mini-batch (sequence level). All inputs [N]; ``seq_log_probs`` carries gradient.

    ``seq_log_probs``: learner's current mean token log-prob ``lbar_k``; ``old_seq_log_probs``: learner's pre-update
    ``lbar`` for self rows, the source's published ``lbar_j`` for cross rows; ``capability_coefficient``: ``v(j,k)``
    (ignored on self rows); ``step``: the optimizer step ``m`` of the round (0-based, counted across epochs).

      s = exp(clamp(lbar - lbar_old, -M, M))
      self:  min(s * A, clamp(s, 1 - self_clip_low, 1 + self_clip_high) * A)            (GSPO)
      cross: c * stopgrad(c) ** alpha * v * A,  c = clamp(s, lower_m, 1),
             lower_m = min(1, 1 - delta + m * cross_clip_step)
             (``config.cross_clip`` False: c = s, no band)
      loss = -mean over the N rows of the objective.

    ``source_ids`` [N] (optional): each row's source index; adds per-source counts of the cross rows
    (``hacpo/num_cross_in_band@<j>`` ..., see :func:`_per_source`).
    """
    _check_seq_inputs(
        seq_log_probs=seq_log_probs,
        old_seq_log_probs=old_seq_log_probs,
        advantages=advantages,
        is_self=is_self,
        capability_coefficient=capability_coefficient,
    )
    is_self = is_self.to(torch.bool)
    adv = advantages.to(seq_log_probs.dtype)
    ratio = torch.exp(clamped_log_ratio(seq_log_probs, old_seq_log_probs, config.max_abs_log_ratio))  # s
    self_obj = gspo_objective(ratio, adv, config.self_clip_low, config.self_clip_high)
    lower, c, inside = hacpo_cross_band(ratio, step, config)  # hard clamp: no gradient outside [lower_m, 1]
    v = capability_coefficient.to(seq_log_probs.dtype)
    cross_obj = c * c.detach() ** config.alpha * v * adv  # c * sg(c)^alpha * v * A
    objective = torch.where(is_self, self_obj, cross_obj)
    loss = -objective.mean()  # seq-mean (each lbar is already a token mean)
    flags = _cross_flags(ratio[~is_self], adv[~is_self], lower, inside[~is_self])
    metrics = _hacpo_metrics(ratio, is_self, objective, lower, flags, config)
    if source_ids is not None:
        metrics.update(_per_source("hacpo", source_ids[~is_self], flags))
    return loss, metrics


def _cross_flags(s_cross: Tensor, a_cross: Tensor, lower: float, in_band: Tensor) -> dict[str, Tensor]:
    """Where each cross row's ratio falls against the band ``[lower, 1]`` (``in_band``: :func:`hacpo_cross_band`'s), and
    whether it moves the weights. [C]."""
    s_cross, a_cross = s_cross.detach(), a_cross.detach()
    return {
        "cross_clip_low": s_cross < lower,
        "cross_clip_high": s_cross > 1.0,
        "cross_in_band": in_band,
        "cross_grad": in_band & (a_cross != 0),  # cross rows that move the weights
    }


def _hacpo_metrics(
    ratio: Tensor,
    is_self: Tensor,
    objective: Tensor,
    lower: float,
    cross_flags: dict[str, Tensor],
    config: PolicyLossConfig,
) -> dict[str, float]:
    s_self, s_cross = ratio[is_self].detach(), ratio[~is_self].detach()
    m: dict[str, float] = {
        "hacpo/num_self": float(s_self.numel()),
        "hacpo/num_cross": float(s_cross.numel()),
        "hacpo/cross_lower_bound": lower,
    }
    m.update(
        _fracs(
            "hacpo",
            {
                "self_clip_low": s_self < 1.0 - config.self_clip_low,
                "self_clip_high": s_self > 1.0 + config.self_clip_high,
            },
        )
    )
    m.update(_fracs("hacpo", cross_flags))
    m.update(_stats("hacpo", "self_ratio", s_self))
    m.update(_stats("hacpo", "cross_ratio", s_cross))
    n = objective.numel()
    m["hacpo/self_objective"] = float(objective[is_self].detach().sum()) / n
    m["hacpo/cross_objective"] = float(objective[~is_self].detach().sum()) / n
    return m


def rows_with_gradient(
    seq_log_probs: Tensor,
    old_seq_log_probs: Tensor,
    advantages: Tensor,
    is_self: Tensor,
    step: int,
    config: PolicyLossConfig,
    *,
    cross_band: bool,
) -> Tensor:
    """Which rows of a sequence-level loss have a nonzero gradient, from their (detached) ``lbar``. All [N] → bool [N].

    With ``raw = lbar - lbar_old`` and ``s = exp(clamp(raw, -M, M))``, a row moves the weights iff ``A != 0``,
    ``|raw| <= M`` (outside, the clamp cuts the gradient) and
      - GSPO's clip (self rows; every row when ``cross_band`` is False, as ``naive``): ``A > 0 and s <= 1 + high`` or
        ``A < 0 and s >= 1 - low`` (where ``min(s A, clamp(s) A)`` takes the unclipped term);
      - HACPO's cross band (foreign rows when ``cross_band``; :func:`hacpo_cross_band`): ``lower_m <= s <= 1`` with
        ``lower_m = min(1, 1 - delta + m * delta_step)`` (``config.cross_clip`` False: always).
    The trainer runs forward and backward only over these rows (the others' terms are constants) and gets the
    mini-batch's gradient exactly, up to float round-off.
    """
    lbar, old = seq_log_probs.detach(), old_seq_log_probs.to(seq_log_probs.dtype)
    adv = advantages.to(lbar.dtype)
    raw = lbar - old
    s = torch.exp(clamped_log_ratio(lbar, old, config.max_abs_log_ratio))  # s = exp(clamp(raw))
    gspo = gspo_has_gradient(s, adv, config.self_clip_low, config.self_clip_high)
    if cross_band:
        cross = hacpo_cross_band(s, step, config)[2] & (adv != 0)
        gspo = torch.where(is_self.to(torch.bool), gspo, cross)
    return gspo & (raw.abs() <= config.max_abs_log_ratio)


def gspo_loss(
    seq_log_probs: Tensor,
    old_seq_log_probs: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = DEFAULTS.self_clip_low,
    clip_high: float = DEFAULTS.self_clip_high,
    max_abs_log_ratio: float = DEFAULTS.max_abs_log_ratio,
    prefix: str = "gspo",
    is_self: Tensor | None = None,
    source_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (sequence-level IS) on every row: ``-mean(min(s A, clamp(s, 1-low, 1+high) A))``. Inputs [N].

    Used by ``gspo`` (own rows) and ``naive`` (every row against its source's ``lbar``, prefix ``naive``).
    ``is_self`` [N] (optional) adds the foreign rows' own statistics (``<prefix>/cross_*``): how many of them
    carry gradient, i.e. ``A != 0`` and the unclipped term is the minimum; with ``source_ids`` [N] also per source
    (:func:`_per_source`).
    """
    _check_seq_inputs(seq_log_probs=seq_log_probs, old_seq_log_probs=old_seq_log_probs, advantages=advantages)
    ratio = torch.exp(clamped_log_ratio(seq_log_probs, old_seq_log_probs, max_abs_log_ratio))  # s
    adv = advantages.to(seq_log_probs.dtype)
    loss = -gspo_objective(ratio, adv, clip_low, clip_high).mean()
    r, a = ratio.detach(), adv.detach()
    metrics = {f"{prefix}/num_rows": float(r.numel()), **_stats(prefix, "ratio", r)}
    metrics.update(_fracs(prefix, {"clip_low": r < 1.0 - clip_low, "clip_high": r > 1.0 + clip_high}))
    if is_self is not None:
        cross = ~is_self.to(torch.bool)
        # the gradient of min(sA, clip(s)A) is nonzero iff A > 0 and s <= 1 + high, or A < 0 and s >= 1 - low
        grad = gspo_has_gradient(r, a, clip_low, clip_high)
        metrics[f"{prefix}/num_cross"] = float(cross.sum())
        metrics.update(_stats(prefix, "cross_ratio", r[cross]))
        cross_grad = {"cross_grad": grad[cross]}
        metrics.update(_fracs(prefix, cross_grad))
        if source_ids is not None:
            metrics.update(_per_source(prefix, source_ids[cross], cross_grad))
    return loss, metrics


def naive_loss(
    seq_log_probs: Tensor,
    old_seq_log_probs: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = DEFAULTS.self_clip_low,
    clip_high: float = DEFAULTS.self_clip_high,
    max_abs_log_ratio: float = DEFAULTS.max_abs_log_ratio,
    is_self: Tensor | None = None,
    source_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """``naive`` sharing: GSPO's ratio and clip on every row (own and foreign) against its source's ``lbar``,
    with none of HACPO's mechanisms (no capability weight, no stepwise band). Inputs [N]; metrics ``naive/...``
    (``naive/cross_*`` too when ``is_self`` is given)."""
    return gspo_loss(
        seq_log_probs,
        old_seq_log_probs,
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        max_abs_log_ratio=max_abs_log_ratio,
        prefix="naive",
        is_self=is_self,
        source_ids=source_ids,
    )


def grpo_loss(
    token_log_probs: Tensor,
    old_token_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = DEFAULTS.grpo_clip_low,
    clip_high: float = DEFAULTS.grpo_clip_high,
    max_abs_log_ratio: float = DEFAULTS.max_abs_log_ratio,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO token-level PPO-clip loss. token_log_probs, old_token_log_probs, response_mask [B,T]; advantages [B].

    r_t = exp(clamp(lp_t - old_lp_t, -M, M));  obj_t = min(r_t A, clamp(r_t, 1 - low, 1 + high) A)
    loss = -token-mean over all masked tokens of the mini-batch (every response token weighs the same; the
    trainer weights micro-batches by their tokens, so the mean is the mini-batch's).
    """
    if (
        token_log_probs.dim() != 2
        or old_token_log_probs.shape != token_log_probs.shape
        or response_mask.shape != token_log_probs.shape
    ):
        raise ValueError("token_log_probs, old_token_log_probs and response_mask must all be [B, T] of one shape")
    if advantages.shape != token_log_probs.shape[:1]:
        raise ValueError(f"advantages must be [B]={token_log_probs.shape[0]}, got {tuple(advantages.shape)}")
    mask = response_mask.to(token_log_probs.dtype)
    ratio = torch.exp(clamped_log_ratio(token_log_probs, old_token_log_probs, max_abs_log_ratio))  # r_t
    adv = advantages.to(token_log_probs.dtype)[:, None]
    obj = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv)
    loss = -masked_mean(obj, mask)  # -token-mean
    sel = mask.bool()
    r = ratio.detach()[sel]
    metrics = {"grpo/num_tokens": float(r.numel()), **_stats("grpo", "ratio", r)}
    metrics.update(_fracs("grpo", {"clip_low": r < 1.0 - clip_low, "clip_high": r > 1.0 + clip_high}))
    return loss, metrics


def kl_k3(
    token_log_probs: Tensor, ref_token_log_probs: Tensor, max_abs_log_ratio: float = DEFAULTS.max_abs_log_ratio
) -> Tensor:
    """k3 KL estimator per token: ``exp(r) - r - 1`` with ``r = clamp(ref_lp - lp, -M, M)``. Same shape as inputs.

    Non-negative; its gradient w.r.t. ``token_log_probs`` is ``1 - exp(r)``.
    """
    r = clamped_log_ratio(ref_token_log_probs.to(token_log_probs.dtype), token_log_probs, max_abs_log_ratio)
    return torch.exp(r) - r - 1.0  # k3 = e^r - r - 1
