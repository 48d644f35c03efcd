"""The learner as its after-update extensions see it (:class:`Learner`): the outcome guard and its shadow
(:mod:`hacrl_fed.worker.outcome`, :mod:`hacrl_fed.worker.shadow`) score, update and swap weights only through these
methods, and the policy worker (:mod:`hacrl_fed.worker.policy_worker`) implements them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from hacrl_fed.algorithm.advantages import Capability
from hacrl_fed.algorithm.loss_inputs import Reweigh
from hacrl_fed.engines.base import GenerationEngine
from hacrl_fed.train_rows import TrainRow
from hacrl_fed.worker.weights import Saved


class Learner(Protocol):
    """A learner's model, engine and trainer behind three verbs: score, update, weights."""

    engine: GenerationEngine  # greedy validation runs on it, with whatever weights are loaded
    context: int | None  # the model's context length (None: unbounded)

    def score(self, rows: Sequence[TrainRow]) -> list[list[float]]:
        """Per-token log-probs of each row's response with the model's current weights (no gradient)."""
        ...

    def update(
        self,
        rows: Sequence[TrainRow],
        learner: int,
        capability: Capability,
        importance: Sequence[float] | None = None,
        reweigh: Reweigh | None = None,
    ) -> dict[str, float]:
        """One update of the model's current weights and trainer state on ``rows`` (the trainer's update;
        ``importance``: a weight per row on its advantage; ``reweigh``: the rows as their own old policy, each
        advantage reweighed in the forward; :meth:`hacrl_fed.trainer.LocalTrainer.update`)."""
        ...

    def one_step(self, n_rows: int) -> bool:
        """Whether an update of ``n_rows`` rows takes a single optimizer step (``reweigh`` needs it)."""
        ...

    def weights(self) -> Saved:
        """A copy of the trainable weights and the trainer's state."""
        ...

    def live(self) -> Saved:
        """The trainable weights and the trainer's state themselves, not copies (to write to a file; never kept)."""
        ...

    def params(self) -> dict[str, torch.Tensor]:
        """A copy of the trainable weights alone."""
        ...

    def load_weights(self, saved: Saved, *, sync: bool = True) -> None:
        """Put :meth:`weights`' copy back on the model and trainer (``sync``: and on the engine)."""
        ...

    def load_params(self, params: dict[str, torch.Tensor], *, sync: bool) -> None:
        """Put :meth:`params`' copy back on the model (``sync``: and on the engine)."""
        ...
