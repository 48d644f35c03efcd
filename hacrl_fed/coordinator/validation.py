"""Coordinator-side checks of an org's :class:`RolloutBatch` against the round's :class:`RoundPlan`.

``validate_batch`` never raises on bad data: every problem becomes a reason in a ``Counter`` and the offending
rollouts are dropped. The wire codec already checks types and ranges of what came over gRPC; this module also
guards in-process workers (no codec) and checks what the codec cannot know: that the batch answers *this* plan.

Reasons (Counter keys). Header problems reject the whole batch, counted once per rollout (at least 1, so an
empty forged batch stays visible): ``malformed_batch``, ``run_id_mismatch``, ``round_mismatch``,
``org_id_mismatch``. Per rollout, first failing check wins: ``malformed``, ``rollout_org_id_mismatch``,
``rollout_round_mismatch``, ``unknown_prompt``, ``bad_sample_index``, ``duplicate``, ``bad_reward``,
``bad_logprob``, ``bad_token_count``, ``bad_finish_reason``, ``response_too_long``.

Per-prompt counts ``<= G`` follow from ``0 <= sample_index < G`` plus the duplicate check on
``(prompt_id, sample_index)``.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from hacrl_fed.types import FINISH_REASONS, Rollout, RolloutBatch, RoundPlan

LOGPROB_SLACK = 1e-4  # a sum of log-probs is <= 0; allow float noise from fused kernels
DEFAULT_MAX_RESPONSE_CHARS = 2**20  # the wire codec's text cap


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: Any) -> float | None:
    """``float(x)`` when ``x`` is a real, finite number (not a bool); else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def header_problem(batch: Any, plan: RoundPlan, org_id: str) -> str | None:
    """The first header reason that rejects the whole batch, or None when it answers ``plan`` for ``org_id``."""
    if not isinstance(batch, RolloutBatch) or not isinstance(batch.rollouts, (tuple, list)):
        return "malformed_batch"
    if batch.run_id != plan.run_id:
        return "run_id_mismatch"
    if batch.round != plan.round:
        return "round_mismatch"
    if batch.org_id != org_id:
        return "org_id_mismatch"
    return None


def rollout_problem(r: Any, plan: RoundPlan, org_id: str, prompt_ids: set[int], max_response_chars: int) -> str | None:
    """The first per-rollout reason (duplicates excluded: they need the batch), or None when ``r`` is sound.

    Bounds: reward finite in [0, 1]; logprob_sum finite and <= LOGPROB_SLACK; 1 <= token_count <=
    max_new_tokens + 1; 0 <= sample_index < G (``plan.sampling.num_samples``); len(response) <= max_response_chars.
    """
    if not isinstance(r, Rollout):
        return "malformed"
    if r.org_id != org_id:
        return "rollout_org_id_mismatch"
    if r.round != plan.round:
        return "rollout_round_mismatch"
    if not _is_int(r.prompt_id) or r.prompt_id not in prompt_ids:
        return "unknown_prompt"
    if not _is_int(r.sample_index) or not 0 <= r.sample_index < plan.sampling.num_samples:
        return "bad_sample_index"
    reward = _finite(r.reward)
    if reward is None or not 0.0 <= reward <= 1.0:
        return "bad_reward"
    logprob = _finite(r.logprob_sum)
    if logprob is None or logprob > LOGPROB_SLACK:
        return "bad_logprob"
    if not _is_int(r.token_count) or not 1 <= r.token_count <= plan.sampling.max_new_tokens + 1:
        return "bad_token_count"
    if r.finish_reason not in FINISH_REASONS:
        return "bad_finish_reason"
    if not isinstance(r.response, str):
        return "malformed"
    if len(r.response) > max_response_chars:
        return "response_too_long"
    return None


def validate_batch(batch: RolloutBatch, plan: RoundPlan, org_id: str, *,
                   max_response_chars: int = DEFAULT_MAX_RESPONSE_CHARS) -> tuple[list[Rollout], Counter[str]]:
    """Split ``batch`` into ``(accepted rollouts in arrival order, Counter of rejection reasons)``.

    The first copy of a ``(prompt_id, sample_index)`` pair is kept, later copies are ``duplicate``.
    """
    rejected: Counter[str] = Counter()
    problem = header_problem(batch, plan, org_id)
    if problem is not None:
        n = len(batch.rollouts) if problem != "malformed_batch" else _safe_len(batch)
        rejected[problem] = max(n, 1)
        return [], rejected
    prompt_ids = {p.prompt_id for p in plan.prompts}
    seen: set[tuple[int, int]] = set()
    accepted: list[Rollout] = []
    for r in batch.rollouts:
        reason = rollout_problem(r, plan, org_id, prompt_ids, max_response_chars)
        if reason is None and (r.prompt_id, r.sample_index) in seen:
            reason = "duplicate"
        if reason is not None:
            rejected[reason] += 1
            continue
        seen.add((r.prompt_id, r.sample_index))
        accepted.append(r)
    return accepted, rejected


def _safe_len(batch: Any) -> int:
    try:
        return len(batch.rollouts)
    except Exception:  # anything at all: this path exists for garbage input
        return 1


def accepted_accuracy(accepted: list[Rollout]) -> float | None:
    """Mean reward of the accepted rollouts (the coordinator's ``P_k(t)``); None when there are none."""
    if not accepted:
        return None
    return sum(float(r.reward) for r in accepted) / len(accepted)
