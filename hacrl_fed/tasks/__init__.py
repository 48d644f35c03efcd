"""Tasks and verifiers: a registry of prompt sources with their reward functions.

Built-in tasks: ``arithmetic`` (procedural, the default), ``jsonl`` (GSM8K/MATH-style local files,
math-verify), ``dataset`` (the same over local Parquet / Arrow / JSON(L) read with ``datasets``, optional),
``reasoning-gym`` (optional package, imported only when built). Tasks from outside the package: an import path
``package.module:ClassName`` or a ``hacrl_fed.tasks`` entry point (:mod:`hacrl_fed.tasks.loader`).

    task = get_task("arithmetic", {"difficulty": 2}, seed=0)
    prompts = task.prompts("train", range(16))
    reward = task.verify(response_text, prompts[0].reference)
"""

from hacrl_fed.tasks import arithmetic as _arithmetic  # noqa: F401  (registers "arithmetic")
from hacrl_fed.tasks import dataset as _dataset  # noqa: F401  (registers "dataset")
from hacrl_fed.tasks import jsonl_math as _jsonl_math  # noqa: F401  (registers "jsonl")
from hacrl_fed.tasks import reasoning_gym as _reasoning_gym  # noqa: F401  (registers "reasoning-gym")
from hacrl_fed.tasks.base import TASKS, Task, TaskParams, get_task, register_task

__all__ = ["TASKS", "Task", "TaskParams", "get_task", "register_task"]
