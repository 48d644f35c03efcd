"""Scoring: batch layout, log-probs equal to unpadded forwards, cross-tokenizer re-tokenization, gradients,
micro-batching."""

from __future__ import annotations

import pytest
import torch
from helpers_tiny import ARCHS, render, tiny_bpe_tokenizer, tiny_char_tokenizer, tiny_model

from hacrl_fed.scoring import (
    ScoringBatch,
    build_scoring_batch,
    build_scoring_batch_from_ids,
    per_token_log_probs,
    sequence_log_probs,
    token_log_probs,
)


@pytest.fixture(scope="module")
def bpe():
    return tiny_bpe_tokenizer()


@pytest.fixture(scope="module")
def char():
    return tiny_char_tokenizer()


def unpadded_log_probs(model, prompt: list[int], response: list[int]) -> list[float]:
    """Reference: one unpadded sequence, default positions, log_softmax over float32 logits."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float().log_softmax(-1)
    return [logits[len(prompt) - 1 + j, tok].item() for j, tok in enumerate(response)]


def random_rows(vocab: int, seed: int, n: int = 5) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)

    def row(lo: int, hi: int) -> list[int]:
        return torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    prompts = [row(1, 12) for _ in range(n)]
    responses = [row(0, 9) for _ in range(n)]
    responses[0] = []  # an empty response is allowed
    return prompts, responses


def test_from_ids_layout():
    b = build_scoring_batch_from_ids([[5, 6], [7]], [[1, 2, 3], []], pad_id=0)
    assert b.prompt_width == 2 and b.response_width == 3
    assert b.input_ids.tolist() == [[5, 6, 1, 2, 3], [0, 7, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    assert b.response_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]
    assert b.response_lengths.tolist() == [3, 0]


def test_from_ids_rejects_bad_input():
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] is empty"):
        build_scoring_batch_from_ids([[1], []], [[2], [3]], pad_id=0)
    with pytest.raises(ValueError, match="rows"):
        build_scoring_batch_from_ids([[1]], [[2], [3]], pad_id=0)
    with pytest.raises(ValueError, match="pad_id"):
        build_scoring_batch_from_ids([[1]], [[2]], pad_id=None)
    with pytest.raises(ValueError, match="response_mask shape"):
        t = torch.zeros(2, 3, dtype=torch.long)
        ScoringBatch(t, t, t, torch.zeros(2, 4, dtype=torch.long), 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_log_probs_equal_unpadded_forward(arch, bpe):
    model = tiny_model(arch, bpe, seed=1)
    prompts, responses = random_rows(len(bpe), seed=2)
    batch = build_scoring_batch_from_ids(prompts, responses, bpe.pad_token_id)
    with torch.no_grad():
        lp, mask = token_log_probs(model, batch)
    assert lp.shape == mask.shape == (len(prompts), max(len(r) for r in responses))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        assert mask[i].tolist() == [1.0] * len(r) + [0.0] * (lp.shape[1] - len(r))
        assert lp[i, len(r) :].abs().sum() == 0
        ref = unpadded_log_probs(model, p, r)
        assert torch.allclose(lp[i, : len(r)], torch.tensor(ref), atol=1e-5, rtol=0), (arch, i)


def test_position_ids_matter_for_absolute_positions(bpe):
    """Sensitivity check for the test above: naive positions on a left-padded batch are measurably wrong."""
    model = tiny_model("gpt2", bpe, seed=1)
    prompts, responses = random_rows(len(bpe), seed=2)
    batch = build_scoring_batch_from_ids(prompts, responses, bpe.pad_token_id)
    naive = ScoringBatch(
        batch.input_ids,
        batch.attention_mask,
        torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids).contiguous(),
        batch.response_mask,
        batch.prompt_width,
    )
    with torch.no_grad():
        good, _ = token_log_probs(model, batch)
        bad, _ = token_log_probs(model, naive)
    assert (good - bad).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_flows_and_mode_restored(arch, bpe):
    model = tiny_model(arch, bpe, seed=3)
    model.train()
    prompts, responses = random_rows(len(bpe), seed=4)
    batch = build_scoring_batch_from_ids(prompts, responses, bpe.pad_token_id)
    lp, mask = token_log_probs(model, batch)
    assert model.training, "previous train mode must be restored"
    assert lp.requires_grad
    ((lp * mask).sum() / mask.sum()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_scoring_is_dropout_free(bpe):
    model = tiny_model("gpt2", bpe, seed=5)  # GPT-2 configs carry dropout 0.1
    prompts, responses = random_rows(len(bpe), seed=6)
    batch = build_scoring_batch_from_ids(prompts, responses, bpe.pad_token_id)
    with torch.no_grad():
        ref, _ = token_log_probs(model.eval(), batch)
        model.train()
        again, _ = token_log_probs(model, batch)
    assert torch.equal(ref, again)


@pytest.mark.parametrize("micro", [1, 2, 3])
def test_micro_batched_sequence_log_probs_equal_unbatched(micro, bpe):
    model = tiny_model("llama", bpe, seed=7)
    prompts, responses = random_rows(len(bpe), seed=8, n=7)
    batch = build_scoring_batch_from_ids(prompts, responses, bpe.pad_token_id)
    s_ref, c_ref, m_ref = sequence_log_probs(model, batch, micro_batch_size=len(prompts))
    s, c, m = sequence_log_probs(model, batch, micro_batch_size=micro)
    assert c.tolist() == c_ref.tolist() == [len(r) for r in responses]
    assert torch.allclose(s, s_ref, atol=1e-5, rtol=0) and torch.allclose(m, m_ref, atol=1e-6, rtol=0)
    assert m[0] == 0 and s[0] == 0  # the empty response
    per_tok = per_token_log_probs(model, batch, micro_batch_size=micro)
    assert [len(x) for x in per_tok] == c.tolist()
    assert torch.allclose(torch.tensor([sum(x) for x in per_tok]), s, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        sequence_log_probs(model, batch, micro_batch_size=0)


def test_rows_trims_shared_padding(bpe):
    batch = build_scoring_batch_from_ids([[4, 5, 6, 7], [8]], [[9], [10, 11, 12]], pad_id=0)
    sub = batch.rows([0])
    assert sub.input_ids.tolist() == [[4, 5, 6, 7, 9]] and sub.prompt_width == 4
    sub = batch.rows(slice(1, 2))
    assert sub.input_ids.tolist() == [[8, 10, 11, 12]] and sub.prompt_width == 1
    assert sub.position_ids.tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("source_learner", [("bpe", "char"), ("char", "bpe")])
def test_cross_tokenizer_retokenization(source_learner, bpe, char):
    toks = {"bpe": bpe, "char": char}
    learner = toks[source_learner[1]]
    texts = ["The answer is \\boxed{55}.", "", "héllo wörld\n  x = 4 \ufffd"]
    reasons = ["stop", "stop", "length"]
    prompts = [render(learner, "What is 12 + 7?")] * len(texts)
    batch = build_scoring_batch(learner, prompts, texts, reasons)
    start = batch.prompt_width
    for i, (text, reason) in enumerate(zip(texts, reasons)):
        eos = [learner.eos_token_id] if reason == "stop" else []
        expected = learner(text, add_special_tokens=False)["input_ids"] + eos
        ids = batch.input_ids[i, start : start + int(batch.response_lengths[i])].tolist()
        assert ids == expected, (source_learner, i)
        decoded = learner.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert decoded == text
    model = tiny_model("gpt2", learner, seed=9)
    s, c, _ = sequence_log_probs(model, batch, micro_batch_size=2)
    assert c.tolist() == batch.response_lengths.tolist() and torch.isfinite(s).all()


def test_prompt_and_response_tokenized_separately(bpe):
    """A BPE merge across the boundary must not move it: the response ids are the response's own tokenization."""
    prompt, response = "The ans", "wer is 19."
    p_ids = bpe(prompt, add_special_tokens=False)["input_ids"]
    r_ids = bpe(response, add_special_tokens=False)["input_ids"]
    assert bpe(prompt + response, add_special_tokens=False)["input_ids"] != p_ids + r_ids  # the case is real
    batch = build_scoring_batch(bpe, [prompt], [response], ["length"])
    assert batch.input_ids[0].tolist() == p_ids + r_ids
    assert batch.response_lengths.tolist() == [len(r_ids)]


def test_special_token_text_is_not_a_control_token(bpe):
    batch = build_scoring_batch(bpe, [render(bpe, "q")], ["<|im_end|>"], ["length"])
    ids = batch.input_ids[0, batch.prompt_width :].tolist()
    assert bpe.eos_token_id not in ids and len(ids) > 1


def test_max_response_tokens_and_validation(char):
    prompts = [render(char, "q")] * 2
    batch = build_scoring_batch(char, prompts, ["abcdef", "ab"], ["stop", "stop"], max_response_tokens=4)
    assert batch.response_lengths.tolist() == [4, 3]
    with pytest.raises(ValueError, match=r"finish_reasons\[1\] = 'eos'"):
        build_scoring_batch(char, prompts, ["a", "b"], ["stop", "eos"])
    with pytest.raises(ValueError, match="lengths differ"):
        build_scoring_batch(char, prompts, ["a"], ["stop", "stop"])
