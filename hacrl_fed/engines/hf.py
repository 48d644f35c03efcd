"""Transformers ``generate()`` engine: batched sampling plus exact source log-probs.

Sampling: prompts (rendered text, encoded with ``add_special_tokens=False``) are repeated ``num_samples`` times,
left-padded and generated in calls of at most ``batch_size`` sequences, under ``torch.manual_seed(seed)`` inside a
forked RNG state (the global RNG is left untouched, and the same seed and ``batch_size`` give the same outputs).
With ``seed_per_batch=True`` (``generation.seed_per_batch``) each call of ``batch_size`` sequences is instead seeded
on its own with ``stable_seed(seed, "batch", first sequence)``, so a batch's samples do not depend on the batches
before it and the batches can be sampled anywhere, in any order (:meth:`HFEngine.sample_batch`; the sharded worker
hands them to its ranks, :mod:`hacrl_fed.sharded.generation`).
Only the requested sampling parameters apply: the model's own ``generation_config`` (repetition penalty, top-k
default, …) is swapped for a bare one during the call, so no hidden processor reshapes the distribution.

Source log-probs (temperature 1, eval mode) come from a recompute of prompt + response with
:func:`hacrl_fed.scoring.per_token_log_probs` — the same left-padding-aware, position-id-correct forward pass a
learner uses — so the published values equal a fresh score of the same ids. With ``logprobs_from_generation=True``
they are instead read from ``generate(output_logits=True)``: those are the *unprocessed* logits of each decoding
step (before temperature / top-k / top-p), so their log-softmax is the temperature-1 distribution for any sampling
parameters; it saves the recompute but keeps every step's ``[N, V]`` float32 logits in memory until the call
ends, and (KV-cache vs full forward) agrees with the recompute only to float round-off (~1e-6 in float32; looser
in bf16).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import GenerationConfig

from hacrl_fed.cancel import raise_if_cancelled
from hacrl_fed.engines.base import (
    Generation,
    GenerationEngine,
    decode_response,
    greedy_prompts,
    register_engine,
    sampling_prompts,
    split_response,
    stop_token_ids,
)
from hacrl_fed.scoring import build_scoring_batch_from_ids, per_token_log_probs
from hacrl_fed.seeding import stable_seed


class _PaddedStepWarningFilter(logging.Filter):
    """Drops transformers' "pass an attention_mask" warning: GPT-2 generation raises it on pad tokens appended
    after EOS in finished rows. We always pass the mask, and the published log-probs are checked against an
    explicit left-padding-aware recompute (tests), so the warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "passing in an `attention_mask`" not in record.getMessage()


logging.getLogger("transformers.modeling_utils").addFilter(_PaddedStepWarningFilter())


def sampling_kwargs(temperature: float, top_p: float, top_k: int) -> dict:
    """``generate()``'s sampling arguments: exactly the requested ones (module docstring)."""
    return dict(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block with every torch RNG seeded to ``seed``, restoring the previous RNG state afterwards."""
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@contextmanager
def _bare_generation(model) -> Iterator[None]:
    """Eval mode and an empty ``generation_config`` for the block (both restored afterwards)."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved_config, was_training = target.generation_config, model.training
    target.generation_config = GenerationConfig()
    model.eval()
    try:
        yield
    finally:
        target.generation_config = saved_config
        model.train(was_training)


def _logits_log_probs(
    step_logits: Sequence[torch.Tensor], new_ids: torch.Tensor, lengths: list[int]
) -> list[list[float]]:
    """Per-token log-probs from raw per-step logits (``step_logits[t]``: ``[N, V]``) at the generated ids ``[N, T]``."""
    cols = [
        step.float().log_softmax(-1).gather(-1, new_ids[:, t : t + 1].to(step.device)).squeeze(-1)
        for t, step in enumerate(step_logits)
    ]
    rows = torch.stack(cols, dim=1).cpu().tolist()
    return [row[:n] for row, n in zip(rows, lengths)]


class HFEngine(GenerationEngine):
    """``GenerationEngine`` over a transformers causal LM that the trainer updates in place.

    ``batch_size``: sequences per ``generate()`` call; ``score_batch_size``: rows per log-prob recompute
    (default ``batch_size``); ``logprobs_from_generation``: read log-probs from raw generation logits (module doc).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        batch_size: int = 64,
        score_batch_size: int | None = None,
        logprobs_from_generation: bool = False,
        seed_per_batch: bool = False,
        extra_stop_ids: Sequence[int] = (),
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if score_batch_size is not None and score_batch_size < 1:
            raise ValueError(f"score_batch_size must be >= 1, got {score_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.score_batch_size = score_batch_size or batch_size
        self.logprobs_from_generation = logprobs_from_generation
        self.seed_per_batch = seed_per_batch
        self.stop_ids = stop_token_ids(tokenizer, model, extra_stop_ids)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else min(self.stop_ids)

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
        prompts = sampling_prompts(
            self.tokenizer,
            prompt_texts,
            num_samples=num_samples,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
        )
        flat = [p for p in prompts for _ in range(num_samples)]
        sampling = sampling_kwargs(temperature, top_p, top_k)
        gens: list[Generation] = []
        with _seeded(int(seed), self._device()):
            for start in range(0, len(flat), self.batch_size):
                raise_if_cancelled("while generating")  # the caller is gone: stop between batches
                gens += self.sample_batch(flat, start, max_new_tokens, sampling, seed)
        return [gens[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]

    def sample_batch(
        self, flat: list[list[int]], start: int, max_new_tokens: int, sampling: dict, seed: int
    ) -> list[Generation]:
        """The call over sequences ``flat[start : start + batch_size]`` (prompt ids, one per sample), reseeded from
        ``(seed, start)`` first when ``seed_per_batch`` (module docstring); else it continues the call's stream."""
        if self.seed_per_batch:
            torch.manual_seed(stable_seed(int(seed), "batch", start))
        return self._run(flat[start : start + self.batch_size], max_new_tokens, sampling)

    def greedy(self, prompt_texts: list[str], *, max_new_tokens: int) -> list[Generation]:
        prompts = greedy_prompts(self.tokenizer, prompt_texts, max_new_tokens=max_new_tokens)
        gens: list[Generation] = []
        for start in range(0, len(prompts), self.batch_size):
            raise_if_cancelled("while evaluating")
            gens += self._run(prompts[start : start + self.batch_size], max_new_tokens, dict(do_sample=False))
        return gens

    def sync_weights(self, model) -> None:
        """The engine generates with the trainer's own model object, so there is nothing to copy; a different
        model object replaces the current one."""
        self.model = model

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _run(self, prompt_token_ids: list[list[int]], max_new_tokens: int, sampling: dict) -> list[Generation]:
        """One ``generate()`` call over ``prompt_token_ids`` (one sequence each) → one Generation per row."""
        batch = build_scoring_batch_from_ids(prompt_token_ids, [[] for _ in prompt_token_ids], self.pad_id).to(
            self._device()
        )
        with _bare_generation(self.model), torch.no_grad():
            out = self.model.generate(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                max_new_tokens=int(max_new_tokens),
                pad_token_id=self.pad_id,
                eos_token_id=sorted(self.stop_ids),
                return_dict_in_generate=True,
                output_logits=self.logprobs_from_generation,
                **sampling,
            )
        new_ids = out.sequences[:, batch.prompt_width :]
        cut = [split_response(row, self.stop_ids) for row in new_ids.tolist()]
        responses = [ids for ids, _ in cut]
        if self.logprobs_from_generation:
            token_log_probs = _logits_log_probs(out.logits, new_ids, [len(r) for r in responses])
        else:
            scoring = build_scoring_batch_from_ids(prompt_token_ids, responses, self.pad_id)
            token_log_probs = per_token_log_probs(self.model, scoring, self.score_batch_size)
        return [
            Generation(decode_response(self.tokenizer, ids, reason), reason, ids, lp)
            for (ids, reason), lp in zip(cut, token_log_probs)
        ]


register_engine("hf", HFEngine)
