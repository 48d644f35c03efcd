"""The ``task`` section: the prompts and their verifier, picked by name from the task registry."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from hacrl_fed.config.section import _d, _Section


class TaskConfig(_Section):
    """``name`` picks a task from the registry; ``params`` are validated by that task's own model."""

    name: str = Field(
        "arithmetic",
        description=_d(
            "task: arithmetic, jsonl (GSM8K/MATH-style files), dataset (local Parquet / Arrow / JSON(L)), "
            "reasoning-gym, or a lab's own (package.module:ClassName or a hacrl_fed.tasks entry point)"
        ),
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description=_d(
            "the task's own parameters (e.g. jsonl: path, test_path, question_field, answer_field); unknown keys are "
            "errors"
        ),
    )
    eval_size: int = Field(
        200, ge=1, description="held-out test prompts of every evaluation (the first ones of the split)"
    )
