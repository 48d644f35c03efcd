"""The algorithms by name: what each is made of and what the trainer and the worker's intake must do for it.

Torch-free and config-free, so the run config validates ``algorithm.name`` against this table (the one place the
names are written) without an import cycle; :mod:`hacrl_fed.algorithm.registry` holds the functions the names
refer to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AlgorithmSpec:
    """What an algorithm is made of and what the trainer must do for it.

    ``advantage`` / ``loss``: registry names; ``uses_cross``: foreign rollouts enter the learner's batch;
    ``uses_capability_coefficient``: foreign rows carry the capability discrepancy coefficient ``v(j, k)`` (else 1);
    ``token_level``: the loss works per token and needs each self row's old per-token log-probs; its
    micro-batches are then weighted by tokens when the loss averages over tokens (``token-mean``);
    ``decoupled_loss``: the loss ``algorithm.cross_staleness: decoupled`` selects instead of ``loss`` (None: the
    algorithm has no decoupled form); it needs each row's pre-update (proximal) log-prob.
    """

    advantage: str
    loss: str
    uses_cross: bool
    uses_capability_coefficient: bool = False
    token_level: bool = False
    decoupled_loss: str | None = None

    def weights_by_tokens(self, config: Any) -> bool:
        """Whether micro-batch losses combine by their share of response tokens (else by their share of rows)."""
        return self.token_level and config.grpo_loss_agg_mode == "token-mean"

    def policy_loss(self, config: Any) -> str:
        """The registry name of the loss an ``algorithm`` config section selects (``cross_staleness``)."""
        decoupled = getattr(config, "cross_staleness", "band") == "decoupled"
        return self.decoupled_loss if decoupled and self.decoupled_loss is not None else self.loss

    def needs_proximal(self, config: Any) -> bool:
        """Whether the selected loss needs every row's pre-update (proximal) log-prob (the decoupled form)."""
        return self.policy_loss(config) != self.loss


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "hacpo": AlgorithmSpec(
        "hacpo", "hacpo", uses_cross=True, uses_capability_coefficient=True, decoupled_loss="hacpo_decoupled"
    ),
    "gspo": AlgorithmSpec("group", "gspo", uses_cross=False),
    "grpo": AlgorithmSpec("group", "grpo", uses_cross=False, token_level=True),
    "naive": AlgorithmSpec("group", "naive", uses_cross=True),
}
