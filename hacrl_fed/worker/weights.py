"""Copies of a learner's trainable weights and trainer state in memory (the outcome guard's reference and shadow,
:mod:`hacrl_fed.worker.outcome`, :mod:`hacrl_fed.worker.shadow`), and the one way they are put back on its model
(:class:`hacrl_fed.worker.learner.Learner`'s ``load_weights`` / ``load_params``)."""

from __future__ import annotations

import copy

import torch

from hacrl_fed.engines.base import GenerationEngine
from hacrl_fed.trainer import LocalTrainer

Saved = tuple[dict[str, torch.Tensor], dict]


def trainable_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's trainable parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def snapshot(model: torch.nn.Module, trainer: LocalTrainer) -> Saved:
    """A copy of the trainable parameters and the trainer's state (optimizer, screen history, masters)."""
    return trainable_params(model), copy.deepcopy(trainer.state_dict())


def restore(
    model: torch.nn.Module, trainer: LocalTrainer, engine: GenerationEngine, saved: Saved, *, sync: bool = True
) -> None:
    """Put a :func:`snapshot` back on the model and trainer (and, with ``sync``, the engine)."""
    params, state = saved
    load_params(model, engine, params, sync=False)
    trainer.load_state_dict(copy.deepcopy(state))
    if sync:
        engine.sync_weights(model)


def load_params(
    model: torch.nn.Module, engine: GenerationEngine, params: dict[str, torch.Tensor], *, sync: bool
) -> None:
    """Copy ``params`` onto the model (the trainer's state untouched); ``sync``: then sync the engine."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in params:
                p.copy_(params[name])
    if sync:
        engine.sync_weights(model)
