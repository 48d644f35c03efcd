"""validate_batch: every bad-input case is dropped with its reason, good rollouts pass, nothing raises."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hacrl_fed.coordinator.validation import accepted_accuracy, validate_batch
from hacrl_fed.types import ChatMessage, Prompt, Rollout, RolloutBatch, RoundPlan, SamplingParams

G = 3
MAX_NEW = 8
PLAN = RoundPlan(
    run_id="run-abc", round=4, task="arithmetic",
    prompts=tuple(Prompt(pid, (ChatMessage("user", f"q{pid}"),), str(pid)) for pid in (10, 20)),
    sampling=SamplingParams(max_new_tokens=MAX_NEW, num_samples=G),
)


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
    acc, rej = validate_batch(batch(*rs), PLAN, "a")
    assert acc == rs and not rej
    assert accepted_accuracy(acc) == pytest.approx(2 / 6)


@pytest.mark.parametrize("field,value,reason", [
    ("run_id", "other", "run_id_mismatch"),
    ("round", 5, "round_mismatch"),
    ("org_id", "b", "org_id_mismatch"),
])
def test_header_mismatch_rejects_everything(field, value, reason):
    acc, rej = validate_batch(batch(good(), good(20), **{field: value}), PLAN, "a")
    assert acc == [] and rej == {reason: 2}


def test_empty_or_garbage_batches_are_visible_and_do_not_raise():
    acc, rej = validate_batch(batch(), PLAN, "a")
    assert acc == [] and not rej
    acc, rej = validate_batch(batch(org_id="b"), PLAN, "a")
    assert acc == [] and rej == {"org_id_mismatch": 1}
    for garbage in (None, "nope", 3, dataclasses.replace(batch(), rollouts=None)):
        acc, rej = validate_batch(garbage, PLAN, "a")  # type: ignore[arg-type]
        assert acc == [] and rej["malformed_batch"] >= 1


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
    (dict(logprob_sum=math.nan), "bad_logprob"),
    (dict(logprob_sum=-math.inf), "bad_logprob"),
    (dict(token_count=0), "bad_token_count"),
    (dict(token_count=MAX_NEW + 2), "bad_token_count"),
    (dict(token_count=2.0), "bad_token_count"),
    (dict(finish_reason="eos"), "bad_finish_reason"),
    (dict(response=b"bytes"), "malformed"),
    (dict(response="x" * 101), "response_too_long"),
])
def test_bad_rollout_dropped_with_reason(changes, reason):
    bad = good(20, 1, **changes)
    acc, rej = validate_batch(batch(good(), bad), PLAN, "a", max_response_chars=100)
    assert acc == [good()] and rej == {reason: 1}


def test_boundary_values_accepted():
    edge = [good(10, 0, logprob_sum=1e-5, token_count=MAX_NEW + 1, reward=0.0, finish_reason="length"),
            good(10, 1, logprob_sum=0.0, token_count=1, response="x" * 100)]
    acc, rej = validate_batch(batch(*edge), PLAN, "a", max_response_chars=100)
    assert acc == edge and not rej


def test_duplicates_keep_first_copy_and_cap_per_prompt_count():
    first = good(10, 0, reward=1.0)
    again = good(10, 0, reward=0.0)
    rs = [first, again] + [good(10, i) for i in range(1, G)] + [good(10, G)]
    acc, rej = validate_batch(batch(*rs), PLAN, "a")
    assert acc[0] is first and len(acc) == G
    assert rej == {"duplicate": 1, "bad_sample_index": 1}


def test_non_rollout_items_are_malformed():
    acc, rej = validate_batch(batch(good(), None, {"reward": 1}), PLAN, "a")
    assert acc == [good()] and rej == {"malformed": 2}


def test_accepted_accuracy_empty_is_none():
    assert accepted_accuracy([]) is None
