"""Selection rule ``rescue``: a peer's success only where the learner failed (docs/ALGORITHM.md "Selecting foreign
rows"; issue 30, BENCHMARKS.md "Why the strongest org gains little").

A foreign row is eligible when its reward is > 0 **and** every one of the learner's own rows of its prompt has
reward 0 (own mean 0; a prompt without own rows counts as failed, as under ``learner_failed``). Budget: a seeded
uniform sample of the eligible, as ``successes``.

Why: under ``successes`` a peer's success also joins the prompts where the learner already succeeds some of the
time. There it teaches nothing new (the learner's own group already has a correct answer to push up) and it raises
the joint-group baseline ``μ_k`` (docs/ALGORITHM.md §2) of the learner's own rows: their correct answers' advantage
shrinks and their wrong answers are pushed harder, so the learner's own update is no longer GSPO's. For the
strongest org that is most of its foreign rows (measured: ``scripts/strongest_decomposition.py``). Under
``rescue`` those prompts keep the learner's own group alone (its update there is GSPO's exactly) and a peer's
success joins only a prompt where the learner's own group is uniform (all wrong: advantage 0 under GSPO), the one
place where it adds signal GSPO cannot have.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def failed_prompts(own_rewards: Mapping[int, Sequence[float]], prompts: Iterable[int]) -> set[int]:
    """The prompts of ``prompts`` where no own reward is > 0 (a prompt without own rows counts as failed)."""
    return {p for p in prompts if not any(r > 0 for r in own_rewards.get(p, ()))}


def rescue_rows(
    rewards: Sequence[float],
    prompt_ids: Sequence[int],
    own_rewards: Mapping[int, Sequence[float]],
    by_key: Sequence[int],
) -> tuple[list[int], list[int]]:
    """Eligible rows (reward > 0 on a prompt where every own reward is 0) and their order (``by_key``: the seeded
    order of the rows). The registry entry in :mod:`hacrl_fed.algorithm.selection` passes an ``Offer``'s fields."""
    failed = failed_prompts(own_rewards, {int(p) for p in prompt_ids})
    keep = [rewards[i] > 0 and int(prompt_ids[i]) in failed for i in range(len(rewards))]
    return [i for i in range(len(rewards)) if keep[i]], [i for i in by_key if keep[i]]
