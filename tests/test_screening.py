"""screen_batch: every bad-input case is dropped with its reason, good rollouts pass, a group is
pooled only when all G samples pass, claimed rewards are re-verified, nothing raises."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hacrl_fed.plan.screening import accepted_accuracy, screen_batch
from hacrl_fed.types import ChatMessage, Prompt, Rollout, RolloutBatch, RoundPlan, SamplingParams

G = 3
MAX_NEW = 8
PLAN = RoundPlan(
    run_id="run-abc", round=4, task="arithmetic",
    prompts=tuple(Prompt(pid, (ChatMessage("user", f"q{pid}"),), str(pid)) for pid in (10, 20)),
    sampling=SamplingParams(max_new_tokens=MAX_NEW, num_samples=G),
)


def _accepted_rejected(*args, **kwargs):
    """``(accepted, rejected)`` of :func:`screen_batch`."""
    out = screen_batch(*args, **kwargs)
    return out.accepted, out.rejected


def good(pid: int = 10, idx: int = 0, **kw) -> Rollout:
    base = dict(org_id="a", round=4, prompt_id=pid, sample_index=idx, response="r", finish_reason="stop",
                reward=1.0, logprob_sum=-2.0, token_count=3)
    base.update(kw)
    return Rollout(**base)


def batch(*rollouts, **kw) -> RolloutBatch:
    base = dict(run_id="run-abc", round=4, org_id="a", rollouts=tuple(rollouts), accuracy=0.5)
    base.update(kw)
    return RolloutBatch(**base)


def test_full_good_batch_accepted():
    rs = [good(pid, i, reward=float(i % 2)) for pid in (10, 20) for i in range(G)]
    acc, rej = _accepted_rejected(batch(*rs), PLAN, "a")
    assert acc == rs and not rej
    assert accepted_accuracy(acc) == pytest.approx(2 / 6)


@pytest.mark.parametrize("field,value,reason", [
    ("run_id", "other", "run_id_mismatch"),
    ("round", 5, "round_mismatch"),
    ("org_id", "b", "org_id_mismatch"),
])
def test_header_mismatch_rejects_everything(field, value, reason):
    acc, rej = _accepted_rejected(batch(good(), good(20), **{field: value}), PLAN, "a")
    assert acc == [] and rej == {reason: 2}


def test_empty_or_garbage_batches_are_visible_and_do_not_raise():
    acc, rej = _accepted_rejected(batch(), PLAN, "a")
    assert acc == [] and not rej
    acc, rej = _accepted_rejected(batch(org_id="b"), PLAN, "a")
    assert acc == [] and rej == {"org_id_mismatch": 1}
    for garbage in (None, "nope", 3, dataclasses.replace(batch(), rollouts=None)):
        acc, rej = _accepted_rejected(garbage, PLAN, "a")
        assert acc == [] and rej["malformed_batch"] >= 1


BYTES_PER_TOKEN = 12  # text bound = MAX_NEW * 12 = 96 UTF-8 bytes


def group(pid: int, **kw) -> list[Rollout]:
    return [good(pid, i, **kw) for i in range(G)]


@pytest.mark.parametrize("changes,reason", [
    (dict(org_id="b"), "rollout_org_id_mismatch"),
    (dict(round=3), "rollout_round_mismatch"),
    (dict(prompt_id=11), "unknown_prompt"),
    (dict(prompt_id="10"), "unknown_prompt"),
    (dict(sample_index=-1), "bad_sample_index"),
    (dict(sample_index=G), "bad_sample_index"),
    (dict(sample_index=True), "bad_sample_index"),
    (dict(reward=1.5), "bad_reward"),
    (dict(reward=-0.1), "bad_reward"),
    (dict(reward=math.nan), "bad_reward"),
    (dict(reward=math.inf), "bad_reward"),
    (dict(reward="1"), "bad_reward"),
    (dict(logprob_sum=0.5), "bad_logprob"),
    (dict(logprob_sum=1e300), "bad_logprob"),
    (dict(logprob_sum=math.nan), "bad_logprob"),
    (dict(logprob_sum=-math.inf), "bad_logprob"),
    (dict(token_count=0), "bad_token_count"),
    (dict(token_count=MAX_NEW + 2), "bad_token_count"),
    (dict(token_count=2.0), "bad_token_count"),
    (dict(finish_reason="eos"), "bad_finish_reason"),
    (dict(response=b"bytes"), "malformed"),
    (dict(response="x" * 97), "response_too_long"),
    (dict(response="\u00e9" * 49), "response_too_long"),  # 49 characters, 98 UTF-8 bytes
    (dict(response="", sealed_response=b"\0" * (96 + 65)), "response_too_long"),
    (dict(response="r", sealed_response=b"\0" * 20), "response_too_long"),  # both text and ciphertext
])
def test_bad_rollout_dropped_with_reason_and_spoils_its_group(changes, reason):
    """One bad sample of prompt 20: it is dropped with its reason, the other G-1 of that group with
    incomplete_group, and prompt 10's full group passes."""
    rest = [good(20, i) for i in range(G) if i != 1]
    acc, rej = _accepted_rejected(batch(*group(10), good(20, 1, **changes), *rest), PLAN, "a",
                              max_bytes_per_token=BYTES_PER_TOKEN)
    assert acc == group(10) and rej == {reason: 1, "incomplete_group": G - 1}


def test_boundary_values_accepted():
    edge = [good(10, 0, logprob_sum=1e-5, token_count=MAX_NEW + 1, reward=0.0, finish_reason="length"),
            good(10, 1, logprob_sum=0.0, token_count=1, response="x" * 96),
            good(10, 2, response="\u00e9" * 48, reward=0.0),
            *group(20)]
    acc, rej = _accepted_rejected(batch(*edge), PLAN, "a", max_bytes_per_token=BYTES_PER_TOKEN)
    assert acc == edge and not rej


def test_duplicates_and_extra_samples_reject_the_whole_group():
    """2,000 copies of one rollout, or G+1 samples: not exactly G distinct samples, so nothing of that prompt."""
    copies = [good(10, 0)] * 2000
    out = screen_batch(batch(*copies, *group(20)), PLAN, "a")
    assert out.accepted == group(20)
    assert out.rejected == {"duplicate": 1999, "incomplete_group": 1} and out.shortfall == G
    out = screen_batch(batch(*group(10), good(10, G), *group(20)), PLAN, "a")
    assert out.accepted == group(20) and out.rejected == {"bad_sample_index": 1, "incomplete_group": G}


def test_cherry_picking_one_sample_per_prompt_is_rejected_with_its_shortfall():
    out = screen_batch(batch(good(10, 0), good(20, 2)), PLAN, "a")
    assert out.accepted == [] and out.rejected == {"incomplete_group": 2}
    assert out.shortfall == 2 * G


def test_missing_prompt_counts_shortfall_only():
    out = screen_batch(batch(*group(10)), PLAN, "a")
    assert out.accepted == group(10) and not out.rejected and out.shortfall == G


def _verify(response: str, reference: str) -> float:
    return float(response == reference)


def test_claimed_rewards_are_reverified_and_lies_dropped_with_their_group():
    honest = [good(10, 0, response="10", reward=1.0), good(10, 1, response="9", reward=0.0),
              good(10, 2, response="10", reward=1.0)]
    lying = [good(20, 0, response="19", reward=1.0), good(20, 1, response="20"), good(20, 2, response="20")]
    out = screen_batch(batch(*honest, *lying), PLAN, "a", verify=_verify)
    assert out.accepted == honest
    assert out.rejected == {"reward_mismatch": 1, "incomplete_group": 2}
    assert out.checked == 6 and out.mismatches == 1 and out.mismatch_rate == pytest.approx(1 / 6)
    assert out.verified_reward_sum == pytest.approx(4.0)


def test_all_lies_give_mismatch_rate_one():
    out = screen_batch(batch(*group(10, response="nope"), *group(20, response="nope")), PLAN, "a", verify=_verify)
    assert out.accepted == [] and out.mismatch_rate == 1.0 and out.rejected["reward_mismatch"] == 2 * G


def test_verifier_crash_counts_as_reward_zero():
    def boom(response: str, reference: str) -> float:
        raise RecursionError("hostile text")

    out = screen_batch(batch(*group(10, reward=0.0), *group(20, reward=1.0)), PLAN, "a", verify=boom)
    assert out.accepted == group(10, reward=0.0) and out.mismatches == G


def test_sealed_text_is_not_reverified_here():
    sealed = [good(10, i, response="", sealed_response=b"\1" * 20) for i in range(G)]
    out = screen_batch(batch(*sealed), PLAN, "a", verify=_verify)
    assert out.accepted == sealed and out.checked == 0


def test_non_rollout_items_are_malformed():
    acc, rej = _accepted_rejected(batch(*group(10), None, {"reward": 1}), PLAN, "a")
    assert acc == group(10) and rej == {"malformed": 2}


def test_accepted_accuracy_empty_is_none():
    assert accepted_accuracy([]) is None
