"""What a learner keeps of its last ``W`` rounds in asynchronous rounds (docs/ALGORITHM.md "Asynchronous rounds"):
its own rounds (:class:`RecentRounds`), the joint-group ids of earlier rounds' prompts (:func:`late_group`) and the
one rule for which round's rows may join a request (:func:`round_refusal`). Pure bookkeeping, imported by both the
unsigned (:mod:`~hacrl_fed.worker.late_rounds`) and the signed (:mod:`~hacrl_fed.worker.late_signed`) paths."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hacrl_fed.trainer import TrainRow
from hacrl_fed.worker.intake import OwnRound

LATE_GROUP_STRIDE = 2**32  # > any prompt id: late groups never collide with each other or with a prompt id


def late_group(round: int, prompt_id: int) -> int:
    """The joint-group id of prompt ``prompt_id`` of an earlier round ``round``: negative, one per (round, prompt)."""
    return -(round * LATE_GROUP_STRIDE + prompt_id) - 1


def group_round(group: int, own_round: int) -> tuple[int, int]:
    """``(round, prompt id)`` of a joint group: :func:`late_group`'s inverse; a prompt id is of ``own_round``."""
    if group >= 0:
        return own_round, group
    return divmod(-(group + 1), LATE_GROUP_STRIDE)


@dataclasses.dataclass
class KeptRound:
    """One round this learner generated: its :class:`OwnRound` and the no-token copies of the foreign rows it
    admitted of that round (``taken``; their rewards count in the baselines of later batches of the round)."""

    own: OwnRound
    taken: list[tuple[str, TrainRow]] = dataclasses.field(default_factory=list)  # (source, row in its late group)


class RecentRounds:
    """What a learner keeps of its last ``window`` rounds of one run (module docstring)."""

    def __init__(self, window: int):
        self.window = int(window)
        self.run_id: str | None = None
        self.rounds: dict[int, KeptRound] = {}
        self.used: set[tuple[str, int]] = set()

    def keep(self, own: OwnRound) -> None:
        """Round ``own.round`` was generated: keep it; forget the rounds no later request may reach."""
        if own.run_id != self.run_id:
            self.run_id, self.rounds, self.used = own.run_id, {}, set()
        self.rounds[own.round] = KeptRound(own)
        for old in [r for r in self.rounds if r <= own.round - self.window]:
            del self.rounds[old]
        self.used = {(s, r) for s, r in self.used if r > own.round - self.window}

    def note_admitted(self, rows: Sequence[TrainRow], agents: Sequence[str], own_round: int) -> None:
        """Keep the no-token copies of the cross rows the update used, in their round's late group (baselines of
        that round's later batches)."""
        for row in rows:
            rnd, prompt = group_round(row.group, own_round)
            kept = self.rounds.get(rnd)
            if kept is not None and not row.is_self:
                copy = dataclasses.replace(row, prompt_token_ids=[], response_ids=[], group=late_group(rnd, prompt))
                kept.taken.append((agents[row.source], copy))


def round_refusal(src: str, rnd: int, own_round: int, recent: RecentRounds) -> str | None:
    """Why rows of ``src``'s round ``rnd`` may not join a request of the learner's round ``own_round`` (None: they
    may)."""
    if rnd > own_round:
        return "future_round"
    if rnd <= own_round - recent.window:
        return "beyond_window"
    if (src, rnd) in recent.used:
        return "already_used"
    if rnd != own_round and rnd not in recent.rounds:
        return "not_generated"
    return None
