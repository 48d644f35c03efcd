"""``reasoning-gym``: an adapter to the optional ``reasoning_gym`` package's procedural datasets and scorers.

The package is imported only when the task is built; without it the build raises ImportError telling how
to install it. ``dataset`` and ``config`` go to ``reasoning_gym.create_dataset(dataset, seed=..., size=...,
**config)``. The train and test datasets use two seeds derived from ``seed`` (the task seed when unset);
train entries whose question also occurs in the test set are dropped, so ``size("train") <= size``.

The reference is JSON ``{"answer": ..., "metadata": ...}`` so the verifier can call the dataset's own
``score_answer(answer, entry)``; the response's answer is its last ``<answer>...</answer>`` (else the whole
stripped response). Rewards are clamped to ``[0, 1]``; scorer errors give 0.0.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from hacrl_fed.tasks.base import Task, TaskParams, check_split, register_task, stable_hash
from hacrl_fed.types import ChatMessage, Prompt

INSTALL_HINT = "pip install 'hacrl-fed[reasoning-gym]'"
DEFAULT_SYSTEM_PROMPT = "Think step by step, then give only the final answer inside <answer></answer> tags."
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ReasoningGymParams(TaskParams):
    dataset: str = Field(min_length=1)
    size: int = Field(1000, ge=1)  # train entries generated (collisions with test removed)
    test_size: int = Field(100, ge=1)
    seed: int | None = None  # defaults to the task seed
    config: dict[str, Any] = Field(default_factory=dict)  # extra create_dataset kwargs
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT


def import_reasoning_gym() -> Any:
    """The ``reasoning_gym`` module, or ImportError with the install command."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError(
            f"task 'reasoning-gym' needs the optional package 'reasoning_gym', which is not installed: {INSTALL_HINT}"
        ) from err
    return reasoning_gym


def extract_tagged_answer(response: str) -> str:
    """Content of the last ``<answer>...</answer>`` (stripped), else the whole stripped response."""
    matches = list(_ANSWER_TAG_RE.finditer(response))
    return (matches[-1].group(1) if matches else response).strip()


@register_task("reasoning-gym")
class ReasoningGymTask(Task):
    """See the module docstring."""

    Params = ReasoningGymParams
    in_memory = True
    params: ReasoningGymParams

    def __init__(self, params: ReasoningGymParams, seed: int = 0) -> None:
        super().__init__(params, seed)
        rg = import_reasoning_gym()
        base = self.seed if params.seed is None else params.seed
        test_ds = self._create(rg, stable_hash("rg-test", base) % 2**31, params.test_size)
        train_ds = self._create(rg, stable_hash("rg-train", base) % 2**31, params.size)
        test = [test_ds[i] for i in range(len(test_ds))]
        test_qs = {e["question"] for e in test}
        train = [e for e in (train_ds[i] for i in range(len(train_ds))) if e["question"] not in test_qs]
        if not train:
            raise ValueError(f"task.params.size: every train entry of {params.dataset!r} is also a test entry")
        self._entries = {"train": train, "test": test}
        self._scorer = train_ds

    def _create(self, rg: Any, seed: int, size: int) -> Any:
        p = self.params
        try:
            return rg.create_dataset(p.dataset, seed=seed, size=size, **p.config)
        except Exception as err:
            raise ValueError(
                f"task.params.dataset/config: reasoning_gym.create_dataset({p.dataset!r}, **{p.config!r}) "
                f"failed: {type(err).__name__}: {err}"
            ) from None

    def size(self, split: str) -> int:
        return len(self._entries[check_split(split)])

    def prompts(self, split: str, ids: Sequence[int]) -> list[Prompt]:
        out = []
        for i in self.check_ids(split, ids):
            e = self._entries[split][i]
            msgs: tuple[ChatMessage, ...] = (ChatMessage("user", e["question"]),)
            if self.params.system_prompt:
                msgs = (ChatMessage("system", self.params.system_prompt),) + msgs
            ref = json.dumps({"answer": e["answer"], "metadata": e.get("metadata", {})}, default=str)
            out.append(Prompt(prompt_id=i, messages=msgs, reference=ref))
        return out

    def verify(self, response: str, reference: str) -> float:
        try:
            entry = json.loads(reference)
            if not isinstance(entry, dict) or "answer" not in entry:
                entry = {"answer": reference, "metadata": {}}
        except (ValueError, TypeError):
            entry = {"answer": reference, "metadata": {}}
        try:
            score = float(self._scorer.score_answer(extract_tagged_answer(response), entry))
        except Exception:  # a dataset scorer choking on odd text: no reward
            return 0.0
        return min(max(score, 0.0), 1.0) if score == score else 0.0

    def sft_target(self, split: str, prompt_id: int) -> str:
        """The oracle answer in answer tags (reasoning_gym has no worked solutions)."""
        (i,) = self.check_ids(split, [prompt_id])
        return f"<answer>{self._entries[split][i]['answer']}</answer>"
