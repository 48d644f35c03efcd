"""A mini-batch of rows as a policy loss's inputs (:class:`~hacrl_fed.algorithm.registry.PolicyLossInputs`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from hacrl_fed.algorithm.registry import PolicyLossInputs
from hacrl_fed.train_rows import TrainRow

Reweigh = Callable[[Tensor, Tensor], Tensor]  # (lbar now [M], the rows' old lbar [M]) -> a weight per row [M]


def on_policy(inputs: PolicyLossInputs, reweigh: Reweigh) -> PolicyLossInputs:
    """A micro-batch as its own old policy: ``lbar_old <- lbar`` (detached; per token too for a token-level loss), so
    GSPO's ratio ``exp(lbar - lbar_old)`` is exactly 1 in value with ``lbar``'s gradient, as after a no-grad scoring
    pass with the same weights but without that pass; and ``A_i <- w_i * A_i`` with ``w = reweigh(lbar, lbar_old of
    the rows as given)`` [M] (the outcome guard's shadow on the learner's rows, :mod:`hacrl_fed.worker.shadow`).
    Exact for the first optimizer step of an update only (the trainer refuses more)."""
    lbar = inputs.seq_log_probs().detach()
    w = reweigh(lbar, inputs.old_seq_log_probs)
    old_tok = None if inputs.old_token_log_probs is None else inputs.token_log_probs.detach()
    return dataclasses.replace(
        inputs, old_seq_log_probs=lbar, old_token_log_probs=old_tok, advantages=inputs.advantages * w
    )


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
