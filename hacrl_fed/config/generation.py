"""The ``generation`` section: the engine each org samples with, and its sampling and memory settings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from hacrl_fed.config.section import _d, _Section


class GenerationConfig(_Section):
    """How each org samples its rollouts and answers evaluations; an org may override any field under
    orgs[].generation."""

    removed_fields = {
        "enforce_eager": "set it in generation.vllm_kwargs (enforce_eager: true), like any vllm.LLM argument"
    }

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
    sleep_during_train: bool = Field(
        False, description=_d("vllm only: sleep(level=1) during each update (weights to CPU, KV cache freed)")
    )
    vllm_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description=_d("vllm only: extra vllm.LLM(...) arguments (e.g. enforce_eager: true, no CUDA graphs)"),
    )
