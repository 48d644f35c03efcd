"""Generation engine interface: sample responses and report the source's temperature-1 token log-probs.

A :class:`Generation` is exactly what docs/ALGORITHM.md "What an org publishes" needs from the sampler: decoded text
(special tokens skipped, no trailing EOS), ``finish_reason``, and per-token log-probs under the generating
(pre-update) weights at temperature 1 (whatever the sampling temperature), with the EOS token counted iff the
response stopped on it. Prompts arrive already rendered with the agent's chat template and are encoded with
``add_special_tokens=False`` (as :mod:`hacrl_fed.scoring` does), so generation and scoring see the same ids.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

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


def stop_token_ids(tokenizer, model=None) -> frozenset[int]:
    """Ids that end a response: the tokenizer's EOS plus the model's ``generation_config.eos_token_id`` (if any).

    Chat models often end a turn with a token listed only in ``generation_config`` (e.g. Llama 3's ``<|eot_id|>``).
    """
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if source is None:
            continue
        ids.update(int(x) for x in (source if isinstance(source, (list, tuple)) else [source]))
    if not ids:
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


_REGISTRY: dict[str, Callable[..., GenerationEngine]] = {}


def register_engine(name: str, factory: Callable[..., GenerationEngine]) -> None:
    """Register ``factory(model, tokenizer, **opts)`` under ``name``."""
    _REGISTRY[name] = factory


def build_engine(name: str, model, tokenizer, **opts) -> GenerationEngine:
    """Build the engine registered as ``name`` (``"hf"``, ``"vllm"``) for ``model`` and ``tokenizer``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown generation engine {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name](model, tokenizer, **opts)
