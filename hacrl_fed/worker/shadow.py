"""The outcome guard's shadow (``trainer.outcome_guard.counterfactual``; the decisions are
:mod:`hacrl_fed.algorithm.counterfactual`'s): a copy of the learner that trains on its own rows alone, the
counterfactual of training alone on the same prompts and samples.

* it starts from the weights and trainer state the learner validated before its run's first update;
* each round, after the learner's update, its weights and optimizer are swapped onto the model, the learner's own
  rows of that round (never a foreign one) are re-scored under them (their old log-probs become the shadow's, so
  its update is on-policy in the ratio the loss clips) and the trainer's update runs on them; the learner's
  weights and state are swapped back (the engine is not touched);
* when the counterfactual is due, its parameters are put on the engine for one greedy pass over the guard's
  validation split, then the learner's are put back; the learner **adopts** the shadow by taking its weights and
  optimizer (keeping its own likelihood-screen history).

Cost: one more copy of the trainable weights and optimizer state in memory, an update over the learner's own rows
each round (its own rows are about half of a two-org update's rows), four weight copies per round and one greedy
validation per check.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from hacrl_fed.trainer import TrainRow
from hacrl_fed.worker.weights import Saved, load_params, restore, snapshot


class Shadow:
    """One learner's shadow (module doc): its weights and trainer state, in memory."""

    def __init__(self, saved: Saved):
        self.saved = saved

    def train(self, worker: Any, rows: Sequence[TrainRow], learner: int, capability: Sequence[float]) -> dict:
        """One update of the shadow on the learner's own ``rows`` of this round (foreign rows are left out here)."""
        own = [r for r in rows if r.is_self]
        if not own:
            return {"outcome/shadow_rows": 0.0}
        t0 = time.perf_counter()
        mine = snapshot(worker)
        restore(worker, self.saved, sync=False)
        toks = worker.trainer.token_log_prob_lists(own)
        own = [
            dataclasses.replace(r, old_seq_log_prob=sum(t) / max(len(t), 1), old_token_log_probs=t)
            for r, t in zip(own, toks)
        ]
        worker.trainer.update(own, learner, capability)
        self.saved = snapshot(worker)
        restore(worker, mine, sync=False)
        return {"outcome/shadow_rows": float(len(own)), "time/outcome_shadow": time.perf_counter() - t0}

    def validate(self, worker: Any, validate: Any) -> list[bool]:
        """``validate(engine, context)`` with the shadow's parameters on the engine; the learner's put back."""
        mine = {n: p.detach().clone() for n, p in worker.model.named_parameters() if p.requires_grad}
        load_params(worker, self.saved[0], sync=True)
        try:
            return validate(worker.engine, worker.context)
        finally:
            load_params(worker, mine, sync=True)

    def adopted_by(self, worker: Any) -> Saved:
        """Put the shadow's weights and optimizer on the learner (its own screen history kept); the new state."""
        params, state = self.saved
        state = {k: v for k, v in state.items() if k != "likelihood_screen"}
        screen = worker.trainer.state_dict().get("likelihood_screen")
        restore(worker, (params, {**state, **({"likelihood_screen": screen} if screen else {})}), sync=True)
        return snapshot(worker)
