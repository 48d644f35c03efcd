"""Typed run configuration (pydantic), loaded from YAML by :func:`load_config`.

Every section forbids unknown keys, so a typo fails loudly with the dotted field name (``trainer.lr``).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A configuration problem; the message names the offending field(s)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # no inf/nan anywhere


class AlgorithmConfig(_Section):
    """docs/ALGORITHM.md parameters plus the baselines' (``grpo``/``gspo``/``naive``)."""

    name: Literal["hacpo", "gspo", "grpo", "naive"] = "hacpo"
    self_clip_low: float = Field(3e-4, ge=0, lt=1)
    self_clip_high: float = Field(4e-4, ge=0)
    cross_clip_delta: float = Field(0.2, ge=0, le=1)
    cross_clip_step: float = Field(0.025, ge=0)
    alpha: float = Field(1.0, ge=0)
    max_abs_log_ratio: float = Field(10.0, gt=0)
    grpo_clip_low: float = Field(0.2, ge=0, lt=1)
    grpo_clip_high: float = Field(0.28, ge=0)
    reward_max: float = Field(1.0, gt=0)
    capability_window: int = Field(5, ge=1)
    capability_floor: float = Field(1e-8, gt=0)
    ratio_min: float = Field(0.1, gt=0)
    ratio_max: float = Field(10.0, gt=0)
    warmup_rounds: int = Field(0, ge=0)
    kl_beta: float = Field(0.0, ge=0)
    adv_eps: float = Field(1e-6, gt=0)

    @model_validator(mode="after")
    def _ratio_bounds(self) -> "AlgorithmConfig":
        if self.ratio_min > self.ratio_max:
            raise ValueError("ratio_min must be <= ratio_max")
        return self


class LoraConfig(_Section):
    enabled: bool = False
    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | str = "all-linear"


class TrainerConfig(_Section):
    lr: float = Field(2e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    epochs: int = Field(1, ge=1)
    minibatch_size: int = Field(128, ge=1)  # sequences per optimizer step
    micro_batch_size: int = Field(32, ge=1)  # sequences per forward/backward (memory bound)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    # Numerics of the update (hacrl_fed/trainer.py):
    #   model          weights, grads and AdamW states in the dtype the model was loaded with (model.dtype; note
    #                  that dtype auto is bfloat16 on CUDA, where pure-bf16 AdamW drops small updates)
    #   bf16-autocast  float32 weights and AdamW states, forward/backward under torch.autocast(bfloat16)
    #                  (needs model.dtype: float32)
    #   bf16-master    bfloat16 weights and grads on the model (what the hf engine generates with), plus a float32
    #                  master copy of the weights and float32 AdamW states kept by the trainer (needs model.dtype:
    #                  bfloat16); checkpoints keep the master copy
    precision: Literal["model", "bf16-autocast", "bf16-master"] = "model"
    # recompute each decoder layer's activations during backward: activation memory ~1/num_layers, ~30% slower
    gradient_checkpointing: bool = False


class GenerationConfig(_Section):
    engine: Literal["hf", "vllm"] = "hf"
    num_samples: int = Field(8, ge=1)  # G
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(64, ge=1)
    eval_max_new_tokens: int = Field(64, ge=1)
    batch_size: int = Field(64, ge=1)  # sequences per generate() call
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)  # vllm only
    max_model_len: int | None = Field(None, ge=1)  # vllm only: prompt + response tokens per sequence; None = model's
    dtype: Literal["bfloat16", "float16"] | None = None  # vllm only: engine weights; None = model's (fp32 -> bf16)
    enforce_eager: bool = False  # vllm only: no CUDA graphs (faster start, less memory, slower decoding)
    sleep_during_train: bool = False  # vllm only: sleep(level=1) during each update (weights to CPU, KV freed)
    vllm_kwargs: dict[str, Any] = Field(default_factory=dict)  # vllm only: extra vllm.LLM(...) arguments


class TaskConfig(_Section):
    """``name`` picks a task from the registry; ``params`` are validated by that task's own model."""

    name: str = "arithmetic"
    params: dict[str, Any] = Field(default_factory=dict)
    eval_size: int = Field(200, ge=1)


class ModelConfig(_Section):
    """Exactly one of ``zoo`` (a built-in tiny agent name) or ``path`` (local dir or hub id)."""

    zoo: str | None = None
    path: str | None = None
    tokenizer: str | None = None  # defaults to the model path
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if (self.zoo is None) == (self.path is None):
            raise ValueError("set exactly one of 'zoo' or 'path'")
        return self


class OrgConfig(_Section):
    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    model: ModelConfig
    seed: int | None = None  # defaults to the run seed mixed with the org id
    trainer: dict[str, Any] = Field(default_factory=dict)  # per-org overrides of the run's trainer section
    generation: dict[str, Any] = Field(default_factory=dict)  # per-org overrides of generation


class FederationConfig(_Section):
    rounds: int = Field(100, ge=1)
    prompts_per_round: int = Field(16, ge=1)  # B
    eval_every: int = Field(10, ge=0)  # 0 = only before and after
    min_orgs: int = Field(1, ge=1)
    round_timeout_s: float = Field(600.0, gt=0)
    transport: Literal["inprocess", "grpc", "flower"] = "inprocess"
    checkpoint_every: int = Field(0, ge=0)  # 0 = only at the end
    max_failed_rounds: int = Field(3, ge=1)  # consecutive rounds below min_orgs before the run aborts
    max_message_mb: int = Field(256, ge=1)


class SecurityConfig(_Section):
    """Trust between organizations (SECURITY.md).

    ``signing``: every RolloutBatch is signed by its org (Ed25519) and verified by the coordinator and by every
    receiving worker against the pinned roster. ``roster_file`` / ``roster`` pin ``org id -> public identity``
    (``hacrl-fed keys`` writes both the roster and each org's private identity file); ``identity_file`` is where
    a worker finds its own private identity (``{org}`` is replaced by the org id). With neither roster set, a
    run on one machine provisions a fresh key set under ``<run dir>/keys/`` (every key on one machine: it proves
    the plumbing, not trust between separate organizations).
    ``encrypt``: coordinator-blind mode; rollout text is sealed end to end for the other orgs.
    ``max_mismatch_rate``: an org whose share of rollouts with a claimed reward that re-verification contradicts
    exceeds this in one round is excluded from the pool for the rest of the run.
    ``max_round_step``: how far ahead of its last trained round a worker accepts a plan.
    ``max_bytes_per_token``: response text may hold at most ``max_new_tokens`` times this many UTF-8 bytes.
    """

    signing: bool = True
    encrypt: bool = False
    roster_file: str | None = None
    roster: dict[str, str] = Field(default_factory=dict)  # org id -> "ed25519:<b64> x25519:<b64>"
    identity_file: str | None = None  # e.g. keys/identity/{org}.key
    reverify_rewards: bool = True
    max_mismatch_rate: float = Field(0.1, ge=0, le=1)
    max_round_step: int = Field(1000, ge=1)
    max_bytes_per_token: int = Field(32, ge=4)

    @model_validator(mode="after")
    def _consistent(self) -> "SecurityConfig":
        if self.roster and self.roster_file:
            raise ValueError("set at most one of 'roster' and 'roster_file'")
        if self.encrypt and not self.signing:
            raise ValueError("encrypt needs signing (encrypt-then-sign)")
        if self.encrypt and not self.reverify_rewards:
            raise ValueError("encrypt needs reverify_rewards (capability comes from receivers' verification)")
        return self


class RunConfig(_Section):
    name: str = Field("run", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # no path parts
    seed: int = 0
    run_dir: str = "runs"
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    orgs: list[OrgConfig] = Field(min_length=1)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)

    @model_validator(mode="after")
    def _unique_orgs(self) -> "RunConfig":
        ids = [o.id for o in self.orgs]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate org ids: {dupes}")
        if self.federation.min_orgs > len(self.orgs):
            raise ValueError(f"federation.min_orgs={self.federation.min_orgs} exceeds the {len(self.orgs)} orgs")
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
            out[key] = yaml.safe_load(raw)
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
            data = yaml.safe_load(path.read_text()) or {}
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
