"""Stopping for any HF model, on the tiny models: loading keeps the model's own EOS list, every engine stops on
all of it plus the prompt format's ids, and ``round/<org>/stopped_frac`` counts the rollouts that stopped."""

from __future__ import annotations

import pytest
import torch
from helpers_tiny import tiny_bpe_tokenizer, tiny_model

from hacrl_fed.config import ModelConfig
from hacrl_fed.coordinator.round_metrics import batch_metrics
from hacrl_fed.engines import build_engine
from hacrl_fed.models.loading import load_model_and_tokenizer
from hacrl_fed.models.prompting import bos_text, prompt_style
from hacrl_fed.types import FINISH_LENGTH, FINISH_STOP, ChatMessage, Rollout, RolloutBatch


def test_loading_keeps_the_models_own_eos_list(tmp_path):
    tok = tiny_bpe_tokenizer()
    model = tiny_model("llama", tok)
    extra = tok.convert_tokens_to_ids("a")
    model.generation_config.eos_token_id = [extra, tok.eos_token_id]
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_model_and_tokenizer(ModelConfig(path=str(tmp_path)))
    assert loaded.generation_config.eos_token_id == [extra, tok.eos_token_id]
    for name in ("hf", "fast"):
        engine = build_engine(name, loaded, loaded_tok, extra_stop_ids=[7])
        assert engine.stop_ids == {extra, tok.eos_token_id, 7}


@pytest.mark.parametrize("engine", ["hf", "fast"])
def test_every_engine_stops_on_the_formats_own_ids(engine):
    """A tokenizer without a template gets the completion format; its newline token ends a response."""
    tok = tiny_bpe_tokenizer()
    tok.chat_template = None
    model = tiny_model("qwen3", tok)
    style = prompt_style(tok)
    head = model.lm_head  # newlines likely (but not certain): some responses stop on one, some run to the end
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    model.lm_head.weight = head.weight
    with torch.no_grad():
        model.lm_head.bias.zero_()
        model.lm_head.bias[style.end_id] = 2.5
    assert style.format == "completion" and style.bos == bos_text(tok) == ""  # this tokenizer adds no BOS
    eng = build_engine(engine, model, tok, extra_stop_ids=style.stop_ids)
    text = style.render(tok, (ChatMessage("user", "1+1"),))
    gens = eng.generate([text], num_samples=16, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=24, seed=0)
    for g in gens[0]:
        stopped = [i for i, t in enumerate(g.token_ids) if t in eng.stop_ids]
        assert stopped == ([len(g.token_ids) - 1] if g.finish_reason == FINISH_STOP else [])
    assert any(g.finish_reason == FINISH_STOP and g.token_ids[-1] in style.stop_ids for g in gens[0])


def _rollout(i: int, reason: str) -> Rollout:
    return Rollout("acme", 1, i, 0, "x", reason, 0.0, -1.0, 2)


def test_round_stopped_frac_counts_the_published_rollouts():
    rollouts = tuple(_rollout(i, r) for i, r in enumerate([FINISH_STOP, FINISH_STOP, FINISH_LENGTH, FINISH_STOP]))
    batch = RolloutBatch("run", 1, "acme", rollouts, 0.0)
    assert batch_metrics("acme", batch, list(rollouts[:2]), {}, None)["round/acme/stopped_frac"] == 0.75
    empty = RolloutBatch("run", 1, "acme", (), 0.0)
    assert "round/acme/stopped_frac" not in batch_metrics("acme", empty, [], {}, None)
