"""The intake's teach rows (``trainer.teach``; docs/ALGORITHM.md "Teach"; :mod:`hacrl_fed.algorithm.teach`).

Taken from the round's rows after stage 6 (re-tokenized, so every stage that bounds, opens, verifies, excludes,
quarantines and selects foreign rows has run on them) and before the likelihood screen (stage 7), which would drop
by design the successes the learner cannot sample. Stage 8 applies: a teach row that does not fit the learner's
context has nothing to train on and is left out. ``teach/...`` metrics count what was taken and how many of those
rows the screen also let into the policy update.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import torch

from hacrl_fed.algorithm.teach import teach_row_mask
from hacrl_fed.config.trainer import TeachConfig
from hacrl_fed.models.context import fits
from hacrl_fed.trainer import TrainRow


def teach_mask(rows: Sequence[TrainRow]) -> list[bool]:
    """:func:`~hacrl_fed.algorithm.teach.teach_row_mask` of ``rows`` (own and cross rows of one round)."""
    if not rows:
        return []
    rewards = torch.tensor([r.reward for r in rows], dtype=torch.float64)
    groups = torch.tensor([r.group for r in rows], dtype=torch.long)
    is_self = torch.tensor([r.is_self for r in rows], dtype=torch.bool)
    return teach_row_mask(rewards, groups, is_self).tolist()


def take_teach_rows(
    rows: Sequence[TrainRow],
    admitted: Sequence[TrainRow],
    agents: Sequence[str],
    cfg: TeachConfig,
    context: int | None,
    seed: int,
) -> tuple[list[TrainRow], dict[str, float]]:
    """The teach rows of ``rows`` (before the likelihood screen) that have tokens and fit ``context``, at most
    ``cfg.max_rows`` of them (a sample seeded by ``seed``, kept in their order), and the ``teach/...`` metrics;
    ``admitted``: the rows the policy update trains on (after the screen), for ``teach/num_in_update`` (those of them
    with tokens that are teach rows too)."""
    taken = [
        r
        for r, t in zip(rows, teach_mask(rows))
        if t and r.response_ids and fits(len(r.prompt_token_ids), len(r.response_ids), context)
    ]
    if cfg.max_rows is not None and len(taken) > cfg.max_rows:
        keep = sorted(random.Random(seed).sample(range(len(taken)), cfg.max_rows))
        taken = [taken[i] for i in keep]
    in_update = sum(t and bool(r.response_ids) for r, t in zip(admitted, teach_mask(admitted)))
    out: dict[str, float] = {"teach/num_rows": float(len(taken)), "teach/num_in_update": float(in_update)}
    for source, n in sorted(Counter(agents[r.source] for r in taken).items()):
        out[f"teach/{source}/num_rows"] = float(n)
    return taken, out
