"""A learner's own rows of a plan: its prompts in the learner's tokens, ``G`` samples of each with the weights on
the engine (:func:`sample_plan`), and the learner's own verifier's reward of each (:func:`verify_samples`): the
published rollouts and the learner's own train rows."""

from __future__ import annotations

from typing import Any

from hacrl_fed.seeding import stable_seed
from hacrl_fed.trainer import TrainRow
from hacrl_fed.types import Prompt, Rollout, RoundPlan

# the PolicyWorker (hacrl_fed.worker.policy_worker), not imported: it imports this module (tests/test_layers.py)
PolicyWorker = Any


def sample_plan(worker: PolicyWorker, plan: RoundPlan) -> tuple[dict[int, list[int]], list[int], list]:
    """The plan's prompts in this learner's tokens, the indices of those that fit the context, and ``G``
    samples of each of those (the engine's generations)."""
    sp = plan.sampling
    texts, tokens_by_prompt = worker.prompts.tokens(plan.prompts)
    keep = worker.prompts.fitting(
        plan.prompts, tokens_by_prompt, sp.max_new_tokens, "generation.max_new_tokens", worker.context
    )
    if not keep:
        return tokens_by_prompt, keep, []
    gens = worker.engine.generate(
        [texts[i] for i in keep],
        num_samples=sp.num_samples,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        max_new_tokens=sp.max_new_tokens,
        seed=stable_seed(sp.seed, worker.seed) % (2**31),
    )
    return tokens_by_prompt, keep, gens


def verify_samples(
    worker: PolicyWorker, plan: RoundPlan, tokens_by_prompt: dict[int, list[int]], prompts: list[Prompt], gens: list
) -> tuple[list[Rollout], list[TrainRow]]:
    """Score every sample with this org's own verifier: the published rollouts and this learner's own rows."""
    rollouts, rows = [], []
    for prompt, samples in zip(prompts, gens):
        for j, g in enumerate(samples):
            reward = float(worker.task.verify(g.text, prompt.reference))
            rollouts.append(
                Rollout(
                    worker.org_id,
                    plan.round,
                    prompt.prompt_id,
                    j,
                    g.text,
                    g.finish_reason,
                    reward,
                    g.logprob_sum,
                    g.token_count,
                )
            )
            rows.append(
                TrainRow(
                    list(tokens_by_prompt[prompt.prompt_id]),
                    list(g.token_ids),
                    reward,
                    prompt.prompt_id,
                    0,
                    True,
                    g.logprob_sum / max(g.token_count, 1),
                    list(g.token_log_probs),
                    n_bytes=len(g.text.encode("utf-8")),
                )
            )
    return rollouts, rows
