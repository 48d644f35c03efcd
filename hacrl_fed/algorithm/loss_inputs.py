"""A mini-batch of rows as a policy loss's inputs (:class:`~hacrl_fed.algorithm.registry.PolicyLossInputs`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hacrl_fed.algorithm.registry import PolicyLossInputs
from hacrl_fed.train_rows import TrainRow


def pad_rows(rows: Sequence[Sequence[float]], width: int) -> Tensor:
    """Ragged float rows left-aligned in a zero-padded [B, width] float32 tensor."""
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.float32)
    return out


def loss_inputs(
    micro: Sequence[TrainRow],
    lp: Tensor,
    mask: Tensor,
    adv: Tensor,
    is_self: Tensor,
    v: Tensor,
    *,
    token_level: bool,
    algorithm: str,
) -> PolicyLossInputs:
    """One scored micro-batch: ``lp`` / ``mask`` [M, T] from the forward pass, ``adv``, ``is_self``, ``v`` [M]; a
    token-level loss (``token_level``) also gets every row's old per-token log-probs [M, T]."""
    old_tok = None
    if token_level:
        if any(r.old_token_log_probs is None for r in micro):
            raise ValueError(f"{algorithm} is token-level: every row needs old_token_log_probs")
        old_tok = pad_rows([r.old_token_log_probs or [] for r in micro], lp.shape[1]).to(lp.device)
    return PolicyLossInputs(
        token_log_probs=lp,
        response_mask=mask,
        old_seq_log_probs=torch.tensor([r.old_seq_log_prob for r in micro], device=lp.device),
        advantages=adv,
        is_self=is_self,
        capability_coefficient=v,
        old_token_log_probs=old_tok,
        seq_lengths=torch.tensor([r.norm_length for r in micro], device=lp.device),
        source_ids=torch.tensor([r.source for r in micro], device=lp.device),
    )


def sequence_inputs(
    rows: Sequence[TrainRow], lbar: Tensor, adv: Tensor, is_self: Tensor, v: Tensor
) -> PolicyLossInputs:
    """Sequence-level loss inputs from given ``lbar`` [N] (one column, mask 1: ``seq_log_probs() == lbar``)."""
    device = lbar.device
    return PolicyLossInputs(
        token_log_probs=lbar[:, None],
        response_mask=torch.ones(len(rows), 1, device=device),
        old_seq_log_probs=torch.tensor([r.old_seq_log_prob for r in rows], device=device),
        advantages=adv,
        is_self=is_self,
        capability_coefficient=v,
        source_ids=torch.tensor([r.source for r in rows], device=device),
    )
