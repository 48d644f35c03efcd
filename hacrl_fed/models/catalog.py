"""The tiny heterogeneous agent zoo's catalog: the named recipes, and where a built copy of one is found.

An entry (:class:`ZooEntry`) = architecture config + tokenizer kind + SFT recipe + task + target start accuracy.
Its *recipe hash* (sha256 of the entry's JSON and :data:`ZOO_FORMAT`) keys every built copy:

- :func:`resolve_zoo` returns the shipped copy ``hacrl_fed/assets/zoo/<name>/`` when its hash matches, else a
  cached one ``$HACRL_FED_CACHE/zoo/<name>-<hash>`` (default cache root ``~/.cache/hacrl_fed``) when one was
  built. It never builds: loading a model never trains. A stale or missing agent is a
  :class:`~hacrl_fed.config.BuildError` naming the command that builds it (``hacrl-fed zoo build NAME --ship``).
- The recipes' parts are public (:data:`QWEN_ARCH`, :data:`DEMO_SFT`, :data:`MICRO_QWEN_ARCH`, ...) so other
  recipes (the benchmark's extra agents) can be built from them.

The builder, which trains and saves an entry, is :mod:`hacrl_fed.models.zoo`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hacrl_fed.config import BuildError
from hacrl_fed.models.sft import SFTRecipe

log = logging.getLogger(__name__)

ZOO_FORMAT = 1  # bump when build code changes what a recipe produces
RECIPE_FILE = "zoo_recipe.json"
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "zoo"
ARCHS = ("qwen3", "gpt2", "llama")


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


QWEN_ARCH = dict(
    hidden_size=128,
    intermediate_size=320,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
GPT2_ARCH = dict(n_embd=112, n_layer=5, n_head=4)
LLAMA_ARCH = dict(
    hidden_size=96,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=32,
)
MICRO_QWEN_ARCH = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16
)
MICRO_GPT2_ARCH = dict(n_embd=32, n_layer=1, n_head=2)

# Demo agents: SFT stops at the first check whose greedy accuracy on 200 held-out *train* prompts reaches
# ``stop_at_accuracy`` (different per agent, so the federation starts heterogeneous in skill too).
DEMO_SFT: dict[str, Any] = dict(steps=6000, batch_size=32, warmup_steps=100, check_every=100, val_size=200)
MICRO_SFT: dict[str, Any] = dict(steps=60, lr=1e-2, batch_size=8, warmup_steps=10)

ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry(
            "qwen-char",
            "qwen3",
            QWEN_ARCH,
            "char",
            SFTRecipe(lr=3e-3, seed=1, stop_at_accuracy=0.40, **DEMO_SFT),
            target_accuracy=(0.2, 0.5),
        ),
        ZooEntry(
            "gpt2-bpe",
            "gpt2",
            GPT2_ARCH,
            "bpe",
            SFTRecipe(lr=2e-3, seed=2, stop_at_accuracy=0.30, **DEMO_SFT),
            target_accuracy=(0.2, 0.5),
        ),
        ZooEntry(
            "llama-bpe",
            "llama",
            LLAMA_ARCH,
            "bpe",
            SFTRecipe(lr=2e-3, seed=3, stop_at_accuracy=0.25, **DEMO_SFT),
            target_accuracy=(0.2, 0.5),
        ),
        # Micro agents for tests: build in a few seconds, emit a mix of stopped and truncated responses.
        ZooEntry(
            "micro-qwen-char",
            "qwen3",
            MICRO_QWEN_ARCH,
            "char",
            SFTRecipe(**MICRO_SFT),
            bpe_corpus_size=200,
            eval_size=16,
        ),
        ZooEntry(
            "micro-gpt2-bpe",
            "gpt2",
            MICRO_GPT2_ARCH,
            "bpe",
            SFTRecipe(**MICRO_SFT),
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
