"""Per-round batch ordering and mini-batching (docs/ALGORITHM.md "Loss and update schedule")."""

from __future__ import annotations

import torch
from torch import Tensor


def order_rows(is_self: Tensor, source_ids: Tensor) -> Tensor:
    """Permutation putting self rows first (original order), then cross rows grouped by source index
    (ascending, original order within a source). is_self [N] bool, source_ids [N] → LongTensor [N]."""
    is_self = torch.as_tensor(is_self, dtype=torch.bool)
    src = torch.as_tensor(source_ids, dtype=torch.long)
    if is_self.shape != src.shape or is_self.dim() != 1:
        raise ValueError(
            f"is_self and source_ids must be [N] of one shape, got {tuple(is_self.shape)}, {tuple(src.shape)}"
        )
    n = src.numel()
    # key: self rows → -1, cross rows → their source; stable sort keeps the original order within a key
    key = torch.where(is_self, torch.full_like(src, -1), src)
    return torch.sort(key * (n + 1) + torch.arange(n), stable=True).indices


def minibatch_schedule(num_rows: int, minibatch_size: int, epochs: int = 1) -> list[tuple[int, Tensor]]:
    """Split ``num_rows`` ordered rows into consecutive mini-batches, repeated for ``epochs`` with no shuffle.

    Returns ``[(m, row_indices), ...]`` where ``m`` is the 0-based optimizer-step index within the round,
    counting across epochs (``m = epoch * steps_per_epoch + b``). The last mini-batch of an epoch may be smaller.
    """
    if minibatch_size < 1 or epochs < 1 or num_rows < 0:
        raise ValueError(
            f"need minibatch_size >= 1, epochs >= 1, num_rows >= 0; got {minibatch_size}, {epochs}, {num_rows}"
        )
    chunks = list(torch.arange(num_rows).split(minibatch_size)) if num_rows else []
    return [(e * len(chunks) + b, idx) for e in range(epochs) for b, idx in enumerate(chunks)]
