"""The outcome guard's shadow (``trainer.outcome_guard.counterfactual``; the decisions are
:mod:`hacrl_fed.algorithm.counterfactual`'s): a copy of the learner that trains on its own rows alone, the
counterfactual of training alone on the same prompts and samples.

* it starts from the weights and trainer state the learner validated before its run's first update;
* it **samples its own rows**: each round, right after the learner generated, the shadow's parameters are put on the
  engine and the same plan is sampled again (the same prompts, sampling parameters and seed: common random numbers)
  and verified with the learner's own verifier; the learner's parameters are put back. Round 1's rows are the
  learner's own (the two still have the same weights then);
* each round, after the learner's update, its weights and optimizer are swapped onto the model, the trainer's update
  runs on the shadow's rows of that round (never a foreign one), and the learner's weights and state are swapped back
  (the engine is not touched);
* when the counterfactual is due, its parameters are put on the engine for one greedy pass over the guard's
  validation split, then the learner's are put back; the learner **adopts** the shadow by taking its weights and
  optimizer (keeping its own likelihood-screen history).

Cost: one more copy of the trainable weights and optimizer state in memory, one more sampling of the round's plan
and an update over as many rows as the learner's own each round (about half of a two-org update's rows), six weight
copies and four engine syncs per round, and one greedy validation per check: what training alone costs, plus copies.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from hacrl_fed.algorithm.advantages import Capability
from hacrl_fed.engines.base import GenerationEngine
from hacrl_fed.trainer import TrainRow
from hacrl_fed.types import RoundPlan
from hacrl_fed.worker.learner import Learner
from hacrl_fed.worker.weights import Saved

Validate = Callable[[GenerationEngine, "int | None"], list[bool]]  # greedy correctness on a split (the guard's)


class Shadow:
    """One learner's shadow (module doc): its weights and trainer state, in memory."""

    def __init__(self, saved: Saved):
        self.saved = saved
        self.rows: dict[int, list[TrainRow]] = {}  # round -> the shadow's own rows of that round's plan

    def generate(self, learner: Learner, plan: RoundPlan) -> dict[str, float]:
        """Sample and verify ``plan`` with the shadow's parameters (the learner's put back); kept for the update."""
        t0 = time.perf_counter()
        mine = learner.params()
        learner.load_params(self.saved[0], sync=True)
        try:
            rows = learner.sample(plan)
        finally:
            learner.load_params(mine, sync=True)
        self.rows = {plan.round: rows}
        n = max(len(rows), 1)
        reward = sum(r.reward for r in rows) / n
        return {"outcome/shadow_reward": reward, "time/outcome_shadow_gen": time.perf_counter() - t0}

    def train(
        self, learner: Learner, round: int, rows: Sequence[TrainRow], index: int, capability: Capability
    ) -> dict[str, float]:
        """One update of the shadow on its own rows of ``round`` (without them, round 1: the learner's own
        ``rows``, re-scored under the shadow's weights; foreign rows are never used)."""
        t0 = time.perf_counter()
        mine = learner.weights()
        learner.load_weights(self.saved, sync=False)
        try:  # whatever happens, the learner gets its own weights and state back
            own = self.rows.pop(round, None)
            if own is None:
                own = [r for r in rows if r.is_self]
                toks = learner.score(own)
                own = [
                    dataclasses.replace(r, old_seq_log_prob=sum(t) / max(len(t), 1), old_token_log_probs=t)
                    for r, t in zip(own, toks)
                ]
            own = [dataclasses.replace(r, source=index) for r in own]
            if own:
                learner.update(own, index, capability)
            self.saved = learner.weights()
        finally:
            learner.load_weights(mine, sync=False)
        return {"outcome/shadow_rows": float(len(own)), "time/outcome_shadow": time.perf_counter() - t0}

    def validate(self, learner: Learner, validate: Validate) -> list[bool]:
        """``validate(engine, context)`` with the shadow's parameters on the engine; the learner's put back."""
        mine = learner.params()
        learner.load_params(self.saved[0], sync=True)
        try:
            return validate(learner.engine, learner.context)
        finally:
            learner.load_params(mine, sync=True)

    def adopted_by(self, learner: Learner) -> Saved:
        """Put the shadow's weights and optimizer on the learner (its own screen history kept); the new state."""
        params, state = self.saved
        state = {k: v for k, v in state.items() if k != "likelihood_screen"}
        screen = learner.weights()[1].get("likelihood_screen")
        learner.load_weights((params, {**state, **({"likelihood_screen": screen} if screen else {})}), sync=True)
        return learner.weights()
