"""Two offline-built tokenizer kinds for the tiny agent zoo (no hub download).

- ``char``: one token per printable ASCII character (lossless for any ASCII text), plus ``<pad> <eos> <bos>
  <unk>``. Chat template ``"Q: {user}\\nA: "`` (system turns ``"S: ...\\n"``).
- ``bpe``: GPT-2-style byte-level BPE trained on task text to ``vocab_size`` tokens (default 400 = 256 byte
  symbols + merges + specials); lossless for any UTF-8 text. Chat template ``"<|user|>{user}<|assistant|>"``
  with the role markers as single special tokens.

The two templates differ on purpose: when one agent scores another agent's response it re-renders the prompt
with its *own* template and tokenizer, as heterogeneous agents must. Both wrap a ``tokenizers.Tokenizer`` in a
``PreTrainedTokenizerFast`` (left padding), so ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip
them, template included. Neither adds BOS/EOS when encoding: the SFT and scoring code append EOS explicitly.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TOKENIZER_KINDS = ("char", "bpe")
PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
BASE_SPECIALS = (PAD, EOS, BOS, UNK)
ROLE_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>")

# Printable ASCII minus the rare whitespace (\t \r \x0b \x0c): 95 symbols incl. space, plus "\n".
CHAR_ALPHABET = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")

CHAR_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}S: {{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Q: {{ m['content'] }}\n"
    "{% else %}A: {{ m['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)

BPE_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _wrap(tok: Tokenizer, chat_template: str, extra_specials: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Wrap a raw tokenizer as a left-padding HF fast tokenizer with our special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        additional_special_tokens=list(extra_specials) or None,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template
    return fast


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: ids 0-3 are ``<pad> <eos> <bos> <unk>``, then one id per ASCII symbol.

    Vocab size = 4 + 96 = 100. Characters outside the alphabet encode to ``<unk>`` (lossy only for non-ASCII).
    """
    vocab = {tok: i for i, tok in enumerate(BASE_SPECIALS + CHAR_ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(BASE_SPECIALS))
    return _wrap(tok, CHAR_CHAT_TEMPLATE)


def build_bpe_tokenizer(corpus: Iterable[str], vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``corpus`` (deterministic for a fixed corpus order) with ``vocab_size`` tokens.

    Ids 0-6 are ``<pad> <eos> <bos> <unk> <|system|> <|user|> <|assistant|>``; then the 256 byte symbols; the
    rest are merges. ``vocab_size`` must exceed 263 so at least one merge is learned.
    """
    specials = BASE_SPECIALS + ROLE_MARKERS
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size <= len(specials) + len(alphabet):
        raise ValueError(f"vocab_size={vocab_size} must exceed {len(specials) + len(alphabet)} (specials + bytes)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(specials),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return _wrap(tok, BPE_CHAT_TEMPLATE, ROLE_MARKERS)


def build_tokenizer(kind: str, corpus: Iterable[str] = (), vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Dispatch on ``kind`` (``"char"`` | ``"bpe"``); ``corpus``/``vocab_size`` are used by ``bpe`` only."""
    if kind == "char":
        return build_char_tokenizer()
    if kind == "bpe":
        return build_bpe_tokenizer(corpus, vocab_size)
    raise ValueError(f"tokenizer kind {kind!r} unknown; expected one of {TOKENIZER_KINDS}")
