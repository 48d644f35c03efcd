"""A sharded worker's checkpoints: ``torch.distributed.checkpoint`` (DCP) shards in the plain worker's folders.

A checkpoint of round ``t`` is the plain worker's directory (:mod:`hacrl_fed.worker.checkpoint`:
``<run dir>/orgs/<org>/checkpoints/<run id>/round-NNNNNN``, ``LATEST``, pruning) with ``dcp/`` in place of
``model.safetensors``: every rank writes its shards of ``{"model": weights, "optim": AdamW state}``, keyed by
parameter name (``torch.distributed.checkpoint.state_dict.get_state_dict``), and rank 0 writes ``trainer.pt``
(RNG states, the likelihood screen's history; ``optimizer: None``) and ``state.json``. All ranks write into one
directory: with several hosts it must be on a shared filesystem.

Because the keys are names, not positions or shard layouts, the checkpoint loads at any ``N``: a sharded worker
reads its own shards back (:func:`load_sharded`, DCP reshards to the current ``N``); a one-process worker or
``hacrl-fed export`` reads the tensors whole (:mod:`hacrl_fed.sharded.dcp_files`, no process group). A
one-process checkpoint loads into a sharded worker through the whole weights and the optimizer state keyed by
position (:func:`~hacrl_fed.sharded.dcp_files.named_optimizer_state`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from hacrl_fed.sharded.dcp_files import SHARDED_DIR
from hacrl_fed.sharded.fsdp import broadcast, portable, world
from hacrl_fed.worker.checkpoint import commit_checkpoint, stage_checkpoint


def _on_rank0(fn):
    """``fn()`` on rank 0, its result (or its error, raised) on every rank."""
    result, err = None, None
    if world()[0] == 0:
        try:
            result = fn()
        except Exception as e:  # handed to every rank so none waits for a directory that never comes
            err = portable(e)
    result, err = broadcast((result, err))
    if err is not None:
        raise err
    return result


def save_sharded(
    root: Path, round: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict, extra: dict
) -> Path:
    """Write round ``round``'s checkpoint under ``root`` (module docstring); collective; returns its directory."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = _on_rank0(lambda: stage_checkpoint(root, round))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / SHARDED_DIR)
    return _on_rank0(lambda: commit_checkpoint(root, round, trainer_state, extra))


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load checkpoint ``path``'s shards into the FSDP ``model`` and its ``optimizer``, resharded to this ``N``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path / SHARDED_DIR)  # in place
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
