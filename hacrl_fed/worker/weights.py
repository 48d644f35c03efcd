"""Copies of a worker's trainable weights and trainer state in memory (the outcome guard's reference and shadow,
:mod:`hacrl_fed.worker.outcome`, :mod:`hacrl_fed.worker.shadow`)."""

from __future__ import annotations

import copy
from typing import Any

import torch

Saved = tuple[dict[str, torch.Tensor], dict]


def snapshot(worker: Any) -> Saved:
    """A copy of the trainable parameters and the trainer's state (optimizer, screen history, masters)."""
    params = {n: p.detach().clone() for n, p in worker.model.named_parameters() if p.requires_grad}
    return params, copy.deepcopy(worker.trainer.state_dict())


def restore(worker: Any, saved: Saved, *, sync: bool = True) -> None:
    """Put a :func:`snapshot` back on the worker's model and trainer (and, with ``sync``, its engine)."""
    params, state = saved
    load_params(worker, params, sync=False)
    worker.trainer.load_state_dict(copy.deepcopy(state))
    if sync:
        worker.engine.sync_weights(worker.model)


def load_params(worker: Any, params: dict[str, torch.Tensor], *, sync: bool) -> None:
    """Copy ``params`` onto the worker's model (the trainer's state untouched); ``sync``: then sync the engine."""
    with torch.no_grad():
        for name, p in worker.model.named_parameters():
            if name in params:
                p.copy_(params[name])
    if sync:
        worker.engine.sync_weights(worker.model)
