"""HACPO and its baselines as pure tensor functions (no I/O, no flwr, no protobuf).

See ``docs/ALGORITHM.md``. Vocabulary: ``seq_log_probs``/``old_seq_log_probs`` (``lbar``, one per sequence) and
``advantages`` [N]; ``token_log_probs``/``old_token_log_probs`` per token [B, T] with ``response_mask``;
``group_ids``/``source_ids`` [N]; ``capability_coefficient`` ``v(j, k)`` [N]; ``step``: the optimizer step of the
round, counted across epochs.
"""

from hacrl_fed.algorithm.advantages import (
    advantage_metrics,
    capability_coefficients,
    capability_per_row,
    capability_ratios,
    group_advantages,
    hacpo_advantages,
)
from hacrl_fed.algorithm.batching import minibatch_schedule, order_rows
from hacrl_fed.algorithm.capability import CapabilityTracker
from hacrl_fed.algorithm.capability_rounds import RoundCapabilities
from hacrl_fed.algorithm.losses import (
    FRACTION_COUNTS,
    PolicyLossConfig,
    clamped_log_ratio,
    cross_lower_bound,
    fractions_from_counts,
    grpo_loss,
    gspo_has_gradient,
    gspo_loss,
    gspo_objective,
    hacpo_cross_band,
    hacpo_loss,
    kl_k3,
    masked_mean,
    naive_loss,
    name_sources,
    rows_with_gradient,
    sequence_mean_log_prob,
)
from hacrl_fed.algorithm.registry import (
    ADVANTAGE_ESTIMATORS,
    ALGORITHMS,
    POLICY_LOSSES,
    AlgorithmSpec,
    PolicyLossInputs,
    get_advantage_estimator,
    get_algorithm,
    get_gradient_rows,
    get_policy_loss,
    register_advantage_estimator,
    register_gradient_rows,
    register_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ALGORITHMS",
    "FRACTION_COUNTS",
    "POLICY_LOSSES",
    "AlgorithmSpec",
    "CapabilityTracker",
    "PolicyLossConfig",
    "PolicyLossInputs",
    "RoundCapabilities",
    "advantage_metrics",
    "capability_coefficients",
    "capability_ratios",
    "clamped_log_ratio",
    "cross_lower_bound",
    "gspo_has_gradient",
    "fractions_from_counts",
    "name_sources",
    "get_advantage_estimator",
    "get_algorithm",
    "get_gradient_rows",
    "get_policy_loss",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_objective",
    "hacpo_advantages",
    "hacpo_cross_band",
    "hacpo_loss",
    "kl_k3",
    "masked_mean",
    "minibatch_schedule",
    "naive_loss",
    "order_rows",
    "capability_per_row",
    "register_advantage_estimator",
    "register_gradient_rows",
    "register_policy_loss",
    "rows_with_gradient",
    "sequence_mean_log_prob",
]
