"""The files of a sharded worker's checkpoint, read in one process: no process group, no worker imports.

``dcp/`` in a checkpoint directory is a ``torch.distributed.checkpoint`` of ``{"model": weights, "optim": AdamW
state}`` keyed by parameter name (written by :func:`hacrl_fed.sharded.checkpoint.save_sharded`). A one-process
worker resuming it (:func:`hacrl_fed.worker.checkpoint.load_checkpoint`) and ``hacrl-fed export`` read it back
whole here; the optimizer state converts between keys by name and the one-process optimizer's keys by position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

SHARDED_DIR = "dcp"  # a sharded worker's weights and optimizer state (torch.distributed.checkpoint) in a checkpoint


def read_whole(path: Path, key: str) -> Any:
    """Part ``key`` (``"model"``: ``{name: tensor}``; ``"optim"``: the optimizer state keyed by parameter name) of
    checkpoint ``path``'s shards, read back whole in this process (no process group)."""
    import torch.distributed.checkpoint as dcp  # here: importing the worker's checkpoints needs none of it
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}  # filled from the checkpoint's metadata (as torch's own dcp_to_torch_save does)
    _load_state_dict(
        state,
        storage_reader=dcp.FileSystemReader(str(path / SHARDED_DIR)),
        planner=_EmptyStateDictLoadPlanner(keys={key}),
        no_dist=True,
    )
    return state[key]


def weights_dtype(path: Path) -> torch.dtype:
    """The dtype of the first floating-point weight in checkpoint ``path``'s shards (from its metadata alone)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path / SHARDED_DIR)).read_metadata()
    for key, item in meta.state_dict_metadata.items():
        if (
            key.startswith("model.")
            and isinstance(item, TensorStorageMetadata)
            and item.properties.dtype.is_floating_point
        ):
            return item.properties.dtype
    return torch.float32


def _trainable_names(model: nn.Module) -> list[str]:
    """Names of ``model``'s trainable parameters in the one-process optimizer's order (``model.parameters()``)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def indexed_optimizer_state(named: dict, model: nn.Module) -> dict:
    """An optimizer state keyed by parameter name → keyed by position, as ``torch.optim`` saves it for the
    one-process trainer of ``model``."""
    index = {n: i for i, n in enumerate(_trainable_names(model))}
    return {
        "state": {index[n]: v for n, v in named["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]],
    }


def named_optimizer_state(indexed: dict, model: nn.Module) -> dict:
    """The inverse of :func:`indexed_optimizer_state`: a one-process optimizer state keyed by parameter name."""
    names = _trainable_names(model)
    return {
        "state": {names[int(i)]: v for i, v in indexed["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in indexed["param_groups"]],
    }
