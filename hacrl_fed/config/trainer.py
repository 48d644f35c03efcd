"""The ``trainer`` section: each org's local update, with the learner's own choices about foreign rows (which it
trains on, its likelihood screen, its outcome guard) and its LoRA adapters; an org may override any field under
``orgs[].trainer``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hacrl_fed.config.section import _d, _registered, _Section


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
            "foreign row: the paper) or peer_sample (whole sources in a seeded order until the budget is full; the "
            "sources it does not reach are not screened)"
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
    margin_nats: float = Field(
        4.0,
        ge=0,
        description=_d(
            "a foreign row is dropped when its learner log-prob per UTF-8 byte of the response is below the minimum "
            "of the learner's own rows of the same prompt minus this margin (nats per byte: comparable across "
            "tokenizers)"
        ),
    )
    claim_z: float = Field(
        8.0,
        gt=0,
        description=_d(
            "a foreign row is dropped when its claimed-minus-learner gap per unit is more than claim_z robust "
            "standard deviations (plus 0.5 nats/unit of slack) from the source's running center"
        ),
    )


class OutcomeGuardConfig(_Section):
    """The learner's outcome guard (docs/ALGORITHM.md "Outcome guard", SECURITY.md): a private validation split,
    rollback to the best validated weights and quarantine of the sources trained on since then."""

    enabled: bool = Field(
        True,
        description=_d(
            "validate this learner's greedy accuracy on a private split of its task on a schedule; on a significant "
            "regression against its best validated weights, roll back to them and quarantine the sources trained on "
            "since, counted as outcome/<source>/... (on by default: the defence that bounds a member's harm where "
            "peers share a tokenizer; its time and memory: BENCHMARKS.md, the guard at a fraction of its cost; off: "
            "trusted peers, or an org sharded over ranks > 1)"
        ),
    )
    every: int = Field(4, ge=1, description=_d("validate after every this many rounds' updates (and the last round's)"))
    val_size: int = Field(
        400,
        ge=8,
        description=_d(
            "prompts of the private validation split, drawn with the org's seed from the train split: the most a "
            "check reads (the sequential test stops earlier when the answer is clear; look, futility)"
        ),
    )
    look: int = Field(
        50,
        ge=1,
        description=_d("prompts the guard's sequential test reads between two looks (docs/ALGORITHM.md)"),
    )
    futility: float = Field(
        0.01,
        ge=0,
        lt=1,
        description=_d(
            "a check stops reading when the chance that its test's bar is passed at the budget, on the trend of the "
            "prompts read, is below this (0: always read the whole split)"
        ),
    )
    z: float = Field(2.5, gt=0, description=_d("a regression: lost - gained > z * sqrt(lost + gained) (McNemar)"))
    margin: int = Field(2, ge=0, description=_d("and lost - gained > margin (prompts)"))
    probation: int = Field(8, ge=1, description=_d("rounds a source is left out after its first strike"))
    backoff: float = Field(2.0, ge=1, description=_d("each further strike multiplies the source's quarantine by this"))
    counterfactual: bool = Field(
        True,
        description=_d(
            "also train a shadow of this learner on its own rows alone (the learner's own samples, importance "
            "weighted) and validate it every `every` rounds and the last: significantly worse than the shadow, the "
            "learner takes the shadow's weights and strikes the sources trained since; worse by more than last_z "
            "standard deviations at the last round, it takes them without a strike"
        ),
    )
    importance_clip: float = Field(
        2.0,
        gt=0,
        description=_d(
            "the shadow's weight of a learner's own row, exp(lbar_shadow - lbar_learner) (GSPO's sequence ratio), is "
            "truncated at this value"
        ),
    )
    final_size: int = Field(
        1000,
        ge=1,
        description=_d(
            "prompts of a second private split of the train split (apart from the validation split) on which the last "
            "round's choice between the learner and its shadow is made: no earlier decision selected weights on it, "
            "and it is larger"
        ),
    )
    last_z: float = Field(
        1.0,
        gt=0,
        description=_d(
            "the counterfactual's bar at the last round: adopt the shadow when lost - gained > last_z * sqrt(lost + "
            "gained) on the split"
        ),
    )


class TrainerConfig(_Section):
    """The local update of each org (hacrl_fed/trainer.py); an org may override any field under orgs[].trainer."""

    removed_fields = {
        "skip_no_gradient_rows": "only the rows the loss has a gradient for run forward and backward, always "
        "(docs/ALGORITHM.md 'Loss and update schedule')",
        "forward": "the update takes the hand-written forward wherever it applies, else the model's own "
        "(hacrl_fed/models/native.py)",
    }

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
        json_schema_extra={"absent_means": {"enabled": False}},  # a stored config from before the guard ran without it
    )
