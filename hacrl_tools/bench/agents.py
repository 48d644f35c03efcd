"""Extra tiny agents for the learning benchmark: recipes only the benchmark needs, built on first use.

The shipped zoo (:mod:`hacrl_fed.models.zoo`) has one agent per architecture. Two benchmark settings need more:

- **state heterogeneity** (same architecture and tokenizer, different warm start): ``qwen-char-b`` is
  ``qwen-char``'s architecture and character tokenizer, SFT from another init seed, stopped at a lower accuracy;
- **size heterogeneity** (same family, two sizes): ``qwen-char-small`` is a ~5x smaller Qwen3-style char model;
- **the agent-count curve** (4 and 8 orgs): ``qwen-char-c``, ``gpt2-bpe-b`` and ``llama-bpe-b``, the shipped
  architectures again from other init seeds;
- **expertise** (issue 30; configs/bench/expertise2.yaml, expertise3.yaml): ``qwen-char-add``, ``qwen-char-sub`` and
  ``qwen-char-mul``, qwen-char's architecture and tokenizer, each SFT on one operator slice of the arithmetic task
  only (:data:`EXPERTISE_SLICES`, the slices of those configs' held-out eval), so each is strongest on its own;
- **mixed expertise** (issue 30; configs/bench/mixed2.yaml, mixed3.yaml): ``qwen-char-mostly-add``, ``-sub`` and
  ``-mul``, the same, each SFT on every slice with its own drawn 6 times as often as each other
  (:func:`mixed_slices`), so each is strongest on its own slice and not at zero on the others.

Each recipe is a :class:`~hacrl_fed.models.catalog.ZooEntry`, built by the zoo's own build code (SFT on the arithmetic
task, one thread, greedy accuracy measured on 200 held-out prompts, ``zoo_recipe.json`` written beside the
weights) into ``benchmarks/agents/<name>/`` (float16, like the shipped zoo). A benchmark config names it by that
path (``model: {path: benchmarks/agents/qwen-char-b}``); :func:`ensure_agent` builds it there when absent or built
from another recipe. Estimated build times on one core: ``qwen-char-b`` ~10 min, ``qwen-char-small`` ~5-10 min
(SFT stops at the first check reaching ``stop_at_accuracy``). ``micro-qwen-char-b`` builds in seconds (tests).

``hacrl-fed bench agents list`` / ``hacrl-fed bench agents build NAME... | all``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from hacrl_fed.models import zoo
from hacrl_fed.models.catalog import (
    DEMO_SFT,
    GPT2_ARCH,
    LLAMA_ARCH,
    MICRO_QWEN_ARCH,
    MICRO_SFT,
    QWEN_ARCH,
    ZooEntry,
    built_recipe,
    read_recipe,
)
from hacrl_fed.models.sft import SFTRecipe

log = logging.getLogger("hacrl_fed.bench.agents")

AGENTS_DIR = Path("benchmarks") / "agents"  # relative to the working directory (the repository root)

_QWEN = dict(QWEN_ARCH)  # qwen-char's architecture (0.70 M params with the char vocabulary)
_QWEN_SMALL = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)  # ~0.15 M params
_SFT = DEMO_SFT  # the demo agents' SFT schedule

# The expertise settings' slices (task.params.slices of configs/bench/expertise*.yaml must match): one operator each,
# so every problem belongs to exactly one slice; ``*`` with operands up to 9, since two-digit products of three
# operands are beyond a 0.7 M-parameter model's reach in the demo's SFT budget.
EXPERTISE_SLICES: dict[str, dict[str, object]] = {
    "add": {"ops": "+"},
    "sub": {"ops": "-"},
    "mul": {"ops": "*", "max_operand": 9},
}


def _slice_agent(name: str, seed: int, task_params: dict[str, object]) -> ZooEntry:
    """qwen-char's architecture and tokenizer, SFT (and its accuracy check) on the task ``task_params`` draw."""
    return ZooEntry(
        name,
        "qwen3",
        dict(QWEN_ARCH),
        "char",
        SFTRecipe(lr=3e-3, seed=seed, stop_at_accuracy=0.45, **_SFT),
        task_params={"difficulty": 2, **task_params},
        target_accuracy=(0.3, 0.7),
    )


def _expert(slice_name: str, seed: int) -> ZooEntry:
    """SFT on slice ``slice_name`` only (:func:`_slice_agent`)."""
    return _slice_agent(f"qwen-char-{slice_name}", seed, EXPERTISE_SLICES[slice_name])


# The mixed-expertise agents (configs/bench/mixed*.yaml): SFT on every slice, their own drawn MIXED_OWN_WEIGHT
# times as often as each other one (6:1:1, i.e. 75 % of their SFT problems), so each is strongest on its own slice
# and not at zero on the others, as labs differ in what they are good at without knowing nothing else.
MIXED_OWN_WEIGHT = 6.0


def mixed_slices(own: str) -> dict[str, dict[str, object]]:
    """Every expertise slice, ``own`` weighted :data:`MIXED_OWN_WEIGHT`, the others 1."""
    return {n: {**s, "weight": MIXED_OWN_WEIGHT if n == own else 1.0} for n, s in EXPERTISE_SLICES.items()}


def _mostly(slice_name: str, seed: int) -> ZooEntry:
    """SFT on every slice, mostly ``slice_name`` (:func:`mixed_slices`, :func:`_slice_agent`)."""
    return _slice_agent(f"qwen-char-mostly-{slice_name}", seed, {"slices": mixed_slices(slice_name)})


BENCH_AGENTS: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        # state heterogeneity: qwen-char's architecture and tokenizer, another init seed, a weaker warm start
        ZooEntry(
            "qwen-char-b",
            "qwen3",
            _QWEN,
            "char",
            SFTRecipe(lr=3e-3, seed=11, stop_at_accuracy=0.25, **_SFT),
            target_accuracy=(0.15, 0.4),
        ),
        # size heterogeneity: same family and tokenizer as qwen-char, ~5x fewer parameters
        ZooEntry(
            "qwen-char-small",
            "qwen3",
            _QWEN_SMALL,
            "char",
            SFTRecipe(lr=4e-3, seed=12, stop_at_accuracy=0.25, **_SFT),
            target_accuracy=(0.1, 0.4),
        ),
        # the agent-count curve (configs/bench/count4.yaml, count8.yaml): more orgs of the same kinds, each from
        # another init seed and SFT order, so each has its own warm start (the tokenizers are the shipped ones')
        ZooEntry(
            "qwen-char-c",
            "qwen3",
            _QWEN,
            "char",
            SFTRecipe(lr=3e-3, seed=21, stop_at_accuracy=0.35, **_SFT),
            target_accuracy=(0.15, 0.5),
        ),
        ZooEntry(
            "gpt2-bpe-b",
            "gpt2",
            dict(GPT2_ARCH),
            "bpe",
            SFTRecipe(lr=2e-3, seed=22, stop_at_accuracy=0.30, **_SFT),
            target_accuracy=(0.15, 0.5),
        ),
        ZooEntry(
            "llama-bpe-b",
            "llama",
            dict(LLAMA_ARCH),
            "bpe",
            SFTRecipe(lr=2e-3, seed=23, stop_at_accuracy=0.30, **_SFT),
            target_accuracy=(0.15, 0.5),
        ),
        # expertise (issue 30): one specialist per operator slice, each from its own init seed
        _expert("add", 31),
        _expert("sub", 32),
        _expert("mul", 33),
        # mixed expertise (issue 30): mostly one slice, a little of the others, each from its own init seed
        _mostly("add", 41),
        _mostly("sub", 42),
        _mostly("mul", 43),
        # for tests: micro-qwen-char's architecture, another seed (builds in seconds)
        ZooEntry(
            "micro-qwen-char-b",
            "qwen3",
            dict(MICRO_QWEN_ARCH),
            "char",
            SFTRecipe(seed=5, **MICRO_SFT),
            bpe_corpus_size=200,
            eval_size=16,
        ),
    )
}


def is_built(path: str | Path, name: str) -> bool:
    """Whether ``path`` holds agent ``name`` built from its current recipe."""
    rec = read_recipe(path)
    return rec is not None and rec.get("recipe_hash") == BENCH_AGENTS[name].recipe_hash()


def agent_name(path: str | Path) -> str | None:
    """The bench agent a model path refers to (its last component names a recipe), else None."""
    name = Path(path).name
    return name if name in BENCH_AGENTS else None


def build(name: str, out: str | Path | None = None, *, dtype: str = "float16") -> Path:
    """Build bench agent ``name`` into ``out`` (default ``benchmarks/agents/<name>``) with the zoo's build code."""
    entry = BENCH_AGENTS[name]
    dest = Path(out) if out is not None else AGENTS_DIR / name
    threads = torch.get_num_threads()
    torch.set_num_threads(zoo.BUILD_THREADS)  # the zoo's reproducible single-thread build
    try:
        return zoo._build(entry, dest, dtype, True)
    finally:
        torch.set_num_threads(threads)


def ensure_agent(path: str | Path, *, allow_build: bool = True) -> Path:
    """``path`` (a bench agent dir) built from its current recipe; builds it unless ``allow_build`` is False
    (then raises ``FileNotFoundError`` naming the command that builds it)."""
    path = Path(path)
    name = agent_name(path)
    if name is None:
        raise KeyError(f"{path}: {path.name!r} is not a bench agent (known: {sorted(BENCH_AGENTS)})")
    if is_built(path, name):
        return path
    if not allow_build:
        raise FileNotFoundError(
            f"bench agent {name!r} is not built at {path}: run `hacrl-fed bench agents build "
            f"{name}` (SFT, minutes on one core)"
        )
    log.warning("bench agent %s: building it into %s (SFT; minutes)", name, path)
    return build(name, path)


def list_agents() -> int:
    """``hacrl-fed bench agents list``: each recipe, its hash, and whether it is built under ``AGENTS_DIR``."""
    for name, entry in BENCH_AGENTS.items():
        where = AGENTS_DIR / name
        rec = read_recipe(where) or {}
        state = (
            f"built (accuracy {rec['accuracy']:.3f}, {rec['num_params']} params)"
            if is_built(where, name)
            else "not built"
        )
        print(f"{name:18s} {entry.arch:6s} {entry.tokenizer:5s} {entry.recipe_hash()} {state}")
    return 0


def build_agents(names: list[str], out: Path | None = None) -> int:
    """``hacrl-fed bench agents build NAME... | all``: build each (``all``: every non-micro recipe) into
    ``out/<name>`` or ``AGENTS_DIR/<name>``. Raises ``KeyError`` for an unknown name, before building any."""
    names = [n for n in BENCH_AGENTS if not n.startswith("micro-")] if names == ["all"] else names
    unknown = [n for n in names if n not in BENCH_AGENTS]
    if unknown:
        raise KeyError(f"unknown agents {unknown}; known: {sorted(BENCH_AGENTS)}")
    for name in names:
        path = build(name, out / name if out else None)
        rec = built_recipe(path)
        print(
            f"{name}: params={rec['num_params']} accuracy={rec['accuracy']:.3f} build={rec['build_seconds']:.0f}s "
            f"-> {path}"
        )
    return 0
