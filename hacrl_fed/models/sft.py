"""Supervised warm start of a zoo agent on a task's worked answers, and greedy held-out accuracy.

One SFT example = ``prompt_token_ids + response_ids + [eos]`` where the prompt is the task prompt rendered with the
agent's *own* chat template (:func:`render_prompt`) and the response is ``task.sft_target(...)``, tokenized
separately without special tokens. Loss: token-mean cross-entropy over the response tokens and the EOS only
(prompt positions are masked with ``-100``), so the model learns to stop (``finish_reason == "stop"``).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hacrl_fed.models.chat import eos_token_id, render_prompt

IGNORE = -100


@dataclass(frozen=True)
class SFTRecipe:
    """AdamW warm start: up to ``steps`` optimizer steps of ``batch_size`` random train prompts each.

    lr schedule: linear warm-up over ``warmup_steps`` to ``lr``, then cosine decay to ``lr * min_lr_ratio``
    (over ``steps``). With ``stop_at_accuracy`` set, the last ``val_size`` train-split ids are held out of SFT
    and every ``check_every`` steps the greedy accuracy on them is measured; training stops at the first check
    reaching ``stop_at_accuracy``. Tiny models learn this task in a sudden jump, so stopping on a measured
    accuracy lands a warm start in a wanted range far more reliably than a fixed step count.
    """

    steps: int = 2000
    lr: float = 3e-3
    batch_size: int = 32
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    stop_at_accuracy: float | None = None
    check_every: int = 100
    val_size: int = 200

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "check_every", "val_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft.{name}={getattr(self, name)} must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"sft.lr={self.lr} must be > 0")


def lr_at(step: int, recipe: SFTRecipe) -> float:
    """Learning rate for 0-based ``step``: warm-up ``lr*(step+1)/W``, then ``lr*(r + (1-r)*(1+cos(pi*p))/2)``."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    span = max(recipe.steps - recipe.warmup_steps, 1)
    progress = min((step - recipe.warmup_steps) / span, 1.0)
    r = recipe.min_lr_ratio
    return recipe.lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress)))


def encode_example(tokenizer, prompt_text: str, response: str) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` for one example; labels are ``-100`` on the prompt, the ids on response + EOS."""
    prompt_token_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [eos_token_id(tokenizer)]
    return prompt_token_ids + response_ids, [IGNORE] * len(prompt_token_ids) + response_ids


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example. Returns ``input_ids``, ``attention_mask``, ``labels``, ``position_ids``,
    each ``[B, T]``; ``position_ids = cumsum(mask) - 1`` clamped at 0 (padding-side agnostic)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "position_ids": position_ids}


def response_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean next-token cross-entropy over positions whose label is not ``-100`` (scalar)."""
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits
    shifted = logits[:, :-1].float()
    target = batch["labels"][:, 1:]
    return F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), target.reshape(-1), ignore_index=IGNORE)


def _batch_examples(task, tokenizer, split: str, ids: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    prompts = task.prompts(split, list(ids))
    return [
        encode_example(tokenizer, render_prompt(tokenizer, p.messages), task.sft_target(split, p.prompt_id))
        for p in prompts
    ]


def run_sft(
    model,
    tokenizer,
    task,
    recipe: SFTRecipe,
    *,
    split: str = "train",
    max_new_tokens: int = 32,
    log: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Train ``model`` in place (eval mode: no dropout); returns ``loss_first``, ``loss_last`` (mean of the
    last 50 steps), ``steps_done``, ``val_accuracy`` (last check, -1 if none) and ``seconds``.

    Batches are drawn with replacement from the ``split`` ids (minus the validation ids, see
    :class:`SFTRecipe`) by ``random.Random(recipe.seed)``.
    """
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    n = task.size(split)
    checking = recipe.stop_at_accuracy is not None
    if checking and n <= recipe.val_size:
        raise ValueError(f"sft.val_size={recipe.val_size} leaves no {split!r} prompts to train on (size {n})")
    n_train, val_ids = (n - recipe.val_size, range(n - recipe.val_size, n)) if checking else (n, range(0))
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=recipe.weight_decay)
    model.eval()
    start, losses, val_acc, step = time.perf_counter(), [], -1.0, 0
    for step in range(1, recipe.steps + 1):
        ids = [rng.randrange(n_train) for _ in range(recipe.batch_size)]
        batch = collate(_batch_examples(task, tokenizer, split, ids), tokenizer.pad_token_id)
        losses.append(
            _sgd_step(
                model, opt, {k: v.to(device) for k, v in batch.items()}, lr_at(step - 1, recipe), recipe.grad_clip
            )
        )
        if checking and step % recipe.check_every == 0:
            val_acc = greedy_accuracy(model, tokenizer, task, split, val_ids, max_new_tokens)["accuracy"]
            if log:
                log(
                    f"sft step {step}/{recipe.steps} loss {_tail_mean(losses):.4f} val accuracy {val_acc:.3f} "
                    f"({time.perf_counter() - start:.0f}s)"
                )
            if recipe.stop_at_accuracy is not None and val_acc >= recipe.stop_at_accuracy:
                break
        elif log and not checking and step % max(recipe.steps // 10, 1) == 0:
            log(f"sft step {step}/{recipe.steps} loss {_tail_mean(losses):.4f} ({time.perf_counter() - start:.0f}s)")
    return {
        "loss_first": losses[0],
        "loss_last": _tail_mean(losses),
        "steps_done": float(step),
        "val_accuracy": val_acc,
        "seconds": time.perf_counter() - start,
    }


def _tail_mean(values: list[float], k: int = 50) -> float:
    tail = values[-k:]
    return sum(tail) / len(tail)


def _sgd_step(model, opt, batch: dict[str, torch.Tensor], lr: float, grad_clip: float) -> float:
    """One AdamW step on :func:`response_loss` at learning rate ``lr``; returns the loss."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss = response_loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return loss.item()


@torch.no_grad()
def greedy_responses(
    model, tokenizer, prompt_texts: Sequence[str], max_new_tokens: int = 32, batch_size: int = 100
) -> list[tuple[str, bool]]:
    """Greedy-decode each prompt; returns ``(response_text, stopped)`` per prompt, special tokens skipped.

    ``stopped`` is True iff the response ended with EOS within ``max_new_tokens``.
    """
    eos, device, out = eos_token_id(tokenizer), next(model.parameters()).device, []
    for lo in range(0, len(prompt_texts), batch_size):
        enc = tokenizer(
            list(prompt_texts[lo : lo + batch_size]),
            add_special_tokens=False,
            padding=True,
            return_tensors="pt",
            padding_side="left",
        ).to(device)
        gen = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        for row in gen[:, enc["input_ids"].shape[1] :].tolist():
            stopped = eos in row
            row = row[: row.index(eos)] if stopped else row
            out.append((tokenizer.decode(row, skip_special_tokens=True), stopped))
    return out


def greedy_accuracy(
    model, tokenizer, task, split: str, ids: Sequence[int], max_new_tokens: int = 32
) -> dict[str, float]:
    """Mean ``task.verify`` reward of greedy responses on ``ids`` of ``split``, plus the stop rate.

    Returns ``{"accuracy", "stop_rate", "num_prompts"}``.
    """
    prompts = task.prompts(split, list(ids))
    texts = [render_prompt(tokenizer, p.messages) for p in prompts]
    results = greedy_responses(model, tokenizer, texts, max_new_tokens)
    rewards = [task.verify(resp, p.reference) for (resp, _), p in zip(results, prompts)]
    return {
        "accuracy": sum(rewards) / len(rewards),
        "stop_rate": sum(s for _, s in results) / len(results),
        "num_prompts": float(len(prompts)),
    }
