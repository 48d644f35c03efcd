"""``AddTask``: "What is a + b?" with operands up to ``max_operand``; reward 1.0 when the response's last integer
is the sum.

A task is a :class:`hacrl_fed.tasks.Task` subclass with a pydantic ``Params`` model (unknown keys are errors) and
four methods: ``size(split)``, ``prompts(split, ids)`` (deterministic per seed, split and id; train and test never
share a problem), ``verify(response, reference)`` (a float in [0, 1] that never raises) and, optionally,
``sft_target(split, id)``.
"""

from __future__ import annotations

import random
import re

from pydantic import Field

from hacrl_fed.tasks import Task, TaskParams
from hacrl_fed.tasks.base import check_split, stable_hash
from hacrl_fed.types import ChatMessage, Prompt

_INT = re.compile(r"-?\d+")


class AddParams(TaskParams):
    max_operand: int = Field(20, ge=2, le=10_000)
    train_size: int = Field(10_000, ge=1)
    test_size: int = Field(100, ge=1)


class AddTask(Task):
    Params = AddParams
    params: AddParams

    def size(self, split: str) -> int:
        return self.params.train_size if check_split(split) == "train" else self.params.test_size

    def _problem(self, split: str, i: int) -> tuple[int, int]:
        # a problem is a test problem iff its hash is 0 mod 5: the splits never share one, whatever the seed
        rng = random.Random(stable_hash("add-small", self.seed, split, i))
        while True:
            a, b = rng.randint(0, self.params.max_operand), rng.randint(0, self.params.max_operand)
            if (stable_hash("add-small-split", a, b) % 5 == 0) == (split == "test"):
                return a, b

    def prompts(self, split: str, ids) -> list[Prompt]:
        out = []
        for i in self.check_ids(split, ids):
            a, b = self._problem(split, i)
            out.append(Prompt(prompt_id=i, messages=(ChatMessage("user", f"{a}+{b}="),), reference=str(a + b)))
        return out

    def verify(self, response: str, reference: str) -> float:
        numbers = _INT.findall(response if isinstance(response, str) else "")
        return 1.0 if numbers and numbers[-1] == reference else 0.0

    def sft_target(self, split: str, prompt_id: int) -> str:
        a, b = self._problem(split, prompt_id)
        return f"{a}+{b}={a + b} #### {a + b}"
