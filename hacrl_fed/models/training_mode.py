"""How the update's forward passes run on a model: the LoRA adapters' own dropout on during them
(:func:`adapter_dropout`; everything else stays in eval mode) and gradient checkpointing of the decoder layers
(:func:`checkpoint_layers`)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch


def adapter_dropout_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The dropout modules of the model's LoRA adapters (peft's ``lora_dropout``; empty without adapters or with
    dropout 0, where peft puts an ``Identity``)."""
    out: list[torch.nn.Module] = []
    for module in model.modules():
        adapters = getattr(module, "lora_dropout", None)
        if isinstance(adapters, torch.nn.ModuleDict):
            out.extend(m for m in adapters.values() if isinstance(m, torch.nn.Dropout) and m.p > 0)
    return out


@contextlib.contextmanager
def adapter_dropout(modules: Sequence[torch.nn.Module]):
    """Training mode for exactly ``modules`` (the adapters' dropout) inside the block; their mode is restored."""
    before = [m.training for m in modules]
    for m in modules:
        m.train(True)
    try:
        yield
    finally:
        for m, mode in zip(modules, before):
            m.train(mode)


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Gradient checkpointing for ``model``: every transformers decoder layer (``GradientCheckpointingLayer``)
    recomputes its activations during backward instead of keeping them; returns how many layers were wrapped.

    transformers' own switch (``gradient_checkpointing_enable``) acts only in training mode, and the trainer
    scores in eval mode (no dropout), so the layers' ``forward`` is wrapped here instead (non-reentrant
    ``torch.utils.checkpoint``, only while grad is enabled: generation and no-grad scoring run unchanged).
    Idempotent. Wrap after any ``deepcopy`` of the model (a copy would call the original's layers).
    """
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(
            f"trainer.gradient_checkpointing: {type(model).__name__} has no transformers decoder "
            "layers (GradientCheckpointingLayer) to checkpoint"
        )
    for layer in layers:
        if getattr(layer, "_hacrl_checkpointed", False):
            continue
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return _forward(*args, **kwargs)

        layer.forward = checkpointed
        setattr(layer, "_hacrl_checkpointed", True)  # noqa: B010 - mark the layer without a typed attribute
    return len(layers)
