"""The outcome guard's shadow (``trainer.outcome_guard.counterfactual``; the decisions are
:mod:`hacrl_fed.algorithm.counterfactual`'s): a copy of the learner that trains on the learner's own rows alone, the
counterfactual of training alone.

* it starts from the weights and trainer state the learner validated before its run's first update;
* it **learns from the learner's own samples**: each round, after the learner's update (engine released), the
  learner's weights and optimizer go to a file, the shadow's are put on the model, the learner's own rows of the
  round (never a foreign one) are scored under the shadow's weights (its ``lbar_old``) and GSPO's update runs on
  them with each row's advantage weighted by the clipped sequence importance ratio shadow / learner
  (:mod:`hacrl_fed.algorithm.shadow_importance`, ``trainer.outcome_guard.importance_clip``), and the learner's
  weights and state come back from the file (the engine is not touched). Where the update is one optimizer step
  the scores and weights are taken in the update's own forward (the trainer's ``reweigh``: no scoring pass) and the
  rows with ``A = 0`` run no pass at all (issue 44). It samples nothing of its own: the
  shadow issue 27 measured sampled the round's plan again, which cost about what the learner's generation costs;
* when the counterfactual is due, its parameters are put on the engine for the guard's validation, then the
  learner's are put back; the learner **adopts** the shadow by taking its weights and optimizer (keeping its own
  likelihood-screen history).

Its weights and trainer state live in a file (:class:`~hacrl_fed.worker.stash.Stash`, under the org's run dir), read
memory-mapped only for its update, its validation and an adoption. Cost per round: one update over the learner's
own rows that have a gradient (a scoring pass before it only where the update takes more than one step), two stash
writes and two reads.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import Tensor

from hacrl_fed.algorithm.advantages import Capability
from hacrl_fed.algorithm.shadow_importance import importance_weights, importance_weights_tensor
from hacrl_fed.engines.base import GenerationEngine
from hacrl_fed.perf import CpuTally
from hacrl_fed.trainer import TrainRow
from hacrl_fed.worker.answers import on_engine
from hacrl_fed.worker.checkpoint_files import LinkedFile
from hacrl_fed.worker.learner import Learner
from hacrl_fed.worker.stash import Stash
from hacrl_fed.worker.weights import Saved

Validate = Callable[[GenerationEngine, "int | None"], list[bool]]  # greedy correctness on a split (the guard's)


class Shadow:
    """One learner's shadow (module doc): its weights and trainer state in ``store``/shadow.pt."""

    def __init__(self, store: Path, saved: Saved | LinkedFile, clip: float, cpu: CpuTally | None = None):
        """Start from ``saved`` (weights and trainer state, or a checkpoint's file of them)."""
        self.stash, self.swap, self.clip = Stash(store / "shadow.pt"), Stash(store / "learner.pt"), clip
        self.cpu = cpu or CpuTally("outcome")  # parts shadow_stash, shadow_score, shadow_update, swap
        with self.cpu("stash"):
            if isinstance(saved, LinkedFile):
                self.stash.take(saved)
            else:
                self.stash.put(saved)

    @property
    def saved(self) -> Saved:
        """The shadow's weights and trainer state (memory-mapped from its file)."""
        return self.stash.get()

    def train(self, learner: Learner, rows: Sequence[TrainRow], index: int, capability: Capability) -> dict[str, float]:
        """One importance-weighted GSPO update of the shadow on the learner's own rows of ``rows`` (module doc)."""
        t0 = time.perf_counter()
        own = [r for r in rows if r.is_self and r.prompt_token_ids]  # not an earlier round's baseline rows
        if not own:
            return {"outcome/shadow_rows": 0.0, "time/outcome_shadow": time.perf_counter() - t0}
        cpu = self.cpu
        with cpu("shadow_stash"):
            self.swap.put(learner.live())
        try:  # whatever happens, the learner gets its own weights and state back
            with cpu("shadow_stash"):
                learner.load_weights(self.stash.get(), sync=False)
            weights = self._update(learner, own, index, capability)
            with cpu("shadow_stash"):
                self.stash.put(learner.live())
        finally:
            with cpu("shadow_stash"):
                learner.load_weights(self.swap.get(), sync=False)
                self.swap.drop()  # copied back: its pages need not stay on disk until the next round
        n = max(len(weights), 1)  # the rows with a gradient where the update took its scores in its forward
        return {
            "outcome/shadow_rows": float(len(own)),
            "outcome/shadow_importance_mean": sum(weights) / n,
            "outcome/shadow_importance_clipped": sum(w >= self.clip for w in weights) / n,
            "time/outcome_shadow": time.perf_counter() - t0,
        }

    def _update(self, learner: Learner, own: Sequence[TrainRow], index: int, capability: Capability) -> list[float]:
        """The update with the shadow on the model; → the rows' importance weights. One optimizer step: the rows'
        scores and weights come from the update's own forward (``reweigh``); more: a scoring pass first."""
        if learner.one_step(len(own)):
            seen: list[Tensor] = []

            def reweigh(lbar: Tensor, learner_lbar: Tensor) -> Tensor:
                seen.append(w := importance_weights_tensor(lbar, learner_lbar, self.clip))
                return w

            rows = [dataclasses.replace(r, source=index) for r in own]
            with self.cpu("shadow_update"):
                learner.update(rows, index, capability, reweigh=reweigh)
            return [float(x) for w in seen for x in w.tolist()]
        with self.cpu("shadow_score"):
            mine, weights = rescored(own, learner.score(own), index, self.clip)
        with self.cpu("shadow_update"):
            learner.update(mine, index, capability, importance=weights)
        return weights

    def validate(self, learner: Learner, validate: Validate) -> list[bool]:
        """``validate(engine, context)`` with the shadow's parameters on the engine; the learner's put back."""
        run = lambda: validate(learner.engine, learner.context)  # noqa: E731
        return on_engine(learner, self.stash.params, run, lambda: self.cpu("swap"))

    def adopted_by(self, learner: Learner) -> None:
        """Put the shadow's weights and optimizer on the learner (its own screen history kept)."""
        params, state = self.stash.get()
        state = {k: v for k, v in state.items() if k != "likelihood_screen"}
        screen = learner.live()[1].get("likelihood_screen")
        learner.load_weights((params, {**state, **({"likelihood_screen": screen} if screen else {})}), sync=True)


def rescored(
    own: Sequence[TrainRow], tokens: Sequence[Sequence[float]], index: int, clip: float
) -> tuple[list[TrainRow], list[float]]:
    """The learner's own rows with the shadow's per-token scores ``tokens`` as their ``old`` log-probs (GSPO's
    ratio starts at 1 for the shadow), and their importance weights shadow / learner (module doc). ``lbar`` divides
    by the row's ``norm_length`` where it has one, else its token count, as the trainer does."""
    rows, shadow_lbar = [], []
    for r, t in zip(own, tokens):
        lbar = sum(t) / max(r.norm_length if r.norm_length > 0 else len(t), 1)
        shadow_lbar.append(lbar)
        rows.append(dataclasses.replace(r, old_seq_log_prob=lbar, old_token_log_probs=list(t), source=index))
    return rows, importance_weights(shadow_lbar, [r.old_seq_log_prob for r in own], clip)
