"""The hand-written forward (hacrl_fed/models/native.py) scores and differentiates like the model's own."""

import pytest
import torch

from hacrl_fed.config import AlgorithmConfig, TrainerConfig
from hacrl_fed.models.native import unsupported_reason
from hacrl_fed.scoring import build_scoring_batch_from_ids, token_log_probs
from hacrl_fed.trainer import LocalTrainer
from tests.helpers_tiny import ARCHS, tiny_bpe_tokenizer, tiny_char_tokenizer, tiny_model


def _batch(tok, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = len(tok)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (3, 7, 1, 5)]
    prompts += [prompts[0], prompts[1], prompts[0]]  # rows sharing a prompt share its pass
    responses = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (4, 1, 6, 0, 5, 2, 1)]
    return build_scoring_batch_from_ids(prompts, responses, tok.pad_token_id)  # left and right padding, empty row


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_native_log_probs_and_gradients_equal_the_models_forward(arch, kind):
    tok = tiny_char_tokenizer() if kind == "char" else tiny_bpe_tokenizer()
    model = tiny_model(arch, tok, seed=3, init=0.5)
    assert unsupported_reason(model) is None
    batch = _batch(tok)
    results = []
    for native in (False, True):
        model.zero_grad()
        lp, mask = token_log_probs(model, batch, native=native)
        (lp * mask).sum().backward()
        results.append((lp.detach(), mask, [p.grad.clone() for p in model.parameters()]))
    (lp_m, mask_m, g_m), (lp_n, mask_n, g_n) = results
    assert torch.equal(mask_m, mask_n)
    assert torch.allclose(lp_m, lp_n, atol=1e-5)
    assert (lp_n[mask_n == 0] == 0).all()
    for a, b in zip(g_m, g_n):  # float32 round-off relative to the tensor's scale (gradients here reach ~40)
        assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(a.abs().max()))


def test_the_trainer_takes_the_native_forward_only_where_it_applies():
    tok = tiny_char_tokenizer()
    algo = AlgorithmConfig(name="hacpo")
    assert LocalTrainer(tiny_model("qwen3", tok), algo, TrainerConfig(), tok.pad_token_id).native
    ckpt = TrainerConfig(gradient_checkpointing=True)
    assert not LocalTrainer(tiny_model("llama", tok), algo, ckpt, tok.pad_token_id).native
    bf16 = tiny_model("gpt2", tok).to(torch.bfloat16)
    assert not LocalTrainer(bf16, algo, TrainerConfig(precision="bf16-master"), tok.pad_token_id).native
    with pytest.raises(ValueError, match="no dropout"):
        token_log_probs(tiny_model("qwen3", tok), _batch(tok), native=True, dropout=[torch.nn.Dropout(0.1)])
