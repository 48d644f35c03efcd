"""A reward function for the built-in ``jsonl`` / ``dataset`` tasks: ``task.params.reward_fn:
"my_task.rewards:last_number_matches"``. Called as ``fn(response, reference)`` by every org that verifies
(the coordinator and each learner); returns a float in [0, 1]."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_matches(response: str, reference: str) -> float:
    """1.0 when the last number in ``response`` equals ``reference`` as a number, else 0.0."""
    numbers = _NUMBER.findall(response)
    if not numbers:
        return 0.0
    try:
        return 1.0 if float(numbers[-1]) == float(reference.replace(",", "")) else 0.0
    except ValueError:
        return 0.0
