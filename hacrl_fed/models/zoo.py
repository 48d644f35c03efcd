"""The tiny heterogeneous agent zoo's builder: a catalog entry (:mod:`hacrl_fed.models.catalog`) built from its
config and warm-started by SFT, offline.

- :func:`build_agent` trains one and saves HF format (``config.json``, ``model.safetensors``, tokenizer files,
  chat template) plus ``zoo_recipe.json`` (recipe, hash, measured greedy held-out accuracy, build time); the
  catalog's :func:`~hacrl_fed.models.catalog.resolve_zoo` finds it there and never builds.
- ``hacrl-fed zoo build NAME... [--out DIR | --ship]`` (:mod:`hacrl_fed.cli.zoo`) builds them.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hacrl_fed.config import ModelConfig
from hacrl_fed.models.catalog import (
    ARCHS,
    RECIPE_FILE,
    ZOO_FORMAT,
    ZooEntry,
    get_entry,
    read_recipe,
)
from hacrl_fed.models.loading import load_model_and_tokenizer
from hacrl_fed.models.sft import greedy_accuracy, run_sft
from hacrl_fed.models.tokenizers import build_tokenizer
from hacrl_fed.tasks import get_task

log = logging.getLogger("hacrl_fed.models.zoo")

BUILD_THREADS = 1


def build_config(entry: ZooEntry, tokenizer):
    """A transformers config for ``entry.arch`` sized to the tokenizer, dropout off, special ids set."""
    from transformers import GPT2Config, LlamaConfig, Qwen3Config

    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    vocab = len(tokenizer)
    if entry.arch == "qwen3":
        return Qwen3Config(
            vocab_size=vocab,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            attention_dropout=0.0,
            **entry.arch_kwargs,
            **ids,
        )
    if entry.arch == "llama":
        return LlamaConfig(
            vocab_size=vocab,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            attention_dropout=0.0,
            **entry.arch_kwargs,
            **ids,
        )
    if entry.arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab,
            n_positions=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **entry.arch_kwargs,
            **ids,
        )
    raise ValueError(f"zoo entry {entry.name!r}: arch={entry.arch!r} unknown; expected one of {ARCHS}")


def _bpe_corpus(task, size: int) -> list[str]:
    n = min(size, task.size("train"))
    texts: list[str] = []
    for p in task.prompts("train", list(range(n))):
        texts.extend(m.content for m in p.messages)
        texts.append(task.sft_target("train", p.prompt_id))
    return texts


def _num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def build_agent(name: str, out_dir: str | Path, *, dtype: str = "float32", replace: bool = True) -> Path:
    """Build, warm-start and save zoo agent ``name`` into ``out_dir`` (renamed into place); returns it.

    An existing ``out_dir`` is replaced, or with ``replace=False`` kept (a concurrent build of the same
    recipe finished first: both are equivalent, and a process may already be loading that one).

    Saves weights in ``dtype`` (``float32`` or ``float16``), then reloads them through
    :func:`load_model_and_tokenizer` on CPU (float32) to measure greedy accuracy on ``entry.eval_size``
    held-out prompts; that accuracy, the recipe and its hash go to ``zoo_recipe.json``.
    """
    entry, out = get_entry(name), Path(out_dir)
    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype={dtype!r}: zoo agents are saved as float32 or float16")
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)  # reproducible reductions; tiny matmuls gain nothing from more
    try:
        return _build(entry, out, dtype, replace)
    finally:
        torch.set_num_threads(threads)


def _build(entry: ZooEntry, out: Path, dtype: str, replace: bool) -> Path:
    from transformers import AutoModelForCausalLM

    name, start = entry.name, time.perf_counter()
    task = get_task(entry.task, dict(entry.task_params), seed=entry.task_seed)
    tokenizer = build_tokenizer(entry.tokenizer, _bpe_corpus(task, entry.bpe_corpus_size), entry.bpe_vocab_size)
    torch.manual_seed(entry.sft.seed)
    model = AutoModelForCausalLM.from_config(build_config(entry, tokenizer), dtype=torch.float32)
    log.info(
        "zoo %s: %s + %s tokenizer, %d params, SFT %d steps",
        name,
        entry.arch,
        entry.tokenizer,
        _num_params(model),
        entry.sft.steps,
    )
    sft_stats = run_sft(
        model,
        tokenizer,
        task,
        entry.sft,
        max_new_tokens=entry.eval_max_new_tokens,
        log=lambda msg: log.info("zoo %s: %s", name, msg),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        model.to(getattr(torch, dtype)).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        reloaded, tok = load_model_and_tokenizer(
            ModelConfig(path=str(tmp), device="cpu", dtype="float32"), for_training=False
        )
        ids = range(min(entry.eval_size, task.size(entry.eval_split)))
        acc = greedy_accuracy(reloaded, tok, task, entry.eval_split, ids, entry.eval_max_new_tokens)
        record = _record(entry, reloaded, dtype, acc, sft_stats, time.perf_counter() - start)
        (tmp / RECIPE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        _move_into_place(tmp, out, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _check_target(entry, acc["accuracy"])
    log.info(
        "zoo %s: accuracy %.3f (stop rate %.2f) in %.0fs -> %s",
        name,
        acc["accuracy"],
        acc["stop_rate"],
        record["build_seconds"],
        out,
    )
    return out


def _move_into_place(tmp: Path, out: Path, replace: bool) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is removed if ``replace`` or if it is not a built agent."""
    if out.exists() and (replace or read_recipe(out) is None):
        shutil.rmtree(out)
    try:
        tmp.rename(out)
    except OSError:
        if read_recipe(out) is None:
            raise
        log.info("zoo: %s was built concurrently; keeping that copy", out)


def _record(entry: ZooEntry, model, dtype: str, acc: dict, sft_stats: dict, seconds: float) -> dict[str, Any]:
    import transformers

    return {
        "name": entry.name,
        "format": ZOO_FORMAT,
        "recipe_hash": entry.recipe_hash(),
        "recipe": entry.to_json(),
        "num_params": _num_params(model),
        "saved_dtype": dtype,
        "accuracy": acc["accuracy"],
        "stop_rate": acc["stop_rate"],
        "eval": {
            "split": entry.eval_split,
            "num_prompts": int(acc["num_prompts"]),
            "max_new_tokens": entry.eval_max_new_tokens,
            "decoding": "greedy",
            "measured_dtype": "float32",
        },
        "sft": sft_stats,
        "build_seconds": seconds,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "torch_threads": torch.get_num_threads(),
    }


def _check_target(entry: ZooEntry, accuracy: float) -> None:
    if entry.target_accuracy and not entry.target_accuracy[0] <= accuracy <= entry.target_accuracy[1]:
        log.warning("zoo %s: accuracy %.3f outside its target %s", entry.name, accuracy, entry.target_accuracy)
