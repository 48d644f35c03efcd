"""Generation and evaluation of a sharded worker: the engine's work over the ranks, the same results as one process.

:class:`RankEngine` wraps the worker's engine (``hf`` or ``fast``; each rank's engine generates with the plain
replica that holds the whole weights, :mod:`hacrl_fed.sharded.trainer`):

* **greedy** (evaluation): the prompts in the engine's own batches of ``batch_size`` (the calls one process makes);
  rank ``r`` decodes batches ``r, r + N, ...`` and the ranks gather them back in order. Greedy decoding draws no
  random numbers and each batch is the one a single process decodes, so the result is the single process's.
* **generate** (sampling) with ``generation.seed_per_batch: true``: each engine batch is seeded on its own from
  the round's seed and its first sequence (:meth:`~hacrl_fed.engines.hf.HFEngine.sample_batch`), so rank ``r``
  samples batches ``r, r + N, ...`` and the ranks gather them in order: the rollouts are the single process's (with
  the same setting), whatever ``N``, in about ``1/N`` of the time when the round spans several batches.
* **generate** with ``seed_per_batch: false`` (the default): the engines draw every batch of a call from one random
  stream seeded once per call (:mod:`hacrl_fed.engines.hf`), so a later batch's samples depend on the draws of the
  batches before it and handing batches to different ranks would change the rollouts. Rank 0 then samples the
  whole call exactly as one process does and broadcasts the generations (the other ranks wait): the single
  process's rollouts, bit for bit, whatever ``N``.

An error on the rank doing the work (cancellation, a bad argument) is handed to every rank and raised there too,
so no rank is left waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from hacrl_fed.engines.base import Generation, GenerationEngine, sampling_prompts
from hacrl_fed.engines.hf import HFEngine, _seeded, sampling_kwargs
from hacrl_fed.sharded.fsdp import broadcast, gather, portable, world

T = TypeVar("T")


def _outcome(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return fn(), None
    except Exception as err:  # handed to every rank and raised there (module docstring)
        return None, portable(err)


def _raise_any(errors: list[BaseException | None]) -> None:
    for err in errors:
        if err is not None:
            raise err


class RankEngine(GenerationEngine):
    """``inner`` (this rank's engine over the whole-weight replica) shared out over the ranks (module doc)."""

    def __init__(self, inner: GenerationEngine) -> None:
        self.inner = inner
        self.rank, self.size = world()

    def generate(self, prompt_texts: list[str], **sampling: Any) -> list[list[Generation]]:
        if getattr(self.inner, "seed_per_batch", False):
            return self._generate_batches(prompt_texts, **sampling)
        result, err = None, None
        if self.rank == 0:
            result, err = _outcome(lambda: self.inner.generate(prompt_texts, **sampling))
        result, err = broadcast((result, err))
        _raise_any([err])
        assert result is not None
        return result

    def _generate_batches(
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
        """Sampling with one seed per engine batch: this rank's batches, gathered in order (module docstring)."""
        inner = self.inner
        assert isinstance(inner, HFEngine)
        prompts = sampling_prompts(
            inner.tokenizer,
            prompt_texts,
            num_samples=num_samples,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
        )
        flat = [p for p in prompts for _ in range(num_samples)]
        starts = list(range(0, len(flat), inner.batch_size))
        sampling = sampling_kwargs(temperature, top_p, top_k)

        def mine() -> dict[int, list[Generation]]:
            with _seeded(int(seed), inner._device()):
                return {
                    s: inner.sample_batch(flat, s, max_new_tokens, sampling, seed)
                    for s in starts[self.rank :: self.size]
                }

        parts = gather(_outcome(mine))
        _raise_any([e for _, e in parts])
        done: dict[int, list[Generation]] = {}
        for part, _ in parts:
            done.update(part or {})
        gens = [g for s in starts for g in done[s]]
        return [gens[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]

    def greedy(self, prompt_texts: list[str], *, max_new_tokens: int) -> list[Generation]:
        size = int(getattr(self.inner, "batch_size", len(prompt_texts)) or 1)
        chunks = [prompt_texts[s : s + size] for s in range(0, len(prompt_texts), size)]
        mine = {i: chunks[i] for i in range(self.rank, len(chunks), self.size)}
        done, err = _outcome(lambda: {i: self.inner.greedy(c, max_new_tokens=max_new_tokens) for i, c in mine.items()})
        parts = gather((done, err))
        _raise_any([e for _, e in parts])
        by_chunk: dict[int, list[Generation]] = {}
        for part, _ in parts:
            by_chunk.update(part or {})
        return [g for i in range(len(chunks)) for g in by_chunk[i]]

    def sync_weights(self, model) -> None:
        self.inner.sync_weights(model)

    @contextmanager
    def released(self) -> Iterator[None]:
        with self.inner.released():
            yield
