"""The ``algorithm`` section: how each org turns the pooled rollouts into its update (HACPO or a baseline)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from hacrl_fed.config.section import _d, _registered, _Section


class AlgorithmConfig(_Section):
    """How each org turns the pooled rollouts into its update: HACPO (docs/ALGORITHM.md) or a baseline.

    These defaults are the only place the algorithm's numbers are written: the loss configuration
    (:class:`hacrl_fed.algorithm.PolicyLossConfig`), the pure functions' defaults and docs/ALGORITHM.md's
    parameter table all follow them (tests check the table).
    """

    removed_fields = {
        "grpo_loss_agg_mode": "grpo always averages over the mini-batch's response tokens (token-mean)",
        "capability_floor": "every capability P-hat is at least CAPABILITY_FLOOR = 1e-8 "
        "(hacrl_fed/algorithm/capability.py)",
        "adv_eps": "every advantage adds ADV_EPS = 1e-6 to the group's reward std (hacrl_fed/algorithm/advantages.py)",
    }

    name: str = Field(
        "hacpo",
        description=_d(
            "the algorithm: hacpo (own + foreign rollouts, capability-aware), gspo / grpo (own rollouts only), naive "
            "(own + foreign rollouts, none of HACPO's mechanisms)"
        ),
    )
    self_clip_low: float = Field(
        3e-4,
        ge=0,
        lt=1,
        description=_d(
            "epsilon_low: GSPO clip band [1 - low, 1 + high] of the sequence ratio on the learner's own rows "
            "(hacpo, gspo, naive)"
        ),
    )
    self_clip_high: float = Field(4e-4, ge=0, description="epsilon_high: upper half of the GSPO clip band on own rows")
    cross_clip_delta: float = Field(
        0.2,
        ge=0,
        le=1,
        description=_d("delta: the first optimizer step's band for foreign rows is [1 - delta, 1] (hacpo)"),
    )
    cross_clip_step: float = Field(
        0.025,
        ge=0,
        description=_d(
            "delta_step: the foreign rows' lower clip bound rises by this much per optimizer step of a round (hacpo)"
        ),
    )
    alpha: float = Field(
        1.0,
        ge=0,
        description=_d(
            "alpha: exponent of the stop-gradient importance weight on foreign rows, c * sg(c)^alpha (hacpo)"
        ),
    )
    advantage_calibration: bool = Field(
        True,
        description=_d(
            "capability-aware advantage baseline mu_k = mean(w(k, j) * R); false takes w = 1, the plain joint-group "
            "mean (an ablation; hacpo)"
        ),
    )
    capability_coefficient: bool = Field(
        True,
        description=_d(
            "scale each foreign row's objective by v(j, k) = clamp(Phat_j / Phat_k); false takes v = 1 (an "
            "ablation; hacpo)"
        ),
    )
    cross_clip: bool = Field(
        True,
        description=_d(
            "clip the foreign rows' ratio to the stepwise band [lower_m, 1]; false uses the unclipped ratio (an "
            "ablation; hacpo)"
        ),
    )
    logprob_norm: Literal["per_token", "per_byte"] = Field(
        "per_byte",
        description=_d(
            "how a foreign row's sequence log-probs enter its cross ratio: per_byte (the default: both sums divided "
            "by the response's UTF-8 bytes, comparable across tokenizers; beyond the paper) or per_token (the "
            "paper: the learner's and the source's means over their own tokens). Own rows always use per-token "
            "means (hacpo, naive)"
        ),
    )
    baseline_rows: Literal["joint", "in_band"] = Field(
        "in_band",
        description=_d(
            "which rows of a joint group its advantage statistics (baseline mu_k, std, 'all rewards equal') are "
            "taken over: in_band (the default; beyond the paper, issues 30 and 42: the learner's own rows and the "
            "foreign rows whose ratio s lies in the cross band at the update's first optimizer step; every row "
            "still gets A = (R - mu_k) / (std + eps) from them) or joint (the paper: every row); hacpo only (the "
            "other algorithms have no cross band and take every row; in_band set for them is refused)"
        ),
        json_schema_extra={"absent_means": "joint"},  # a stored config from before the field took every row
    )
    max_abs_log_ratio: float = Field(
        10.0, gt=0, description=_d("M: every log-ratio is clamped to [-M, M] before exp (all losses and the KL term)")
    )
    grpo_clip_low: float = Field(0.2, ge=0, lt=1, description="grpo's token-level PPO clip band: 1 - low")
    grpo_clip_high: float = Field(0.28, ge=0, description="grpo's token-level PPO clip band: 1 + high")
    reward_max: float = Field(
        1.0,
        gt=0,
        description=_d(
            "R_max: baseline guard; a capability-weighted group mean above it is replaced by the learner's own mean "
            "(hacpo)"
        ),
    )
    capability_window: int = Field(
        5, ge=1, description=_d("K: capability P-hat of an org is the mean of its last K per-round accuracies")
    )
    ratio_min: float = Field(0.1, gt=0, description="lower clamp of the capability ratios w and v (hacpo)")
    ratio_max: float = Field(10.0, gt=0, description="upper clamp of the capability ratios w and v (hacpo)")
    warmup_rounds: int = Field(
        0,
        ge=0,
        description=_d("training rounds during which every capability is taken as 1 (no capability weighting yet)"),
    )
    kl_beta: float = Field(
        0.0,
        ge=0,
        description=_d(
            "beta: weight of the k3 KL to the worker's initial weights on its own tokens; 0 = no KL and no "
            "reference copy of the model (the paper uses 0.001)"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _baseline_rows_default(cls, data: object) -> object:
        """``baseline_rows`` left out: ``in_band`` for hacpo, ``joint`` (every row) for the algorithms without a
        cross band, so a resolved config names the form that ran."""
        if isinstance(data, dict) and "baseline_rows" not in data:
            data = {**data, "baseline_rows": "in_band" if data.get("name", "hacpo") == "hacpo" else "joint"}
        return data

    @model_validator(mode="after")
    def _ratio_bounds(self) -> AlgorithmConfig:
        if self.ratio_min > self.ratio_max:
            raise ValueError("ratio_min must be <= ratio_max")
        return self

    @model_validator(mode="after")
    def _in_band_needs_the_band(self) -> AlgorithmConfig:
        if self.baseline_rows == "joint":
            return self
        form = self.baseline_rows
        if self.name != "hacpo":
            raise ValueError(f"baseline_rows: {form} needs HACPO's cross band (name: hacpo), not {self.name!r}")
        return self

    @field_validator("name")
    @classmethod
    def _registered_algorithm(cls, name: str) -> str:
        from hacrl_fed.algorithm.specs import ALGORITHMS  # lazy: algorithm/__init__ imports config

        return _registered(name, ALGORITHMS)
