"""Checks of an org's :class:`RolloutBatch` against the round's :class:`RoundPlan`: the trust boundary's core.

The same code screens a batch at the coordinator (as it arrives) and at every receiving worker (before it trains
on foreign rollouts): nothing an org, the coordinator or the network sends is trusted until it passed here.
:func:`screen_batch` never raises on bad data: every problem becomes a reason in a ``Counter`` and the offending
rollouts are dropped.

Reasons (Counter keys). Header problems reject the whole batch, counted once per rollout (at least 1, so an
empty forged batch stays visible): ``malformed_batch``, ``run_id_mismatch``, ``round_mismatch``,
``org_id_mismatch``. Per rollout, first failing check wins: ``malformed``, ``rollout_org_id_mismatch``,
``rollout_round_mismatch``, ``unknown_prompt``, ``bad_sample_index``, ``duplicate``, ``bad_reward``,
``bad_logprob``, ``bad_token_count``, ``bad_finish_reason``, ``response_too_long``, ``reward_mismatch`` (the
receiver's own verifier contradicts the claimed reward). Per group: ``incomplete_group`` — a prompt's group is
pooled only when all ``G`` planned samples of that org passed every check, so an org cannot cherry-pick which of
its samples count (the other members of a group with a failing or missing sample are dropped with this reason).

Text is bounded before anything reads it: ``len(response.encode()) <= max_new_tokens * max_bytes_per_token``
(sealed text: its ciphertext length, less the AEAD overhead).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hacrl_fed.limits import MAX_BYTES_PER_TOKEN
from hacrl_fed.types import FINISH_REASONS, Rollout, RolloutBatch, RoundPlan

LOGPROB_SLACK = 1e-4  # a sum of log-probs is <= 0; allow float noise from fused kernels
SEALED_OVERHEAD_BYTES = 64  # AEAD tag (and nonce) around sealed text
REWARD_TOLERANCE = 1e-6  # |claimed - verified| above this is a mismatch

Verifier = Callable[[str, str], float]  # (response text, reference answer) -> reward in [0, 1]


@dataclass
class Screened:
    """What :func:`screen_batch` kept and why it dropped the rest.

    ``checked`` rollouts were re-verified (text readable, verifier given), ``mismatches`` of them disagreed with
    the claimed reward and ``verified_reward_sum`` sums the verifier's rewards over ``checked``; ``shortfall``
    counts planned samples (prompts × G) that are not pooled.
    """

    accepted: list[Rollout] = field(default_factory=list)
    rejected: Counter = field(default_factory=Counter)
    checked: int = 0
    mismatches: int = 0
    verified_reward_sum: float = 0.0
    shortfall: int = 0

    @property
    def mismatch_rate(self) -> float:
        """``mismatches / checked`` (0 when nothing was checked)."""
        return self.mismatches / self.checked if self.checked else 0.0


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: Any) -> float | None:
    """``float(x)`` when ``x`` is a real, finite number (not a bool); else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def max_response_bytes(plan: RoundPlan, max_bytes_per_token: int = MAX_BYTES_PER_TOKEN) -> int:
    """The text bound a plan allows: ``max_new_tokens * max_bytes_per_token`` UTF-8 bytes."""
    return plan.sampling.max_new_tokens * max_bytes_per_token


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


def _text_too_long(r: Rollout, max_bytes: int) -> bool | None:
    """True when the (possibly sealed) text exceeds ``max_bytes``; None when the fields are malformed."""
    sealed = getattr(r, "sealed_response", b"")
    if not isinstance(r.response, str) or not isinstance(sealed, (bytes, bytearray)):
        return None
    if sealed:
        return bool(r.response) or len(sealed) > max_bytes + SEALED_OVERHEAD_BYTES
    if len(r.response) > max_bytes:  # chars <= bytes: a cheap bound before encoding
        return True
    return len(r.response.encode("utf-8", "surrogatepass")) > max_bytes


def rollout_problem(r: Any, plan: RoundPlan, org_id: str, planned_ids: set[int], max_bytes: int) -> str | None:
    """The first per-rollout reason (duplicates and rewards excluded: they need more context), or None.

    Bounds: reward finite in [0, 1]; logprob_sum finite and <= LOGPROB_SLACK; 1 <= token_count <=
    max_new_tokens + 1; 0 <= sample_index < G (``plan.sampling.num_samples``); text <= ``max_bytes``.
    """
    if not isinstance(r, Rollout):
        return "malformed"
    if r.org_id != org_id:
        return "rollout_org_id_mismatch"
    if r.round != plan.round:
        return "rollout_round_mismatch"
    if not _is_int(r.prompt_id) or r.prompt_id not in planned_ids:
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
    too_long = _text_too_long(r, max_bytes)
    if too_long is None:
        return "malformed"
    return "response_too_long" if too_long else None


def _reverify(r: Rollout, reference: str, verify: Verifier, out: Screened) -> str | None:
    """Re-run the verifier on readable text; ``reward_mismatch`` when it contradicts the claim."""
    if getattr(r, "sealed_response", b""):
        return None  # sealed: only the recipients can read (and verify) it
    try:
        verified = float(verify(r.response, reference))
    except Exception:  # a verifier crash on hostile text is that text's problem, not the round's
        verified = 0.0
    out.checked += 1
    out.verified_reward_sum += verified
    if not abs(verified - float(r.reward)) <= REWARD_TOLERANCE:
        out.mismatches += 1
        return "reward_mismatch"
    return None


def screen_batch(
    batch: Any,
    plan: RoundPlan,
    org_id: str,
    *,
    verify: Verifier | None = None,
    max_bytes_per_token: int = MAX_BYTES_PER_TOKEN,
) -> Screened:
    """Screen ``batch`` (``org_id``'s answer to ``plan``): see the module docstring for every reason.

    ``verify`` (the task's verifier) re-checks every readable rollout's claimed reward against the prompt's
    reference. Accepted rollouts keep arrival order; a group enters only when all ``G`` samples passed.
    """
    out = Screened()
    g = plan.sampling.num_samples
    problem = header_problem(batch, plan, org_id)
    if problem is not None:
        n = len(batch.rollouts) if problem != "malformed_batch" else _safe_len(batch)
        out.rejected[problem] = max(n, 1)
        out.shortfall = len(plan.prompts) * g
        return out
    references = {p.prompt_id: p.reference for p in plan.prompts}
    max_bytes = max_response_bytes(plan, max_bytes_per_token)
    seen: set[tuple[int, int]] = set()
    passed: dict[int, list[Rollout]] = {pid: [] for pid in references}
    failed_groups: set[int] = set()
    planned_ids = set(references)
    for r in batch.rollouts:
        reason = rollout_problem(r, plan, org_id, planned_ids, max_bytes)
        if reason is None and (r.prompt_id, r.sample_index) in seen:
            reason = "duplicate"
        if reason is None:
            seen.add((r.prompt_id, r.sample_index))
            if verify is not None:
                reason = _reverify(r, references[r.prompt_id], verify, out)
        if reason is not None:
            out.rejected[reason] += 1
            pid = getattr(r, "prompt_id", None)
            if _is_int(pid) and pid in passed:  # any bad member spoils its group
                failed_groups.add(pid)
            continue
        passed[r.prompt_id].append(r)
    for pid, group in passed.items():
        if len(group) == g and pid not in failed_groups:
            out.accepted.extend(group)
        else:
            out.shortfall += g
            if group:
                out.rejected["incomplete_group"] += len(group)
    order = {id(r): i for i, r in enumerate(batch.rollouts)}
    out.accepted.sort(key=lambda r: order[id(r)])
    return out


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
