"""The algorithms by name: what each is made of and what the trainer and the worker's intake must do for it.

Torch-free and config-free, so the run config validates ``algorithm.name`` against this table (the one place the
names are written) without an import cycle; :mod:`hacrl_fed.algorithm.registry` holds the functions the names
refer to.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AlgorithmSpec:
    """What an algorithm is made of and what the trainer must do for it.

    ``advantage`` / ``loss``: registry names; ``uses_cross``: foreign rollouts enter the learner's batch;
    ``uses_capability_coefficient``: foreign rows carry the capability discrepancy coefficient ``v(j, k)`` (else 1);
    ``token_level``: the loss works per token (GRPO's token mean) and needs each self row's old per-token
    log-probs; its micro-batches are weighted by their share of the mini-batch's response tokens (else of its rows).
    """

    advantage: str
    loss: str
    uses_cross: bool
    uses_capability_coefficient: bool = False
    token_level: bool = False


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "hacpo": AlgorithmSpec("hacpo", "hacpo", uses_cross=True, uses_capability_coefficient=True),
    "gspo": AlgorithmSpec("group", "gspo", uses_cross=False),
    "grpo": AlgorithmSpec("group", "grpo", uses_cross=False, token_level=True),
    "naive": AlgorithmSpec("group", "naive", uses_cross=True),
}
