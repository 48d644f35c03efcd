"""The rows a learner's update trains on, in the learner's tokenization (:class:`TrainRow`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainRow:
    """One sequence in the learner's tokenization.

    ``old_seq_log_prob`` is ``lbar_old``: the learner's pre-update mean token log-prob for self rows, the source's
    published mean for cross rows. ``old_token_log_probs`` (self rows) feeds token-level losses (GRPO).
    ``norm_length`` > 0 replaces the learner's token count as the divisor of its ``lbar`` of this row (with
    ``algorithm.logprob_norm: per_byte`` a cross row's ``old_seq_log_prob`` is then per byte too).
    """

    prompt_token_ids: list[int]
    response_ids: list[int]
    reward: float
    group: int
    source: int
    is_self: bool
    old_seq_log_prob: float
    old_token_log_probs: list[float] | None = None
    norm_length: float = 0.0  # divisor of this row's lbar; 0: its token count (per_byte cross rows: UTF-8 bytes)
    n_bytes: int = 0  # UTF-8 bytes of the response text (the likelihood screen's per_byte unit)
    claimed_log_prob_sum: float | None = None  # cross rows: the source's claimed sum over its own tokens
    claimed_token_count: int = 0  # cross rows: the source's token count of that claim
    pre_log_prob_sum: float | None = None  # the learner's pre-update log-prob sum (in-band baseline; None: not yet)
    age: int = 0  # rounds between the learner's version and the row's batch's (0: this round's)
    round: int = 0  # the round the row answers (asynchronous rounds; 0: the train request's round)

    def pre_seq_log_prob(self) -> float:
        """``lbar_0``: the pre-update sum over this row's divisor (``norm_length``, else its tokens); a self row
        without one takes its ``old_seq_log_prob`` (the same pre-update weights sampled it)."""
        if self.pre_log_prob_sum is None:
            if not self.is_self:
                raise ValueError("a cross row needs its pre_log_prob_sum (its pre-update score)")
            return self.old_seq_log_prob
        return self.pre_log_prob_sum / max(self.norm_length if self.norm_length > 0 else len(self.response_ids), 1)
