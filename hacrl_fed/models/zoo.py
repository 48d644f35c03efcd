"""The tiny heterogeneous agent zoo: named agents built from configs and warm-started by SFT, offline.

An entry = architecture config + tokenizer kind + SFT recipe + task + target start accuracy. Its *recipe hash*
(sha256 of the entry's JSON and :data:`ZOO_FORMAT`) keys every built copy:

- :func:`build_agent` trains one and saves HF format (``config.json``, ``model.safetensors``, tokenizer files,
  chat template) plus ``zoo_recipe.json`` (recipe, hash, measured greedy held-out accuracy, build time).
- :func:`resolve_zoo` returns the shipped copy ``hacrl_fed/assets/zoo/<name>/`` when its hash matches, else a
  cached one ``$HACRL_FED_CACHE/zoo/<name>-<hash>`` (default cache root ``~/.cache/hacrl_fed``) when one was
  built. It never builds: loading a model never trains. A stale or missing agent is a
  :class:`~hacrl_fed.config.BuildError` naming the command that builds it (``hacrl-fed zoo build NAME --ship``).
- ``hacrl-fed zoo build NAME... [--out DIR | --ship]`` (:mod:`hacrl_fed.cli.zoo`) builds them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hacrl_fed.config import BuildError
from hacrl_fed.models.sft import SFTRecipe, greedy_accuracy, run_sft
from hacrl_fed.models.tokenizers import build_tokenizer

log = logging.getLogger("hacrl_fed.models.zoo")

ZOO_FORMAT = 1  # bump when build code changes what a recipe produces
RECIPE_FILE = "zoo_recipe.json"
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "zoo"
ARCHS = ("qwen3", "gpt2", "llama")
BUILD_THREADS = 1


@dataclass(frozen=True)
class ZooEntry:
    """One named agent. ``arch_kwargs`` go to the transformers config (vocab/special ids are filled in)."""

    name: str
    arch: str
    arch_kwargs: dict[str, Any]
    tokenizer: str  # "char" | "bpe"
    sft: SFTRecipe
    bpe_vocab_size: int = 400
    task: str = "arithmetic"
    task_params: dict[str, Any] = field(default_factory=lambda: {"difficulty": 2})
    task_seed: int = 0
    bpe_corpus_size: int = 4000  # train prompts (prompt + worked answer) the BPE is trained on
    eval_split: str = "test"
    eval_size: int = 200
    eval_max_new_tokens: int = 32
    target_accuracy: tuple[float, float] | None = None  # (low, high) wanted for the warm start; None = any

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["target_accuracy"] = list(self.target_accuracy) if self.target_accuracy else None
        return data

    def recipe_hash(self) -> str:
        """First 12 hex digits of sha256 over the canonical JSON of the entry plus :data:`ZOO_FORMAT`."""
        blob = json.dumps({"format": ZOO_FORMAT, "entry": self.to_json()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


_QWEN = dict(
    hidden_size=128,
    intermediate_size=320,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
_GPT2 = dict(n_embd=112, n_layer=5, n_head=4)
_LLAMA = dict(
    hidden_size=96,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=32,
)
_MICRO_QWEN = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16
)
_MICRO_GPT2 = dict(n_embd=32, n_layer=1, n_head=2)

# Demo agents: SFT stops at the first check whose greedy accuracy on 200 held-out *train* prompts reaches
# ``stop_at_accuracy`` (different per agent, so the federation starts heterogeneous in skill too).
_DEMO_SFT: dict[str, Any] = dict(steps=6000, batch_size=32, warmup_steps=100, check_every=100, val_size=200)
_MICRO_SFT: dict[str, Any] = dict(steps=60, lr=1e-2, batch_size=8, warmup_steps=10)

ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry(
            "qwen-char",
            "qwen3",
            _QWEN,
            "char",
            SFTRecipe(lr=3e-3, seed=1, stop_at_accuracy=0.40, **_DEMO_SFT),
            target_accuracy=(0.2, 0.5),
        ),
        ZooEntry(
            "gpt2-bpe",
            "gpt2",
            _GPT2,
            "bpe",
            SFTRecipe(lr=2e-3, seed=2, stop_at_accuracy=0.30, **_DEMO_SFT),
            target_accuracy=(0.2, 0.5),
        ),
        ZooEntry(
            "llama-bpe",
            "llama",
            _LLAMA,
            "bpe",
            SFTRecipe(lr=2e-3, seed=3, stop_at_accuracy=0.25, **_DEMO_SFT),
            target_accuracy=(0.2, 0.5),
        ),
        # Micro agents for tests: build in a few seconds, emit a mix of stopped and truncated responses.
        ZooEntry(
            "micro-qwen-char", "qwen3", _MICRO_QWEN, "char", SFTRecipe(**_MICRO_SFT), bpe_corpus_size=200, eval_size=16
        ),
        ZooEntry(
            "micro-gpt2-bpe",
            "gpt2",
            _MICRO_GPT2,
            "bpe",
            SFTRecipe(**_MICRO_SFT),
            bpe_vocab_size=300,
            bpe_corpus_size=200,
            eval_size=16,
        ),
    )
}


def get_entry(name: str) -> ZooEntry:
    """The zoo entry called ``name`` (a leading ``zoo:`` is accepted); a :class:`BuildError` lists the known names."""
    key = name.removeprefix("zoo:")
    if key not in ZOO:
        raise BuildError(f"model.zoo={name!r} is not a zoo agent; known: {sorted(ZOO)}")
    return ZOO[key]


def cache_root() -> Path:
    """``$HACRL_FED_CACHE`` if set, else ``~/.cache/hacrl_fed``."""
    env = os.environ.get("HACRL_FED_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hacrl_fed"


def read_recipe(path: str | Path) -> dict[str, Any] | None:
    """The parsed ``zoo_recipe.json`` of a built agent dir, or None when absent."""
    file = Path(path) / RECIPE_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def built_recipe(path: str | Path) -> dict[str, Any]:
    """:func:`read_recipe` of a dir that was just built; a missing recipe is a :class:`BuildError`."""
    rec = read_recipe(path)
    if rec is None:
        raise BuildError(f"{Path(path) / RECIPE_FILE}: missing after the build")
    return rec


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

    from hacrl_fed.config import ModelConfig
    from hacrl_fed.models.loading import load_model_and_tokenizer
    from hacrl_fed.tasks import get_task

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


def shipped_dir(name: str) -> Path:
    """Where the shipped copy of ``name`` lives inside the package (it may not exist)."""
    return ASSETS_DIR / get_entry(name).name


def cached_dir(name: str) -> Path:
    """``<cache_root>/zoo/<name>-<recipe hash>``."""
    entry = get_entry(name)
    return cache_root() / "zoo" / f"{entry.name}-{entry.recipe_hash()}"


def resolve_zoo(name: str) -> Path:
    """Local HF-format dir of zoo agent ``name``: the shipped copy if its recipe hash matches, else a cached build
    of the current recipe. Never builds (an SFT build takes seconds to minutes and is a deliberate step): a stale
    shipped copy with no cached build, or an agent neither shipped nor built, is a :class:`BuildError` naming the
    ``hacrl-fed zoo build`` command that fixes it."""
    entry = get_entry(name)
    shipped = read_recipe(shipped_dir(name))
    if shipped is not None and shipped.get("recipe_hash") == entry.recipe_hash():
        return shipped_dir(name)
    cached = cached_dir(name)
    if read_recipe(cached) is not None:
        if shipped is not None:
            log.info(
                "zoo %s: the shipped weights are from another recipe; using the cached build %s", entry.name, cached
            )
        return cached
    why = (
        "its shipped weights were built from another recipe "
        f"({shipped.get('recipe_hash')}, the code's recipe is {entry.recipe_hash()})"
        if shipped is not None
        else "it is neither shipped nor built"
    )
    raise BuildError(
        f"model.zoo={entry.name!r}: {why}; build it with `hacrl-fed zoo build {entry.name} --ship` "
        f"(into the package) or `hacrl-fed zoo build {entry.name}` (into the cache, {cached})"
    )
