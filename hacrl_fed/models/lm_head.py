"""Log-probs from a causal LM's final hidden states without a ``[rows, tokens, vocab]`` logits tensor.

At a real vocabulary (SmolLM2: 49,152; Gemma 3: 262,144 → 1 MiB of float32 logits per token) the logits of a
micro-batch are the largest tensor of scoring and of the update: 8 rows × 48 tokens of Gemma are 400 MB in float32,
and autograd keeps them (and the log-softmax's output) for backward. Here the model's decoder runs to its final
(normed) hidden states ``[B, T, H]``; the tokens that are scored (the response mask) are gathered to ``[M, H]``
and taken in chunks of :data:`HEAD_CHUNK_BYTES` of float32 logits::

    logits_c = head(h_c)            (lm_head; Gemma: cap * tanh(logits_c / cap) when final_logit_softcapping)
    lp_c     = logits_c[target_c] - logsumexp(logits_c)

With gradient each chunk runs under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant): forward keeps only
the chunk's hidden states and targets, backward recomputes one chunk's logits at a time. So neither pass ever holds
more than one chunk of logits. The values are the full log-softmax's to float32 round-off (tests: within 1e-6 on
the zoo agents and on both real checkpoints).

:func:`head_parts` says which models this applies to: an architecture whose logits are exactly ``lm_head`` of the
decoder's ``last_hidden_state`` (plus Gemma's final soft-capping), :data:`HEAD_ARCHS`. Other architectures (a head
with a logit scale or bias of its own) and an FSDP2-sharded model (its root gathers the head only in its own
forward: :mod:`hacrl_fed.sharded`) keep the model's own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

HEAD_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "gpt2")
HEAD_CHUNK_BYTES = 64 << 20  # float32 logits per chunk: Gemma 3 → 64 tokens, SmolLM2 → 341 tokens


@dataclass(frozen=True)
class HeadParts:
    """A causal LM split at its head: ``decoder`` (→ ``last_hidden_state`` ``[B, L, H]``, normed), ``head`` (the
    ``lm_head`` module, PEFT-wrapped or not) and ``softcap`` (Gemma's ``final_logit_softcapping``, else None)."""

    decoder: nn.Module
    head: nn.Module
    softcap: float | None

    def logits(self, hidden: Tensor) -> Tensor:
        """``[..., H]`` → float32 ``[..., V]``: ``head(hidden)``, soft-capped as the model's own forward does."""
        logits = self.head(hidden).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def head_parts(model: nn.Module) -> HeadParts | None:
    """``model``'s decoder and head when its logits are ``lm_head(last_hidden_state)`` (module doc), else None.
    A PEFT wrapper is looked through (its adapters sit inside the decoder's and the head's modules)."""
    lm: Any = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    config = getattr(lm, "config", None)
    if getattr(config, "model_type", None) not in HEAD_ARCHS or _sharded(lm):
        return None
    decoder = getattr(lm, getattr(lm, "base_model_prefix", ""), None)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if not isinstance(decoder, nn.Module) or decoder is lm or not isinstance(head, nn.Module):
        return None
    cap = getattr(config, "final_logit_softcapping", None)
    return HeadParts(decoder, head, float(cap) if cap else None)


def _sharded(model: nn.Module) -> bool:
    """Whether ``model`` is FSDP2-sharded: its root holds the head and gathers it only in its own forward."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _chunk_log_probs(logits_of: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor) -> Tensor:
    """``[C, H]``, ``[C]`` → ``[C]``: ``logit[target] - logsumexp(logit)`` of one chunk."""
    logits = logits_of(hidden)
    return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def chunked_log_probs(
    parts: HeadParts, hidden: Tensor, targets: Tensor, mask: Tensor, chunk_bytes: int | None = None
) -> Tensor:
    """Per-token log-probs ``[B, T]`` float32 of ``targets`` ``[B, T]`` from the final hidden states ``hidden``
    ``[B, T, H]`` (column ``j`` predicts ``targets[:, j]``), 0 where ``mask`` ``[B, T]`` is 0. Only the masked
    tokens go through the head, in chunks of ``chunk_bytes // (4 V)`` tokens (default :data:`HEAD_CHUNK_BYTES`;
    module doc); differentiable, each chunk checkpointed when grad is enabled."""
    b, t, _ = hidden.shape
    where = mask.bool().nonzero(as_tuple=True)
    picked, wanted = hidden[where], targets[where]  # [M, H], [M]
    weight: Any = getattr(parts.head, "weight", None)
    vocab = int(weight.shape[0]) if weight is not None else 1
    step = max(1, (HEAD_CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * vocab))
    grad = torch.is_grad_enabled() and picked.requires_grad
    values = []
    for start in range(0, picked.shape[0], step):
        h, y = picked[start : start + step], wanted[start : start + step]
        if grad:
            values.append(checkpoint(_chunk_log_probs, parts.logits, h, y, use_reentrant=False))
        else:
            values.append(_chunk_log_probs(parts.logits, h, y))
    out = torch.zeros(b, t, device=hidden.device, dtype=torch.float32)
    return out.index_put(where, torch.cat(values)) if values else out
