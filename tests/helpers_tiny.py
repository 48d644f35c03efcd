"""Tiny, offline model and tokenizer builders shared by tests (no hub access; each builds in well under a second).

- :func:`tiny_char_tokenizer`: character-level tokenizer (printable ASCII, byte fallback for anything else, so any
  text round-trips), EOS ``</s>``, pad ``<pad>``, a ``<|user|>`` / ``<|assistant|>`` chat template.
- :func:`tiny_bpe_tokenizer`: byte-level BPE trained on a few sentences, Qwen-style ``<|im_start|>`` template, EOS
  ``<|im_end|>``, pad ``<|endoftext|>``.
- :func:`tiny_model`: a 2-layer causal LM (``"gpt2"``, ``"qwen3"`` or ``"llama"``) sized to a tokenizer, in eval
  mode. Weights use a larger init scale than the library default so the next-token distributions are peaked and
  depend on positions (a near-uniform model would hide position-id or alignment bugs). ``eos_logit_bias`` adds a
  bias to the EOS logit (via a biased ``lm_head`` sharing the original weight) so tests can make responses end
  early or immediately.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config
from transformers import AutoModelForCausalLM

ARCHS = ("gpt2", "qwen3", "llama")

CHAR_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BPE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_BPE_CORPUS = [
    "What is 12 + 7? The answer is 19.",
    "Compute the sum of the first ten positive integers. The answer is \\boxed{55}.",
    "Let x be a real number such that 2x + 3 = 11. Then x = 4.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "A triangle has angles 30, 60 and 90 degrees; its hypotenuse is twice the short side.",
]


def tiny_char_tokenizer() -> PreTrainedTokenizerFast:
    """Char-level tokenizer: one token per printable ASCII char, ``<0xNN>`` byte tokens for everything else."""
    specials = ["<pad>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab: dict[str, int] = {}
    for tok in specials + list(string.printable) + [f"<0x{b:02X}>" for b in range(256)]:
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", clean_up_tokenization_spaces=False
    )
    hf.chat_template = CHAR_TEMPLATE
    return hf


def tiny_bpe_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2/Qwen style) trained offline on a tiny corpus; round-trips any text."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_BPE_CORPUS, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>", clean_up_tokenization_spaces=False
    )
    hf.chat_template = BPE_TEMPLATE
    return hf


def _config(arch: str, vocab: int, tokenizer: PreTrainedTokenizerFast, hidden: int, init: float):
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab, n_positions=512, n_embd=hidden, n_layer=2, n_head=2, initializer_range=init, **ids
        )
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=init,
        tie_word_embeddings=False,
        **ids,
    )
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden // 2, **common)
    if arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")


def tiny_model(
    arch: str,
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    *,
    hidden: int = 32,
    init: float = 0.2,
    eos_logit_bias: float = 0.0,
) -> torch.nn.Module:
    """A 2-layer ``arch`` causal LM for ``tokenizer`` (float32, CPU, eval mode), deterministic in ``seed``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, len(tokenizer), tokenizer, hidden, init))
    if eos_logit_bias:
        head = model.lm_head
        biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
        biased.weight = head.weight  # keep the (possibly tied) parameter
        with torch.no_grad():
            biased.bias.zero_()
            biased.bias[tokenizer.eos_token_id] = eos_logit_bias
        model.lm_head = biased
    return model.eval()


def render(tokenizer: PreTrainedTokenizerFast, user_text: str) -> str:
    """The chat-template rendering of one user message with the generation prompt appended."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
    )


def assert_stops_and_lengths(gens, stop_ids, max_new_tokens: int, tokenizer) -> None:
    """Every generation ends in exactly one stop id (``stop``) or has ``max_new_tokens`` tokens (``length``), holds
    no stop id before its end, and its text is the worker tokenizer's decoding of the tokens before the stop."""
    for g in gens:
        body = g.token_ids[:-1] if g.finish_reason == "stop" else g.token_ids
        assert not set(body) & set(stop_ids)
        if g.finish_reason == "stop":
            assert g.token_ids[-1] in stop_ids
        else:
            assert len(g.token_ids) == max_new_tokens
        assert g.text == tokenizer.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# The paper's HACPO (docs/ALGORITHM.md "The defaults and the paper's form"): every foreign row, per-token cross
# ratios, no likelihood screen. Tests of mechanics that the defaults' row choices would hide (micro-batching, the
# schedule, bit-identity of paths) run it; the defaults have their own tests.
PAPER_ALGORITHM: dict = {"logprob_norm": "per_token", "baseline_rows": "joint"}
PAPER_TRAINER: dict = {
    "selection": {"rule": "all"},
    "likelihood_screen": {"enabled": False},
    "outcome_guard": {"enabled": False},
}
