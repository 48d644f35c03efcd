"""The outcome guard's shadow learns from the learner's own samples (:mod:`hacrl_fed.worker.shadow`): GSPO's update
on rows another policy sampled, each weighted by its clipped sequence importance ratio. Pure math, no I/O.

A self row ``y`` of prompt ``x`` was sampled by the learner ``pi_l``; the shadow ``pi_s`` trains on it with GSPO
(its own pre-update score as ``lbar_old``, so its ratio starts at 1), and the row's advantage is multiplied by

    w = min(exp(lbar_s(y) - lbar_l(y)), clip),     lbar(y) = (1 / |y|) * sum_t log pi(y_t | x, y_<t)

GSPO's length-normalized sequence ratio ``shadow / learner`` (a geometric mean per token, so it stays near 1 where a
product over tokens would not), truncated at ``clip`` (variance bounded; a row the shadow likes much more than the
learner counts as ``clip`` rows). ``E_l[w A grad] ~ E_s[A grad]`` up to the truncation and the per-token geometric
mean: the shadow's update is the one it would take on its own samples. When shadow == learner every ``w`` is 1 and
the update is exactly GSPO's on the learner's own rows. :func:`importance_weights` on lists (the shadow's scoring
pass), :func:`importance_weights_tensor` on a micro-batch's ``lbar`` in the update's own forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def importance_weights(shadow_lbar: Sequence[float], learner_lbar: Sequence[float], clip: float) -> list[float]:
    """``w_i = min(exp(shadow_lbar_i - learner_lbar_i), clip)`` per row (module doc). → [N]."""
    if len(shadow_lbar) != len(learner_lbar):
        raise ValueError(f"{len(shadow_lbar)} shadow scores for {len(learner_lbar)} learner scores")
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    return [min(math.exp(min(s - q, 50.0)), clip) for s, q in zip(shadow_lbar, learner_lbar)]


def importance_weights_tensor(shadow_lbar: Tensor, learner_lbar: Tensor, clip: float) -> Tensor:
    """:func:`importance_weights` on tensors: ``min(exp(min(s - q, 50)), clip)`` [M] (float64 inside, as the list
    form computes in Python floats; returned in ``shadow_lbar``'s dtype)."""
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    gap = shadow_lbar.double() - learner_lbar.to(shadow_lbar.device).double()
    return torch.exp(gap.clamp(max=50.0)).clamp(max=clip).to(shadow_lbar.dtype)
