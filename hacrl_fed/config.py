"""Typed run configuration (pydantic), loaded from YAML by :func:`load_config`.

Every section forbids unknown keys, so a typo fails loudly with the dotted field name (``trainer.lr``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hacrl_fed.limits import MAX_BYTES_PER_TOKEN, MAX_MESSAGE_MB
from hacrl_fed.run_files import ERROR_LOG
from hacrl_fed.unique_yaml import DuplicateKey, load_unique


class ConfigError(ValueError):
    """A configuration problem; the message names the offending field(s)."""


class BuildError(ConfigError):
    """A problem found while building what a valid config names: a model or tokenizer that cannot be loaded, a
    task that cannot be built (unknown name, bad params, an unreadable or malformed data file), a zoo agent whose
    shipped weights are stale, prompts that do not fit a model's context. The message names the field or the file
    (and line). Entry points treat it like any :class:`ConfigError`: one line, exit code 2."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # no inf/nan anywhere


def _d(text: str) -> str:
    """A field description: one paragraph, whitespace folded (rendered by ``hacrl-fed config --describe``)."""
    return " ".join(text.split())


def _registered(name: str, registry: Collection[str]) -> str:
    """``name`` when ``registry`` (a registry's names: the one place they are written) holds it; else the error a
    ``Literal`` of those names gives (``Input should be 'a', 'b' or 'c'``)."""
    if name in registry:
        return name
    quoted = [repr(n) for n in registry]
    expected = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})


class AlgorithmConfig(_Section):
    """How each org turns the pooled rollouts into its update: HACPO (docs/ALGORITHM.md) or a baseline.

    These defaults are the only place the algorithm's numbers are written: the loss configuration
    (:class:`hacrl_fed.algorithm.PolicyLossConfig`), the pure functions' defaults and docs/ALGORITHM.md's
    parameter table all follow them (tests check the table).
    """

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
    max_abs_log_ratio: float = Field(
        10.0, gt=0, description=_d("M: every log-ratio is clamped to [-M, M] before exp (all losses and the KL term)")
    )
    grpo_clip_low: float = Field(0.2, ge=0, lt=1, description="grpo's token-level PPO clip band: 1 - low")
    grpo_clip_high: float = Field(0.28, ge=0, description="grpo's token-level PPO clip band: 1 + high")
    grpo_loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = Field(
        "token-mean",
        description=_d(
            "how grpo averages its per-token objective over a mini-batch: token-mean (every response token of the "
            "mini-batch weighs the same) or seq-mean-token-mean (the mean over sequences of each sequence's token "
            "mean)"
        ),
    )
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
    capability_floor: float = Field(1e-8, gt=0, description="lower bound of every capability P-hat (no division by 0)")
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
    adv_eps: float = Field(1e-6, gt=0, description="epsilon added to the group's reward std in every advantage")
    cross_staleness: Literal["band", "decoupled"] = Field(
        "band",
        description=_d(
            "the foreign rows' loss: band (HACPO's stepwise band around the source's log-prob) or decoupled (a "
            "trust region around the learner's pre-update policy and a stop-gradient behaviour weight w = "
            "pi_prox / mu_source; hacpo; usable in today's synchronous rounds)"
        ),
    )
    cross_weight_mode: Literal["filter", "clamp"] = Field(
        "filter",
        description=_d(
            "decoupled: a foreign row whose behaviour weight w is outside [cross_weight_min, cross_weight_max] is "
            "left out (filter) or has w clamped into it (clamp)"
        ),
    )
    cross_weight_min: float = Field(
        0.8, ge=0, le=1, description=_d("decoupled: lower bound of the behaviour weight w (<= 1)")
    )
    cross_weight_max: float = Field(
        1.0, ge=1, le=10, description=_d("decoupled: upper bound of the behaviour weight w (>= 1)")
    )

    @model_validator(mode="after")
    def _ratio_bounds(self) -> AlgorithmConfig:
        if self.ratio_min > self.ratio_max:
            raise ValueError("ratio_min must be <= ratio_max")
        return self

    @model_validator(mode="after")
    def _decoupled_needs_a_cross_loss(self) -> AlgorithmConfig:
        from hacrl_fed.algorithm.specs import ALGORITHMS  # lazy: algorithm/__init__ imports config

        spec = ALGORITHMS.get(self.name)
        if self.cross_staleness == "decoupled" and spec is not None and spec.decoupled_loss is None:
            raise ValueError(
                f"cross_staleness: decoupled needs an algorithm with foreign rows (hacpo), not {self.name!r}"
            )
        return self

    @field_validator("name")
    @classmethod
    def _registered_algorithm(cls, name: str) -> str:
        from hacrl_fed.algorithm.specs import ALGORITHMS  # lazy: algorithm/__init__ imports config

        return _registered(name, ALGORITHMS)


class LoraConfig(_Section):
    """LoRA adapters (peft): only the adapters train, the base weights stay frozen."""

    enabled: bool = Field(False, description="train LoRA adapters instead of every weight (needs peft)")
    r: int = Field(8, ge=1, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator (the update is scaled by alpha / r)")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description=_d(
            "dropout on the adapters' input during the update's forward passes (only the adapters' dropout: the "
            "base model stays deterministic, and generation and log-prob scoring run without dropout). Above 0 "
            "the importance ratios of an update carry dropout noise"
        ),
    )
    target_modules: list[str] | str = Field(
        "all-linear", description=_d("module names to adapt (peft's target_modules), or all-linear")
    )


DEFAULT_BUDGET_MULTIPLE = 0.5  # BENCHMARKS.md "A per-source budget at 2 and 8 orgs" (issue 27)
DEFAULT_BUDGET_SPLIT: Literal["pooled", "per_source"] = "per_source"


class SelectionConfig(_Section):
    """Which screened foreign rows a learner trains on (hacrl_fed/algorithm/selection.py, docs/ALGORITHM.md
    "Selecting foreign rows"): a rule and a budget of foreign rows per round (by default 0.5x the learner's own
    rows, divided per source; :meth:`_default_budget` says where the default does not apply)."""

    rule: str = Field(
        "successes",
        description=_d(
            "successes (the default: rows with reward > 0; BENCHMARKS.md, SECURITY.md), all (every screened "
            "foreign row: the paper), uniform (a seeded uniform sample of the budget), nonzero_advantage (rows "
            "whose reward differs from their joint group's mean), learner_failed (rows of prompts where the "
            "learner's own mean reward is below the best reward in the pool, lowest own mean first), max_variance "
            "(per prompt the subset of its share of the budget that maximizes the joint group's reward variance: "
            "PODS), rescue (rows with reward > 0 on prompts where every own row of the learner has reward 0), "
            "peer_sample (whole sources in a seeded order until the budget is full; the sources it does not "
            "reach are not screened)"
        ),
    )
    budget: int | None = Field(
        None,
        ge=0,
        description=_d("at most this many foreign rows per round (null: no budget); not with budget_multiple"),
    )
    budget_multiple: float | None = Field(
        DEFAULT_BUDGET_MULTIPLE,
        ge=0,
        description=_d(
            "at most floor(this x the learner's own rows of the round) foreign rows per round (null: no budget); "
            "not with budget. Left out: 0.5 (a learner's train cost stays nearly flat as orgs join: "
            'BENCHMARKS.md "A per-source budget at 2 and 8 orgs"), or null where the section gives budget or '
            "its rule keeps every row (all)"
        ),
    )
    budget_split: Literal["pooled", "per_source"] = Field(
        DEFAULT_BUDGET_SPLIT,
        description=_d(
            "how the budget is divided among the round's sources: pooled (one budget over every source's rows: a "
            "source with many eligible rows can take most of it) or per_source (each source a max-min fair share, "
            "at least floor(budget / sources) or its eligible rows, that no other source can spend: a budget a "
            'doctoring peer cannot squat; docs/ALGORITHM.md "A budget per source"); no effect without a budget; '
            "not with peer_sample. Left out: per_source, or pooled where there is no budget or the rule takes "
            "whole sources (peer_sample)"
        ),
        # a stored run config without this field (a benchmark cell run before it existed) ran pooled
        json_schema_extra={"absent_means": "pooled"},
    )

    @field_validator("rule")
    @classmethod
    def _registered_rule(cls, rule: str) -> str:
        from hacrl_fed.algorithm.selection import SELECTION_RULES  # lazy: algorithm/__init__ imports config

        return _registered(rule, SELECTION_RULES)

    @model_validator(mode="before")
    @classmethod
    def _default_budget(cls, data: Any) -> Any:
        """The default budget where the section leaves it out: naming neither ``budget`` nor ``budget_multiple``
        gives ``budget_multiple`` 0.5, or null under a rule that keeps every row (``all``); not naming
        ``budget_split`` gives ``per_source``, or ``pooled`` where there is no budget (nothing to divide) or the
        rule takes whole sources (``peer_sample``, which refuses ``per_source``). A field the section names is
        kept as named; an unknown rule is left to the rule's own check."""
        from hacrl_fed.algorithm.selection import SELECTION_RULES

        if not isinstance(data, dict):
            return data
        rule = data.get("rule", cls.model_fields["rule"].default)
        spec = SELECTION_RULES.get(rule) if isinstance(rule, str) else None
        if spec is None:
            return data
        out = dict(data)
        if "budget_multiple" not in out:  # ``budget`` named: the section chose its budget (null: none)
            out["budget_multiple"] = DEFAULT_BUDGET_MULTIPLE if spec.allows_budget and "budget" not in out else None
        if "budget_split" not in out:
            budgeted = out.get("budget") is not None or out.get("budget_multiple") is not None
            out["budget_split"] = DEFAULT_BUDGET_SPLIT if budgeted and not spec.source_ordered else "pooled"
        return out

    @model_validator(mode="after")
    def _budget(self) -> SelectionConfig:
        from hacrl_fed.algorithm.selection import selection_budget_problem

        if self.budget is not None and self.budget_multiple is not None:
            raise ValueError("budget and budget_multiple are exclusive: set one of them (the other null)")
        problem = selection_budget_problem(self.rule, self.budget is not None or self.budget_multiple is not None)
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _split(self) -> SelectionConfig:
        from hacrl_fed.algorithm.selection import budget_split_problem

        problem = budget_split_problem(self.rule, self.budget_split)
        if problem is not None:
            raise ValueError(problem)
        return self


class LikelihoodScreenConfig(_Section):
    """The learner's likelihood screen of foreign rows (docs/ALGORITHM.md "Likelihood screen", SECURITY.md)."""

    enabled: bool = Field(
        True,
        description=_d(
            "(on by default) score every foreign row with this learner's model before the update and leave out "
            "rows it finds implausible (low likelihood against its own responses, or a claimed log-prob out of "
            "line with the source's other claims), counted as screen/<source>/dropped_<reason>"
        ),
    )
    norm: Literal["per_byte", "per_token"] = Field(
        "per_byte",
        description=_d(
            "unit of the length-normalised log-probs it compares: per UTF-8 byte of the response (comparable "
            "across tokenizers) or per token (the learner's tokens; a claim per the source's tokens)"
        ),
    )
    margin_nats: float = Field(
        4.0,
        ge=0,
        description=_d(
            "a foreign row is dropped when its learner log-prob per unit is below the quantile of the learner's own "
            "rows of the same prompt minus this margin"
        ),
    )
    quantile: float = Field(
        0.0, ge=0, le=1, description=_d("which quantile of the own rows' log-probs is the reference (0: the minimum)")
    )
    claim_z: float = Field(
        8.0,
        gt=0,
        description=_d(
            "a foreign row is dropped when its claimed-minus-learner gap per unit is more than claim_z robust "
            "standard deviations (plus claim_margin_nats) from the source's running center"
        ),
    )
    claim_margin_nats: float = Field(0.5, ge=0, description=_d("slack added to the claim-outlier bound, nats/unit"))
    min_scale: float = Field(0.05, gt=0, description=_d("floor of the gap's robust standard deviation, nats/unit"))
    history_decay: float = Field(
        0.8, ge=0, lt=1, description=_d("EMA weight of a source's past rounds in its gap center and scale")
    )
    min_rows: int = Field(
        4, ge=2, description=_d("rows of a source needed before its first round's own gaps serve as the reference")
    )


class OutcomeGuardConfig(_Section):
    """The learner's outcome guard (docs/ALGORITHM.md "Outcome guard", SECURITY.md): a private validation split,
    rollback to the best validated weights and quarantine of the sources trained on since then."""

    enabled: bool = Field(
        False,
        description=_d(
            "(off by default until measured on the matrix) validate this learner's greedy accuracy on a private split "
            "of its task on a schedule; on a significant regression against its best validated weights, roll back to "
            "them and quarantine the sources trained on since, counted as outcome/<source>/..."
        ),
    )
    every: int = Field(4, ge=1, description=_d("validate after every this many rounds' updates (and the last round's)"))
    val_size: int = Field(
        400,
        ge=8,
        description=_d("prompts of the private validation split, drawn with the org's seed from the train split"),
    )
    z: float = Field(2.5, gt=0, description=_d("a regression: lost - gained > z * sqrt(lost + gained) (McNemar)"))
    margin: int = Field(2, ge=0, description=_d("and lost - gained > margin (prompts)"))
    probation: int = Field(8, ge=1, description=_d("rounds a source is left out after its first strike"))
    backoff: float = Field(2.0, ge=1, description=_d("each further strike multiplies the source's quarantine by this"))
    counterfactual: bool = Field(
        True,
        description=_d(
            "also train a shadow of this learner on its own rows alone and validate it every `every` rounds and the "
            "last: significantly worse than the shadow, the learner takes the shadow's weights and strikes the "
            "sources trained since; worse by the point estimate at the last round, it takes them without a strike"
        ),
    )


class TrainerConfig(_Section):
    """The local update of each org (hacrl_fed/trainer.py); an org may override any field under orgs[].trainer."""

    lr: float = Field(2e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas (beta1, beta2)")
    grad_clip: float = Field(1.0, gt=0, description="gradient-norm clip before every optimizer step")
    epochs: int = Field(1, ge=1, description="passes over one round's rows (no shuffling)")
    minibatch_size: int = Field(128, ge=1, description=_d("rows (sequences, own and foreign alike) per optimizer step"))
    micro_batch_size: int = Field(
        32,
        ge=1,
        description=_d("rows per forward/backward pass (memory bound); the gradient equals the whole mini-batch's"),
    )
    skip_no_gradient_rows: bool = Field(
        True,
        description=_d(
            "score each mini-batch's foreign rows without gradient first and run forward/backward only over those "
            "the loss has a gradient for (HACPO's cross band, naive's clip): the same update up to float round-off, "
            "at a fraction of the cost when most foreign rows fall outside the band (hacpo, naive; not with LoRA "
            "dropout)"
        ),
    )
    forward: Literal["auto", "model"] = Field(
        "auto",
        description=_d(
            "the update's forward pass. auto: the hand-written forward of the zoo's architectures (Qwen3, Llama, "
            "GPT-2; hacrl_fed/models/native.py) where it applies (float32, trainer.precision: model, no LoRA, no "
            "gradient checkpointing), else the model's own; model: always the model's own forward"
        ),
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters instead of full fine-tuning")
    precision: Literal["model", "bf16-autocast", "bf16-master"] = Field(
        "model",
        description=_d(
            "numerics of the update. model: weights, grads and AdamW states in the dtype the model was loaded with "
            "(model.dtype; auto is bfloat16 on CUDA, where pure-bf16 AdamW drops small updates). bf16-autocast: "
            "float32 weights and AdamW states, forward/backward under torch.autocast(bfloat16) (needs model.dtype: "
            "float32). bf16-master: bfloat16 weights on the model (what the hf engine generates with) plus a float32 "
            "master copy and float32 AdamW states kept by the trainer (needs model.dtype: bfloat16); checkpoints keep "
            "the master copy"
        ),
    )
    gradient_checkpointing: bool = Field(
        False,
        description=_d(
            "recompute each decoder layer's activations during backward: activation memory ~1/num_layers, ~30% slower"
        ),
    )
    selection: SelectionConfig = Field(
        default_factory=SelectionConfig,
        description=_d("which screened foreign rows the learner trains on, picked before they are tokenized or scored"),
    )
    likelihood_screen: LikelihoodScreenConfig = Field(
        default_factory=LikelihoodScreenConfig,
        description=_d("leave implausible foreign rows out of this org's update (the learner's own choice)"),
    )
    outcome_guard: OutcomeGuardConfig = Field(
        default_factory=OutcomeGuardConfig,
        description=_d("bound a member's harm by this learner's own validated accuracy (the learner's own choice)"),
    )


class GenerationConfig(_Section):
    """How each org samples its rollouts and answers evaluations; an org may override any field under
    orgs[].generation."""

    engine: Literal["hf", "fast", "vllm"] = Field(
        "hf",
        description=_d(
            "generation engine: hf (transformers generate, any device), fast (a lean decoding loop that records "
            "log-probs as it samples; for small models on CPU, any device) or vllm (CUDA, pip install "
            "'hacrl-fed[vllm]')"
        ),
    )
    num_samples: int = Field(8, ge=1, description="G: responses per prompt and org")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (published log-probs are at temperature 1)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: keep the smallest token set of this mass")
    top_k: int = Field(0, ge=0, description="sample among the k likeliest tokens; 0 = no top-k")
    max_new_tokens: int = Field(
        64,
        ge=1,
        description=_d(
            "response budget of a training rollout, in the org's own tokens; prompt tokens + this must fit the model's "
            "context (checked at worker start-up)"
        ),
    )
    eval_max_new_tokens: int = Field(
        64,
        ge=1,
        description=_d(
            "response budget of a greedy evaluation answer; prompt tokens + this must fit the model's context"
        ),
    )
    batch_size: int = Field(64, ge=1, description="sequences per generate() call (hf) / max_num_seqs (vllm)")
    seed_per_batch: bool = Field(
        False,
        description=_d(
            "hf/fast: seed each generate() call of batch_size sequences on its own (from the round's seed and the "
            "batch), not one random stream per round; lets a sharded worker sample its batches on every rank"
        ),
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        le=1,
        description=_d("vllm only: share of the GPU's memory the engine may take (weights and KV cache)"),
    )
    max_model_len: int | None = Field(
        None, ge=1, description=_d("vllm only: prompt + response tokens per sequence; null = the model's context")
    )
    dtype: Literal["bfloat16", "float16"] | None = Field(
        None, description=_d("vllm only: the engine's weight dtype; null = the model's (float32 runs as bfloat16)")
    )
    enforce_eager: bool = Field(
        False, description=_d("vllm only: no CUDA graphs (faster start, less memory, slower decoding)")
    )
    sleep_during_train: bool = Field(
        False, description=_d("vllm only: sleep(level=1) during each update (weights to CPU, KV cache freed)")
    )
    vllm_kwargs: dict[str, Any] = Field(default_factory=dict, description="vllm only: extra vllm.LLM(...) arguments")


class TaskConfig(_Section):
    """``name`` picks a task from the registry; ``params`` are validated by that task's own model."""

    name: str = Field(
        "arithmetic",
        description=_d(
            "task: arithmetic, jsonl (GSM8K/MATH-style files), dataset (local Parquet / Arrow / JSON(L)), "
            "reasoning-gym, or a lab's own (package.module:ClassName or a hacrl_fed.tasks entry point)"
        ),
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description=_d(
            "the task's own parameters (e.g. jsonl: path, test_path, question_field, answer_field); unknown keys are "
            "errors"
        ),
    )
    eval_size: int = Field(
        200, ge=1, description="held-out test prompts of every evaluation (the first ones of the split)"
    )


class ModelConfig(_Section):
    """Exactly one of ``zoo`` (a built-in tiny agent name) or ``path`` (local dir or hub id)."""

    zoo: str | None = Field(
        None, description=_d("a built-in tiny agent (hacrl-fed zoo list), shipped in hacrl_fed/assets/zoo")
    )
    path: str | None = Field(None, description="a local HF-format model folder, or a hub id (offline: must be cached)")
    tokenizer: str | None = Field(None, description="tokenizer folder or hub id; null = the model's own")
    device: str = Field("auto", description="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    dtype: str = Field("auto", description="auto (bfloat16 on CUDA, else float32), float32, bfloat16 or float16")
    trust_remote_code: bool = Field(False, description="let transformers run the model folder's own code")

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.zoo is None) == (self.path is None):
            raise ValueError("set exactly one of 'zoo' or 'path'")
        return self


class ShardingConfig(_Section):
    """An organization's worker as several ranks of one torch.distributed group (FSDP2), launched by torchrun."""

    ranks: int = Field(
        1,
        ge=1,
        le=1024,
        description=_d(
            "processes (one per device) behind the org's one endpoint, launched by torchrun; 1 = one plain process"
        ),
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend: auto = nccl on CUDA, gloo on CPU"
    )
    mixed_precision: Literal["off", "bf16", "fp16"] = Field(
        "off",
        description=_d("FSDP2 compute dtype of the sharded parameters (gradients reduced in fp32); off = the model's"),
    )
    cpu_offload: bool = Field(
        False, description=_d("keep parameter shards and optimizer state on CPU between uses (FSDP2 CPUOffloadPolicy)")
    )
    hang_timeout_s: float = Field(
        300.0,
        gt=0,
        description=_d("seconds a rank may stay silent inside one request before the org's reply fails naming it"),
    )


class OrgConfig(_Section):
    """One organization: its id, its private model and optional per-org overrides."""

    id: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description=_d("the org's id (letters, digits, _ . -), unique in the run"),
    )
    model: ModelConfig = Field(description="the org's private model")
    seed: int | None = Field(None, description="the org's seed; null = derived from the run seed and the org id")
    trainer: dict[str, Any] = Field(
        default_factory=dict, description=_d("overrides of the run's trainer section for this org (same fields)")
    )
    generation: dict[str, Any] = Field(
        default_factory=dict, description=_d("overrides of the run's generation section for this org (same fields)")
    )
    sharding: ShardingConfig = Field(
        default_factory=ShardingConfig, description="the org's worker sharded over several ranks (FSDP2, torchrun)"
    )
    emulate_slowdown: float = Field(
        1.0,
        ge=1.0,
        description=_d(
            "benchmarks only: every step of this org's hacrl-fed worker process takes this many times its compute "
            "time (after the step the worker sleeps (F-1) x the step's measured seconds), emulating a slower org in "
            "real processes; 1 = as fast as it is. Needs worker processes (federation.transport grpc or a Flower "
            "deployment); in process use federation.virtual_step_s"
        ),
    )


class FederationConfig(_Section):
    """The round loop run by the coordinator."""

    rounds: int = Field(100, ge=1, description="rounds to run")
    prompts_per_round: int = Field(16, ge=1, description="B: prompts every org answers per round")
    eval_every: int = Field(
        10,
        ge=0,
        description=_d(
            "greedy held-out evaluation every this many rounds (also before round 1 and after the last); 0 = only "
            "before and after"
        ),
    )
    min_orgs: int = Field(1, ge=1, description="orgs that must reply for a round to train")
    round_timeout_s: float = Field(600.0, gt=0, description="seconds each phase of a round waits for the orgs")
    transport: Literal["inprocess", "grpc", "flower"] = Field(
        "inprocess",
        description=_d(
            "how the coordinator reaches the workers with hacrl-fed run: inprocess or grpc (flower: hacrl-fed simulate "
            "or flwr run)"
        ),
    )
    protocol: Literal["fused", "two_message"] = Field(
        "fused",
        description=_d(
            "fused: one step message per org per round (round r-1's train request, its evaluation and checkpoint when "
            "due, and round r's plan; the worker trains, then generates); two_message: a plan-only step, then a "
            "train-only step (same numbers)"
        ),
    )
    checkpoint_every: int = Field(0, ge=0, description="worker checkpoints every this many rounds; 0 = only at the end")
    max_failed_rounds: int = Field(3, ge=1, description=_d("consecutive rounds below min_orgs before the run aborts"))
    max_message_mb: int = Field(MAX_MESSAGE_MB, ge=1, description="largest gRPC / Flower message, in MB")
    staleness: int = Field(
        0,
        ge=0,
        description=_d(
            "K: asynchronous rounds when >= 1 (in-process, gRPC and Flower): an org may plan round t once every "
            "live org has published round t-K-1, so no org runs more than K rounds ahead of the slowest; 0 = today's "
            "lock-step rounds (docs/ALGORITHM.md 'Asynchronous rounds')"
        ),
    )
    window: int | None = Field(
        None,
        ge=1,
        description=_d(
            "W: a step planning round t takes the foreign batches of rounds t-W..t-1 it has not used; null = K+1"
        ),
    )
    virtual_step_s: dict[str, float] = Field(
        default_factory=dict,
        description=_d(
            "asynchronous rounds in-process: org id -> the virtual seconds one step of that org takes (default 1.0; "
            "e.g. 4.0 = four times slower); the driver orders the replies by this clock, so a run is deterministic "
            "(over gRPC the replies come on the wall clock and this is not used)"
        ),
    )

    virtual_dies: dict[str, float] = Field(
        default_factory=dict,
        description=_d(
            "asynchronous rounds in-process: org id -> the virtual second it dies (its step in flight is lost, it "
            "stops counting in the staleness bound): fault injection on the virtual clock (not used over gRPC, "
            "where a step whose call fails or times out is the death)"
        ),
    )
    virtual_rejoins: dict[str, float] = Field(
        default_factory=dict,
        description=_d(
            "asynchronous rounds in-process: org id -> the virtual second it comes back (after its virtual_dies "
            "second), at the current round"
        ),
    )

    @property
    def effective_window(self) -> int:
        """``W``: ``window``, or ``K + 1`` when unset."""
        return self.staleness + 1 if self.window is None else self.window

    @field_validator("virtual_step_s")
    @classmethod
    def _positive_steps(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {org: s for org, s in value.items() if not (math.isfinite(s) and s > 0)}
        if bad:
            raise ValueError(f"every step duration must be finite and > 0, got {bad}")
        return value

    @field_validator("virtual_dies", "virtual_rejoins")
    @classmethod
    def _fault_times(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {org: s for org, s in value.items() if not (math.isfinite(s) and s >= 0)}
        if bad:
            raise ValueError(f"every fault time must be finite and >= 0, got {bad}")
        return value


class SecurityConfig(_Section):
    """Trust between organizations (SECURITY.md).

    ``signing``: every RolloutBatch is signed by its org (Ed25519) and verified by the coordinator and by every
    receiving worker against the pinned roster. ``roster_file`` / ``roster`` pin ``org id -> public identity``
    (``hacrl-fed keys`` writes both the roster and each org's private identity file); ``identity_file`` is where
    a worker finds its own private identity (``{org}`` is replaced by the org id). With neither roster set, a
    run on one machine provisions a fresh key set under ``<run dir>/keys/`` (every key on one machine: it proves
    the plumbing, not trust between separate organizations).
    ``encrypt``: coordinator-blind mode; rollout text is sealed end to end for the other orgs.
    """

    signing: bool = Field(
        True,
        description=_d(
            "every rollout batch is signed by its org (Ed25519) and verified by the coordinator and every receiver"
        ),
    )
    encrypt: bool = Field(
        False,
        description=_d(
            "coordinator-blind mode: rollout text is sealed end to end for the other orgs (needs signing and "
            "reverify_rewards)"
        ),
    )
    roster_file: str | None = Field(
        None,
        description=_d(
            "file pinning org id -> public identity (written by hacrl-fed keys); null with no roster = fresh keys "
            "under <run dir>/keys/"
        ),
    )
    roster: dict[str, str] = Field(
        default_factory=dict,
        description=_d(
            'the roster inline: org id -> "ed25519:<b64> x25519:<b64>" (at most one of roster and roster_file)'
        ),
    )
    identity_file: str | None = Field(
        None,
        description=_d(
            "where a worker finds its private identity; {org} is replaced by the org id (e.g. keys/identity/{org}.key)"
        ),
    )
    reverify_rewards: bool = Field(
        True, description=_d("every receiver re-verifies the claimed rewards of foreign rollouts with its own verifier")
    )
    max_mismatch_rate: float = Field(
        0.1,
        ge=0,
        le=1,
        description=_d(
            "an org whose share of contradicted reward claims in one round exceeds this is excluded for the rest of "
            "the run"
        ),
    )
    max_screen_drop_rate: float = Field(
        1.0,
        ge=0,
        le=1,
        description=_d(
            "an org whose rows the receivers' likelihood screens left out at more than this rate (over the run, the "
            "median over receivers) is excluded for the rest of the run; 1 never excludes"
        ),
    )
    screen_min_rows: int = Field(
        64,
        ge=1,
        description=_d("rows a receiver must have screened of an org before its screen drop rate can exclude it"),
    )
    max_round_step: int = Field(
        1000, ge=1, description=_d("how far ahead of its last trained round a worker accepts a plan")
    )
    pad_sealed: bool = Field(
        False,
        description=_d(
            "coordinator-blind mode: pad each sealed text to a power-of-two size bucket (at most the plan's text "
            "bound), so the coordinator does not see each response's exact length"
        ),
    )
    max_stale_rounds: int = Field(
        2,
        ge=1,
        description=_d(
            "a plan at most this many rounds behind a worker's last trained round is a coordinator restart "
            "(stale_round); further behind, the worker was driven ahead by someone else (round_ahead, an attack)"
        ),
    )
    max_bytes_per_token: int = Field(
        MAX_BYTES_PER_TOKEN,
        ge=4,
        description=_d("response text may hold at most max_new_tokens times this many UTF-8 bytes"),
    )

    @model_validator(mode="after")
    def _consistent(self) -> SecurityConfig:
        if self.roster and self.roster_file:
            raise ValueError("set at most one of 'roster' and 'roster_file'")
        if self.encrypt and not self.signing:
            raise ValueError("encrypt needs signing (encrypt-then-sign)")
        if self.pad_sealed and not self.encrypt:
            raise ValueError("pad_sealed needs encrypt (only sealed text is padded)")
        if self.encrypt and not self.reverify_rewards:
            raise ValueError("encrypt needs reverify_rewards (capability comes from receivers' verification)")
        return self


class WandbConfig(_Section):
    """Weights & Biases as a second metrics sink (pip install 'hacrl-fed[wandb]'): the coordinator logs every
    round's metrics with the keys of metrics.jsonl, step = round (hacrl_fed/loggers/wandb.py)."""

    enabled: bool = Field(False, description="log the round metrics to W&B as well")
    project: str = Field("hacrl-fed", min_length=1, description="the W&B project")
    entity: str | None = Field(None, description="the W&B entity (team or user); null = the account's default")
    name: str | None = Field(None, description="the W&B run name; null = the run's name")
    tags: list[str] = Field(default_factory=list, description="tags of the W&B run")
    mode: Literal["online", "offline"] = Field(
        "online", description=_d("offline writes the W&B run under <run dir>/wandb only (upload later: wandb sync)")
    )


class RunConfig(_Section):
    """One federated run: its name and seed, the algorithm, the orgs and how rounds run."""

    name: str = Field(
        "run",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$",
        description=_d("the run's name (letters, digits, _ . + -; no path parts): outputs go to <run_dir>/<name>"),
    )
    seed: int = Field(
        0,
        description=_d(
            "the run seed: prompt sampling, the task's held-out problems, and (unless set per org) each org's seed"
        ),
    )
    run_dir: str = Field("runs", description="folder that holds the run folder <run_dir>/<name>")
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="the update rule: HACPO or a baseline"
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="each org's local update")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="each org's sampling")
    task: TaskConfig = Field(default_factory=TaskConfig, description="the prompts and their verifier")
    orgs: list[OrgConfig] = Field(min_length=1, description="the organizations, each with its own model")
    federation: FederationConfig = Field(default_factory=FederationConfig, description="the round loop")
    security: SecurityConfig = Field(default_factory=SecurityConfig, description="trust between the organizations")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases logging (optional)")

    @model_validator(mode="after")
    def _unique_orgs(self) -> RunConfig:
        ids = [o.id for o in self.orgs]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate org ids: {dupes}")
        if self.federation.min_orgs > len(self.orgs):
            raise ValueError(f"federation.min_orgs={self.federation.min_orgs} exceeds the {len(self.orgs)} orgs")
        _check_asynchronous(self)
        if self.federation.transport == "inprocess":
            refuse_emulated_slowdown(self, "federation.transport=inprocess")
        for org in self.orgs:  # per-org overrides must name real fields with valid values
            org_trainer(self, org.id)
            org_generation(self, org.id)
        return self

    def org(self, org_id: str) -> OrgConfig:
        for o in self.orgs:
            if o.id == org_id:
                return o
        raise KeyError(f"no org {org_id!r} in config (orgs: {[o.id for o in self.orgs]})")


def _deep_update(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in recursively (nested dicts merge; other values replace)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_update(out[key], value)
        else:
            out[key] = value
    return out


def _merged(base: _Section, overrides: dict[str, Any], where: str) -> Any:
    data = _deep_update(base.model_dump(), overrides)
    try:
        return type(base).model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, prefix=where, header="")) from None


def _check_asynchronous(cfg: RunConfig) -> None:
    """What asynchronous rounds (``federation.staleness >= 1``) need in this slice of the driver; each
    refusal names its field (docs/ALGORITHM.md "Asynchronous rounds")."""
    fed = cfg.federation
    for name in ("virtual_step_s", "virtual_dies", "virtual_rejoins"):
        unknown = sorted(set(getattr(fed, name)) - {o.id for o in cfg.orgs})
        if unknown:
            raise ValueError(f"federation.{name} names orgs not in the run: {unknown}")
    late = {o: t for o, t in fed.virtual_rejoins.items() if not t > fed.virtual_dies.get(o, math.inf)}
    if late:
        raise ValueError(f"federation.virtual_rejoins: an org rejoins only after its virtual_dies second, got {late}")
    if fed.staleness == 0:
        if fed.window is not None and fed.window != 1:
            raise ValueError(f"federation.window={fed.window} needs federation.staleness >= 1 (K = 0: W = 1)")
        if fed.virtual_dies:
            raise ValueError("federation.virtual_dies needs federation.staleness >= 1 (the asynchronous driver)")
        return
    needs = {
        "federation.protocol: fused": fed.protocol == "fused",
        "federation.min_orgs: 1 (each org steps alone)": fed.min_orgs == 1,
        "security.encrypt: false (coordinator-blind capability and accusations assume one round per update)": (
            not cfg.security.encrypt
        ),
        "trainer.outcome_guard.enabled: false (its rollback assumes one round per update)": not any(
            org_trainer(cfg, o.id).outcome_guard.enabled for o in cfg.orgs
        ),
    }
    for need, ok in needs.items():
        if not ok:
            raise ValueError(f"federation.staleness={fed.staleness} (asynchronous rounds) needs {need}")


def refuse_emulated_slowdown(cfg: RunConfig, transport: str) -> None:
    """ConfigError naming ``orgs[i].emulate_slowdown`` for an org slowed for real (> 1), called where ``transport``
    (as the caller names it: ``federation.transport=inprocess``, ``--transport inprocess``, ``the Flower
    simulation``) builds every worker in one process: the slowdown paces a ``hacrl-fed worker`` process
    (:mod:`hacrl_fed.worker.pacing`); in process the virtual clock's ``federation.virtual_step_s`` does this."""
    for i, org in enumerate(cfg.orgs):
        if org.emulate_slowdown != 1.0:
            raise ConfigError(
                f"orgs[{i}].emulate_slowdown={org.emulate_slowdown:g} (org {org.id!r}) slows the org's hacrl-fed "
                f"worker process, but {transport} builds every worker in this process: use "
                "federation.virtual_step_s there (or federation.transport: grpc for real worker processes)"
            )


def config_hash(
    cfg: RunConfig,
    *,
    exclude: Collection[str] = ("run_dir",),
    relative_to: Path | None = None,
    digits: int = 8,
    exclude_defaults: bool = False,
) -> str:
    """The project's one config hash: the first ``digits`` hex digits of SHA-256 over the config as sorted JSON.

    ``exclude`` names top-level fields left out (``run_dir`` by default: where a run lives is not what it is);
    with ``relative_to``, absolute ``orgs[].model.path`` / ``.tokenizer`` under that folder are written relative to
    it, so the same config hashes alike in every checkout (the benchmark's cells). ``exclude_defaults``: only the
    fields whose value differs from the schema's default (the benchmark's cells: a field added later with a
    default leaves their hash alone; what the code does with a default is tracked by the commit a cell ran on).
    """
    data = cfg.model_dump(mode="json", exclude=set(exclude), exclude_defaults=exclude_defaults)
    if relative_to is not None:
        for org in data.get("orgs", []):
            for key in ("path", "tokenizer"):
                value = org.get("model", {}).get(key)
                if value and Path(value).is_absolute():
                    try:
                        org["model"][key] = str(Path(value).relative_to(relative_to))
                    except ValueError:
                        pass
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:digits]


def org_trainer(cfg: RunConfig, org_id: str) -> TrainerConfig:
    """The run's trainer section with the org's ``trainer`` overrides applied."""
    return _merged(cfg.trainer, cfg.org(org_id).trainer, f"orgs[{org_id}].trainer")


def org_generation(cfg: RunConfig, org_id: str) -> GenerationConfig:
    """The run's generation section with the org's ``generation`` overrides applied."""
    return _merged(cfg.generation, cfg.org(org_id).generation, f"orgs[{org_id}].generation")


def _format_errors(err: ValidationError, prefix: str = "", header: str = "invalid config: ") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if prefix:
            loc = f"{prefix}.{loc}" if loc else prefix
        cause = (e.get("ctx") or {}).get("error")
        msg = str(cause) if e["type"] == "value_error" and cause is not None else e["msg"]
        lines.append(f"{loc}: {msg}" if loc else msg)  # cross-field checks name their fields themselves
    return header + "; ".join(lines)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


_OVERRIDE_SPLIT = re.compile(r"[\s,]+(?=[A-Za-z_][\w.-]*=)")


def parse_overrides(items: list[str] | str | None) -> dict[str, Any]:
    """``["federation.rounds=3", "trainer.lr=1e-5"]`` (or one space/comma-separated string) → dotted dict.

    Values are parsed as YAML scalars, so ``3`` is an int and ``true`` a bool.
    """
    if not items:
        return {}
    if isinstance(items, str):  # split only before the next "key=", so values like [1, 2] stay whole
        items = [p for p in _OVERRIDE_SPLIT.split(items.strip()) if p]
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        try:
            out[key] = load_unique(raw)
        except DuplicateKey as err:
            raise ConfigError(f"override {key!r}: {err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"override {key!r}: value {raw!r} is not a YAML scalar or list: {err}") from None
    return out


def load_config(source: str | Path | dict[str, Any], overrides: dict[str, Any] | list[str] | None = None) -> RunConfig:
    """Load and validate a run config from a YAML path (or an already-parsed dict).

    ``overrides`` are dotted keys applied before validation (``{"federation.rounds": 3}``).
    Raises :class:`ConfigError` whose message names every bad field (``trainer.lr: ...``).
    """
    if isinstance(source, dict):
        data = copy.deepcopy(source)  # overrides write into nested sections: never the caller's
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = load_unique(path.read_text()) or {}  # e.g. security.roster listing one org twice is refused
        except DuplicateKey as err:
            raise ConfigError(f"{path}: {err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def report_error(prog: str, err: BaseException, *, log_dir: str | Path | None = None) -> int:
    """Report a configuration or build-time error the way every command does; returns the exit code, 2.

    One line on stderr, ``<prog>: error: <message> (traceback in <file>)``: the message names the field or the
    file (and line). The traceback goes to ``<log_dir>/error.log`` when ``log_dir`` is an existing folder (a run
    dir), else to a new file in the temp folder.
    """
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    path: Path | None = None
    try:
        if log_dir is not None and Path(log_dir).is_dir():
            path = Path(log_dir) / ERROR_LOG
            path.write_text(text)
        else:
            slug = re.sub(r"[^A-Za-z0-9]+", "-", prog).strip("-") or "hacrl-fed"
            fd, name = tempfile.mkstemp(prefix=f"{slug}-error-", suffix=".log")
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            path = Path(name)
    except OSError:  # nowhere to keep it: the one line still says what is wrong
        path = None
    message = " ".join(str(err).split()) or type(err).__name__
    where = f" (traceback in {path})" if path is not None else ""
    print(f"{prog}: error: {message}{where}", file=sys.stderr, flush=True)
    return 2
