"""Score a model on a task's held-out test split: greedy accuracy and pass@k, with the task's own verifier.

The prompts are the run's held-out set (test ids ``0 .. n-1``, as the coordinator's evaluations), rendered with the
model's own chat template, answered by the ``hf`` engine (:mod:`hacrl_fed.engines.hf`) and scored by
``task.verify`` (the verifier every org runs during training):

- ``eval/accuracy``: mean reward of one greedy answer per prompt (``eval_max_new_tokens`` tokens);
- ``eval/pass@1`` and ``eval/pass@{k}``: with ``k`` sampled answers per prompt, ``c`` of them correct (reward
  ≥ ``threshold``), the unbiased estimator ``pass@j = mean_prompts(1 - C(k-c, j) / C(k, j))`` (Chen et al.
  2021) for ``j = 1`` and ``j = k``;
- ``eval/mean_reward@{k}``: mean reward of the sampled answers; ``eval/prompts``, ``eval/samples``;
- ``eval/slice/<s>/accuracy`` and ``eval/slice/<s>/prompts``: the greedy accuracy per slice, for a task that labels
  its problems (:mod:`hacrl_fed.tasks.slices`; none otherwise).

The model is an exported folder (:mod:`hacrl_fed.export`) or a run's checkpoint; both go through
:func:`evaluate`, a function of ``(model, tokenizer, task)`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hacrl_fed.config import BuildError
from hacrl_fed.tasks.slices import slice_labels, slice_metrics


@dataclass(frozen=True)
class EvalSettings:
    """How :func:`evaluate` samples: ``n`` held-out prompts, ``k`` samples each at ``temperature`` / ``top_p`` /
    ``top_k``, ``max_new_tokens`` per answer, ``seed`` for the sampling, ``threshold`` for a correct answer."""

    n: int = 200
    k: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    seed: int = 0
    threshold: float = 1.0
    batch_size: int = 64
    prompt_format: str = "auto"  # the org's model.prompt_format / model.few_shot (hacrl_fed.models.prompting)
    few_shot: int = 0


def pass_at(n: int, c: int, j: int) -> float:
    """Unbiased pass@j of one prompt with ``c`` correct among ``n`` samples: ``1 - C(n-c, j) / C(n, j)``."""
    if not 0 <= c <= n or not 1 <= j <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= j <= n, got n={n}, c={c}, j={j}")
    if n - c < j:
        return 1.0
    return 1.0 - math.comb(n - c, j) / math.comb(n, j)


def evaluate(model: Any, tokenizer: Any, task: Any, settings: EvalSettings) -> dict[str, float]:
    """The metrics of the module docstring for ``model`` on ``task``'s first ``settings.n`` test prompts."""
    from hacrl_fed.engines import build_engine
    from hacrl_fed.models.prompting import prompt_style
    from hacrl_fed.plan.sampler import eval_ids

    s = settings
    if s.n < 1 or s.k < 1:
        raise BuildError(f"--n and --k must be >= 1, got n={s.n}, k={s.k}")
    prompts = task.prompts("test", eval_ids(task.size("test"), s.n))
    style = prompt_style(tokenizer, task, prompt_format=s.prompt_format, few_shot=s.few_shot)
    texts = [style.render(tokenizer, p.messages) for p in prompts]
    engine = build_engine("hf", model, tokenizer, batch_size=s.batch_size, extra_stop_ids=style.stop_ids)
    greedy = engine.greedy(texts, max_new_tokens=s.max_new_tokens)
    greedy_rewards = [float(task.verify(g.text, p.reference)) for g, p in zip(greedy, prompts)]
    samples = engine.generate(
        texts,
        num_samples=s.k,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_new_tokens=s.max_new_tokens,
        seed=s.seed,
    )
    sampled = [[float(task.verify(g.text, p.reference)) for g in row] for row, p in zip(samples, prompts)]
    correct = [sum(r >= s.threshold for r in row) for row in sampled]
    count = len(prompts)
    out = {
        "eval/prompts": float(count),
        "eval/samples": float(s.k),
        "eval/accuracy": sum(greedy_rewards) / count,
        "eval/pass@1": sum(pass_at(s.k, c, 1) for c in correct) / count,
        f"eval/pass@{s.k}": sum(pass_at(s.k, c, s.k) for c in correct) / count,
        f"eval/mean_reward@{s.k}": sum(map(sum, sampled)) / (count * s.k),
    }
    labels = slice_labels(task, "test", [p.prompt_id for p in prompts])
    out.update({f"eval/{key}": v for key, v in slice_metrics(labels, greedy_rewards).items()})  # sliced tasks only
    return out


def load_exported(folder: str, device: str = "auto") -> tuple[Any, Any]:
    """``(model, tokenizer)`` of an exported (or any local transformers) folder, as a worker loads one."""
    from pathlib import Path

    from hacrl_fed.config import ModelConfig
    from hacrl_fed.models.loading import load_model_and_tokenizer

    if not Path(folder).is_dir():
        raise BuildError(f"model: no such folder: {folder}")
    return load_model_and_tokenizer(ModelConfig(path=str(folder), device=device), for_training=False)
