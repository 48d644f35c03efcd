"""Does a prompt plus its token budget fit a model's context? Checked once at worker start-up, guarded every call.

A model reads at most ``context`` positions (``max_position_embeddings``, GPT-2's ``n_positions``; with the vLLM
engine also ``generation.max_model_len``). A prompt of ``L`` tokens (rendered with the org's chat template) whose
response may take ``budget`` tokens (``generation.max_new_tokens`` for rollouts, ``eval_max_new_tokens`` for
evaluations) needs ``L + budget <= context``; past it a model with learned positions fails with an opaque
"index out of range in self" and a rotary one generates from positions it was never trained on.

* At start-up (:func:`check_task_fits`): every held-out prompt an evaluation uses (the first ``task.eval_size``
  test prompts) and the train prompts (all of them for a task that holds its prompts in memory, ``Task.in_memory``
  such as ``jsonl``; the first :data:`SCAN_LIMIT` of a procedural one) are measured; the longest one that does not fit
  is a :class:`~hacrl_fed.config.BuildError` naming the org, the split and prompt id, the prompt's length, the budget
  field and the context. To keep start-up fast only the :data:`CANDIDATES` prompts with the most content tokens of each
  split are rendered with the chat template and measured exactly.
* At every call (:func:`fits`), for prompts start-up could not see: the worker skips a training prompt that does
  not fit (no rollouts of it from this org; counted as ``gen/skipped_too_long``) and scores an evaluation prompt
  that does not fit as wrong (counted as ``eval/skipped_too_long``), logging a warning either way. The trainer
  likewise leaves out rows whose prompt plus (foreign) response exceed the context (``train/num_too_long``); they
  still count in their group's advantage statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hacrl_fed.config import BuildError

CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")
SCAN_LIMIT = 2048  # train prompt ids of a procedural task measured at start-up (in-memory tasks: every id)
CANDIDATES = 16  # prompts per split rendered with the chat template and measured exactly
_CHUNK = 2048


def context_length(model: Any, max_model_len: int | None = None) -> tuple[int | None, str]:
    """``(positions, where it comes from)`` of ``model`` (a model or its config); ``(None, "")`` when the config
    names none. ``max_model_len`` (vLLM's bound) lowers it."""
    config = getattr(model, "config", model)
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        config = get_text()
    found: tuple[int | None, str] = (None, "")
    for attr in CONTEXT_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found = (value, attr)
            break
    if max_model_len is not None and (found[0] is None or max_model_len < found[0]):
        found = (int(max_model_len), "generation.max_model_len")
    return found


def fits(prompt_tokens: int, budget: int, context: int | None) -> bool:
    """Whether a prompt of ``prompt_tokens`` tokens plus ``budget`` new tokens fits ``context`` (None: no bound)."""
    return context is None or prompt_tokens + budget <= context


def _token_counts(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    out: list[int] = []
    for i in range(0, len(texts), _CHUNK):
        out.extend(len(ids) for ids in tokenizer(list(texts[i : i + _CHUNK]), add_special_tokens=False)["input_ids"])
    return out


def longest_prompt(
    task: Any, split: str, ids: Sequence[int], tokenizer: Any, render: Callable[[Any], str]
) -> tuple[int, int] | None:
    """``(prompt id, tokens)`` of the longest rendered prompt among ``ids`` (None for no ids).

    Ranks every prompt by the tokens of its messages' content, then renders the :data:`CANDIDATES` longest with
    the chat template and measures them exactly (the template adds about the same to every prompt)."""
    ids = list(ids)
    if not ids:
        return None
    prompts = task.prompts(split, ids)
    content = _token_counts(tokenizer, ["\n".join(m.content for m in p.messages) for p in prompts])
    ranked = sorted(range(len(prompts)), key=lambda i: content[i], reverse=True)[:CANDIDATES]
    exact = _token_counts(tokenizer, [render(prompts[i]) for i in ranked])
    best = max(range(len(ranked)), key=lambda j: exact[j])
    return prompts[ranked[best]].prompt_id, exact[best]


def check_task_fits(
    org_id: str,
    task: Any,
    tokenizer: Any,
    render: Callable[[Any], str],
    context: int | None,
    source: str,
    *,
    max_new_tokens: int,
    eval_max_new_tokens: int,
    eval_ids: Sequence[int],
    scan_limit: int = SCAN_LIMIT,
) -> dict[str, int]:
    """Raise :class:`BuildError` when a prompt the run can use does not fit the context with its budget (module
    docstring); otherwise ``{"train": longest train prompt, "test": longest eval prompt}`` in tokens.

    ``source`` names where ``context`` comes from (``max_position_embeddings``...); ``eval_ids``: the held-out
    prompt ids every evaluation uses."""
    out: dict[str, int] = {}
    checks = (
        ("test", list(eval_ids), "eval_max_new_tokens", eval_max_new_tokens),
        (
            "train",
            range(task.size("train") if getattr(task, "in_memory", False) else min(task.size("train"), scan_limit)),
            "max_new_tokens",
            max_new_tokens,
        ),
    )
    for split, ids, field, budget in checks:
        found = longest_prompt(task, split, ids, tokenizer, render)
        if found is None:
            continue
        prompt_id, length = found
        out[split] = length
        if not fits(length, budget, context):
            raise BuildError(
                f"org {org_id!r}: {split} prompt {prompt_id} of task {task.name!r} is {length} tokens and "
                f"generation.{field}={budget}: {length + budget} > the model's context of {context} tokens "
                f"({source}); lower generation.{field}, shorten the prompts, or use a model with a longer context"
            )
    return out
