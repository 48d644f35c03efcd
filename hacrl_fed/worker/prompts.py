"""A policy worker's prompts: rendered in its own style (chat template or completion format,
:mod:`hacrl_fed.models.prompting`), checked against its own copy of the task, and
fitted to its model's context (:mod:`hacrl_fed.models.context`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hacrl_fed.models.chat import render_prompt
from hacrl_fed.models.context import check_task_fits, fits
from hacrl_fed.models.prompting import PromptStyle
from hacrl_fed.types import Prompt
from hacrl_fed.worker.guard import RequestRefused

log = logging.getLogger(__name__)


class PromptBook:
    """Renders (cached), checks and fits one org's prompts (``context``: its model's context, None: unbounded);
    ``style``: the org's :class:`PromptStyle` (None: the chat template as it renders)."""

    def __init__(self, org_id: str, task: Any, tokenizer: Any, style: PromptStyle | None = None) -> None:
        self.org_id, self.task, self.tokenizer, self.style = org_id, task, tokenizer, style
        self._cache: dict[tuple[int, tuple], str] = {}

    def check_fits(self, context: int | None, source: str, gen: Any, eval_ids: Sequence[int]) -> None:
        """The task's prompts plus ``gen``'s token budgets fit the context (``source`` names where it comes from):
        checked at start-up where known, guarded per call (:meth:`fitting`)."""
        check_task_fits(
            self.org_id,
            self.task,
            self.tokenizer,
            self.render,
            context,
            source,
            max_new_tokens=gen.max_new_tokens,
            eval_max_new_tokens=gen.eval_max_new_tokens,
            eval_ids=eval_ids,
        )

    def render(self, prompt: Prompt) -> str:
        key = (prompt.prompt_id, prompt.messages)
        if key not in self._cache:
            if len(self._cache) > 100_000:
                self._cache.clear()
            style = self.style
            text = (
                style.render(self.tokenizer, prompt.messages)
                if style
                else render_prompt(self.tokenizer, prompt.messages)
            )
            self._cache[key] = text
        return self._cache[key]

    def tokens(self, prompts: Sequence[Prompt]) -> tuple[list[str], dict[int, list[int]]]:
        """The rendered prompts and their token ids by prompt id."""
        texts = [self.render(p) for p in prompts]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return texts, dict(zip((p.prompt_id for p in prompts), ids))

    def check_task(self, task: str) -> None:
        if task != self.task.name:
            raise ValueError(f"request is for task {task!r} but worker {self.org_id!r} runs {self.task.name!r}")

    def check(self, prompts: tuple[Prompt, ...], split: str) -> None:
        """Every prompt (messages and reference) must equal this org's own copy of the task's prompt with that id:
        the coordinator cannot change what is asked or what counts as right."""
        try:
            own = self.task.prompts(split, [p.prompt_id for p in prompts])
        except (ValueError, KeyError, IndexError) as err:
            raise RequestRefused("unknown_prompt", str(err)) from None
        for mine, theirs in zip(own, prompts):
            if mine != theirs:
                raise RequestRefused(
                    "prompt_mismatch",
                    f"{split} prompt {theirs.prompt_id} differs from this org's copy "
                    f"of task {self.task.name!r} (task name, params and seed must match the run's)",
                )

    def fitting(
        self, prompts: Sequence[Prompt], tokens_by_prompt: dict, budget: int, field: str, context: int | None
    ) -> list[int]:
        """Indices of ``prompts`` whose tokens plus ``budget`` fit the model's context; the rest are skipped with a
        warning (and counted by the caller)."""
        keep = [i for i, p in enumerate(prompts) if fits(len(tokens_by_prompt[p.prompt_id]), budget, context)]
        if len(keep) < len(prompts):
            longest = max(len(tokens_by_prompt[p.prompt_id]) for p in prompts)
            log.warning(
                "worker %s: skipped %d of %d prompts that do not fit the model's context of %s tokens with "
                "%s=%d (longest prompt %d tokens)",
                *(self.org_id, len(prompts) - len(keep), len(prompts), context, field, budget, longest),
            )
        return keep
