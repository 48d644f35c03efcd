"""How one org turns a task prompt into text, and which tokens end its response: its :class:`PromptStyle`.

Two formats (``model.prompt_format``; ``auto`` = ``chat`` when the tokenizer has a chat template, else
``completion``):

- ``chat``: the tokenizer's own chat template with the generation prompt (:func:`render_prompt`). A response ends
  on any id of the model's ``generation_config.eos_token_id`` or the tokenizer's EOS
  (:func:`~hacrl_fed.engines.base.stop_token_ids`); a re-tokenized foreign response that stopped gets the
  tokenizer's EOS appended.
- ``completion``, for base models without a template: plain text, ``model.few_shot`` solved examples first (the
  *last* ``few_shot`` prompts of the task's train split with their reference answers), then the question::

      <system message>\\n\\n                      (when the prompt has one)
      Question: <train question>\\nAnswer: <its reference answer>\\n\\n      (× few_shot)
      Question: <question>\\nAnswer:

  A response ends at the first token that is only newlines (a base model would go on to write the next
  ``Question:``), as well as on the EOS ids above; a re-tokenized foreign response that stopped gets the
  tokenizer's ``"\\n"`` token appended.

Either way the BOS the tokenizer defines is put in front when the rendered text does not start with it and the
tokenizer itself adds one when encoding with special tokens (Gemma's ``<bos>``; a model without it produces
garbage). Prompts are then encoded with ``add_special_tokens=False`` everywhere, so the ``<bos>`` text is the one
BOS. Tokenizers that never add a BOS (the tiny zoo's, GPT-2's) render exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hacrl_fed.models.chat import _check, eos_token_id, render_prompt
from hacrl_fed.types import ChatMessage

_PREFIX = {"user": "Question: ", "assistant": "Answer: "}


@dataclass(frozen=True)
class PromptStyle:
    """``format``: ``"chat"`` | ``"completion"``; ``bos``: text put in front of a prompt that lacks it (``""``:
    none); ``shots``: ``(question, answer)`` pairs of the completion format; ``stop_ids``: ids that end a response
    besides the EOS ids (completion: the newline tokens); ``end_id``: the id a stopped foreign response gets."""

    format: str
    bos: str
    end_id: int
    shots: tuple[tuple[str, str], ...] = ()
    stop_ids: frozenset[int] = frozenset()

    def render(self, tokenizer: Any, messages: Sequence[ChatMessage]) -> str:
        """The prompt text (module doc)."""
        text = render_prompt(tokenizer, messages) if self.format == "chat" else completion_render(messages, self.shots)
        return text if not self.bos or text.startswith(self.bos) else self.bos + text


def completion_render(messages: Sequence[ChatMessage], shots: Sequence[tuple[str, str]] = ()) -> str:
    """The completion format's text (module doc): system text, the shots, the messages, then ``"Answer:"``."""
    _check(messages)
    parts = [f"{m.content}\n\n" for m in messages if m.role == "system"]
    parts += [f"Question: {q}\nAnswer: {a}\n\n" for q, a in shots]
    parts += [
        f"{_PREFIX[m.role]}{m.content}\n" + "\n" * (m.role == "assistant") for m in messages if m.role != "system"
    ]
    return "".join(parts) + "Answer:"


def bos_text(tokenizer: Any) -> str:
    """The tokenizer's BOS text when the tokenizer adds it in front of encoded text, else ``""``."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bos if with_special[:1] == [bos_id] and without[:1] != [bos_id] else ""


_NEWLINE_PIECES = ("\n", "\u010a", "<0x0A>")  # a newline in a raw token: itself, byte-level BPE's, a byte fallback


def newline_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokens whose text is only newlines (``"\\n"``, ``"\\n\\n"``, …): the raw tokens that spell a
    newline (:data:`_NEWLINE_PIECES`) are decoded, the rest of the vocabulary cannot be one."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    ids = [i for i, p in enumerate(pieces) if p and any(n in p for n in _NEWLINE_PIECES)]
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
    return frozenset(i for i, t in zip(ids, texts) if t and set(t) == {"\n"})


def resolve_format(requested: str, tokenizer: Any) -> str:
    """``auto`` → ``chat`` when the tokenizer has a chat template, else ``completion``."""
    if requested != "auto":
        return requested
    return "chat" if getattr(tokenizer, "chat_template", None) else "completion"


def prompt_style(tokenizer: Any, task: Any = None, *, prompt_format: str = "auto", few_shot: int = 0) -> PromptStyle:
    """The org's :class:`PromptStyle` from ``model.prompt_format`` and ``model.few_shot`` (module doc)."""
    fmt, bos = resolve_format(prompt_format, tokenizer), bos_text(tokenizer)
    if fmt == "chat":
        return PromptStyle("chat", bos, eos_token_id(tokenizer))
    shots: tuple[tuple[str, str], ...] = ()
    if few_shot and task is not None:
        n = task.size("train")
        picked = task.prompts("train", list(range(max(0, n - few_shot), n)))
        shots = tuple((_question(p.messages), p.reference) for p in picked)
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    if len(newline) != 1:
        raise ValueError(f"model.prompt_format=completion: the tokenizer encodes '\\n' as {newline}, not one token")
    return PromptStyle("completion", bos, int(newline[0]), shots, newline_ids(tokenizer) | {int(newline[0])})


def _question(messages: Sequence[ChatMessage]) -> str:
    return "\n".join(m.content for m in messages if m.role == "user")


def style_of(model_cfg: Any, tokenizer: Any, task: Any = None) -> PromptStyle:
    """:func:`prompt_style` for an org's ``model`` section."""
    return prompt_style(tokenizer, task, prompt_format=model_cfg.prompt_format, few_shot=model_cfg.few_shot)
