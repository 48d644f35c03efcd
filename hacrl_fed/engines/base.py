"""Generation engine interface: sample responses and report the source's temperature-1 token log-probs.

A :class:`Generation` is exactly what docs/ALGORITHM.md "What an org publishes" needs from the sampler: decoded text
(special tokens skipped, no trailing EOS), ``finish_reason``, and per-token log-probs under the generating
(pre-update) weights at temperature 1 (whatever the sampling temperature), with the EOS token counted iff the
response stopped on it. Prompts arrive already rendered with the agent's chat template and are encoded with
``add_special_tokens=False`` (as :mod:`hacrl_fed.scoring` does), so generation and scoring see the same ids.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

from hacrl_fed.types import FINISH_LENGTH, FINISH_REASONS, FINISH_STOP


@dataclass
class Generation:
    """One sampled response.

    ``token_ids`` are the response ids (EOS included iff ``finish_reason == "stop"``); ``token_log_probs`` has one
    temperature-1 log-prob per id under the generating weights.
    """

    text: str
    finish_reason: str
    token_ids: list[int]
    token_log_probs: list[float]

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason={self.finish_reason!r}; expected one of {FINISH_REASONS}")
        if len(self.token_ids) != len(self.token_log_probs):
            raise ValueError(
                f"token_ids has {len(self.token_ids)} entries but token_log_probs has {len(self.token_log_probs)}"
            )

    @property
    def logprob_sum(self) -> float:
        """Σ token log-probs (exactly rounded sum)."""
        return math.fsum(self.token_log_probs)

    @property
    def token_count(self) -> int:
        return len(self.token_ids)


def check_sampling(*, num_samples: int, temperature: float, top_p: float, top_k: int, max_new_tokens: int) -> None:
    """Validate sampling arguments; raises ``ValueError`` naming the bad one."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def encode_prompts(tokenizer, prompt_texts: Sequence[str]) -> list[list[int]]:
    """Rendered prompts → token ids (``add_special_tokens=False``, module docstring); a single ``str`` (not a list)
    and a prompt that encodes to no tokens are errors naming it."""
    if isinstance(prompt_texts, str):
        raise TypeError("prompt_texts must be a list of strings, got a single str")
    ids = tokenizer(list(prompt_texts), add_special_tokens=False)["input_ids"] if prompt_texts else []
    for i, row in enumerate(ids):
        if not row:
            raise ValueError(f"prompt_texts[{i}] encodes to no tokens")
    return [list(r) for r in ids]


def sampling_prompts(
    tokenizer,
    prompt_texts: Sequence[str],
    *,
    num_samples: int,
    temperature: float,
    top_p: float,
    top_k: int,
    max_new_tokens: int,
) -> list[list[int]]:
    """The prologue of an engine's :meth:`GenerationEngine.generate`: the sampling arguments checked
    (:func:`check_sampling`), then the prompts encoded (:func:`encode_prompts`)."""
    check_sampling(
        num_samples=num_samples, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens
    )
    return encode_prompts(tokenizer, prompt_texts)


def greedy_prompts(tokenizer, prompt_texts: Sequence[str], *, max_new_tokens: int) -> list[list[int]]:
    """The prologue of an engine's :meth:`GenerationEngine.greedy`: ``max_new_tokens`` checked, prompts encoded."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return encode_prompts(tokenizer, prompt_texts)


def stop_token_ids(tokenizer, model=None, extra: Iterable[int] = ()) -> frozenset[int]:
    """Ids that end a response: the tokenizer's EOS plus every id of the model's ``generation_config.eos_token_id``
    (if any), plus ``extra`` (the org's prompt format's own stop ids, :mod:`hacrl_fed.models.prompting`).

    Chat models often end a turn with a token listed only in ``generation_config`` (e.g. Llama 3's ``<|eot_id|>``).
    """
    ids: set[int] = {int(x) for x in extra}
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if source is None:
            continue
        ids.update(int(x) for x in (source if isinstance(source, (list, tuple)) else [source]))
    if not ids - {int(x) for x in extra}:
        raise ValueError("no EOS token: the tokenizer has no eos_token_id and the model sets none")
    return frozenset(ids)


def split_response(new_ids: Iterable[int], stop_ids: frozenset[int]) -> tuple[list[int], str]:
    """Cut generated ids at the first stop token (kept) → ``(response_ids, finish_reason)``.

    Without a stop token every id is kept and the finish reason is ``"length"`` (anything generated after an EOS,
    i.e. padding, is dropped).
    """
    out: list[int] = []
    for tok in new_ids:
        out.append(int(tok))
        if out[-1] in stop_ids:
            return out, FINISH_STOP
    return out, FINISH_LENGTH


def decode_response(tokenizer, response_ids: Sequence[int], finish_reason: str) -> str:
    """Published text: ids without the trailing EOS, special tokens skipped, no whitespace clean-up."""
    ids = list(response_ids[:-1] if finish_reason == FINISH_STOP else response_ids)
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class GenerationEngine(ABC):
    """Samples responses for rendered prompts; results are ``[prompt][sample]``."""

    @abstractmethod
    def generate(
        self,
        prompt_texts: list[str],
        *,
        num_samples: int,
        temperature: float,
        top_p: float,
        top_k: int,
        max_new_tokens: int,
        seed: int,
    ) -> list[list[Generation]]:
        """``num_samples`` responses per prompt; the same ``seed`` (and engine settings) gives the same outputs."""

    @abstractmethod
    def greedy(self, prompt_texts: list[str], *, max_new_tokens: int) -> list[Generation]:
        """One greedy (argmax) response per prompt, e.g. for evaluation."""

    @abstractmethod
    def sync_weights(self, model) -> None:
        """Make the engine generate with ``model``'s current weights (call after every update)."""

    @contextmanager
    def released(self) -> Iterator[None]:
        """Context for a weight update: an engine that holds its own GPU memory may free it for the block (the
        vLLM engine sleeps at level 1 when configured). The default holds nothing and does nothing. Call
        :meth:`sync_weights` after the block."""
        yield


@dataclass(frozen=True)
class EngineOptions:
    """Engine settings derived from the run's ``generation`` section (:meth:`from_config`).

    :func:`build_engine` passes each field the engine's factory accepts as a keyword argument, so an engine
    ignores the fields it has no use for (the ``hf`` engine takes only ``batch_size``).
    """

    batch_size: int = 64  # sequences per generate() call (hf) / max concurrent sequences (vllm max_num_seqs)
    seed_per_batch: bool = False  # hf/fast: each generate() call seeded on its own (generation.seed_per_batch)
    seed: int = 0  # the org's seed (vllm: the engine seed; per-request seeds come from the plan)
    model_path: str | None = None  # where the engine loads the model from (vllm); default: the model's own path
    tokenizer_path: str | None = None  # where the engine loads the tokenizer from (vllm); default: model_path
    dtype: str | None = None  # engine weight dtype (vllm); default: the model's, bfloat16 when that is float32
    gpu_memory_utilization: float = 0.5  # vllm: fraction of the GPU the engine may reserve (weights + KV cache)
    max_model_len: int | None = None  # vllm: prompt + response tokens the KV cache is sized for; default: model's
    sleep_level: int = 0  # vllm: 1 = sleep(level=1) while the trainer updates (see GenerationEngine.released)
    llm_kwargs: dict[str, Any] = field(default_factory=dict)  # vllm: extra vllm.LLM(...) arguments
    extra_stop_ids: tuple[int, ...] = ()  # every engine: stop ids of the org's prompt format besides the EOS ids

    @classmethod
    def from_config(
        cls,
        gen,
        *,
        seed: int,
        model_path: str | None = None,
        tokenizer_path: str | None = None,
        extra_stop_ids: Iterable[int] = (),
    ) -> EngineOptions:
        """Options for an org from its (merged) :class:`hacrl_fed.config.GenerationConfig` ``gen``, its seed,
        the local sources of its model and tokenizer and its prompt format's stop ids."""
        return cls(
            batch_size=gen.batch_size,
            seed_per_batch=gen.seed_per_batch,
            seed=int(seed),
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            dtype=gen.dtype,
            gpu_memory_utilization=gen.gpu_memory_utilization,
            max_model_len=gen.max_model_len,
            sleep_level=1 if gen.sleep_during_train else 0,
            llm_kwargs=dict(gen.vllm_kwargs),
            extra_stop_ids=tuple(sorted(int(x) for x in extra_stop_ids)),
        )

    def kwargs_for(self, factory: Callable[..., Any]) -> dict[str, Any]:
        """The fields ``factory`` takes as keyword arguments (all of them if it takes ``**kwargs``)."""
        params = inspect.signature(factory).parameters.values()
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return values
        names = {
            p.name
            for p in params
            if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        }
        return {k: v for k, v in values.items() if k in names}


_REGISTRY: dict[str, Callable[..., GenerationEngine]] = {}


def register_engine(name: str, factory: Callable[..., GenerationEngine]) -> None:
    """Register ``factory(model, tokenizer, **opts)`` under ``name``."""
    _REGISTRY[name] = factory


def build_engine(name: str, model, tokenizer, options: EngineOptions | None = None, **opts) -> GenerationEngine:
    """Build the engine registered as ``name`` (``"hf"``, ``"vllm"``) for ``model`` and ``tokenizer``.

    ``options`` (normally :meth:`EngineOptions.from_config` of the org's generation section) are passed as the
    keyword arguments the engine accepts; ``opts`` are passed as given and win over ``options``.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown generation engine {name!r}; known: {sorted(_REGISTRY)}")
    factory = _REGISTRY[name]
    kwargs = options.kwargs_for(factory) if options is not None else {}
    return factory(model, tokenizer, **{**kwargs, **opts})
