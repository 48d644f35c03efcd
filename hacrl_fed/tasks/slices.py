"""Accuracy per slice of a task's held-out prompts (a task that labels its problems, e.g. ``arithmetic`` with
``slices``; :meth:`hacrl_fed.tasks.base.Task.slice_label`).

For slice ``s`` with prompts ``P_s`` (the held-out prompts labelled ``s``) and rewards ``r_i``:

- ``slice/<s>/accuracy = sum_{i in P_s} r_i / |P_s|``;
- ``slice/<s>/prompts = |P_s|`` (the count, for a standard error).

Unlabelled prompts (label None) count in no slice; a task without labels gives no keys at all, so the overall
accuracy and the metric keys of an unsliced run are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def slice_labels(task: Any, split: str, prompt_ids: Sequence[int]) -> list[str | None]:
    """``task.slice_label(split, id)`` for each id (None for a task without the method)."""
    label = getattr(task, "slice_label", None)
    return [label(split, i) if label is not None else None for i in prompt_ids]


def slice_metrics(labels: Sequence[str | None], rewards: Sequence[float]) -> dict[str, float]:
    """``slice/<s>/accuracy`` and ``slice/<s>/prompts`` of the module docstring; ``{}`` when nothing is labelled.

    ``labels[i]`` and ``rewards[i]`` belong to prompt ``i`` (same length).
    """
    if len(labels) != len(rewards):
        raise ValueError(f"need one label per reward, got {len(labels)} and {len(rewards)}")
    sums: dict[str, list[float]] = {}
    for lab, r in zip(labels, rewards):
        if lab is not None:
            acc = sums.setdefault(lab, [0.0, 0.0])
            acc[0] += float(r)
            acc[1] += 1.0
    out: dict[str, float] = {}
    for lab in sorted(sums):
        total, count = sums[lab]
        out[f"slice/{lab}/accuracy"] = total / count
        out[f"slice/{lab}/prompts"] = count
    return out
