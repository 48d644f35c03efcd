"""Rendering chat prompts with an agent's own template, and its EOS id.

Every agent renders the shared task prompt with its *own* chat template; the response text is tokenized
separately and appended (``prompt_token_ids + response_ids [+ eos]``), which is how both SFT and scoring see it.
"""

from __future__ import annotations

from collections.abc import Sequence

from hacrl_fed.types import ChatMessage

_ROLES = ("system", "user", "assistant")
_FALLBACK_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


def _check(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise ValueError("messages: need at least one chat message")
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise ValueError(f"messages[{i}].role={m.role!r}; expected one of {_ROLES}")


def fallback_render(messages: Sequence[ChatMessage]) -> str:
    """Plain template for tokenizers without one: ``"System: s\\nUser: q\\nAssistant:"``.

    Each message becomes ``"<Role>: <content>\\n"``; the generation prompt ``"Assistant:"`` ends the string.
    """
    _check(messages)
    body = "".join(f"{_FALLBACK_NAMES[m.role]}: {m.content}\n" for m in messages)
    return body + "Assistant:"


def render_prompt(tokenizer, messages: Sequence[ChatMessage]) -> str:
    """The prompt text an agent conditions on: its chat template with ``add_generation_prompt=True``.

    Deterministic (no dates or random ids). Falls back to :func:`fallback_render` when the tokenizer has no
    chat template. The result is encoded with ``add_special_tokens=False`` by callers.
    """
    _check(messages)
    if not getattr(tokenizer, "chat_template", None):
        return fallback_render(messages)
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def eos_token_id(tokenizer) -> int:
    """The id that ends a response (the tokenizer's ``eos_token_id``); errors if the tokenizer has none."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no eos_token; cannot mark response ends")
    if isinstance(eos, (list, tuple)):
        return int(eos[0])
    return int(eos)
