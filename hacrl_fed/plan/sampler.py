"""Which prompts a round uses: a pure function of (run seed, round), so a resumed run needs no sampler state.

Round ``t`` draws ``n`` distinct train ids with
``random.Random(stable_seed("prompts", seed, t)).sample(range(size), n)`` (:func:`hacrl_fed.seeding.stable_seed`).
``random.sample`` over a ``range`` never materialises the population, so sizes of 1e6+ (or procedurally
generated tasks with 2**62 prompts) cost O(n). Rounds are independent draws: an id may recur in a later round.
The held-out set is fixed: the first ``n`` test ids.
"""

from __future__ import annotations

import random

from hacrl_fed.seeding import stable_seed


class PromptSampler:
    """Deterministic per-round prompt ids from a task split of ``task_size`` prompts."""

    def __init__(self, task_size: int, seed: int):
        if isinstance(task_size, bool) or not isinstance(task_size, int) or task_size < 1:
            raise ValueError(f"task_size must be an int >= 1, got {task_size!r}")
        self.task_size = task_size
        self.seed = int(seed)

    def round_ids(self, round: int, n: int) -> list[int]:
        """``n`` distinct ids in ``[0, task_size)`` for ``round``; depends only on (seed, round, n, task_size)."""
        if n < 1 or n > self.task_size:
            raise ValueError(f"cannot draw {n} distinct prompts per round from a split of {self.task_size}")
        rng = random.Random(stable_seed("prompts", self.seed, int(round)))
        return rng.sample(range(self.task_size), n)


def eval_ids(test_size: int, n: int) -> list[int]:
    """The fixed held-out set: test ids ``0 .. min(n, test_size) - 1``."""
    if n < 0 or test_size < 0:
        raise ValueError(f"need n >= 0 and test_size >= 0, got n={n}, test_size={test_size}")
    return list(range(min(n, test_size)))
