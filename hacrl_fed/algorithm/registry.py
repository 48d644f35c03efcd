"""Registries by name: advantage estimators, policy losses, and the algorithms that combine them.

Advantage estimators share one signature::

    fn(rewards[N], group_ids[N], source_ids[N], learner: int, capability[n_agents], *, reward_max, ratio_min,
       ratio_max, eps) -> advantages[N]

Policy losses share one signature: ``fn(inputs: PolicyLossInputs, step: int, config) -> (loss, metrics)``.
A sequence-level loss may also register which rows it has a gradient for
(``fn(seq_log_probs[N], inputs, step, config) -> bool[N]``, :func:`get_gradient_rows`): the trainer then runs
forward and backward only over those foreign rows.

An algorithm (:class:`AlgorithmSpec`, its table in :mod:`hacrl_fed.algorithm.specs`) names its advantage
estimator and policy loss and says what the trainer and the worker's intake must do for it (foreign rows or not,
capability cross weights or not, token-level inputs and weighting or not), so they ask the spec instead of
testing algorithm names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from hacrl_fed.algorithm.advantages import ADV_EPS, group_advantages, hacpo_advantages
from hacrl_fed.algorithm.losses import (
    PolicyLossConfig,
    grpo_loss,
    gspo_loss,
    hacpo_loss,
    naive_loss,
    rows_with_gradient,
    sequence_mean_log_prob,
)
from hacrl_fed.algorithm.specs import ALGORITHMS, AlgorithmSpec

AdvantageFn = Callable[..., Tensor]
LossFn = Callable[["PolicyLossInputs", int, PolicyLossConfig], tuple[Tensor, dict[str, float]]]
GradientRowsFn = Callable[[Tensor, "PolicyLossInputs", int, PolicyLossConfig], Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}
POLICY_LOSSES: dict[str, LossFn] = {}
GRADIENT_ROWS: dict[str, GradientRowsFn] = {}  # policy loss name -> the rows it has a gradient for


def _register(table: dict, kind: str, name: str):
    def deco(fn):
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = fn
        return fn

    return deco


def register_advantage_estimator(name: str):
    return _register(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def register_policy_loss(name: str):
    return _register(POLICY_LOSSES, "policy loss", name)


def register_gradient_rows(loss_name: str):
    return _register(GRADIENT_ROWS, "gradient-rows function", loss_name)


def _get(table: dict, kind: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown {kind} {name!r}; registered: {sorted(table)}") from None


def get_advantage_estimator(name: str) -> AdvantageFn:
    return _get(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def get_policy_loss(name: str) -> LossFn:
    return _get(POLICY_LOSSES, "policy loss", name)


def get_gradient_rows(loss_name: str) -> GradientRowsFn | None:
    """The policy loss's gradient-rows function, or None (a token-level loss, or one that registered none)."""
    return GRADIENT_ROWS.get(loss_name)


@dataclass
class PolicyLossInputs:
    """One mini-batch. ``token_log_probs``/``response_mask``/``old_token_log_probs`` [B,T]; the rest [B].

    ``old_seq_log_probs`` is the sequence mean ``lbar_old``: the learner's pre-update value on self rows, the source's
    published value on cross rows. ``old_token_log_probs`` is needed by token-level losses (``grpo``) only.
    """

    token_log_probs: Tensor
    response_mask: Tensor
    old_seq_log_probs: Tensor
    advantages: Tensor
    is_self: Tensor
    capability_coefficient: Tensor  # [B] v(j, k) of each row (1 on self rows)
    old_token_log_probs: Tensor | None = None
    seq_lengths: Tensor | None = None  # [B] divisor of each row's lbar (<= 0: its token count); see below
    source_ids: Tensor | None = None  # [B] each row's source index: per-source metrics of the cross rows

    def seq_log_probs(self) -> Tensor:
        """``lbar`` per row: token mean, or per ``seq_lengths`` unit (UTF-8 bytes under ``logprob_norm: per_byte``)."""
        return sequence_mean_log_prob(self.token_log_probs, self.response_mask, self.seq_lengths)


def get_algorithm(name: str) -> AlgorithmSpec:
    return _get(ALGORITHMS, "algorithm", name)


@register_advantage_estimator("hacpo")
def _adv_hacpo(rewards, group_ids, source_ids, learner, capability, **kw) -> Tensor:
    """HACPO's capability-aware advantage (``calibrate=False``: ``w = 1``, the ``advantage_calibration`` ablation)."""
    return hacpo_advantages(rewards, group_ids, source_ids, learner, capability, **kw)


@register_advantage_estimator("group")
def _adv_group(rewards, group_ids, source_ids, learner, capability, *, eps: float = ADV_EPS, **_: object) -> Tensor:
    """Plain (joint-)group mean/std: GRPO and GSPO on own rows, ``naive`` on the joint group."""
    return group_advantages(rewards, group_ids, eps=eps)


@register_policy_loss("hacpo")
def _loss_hacpo(inputs: PolicyLossInputs, step: int, config: PolicyLossConfig):
    return hacpo_loss(
        inputs.seq_log_probs(),
        inputs.old_seq_log_probs,
        inputs.advantages,
        inputs.is_self,
        inputs.capability_coefficient,
        step,
        config,
        source_ids=inputs.source_ids,
    )


@register_policy_loss("gspo")
def _loss_gspo(inputs: PolicyLossInputs, step: int, config: PolicyLossConfig):
    if not bool(inputs.is_self.all()):
        raise ValueError("gspo trains on the learner's own rows only; got cross rows")
    return gspo_loss(
        inputs.seq_log_probs(),
        inputs.old_seq_log_probs,
        inputs.advantages,
        clip_low=config.self_clip_low,
        clip_high=config.self_clip_high,
        max_abs_log_ratio=config.max_abs_log_ratio,
        prefix="gspo",
    )


@register_policy_loss("naive")
def _loss_naive(inputs: PolicyLossInputs, step: int, config: PolicyLossConfig):
    """Every row with GSPO's ratio and clip against its source's ``lbar`` (no weight, no stepwise band)."""
    return naive_loss(
        inputs.seq_log_probs(),
        inputs.old_seq_log_probs,
        inputs.advantages,
        clip_low=config.self_clip_low,
        clip_high=config.self_clip_high,
        max_abs_log_ratio=config.max_abs_log_ratio,
        is_self=inputs.is_self,
        source_ids=inputs.source_ids,
    )


@register_policy_loss("grpo")
def _loss_grpo(inputs: PolicyLossInputs, step: int, config: PolicyLossConfig):
    if inputs.old_token_log_probs is None:
        raise ValueError("grpo is token-level: PolicyLossInputs.old_token_log_probs is required")
    if not bool(inputs.is_self.all()):
        raise ValueError("grpo trains on the learner's own rows only; got cross rows")
    return grpo_loss(
        inputs.token_log_probs,
        inputs.old_token_log_probs,
        inputs.advantages,
        inputs.response_mask,
        clip_low=config.grpo_clip_low,
        clip_high=config.grpo_clip_high,
        max_abs_log_ratio=config.max_abs_log_ratio,
    )


@register_gradient_rows("hacpo")
def _grad_rows_hacpo(seq_log_probs: Tensor, inputs: PolicyLossInputs, step: int, config: PolicyLossConfig) -> Tensor:
    """HACPO: GSPO's clip on self rows, the stepwise cross band on foreign rows."""
    return rows_with_gradient(
        seq_log_probs, inputs.old_seq_log_probs, inputs.advantages, inputs.is_self, step, config, cross_band=True
    )


@register_gradient_rows("naive")
def _grad_rows_naive(seq_log_probs: Tensor, inputs: PolicyLossInputs, step: int, config: PolicyLossConfig) -> Tensor:
    """``naive``: GSPO's clip on every row."""
    return rows_with_gradient(
        seq_log_probs, inputs.old_seq_log_probs, inputs.advantages, inputs.is_self, step, config, cross_band=False
    )
