"""Teach: learning from peers' verified successes the learner cannot yet sample (docs/ALGORITHM.md "Teach").

Pure tensor functions, no I/O. HACPO learns from a foreign row through its importance ratio ``s = exp(lbar_k -
lbar_j)``: a peer's success in a skill the learner has never shown is far less likely under the learner's policy
than under the peer's, so ``s`` falls below the cross band and the row carries no gradient (and the likelihood
screen drops it first). A member then learns from its peers only what it can already sometimes do (BENCHMARKS.md
"Expertise settings"). Teach adds, after the policy update, supervised steps on exactly those rows:

  teach rows  T = { i : not self_i, R_i > 0, and every own row of the learner in group g_i has R = 0 }
  loss        L = -(1/|B|) sum_{i in B} lbar_i,   lbar_i = (1/n_i) sum_t log pi_theta(y_i,t | x_i, y_i,<t)

over a mini-batch ``B`` of ``T``: the mean over rows of the per-token negative log-likelihood, so every row weighs
the same whatever its length.
"""

from __future__ import annotations

import torch
from torch import Tensor


def teach_row_mask(rewards: Tensor, groups: Tensor, is_self: Tensor) -> Tensor:
    """Which rows are teach rows (module docstring). rewards [N], groups [N] (int), is_self [N] (bool) → bool [N].

    A group with no own row is not "failed by the learner" (it has no evidence), so its rows are not teach rows."""
    if not (rewards.shape == groups.shape == is_self.shape and rewards.dim() == 1):
        shapes = [tuple(t.shape) for t in (rewards, groups, is_self)]
        raise ValueError(f"teach_row_mask needs three [N] tensors, got {shapes}")
    is_self = is_self.to(torch.bool)
    own_groups = groups[is_self].unique()
    solved = groups[is_self & (rewards > 0)].unique()
    failed = own_groups[~torch.isin(own_groups, solved)]  # groups where every own row has R <= 0
    return ~is_self & (rewards > 0) & torch.isin(groups, failed)


def teach_loss(token_log_probs: Tensor, response_mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """``L = -mean_b lbar_b`` over one (micro-)batch of teach rows. token_log_probs [B, T] (with gradient),
    response_mask [B, T] → (scalar loss, metrics ``teach/nll`` (the mean per-token NLL) and ``teach/num_rows``)."""
    if token_log_probs.shape != response_mask.shape or token_log_probs.dim() != 2 or token_log_probs.shape[0] == 0:
        raise ValueError(f"teach_loss needs [B, T] inputs with B >= 1, got {tuple(token_log_probs.shape)}")
    mask = response_mask.to(token_log_probs.dtype)
    lbar = (token_log_probs * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # lbar_b = sum_t lp * m / n_b
    loss = -lbar.mean()
    return loss, {"teach/nll": float(-lbar.detach().mean()), "teach/num_rows": float(lbar.numel())}
