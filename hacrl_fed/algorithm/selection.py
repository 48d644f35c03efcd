"""Which screened foreign rows a learner trains on: a rule and a budget (docs/ALGORITHM.md "Selecting foreign rows").

Pure functions of rewards and groups alone (no torch, no I/O, no text): they run in the worker after screening and
before re-tokenization and scoring, so a row left out is never tokenized, scored or trained on. ``N`` offered
foreign rows, each with a reward, a prompt id (its joint group), a source (the org that produced it) and a sample
index; the learner's own rewards per prompt; a rule; a budget (``None``: none); a seed.

Rules (``trainer.selection.rule``); each is a *filter* (which rows are eligible) and an *order* (which eligible rows a
budget keeps first):

- ``all``: every row, no budget (the paper's HACPO; the identity).
- ``successes`` (the default): rows with reward > 0. Budget: seeded uniform sample of the eligible.
- ``peer_sample``: needs a budget. Every row eligible; the budget takes whole sources in a seeded order of the
  sources (:func:`source_order`), the last one's rows in a seeded order of that source's rows (``stable_seed(seed,
  "row", source, prompt id, sample index)``, which depends on no other row): the learner trains on a few random
  peers a round, as many as its budget holds. The order depends on the source names and the seed alone, not on
  the rows, so the worker can screen the sources lazily in that order and stop once the budget is full
  (:func:`hacrl_fed.worker.intake.screen_sources`): a source it never reaches is never authenticated, checked or
  re-verified, and the selection is the same as if every source had been screened.

Budget split (``trainer.selection.budget_split``, :mod:`hacrl_fed.algorithm.budget_split`): ``pooled`` takes the
first ``budget`` rows of the rule's order over every source's rows; ``per_source`` gives each source a max-min
fair share of the budget, filled from its own rows only (the first rows of that source in the rule's order), so no
source spends another's share. Not with a source-ordered rule.

Rules the benchmarks rejected (``uniform``, ``nonzero_advantage``, ``learner_failed``, ``max_variance``, ``rescue``)
were removed (issue 42); their measured cells stay in BENCHMARKS.md, each naming the commit that ran it.

Determinism: the seeded order of the rows is their canonical order (by source, prompt id, sample index) shuffled by
``random.Random(seed)`` (the sources' order: :func:`source_order`). A selection depends on the seed and the rows, not
on their arrival order.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hacrl_fed.algorithm.budget_split import BUDGET_SPLITS, share_metrics, source_shares, take_shares
from hacrl_fed.seeding import stable_seed

COUNTS = ("offered", "selected", "dropped_rule", "dropped_budget")


@dataclass(frozen=True)
class Offer:
    """What a rule sees: per offered row (``N``) its reward, prompt id, source and sample index, the learner's own
    rewards per prompt, the budget (``None``: none), the seed and the seeded order of the rows (``by_key``: row
    indices; ``keys[i]``: row ``i``'s rank in it)."""

    rewards: Sequence[float]
    prompt_ids: Sequence[int]
    source_ids: Sequence[Any]
    sample_indices: Sequence[int]
    own_rewards: Mapping[int, Sequence[float]]
    budget: int | None
    seed: int
    by_key: list[int]
    keys: list[int]


RuleFn = Callable[[Offer], tuple[list[int], list[int]]]  # -> (eligible rows, the order a budget takes them in)


@dataclass(frozen=True)
class SelectionRule:
    """A registered rule: its function, whether it needs a budget (``needs_budget``) or refuses one
    (``allows_budget`` False), and whether its budget takes whole sources in :func:`source_order`
    (``source_ordered``: the worker can then screen sources lazily)."""

    pick: RuleFn
    needs_budget: bool = False
    allows_budget: bool = True
    source_ordered: bool = False


SELECTION_RULES: dict[str, SelectionRule] = {}


def register_selection_rule(
    name: str,
    *,
    needs_budget: bool = False,
    allows_budget: bool = True,
    source_ordered: bool = False,
) -> Callable[[RuleFn], RuleFn]:
    """Register a rule under ``name`` (``trainer.selection.rule``); the config accepts exactly the registered names."""

    def deco(fn: RuleFn) -> RuleFn:
        if name in SELECTION_RULES:
            raise ValueError(f"selection rule {name!r} is already registered")
        SELECTION_RULES[name] = SelectionRule(fn, needs_budget, allows_budget, source_ordered)
        return fn

    return deco


def get_selection_rule(name: str) -> SelectionRule:
    try:
        return SELECTION_RULES[name]
    except KeyError:
        raise ValueError(f"unknown selection rule {name!r} (one of {', '.join(SELECTION_RULES)})") from None


def source_ordered(name: str) -> bool:
    """Whether rule ``name``'s budget takes whole sources in :func:`source_order` (lazy screening)."""
    return get_selection_rule(name).source_ordered


@dataclass(frozen=True)
class Selection:
    """What a rule kept: ``eligible`` (indices into the offered rows that passed the rule's filter) and
    ``selected`` (those the budget kept), both ascending; ``shares``: each source's share of the budget
    (:mod:`hacrl_fed.algorithm.budget_split`; under ``pooled`` the share it would have had), None without a
    budget or under a source-ordered rule."""

    eligible: tuple[int, ...]
    selected: tuple[int, ...]
    shares: Mapping[str, int] | None = None

    def metrics(self, source_ids: Sequence[Any], budget: int | None = None) -> dict[str, float]:
        """``select/<source>/{offered,selected,dropped_rule,dropped_budget}`` per source of the offered rows (every
        source, zeros included), the same four totals as ``select/<count>``, ``select/budget`` when there is
        one, and ``select/<source>/{share,over_share}`` when there are shares."""
        eligible, selected = set(self.eligible), set(self.selected)
        per: dict[str, dict[str, float]] = {}
        for i, src in enumerate(source_ids):
            c = per.setdefault(str(src), dict.fromkeys(COUNTS, 0.0))
            c["offered"] += 1
            c["selected" if i in selected else "dropped_budget" if i in eligible else "dropped_rule"] += 1
        out: dict[str, float] = {}
        totals = dict.fromkeys(COUNTS, 0.0)
        for src, c in sorted(per.items()):
            for k in COUNTS:
                out[f"select/{src}/{k}"] = c[k]
                totals[k] += c[k]
        out.update({f"select/{k}": v for k, v in totals.items()})
        if budget is not None:
            out["select/budget"] = float(budget)
        if self.shares is not None:
            out.update(share_metrics([str(s) for s in source_ids], self.selected, self.shares))
        return out


def resolve_budget(budget: int | None, budget_multiple: float | None, own_rows: int) -> int | None:
    """Foreign rows allowed this round: ``budget``, or ``floor(budget_multiple × own_rows)``, or ``None`` (no
    budget). Raises ValueError when both are set or either is negative."""
    if budget is not None and budget_multiple is not None:
        raise ValueError("budget and budget_multiple are exclusive")
    if budget is not None:
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        return int(budget)
    if budget_multiple is not None:
        if not math.isfinite(budget_multiple) or budget_multiple < 0:
            raise ValueError(f"budget_multiple must be finite and >= 0, got {budget_multiple}")
        return math.floor(budget_multiple * own_rows)
    return None


def select_rows(
    rewards: Sequence[float],
    prompt_ids: Sequence[int],
    source_ids: Sequence[Any],
    sample_indices: Sequence[int],
    own_rewards: Mapping[int, Sequence[float]],
    rule: str,
    budget: int | None,
    seed: int,
    split: str = "pooled",
) -> Selection:
    """The offered foreign rows a learner trains on (module docstring: rules, budget, order, determinism).

    Args: per offered row (``N`` each) its reward, prompt id, source and sample index; ``own_rewards``: the
    learner's own rewards per prompt id; ``rule`` one of :data:`RULES`; ``budget``: most rows kept (``None``: no
    budget; required by ``peer_sample``, refused by ``all``); ``seed``: any int; ``split``:
    ``pooled`` (one budget over every source's rows) or ``per_source`` (each source its share:
    :mod:`hacrl_fed.algorithm.budget_split`; refused by a source-ordered rule).
    Returns a :class:`Selection` (indices into the ``N`` rows, ascending).
    """
    spec = _checked_rule(rewards, prompt_ids, source_ids, sample_indices, rule, budget, split)
    n = len(rewards)
    by_key = sorted(range(n), key=lambda i: (str(source_ids[i]), int(prompt_ids[i]), int(sample_indices[i]), i))
    random.Random(seed).shuffle(by_key)  # a seeded order of the rows (canonical first: arrival order plays no part)
    keys = [0] * n
    for rank, i in enumerate(by_key):
        keys[i] = rank
    offer = Offer(rewards, prompt_ids, source_ids, sample_indices, own_rewards, budget, seed, by_key, keys)
    if budget is not None and split == "per_source":
        return _per_source(spec, offer, budget)
    eligible, order = spec.pick(offer)
    if budget is None:
        return Selection(tuple(eligible), tuple(sorted(order)))
    shares = None if spec.source_ordered else source_shares(_demands(offer, order), budget, seed)
    return Selection(tuple(eligible), tuple(sorted(order[:budget])), shares)


def _checked_rule(
    rewards: Sequence[float],
    prompt_ids: Sequence[int],
    source_ids: Sequence[Any],
    sample_indices: Sequence[int],
    rule: str,
    budget: int | None,
    split: str,
) -> SelectionRule:
    """The registered rule ``rule``, once the arguments of :func:`select_rows` are consistent (ValueError if not)."""
    n = len(rewards)
    if not len(prompt_ids) == len(source_ids) == len(sample_indices) == n:
        raise ValueError(
            f"rewards, prompt_ids, source_ids and sample_indices must have the same length, got "
            f"{n}, {len(prompt_ids)}, {len(source_ids)}, {len(sample_indices)}"
        )
    spec = get_selection_rule(rule)
    if budget is not None and budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if budget is not None and not spec.allows_budget:
        raise ValueError(f"rule {rule} keeps every row: a budget needs another rule")
    if budget is None and spec.needs_budget:
        raise ValueError(f"rule {rule} needs a budget")
    problem = budget_split_problem(rule, split)
    if problem is not None:
        raise ValueError(problem)
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError("rewards must be finite")
    return spec


def _demands(offer: Offer, order: Sequence[int]) -> dict[str, int]:
    """Per source, the rows the rule could take (budget_split module docstring): those in its order (its eligible
    rows)."""
    demands = dict.fromkeys((str(s) for s in offer.source_ids), 0)
    for i in order:
        demands[str(offer.source_ids[i])] += 1
    return demands


def _per_source(spec: SelectionRule, offer: Offer, budget: int) -> Selection:
    """``budget_split: per_source``: each source's share (:func:`~hacrl_fed.algorithm.budget_split.source_shares`)
    filled from its own rows: the first rows of the rule's order over the whole pool (its filter and order see
    every source)."""
    sources = [str(s) for s in offer.source_ids]
    eligible, order = spec.pick(offer)
    shares = source_shares(_demands(offer, order), budget, offer.seed)
    return Selection(tuple(eligible), tuple(sorted(take_shares(order, sources, shares))), shares)


def selection_budget_problem(rule: str, budgeted: bool) -> str | None:
    """Why rule ``rule`` cannot run with (``budgeted``) or without a budget, or None when it can."""
    spec = get_selection_rule(rule)
    if budgeted and not spec.allows_budget:
        return (
            f"rule {rule} keeps every foreign row: a budget needs another rule (successes, peer_sample), or set "
            "budget_multiple: null (the default budget of 0.5x own rows is left out only where the rule is named "
            "in the same section)"
        )
    if not budgeted and spec.needs_budget:
        return f"rule {rule} picks a subset of the budget's size: set budget or budget_multiple"
    return None


def budget_split_problem(rule: str, split: str) -> str | None:
    """Why rule ``rule`` cannot divide its budget by ``split``, or None when it can."""
    if split not in BUDGET_SPLITS:
        return f"budget_split must be one of {', '.join(BUDGET_SPLITS)}, got {split!r}"
    if split == "per_source" and get_selection_rule(rule).source_ordered:
        return (
            f"budget_split per_source needs a rule that looks at every source: rule {rule} takes whole sources "
            "in a seeded order (use budget_split pooled, or another rule)"
        )
    return None


@register_selection_rule("all", allows_budget=False)
def _all(o: Offer) -> tuple[list[int], list[int]]:
    everything = list(range(len(o.rewards)))
    return everything, everything


@register_selection_rule("successes")
def _successes(o: Offer) -> tuple[list[int], list[int]]:
    return [i for i in range(len(o.rewards)) if o.rewards[i] > 0], [i for i in o.by_key if o.rewards[i] > 0]


@register_selection_rule("peer_sample", needs_budget=True, source_ordered=True)
def _peer_sample(o: Offer) -> tuple[list[int], list[int]]:
    """Whole sources first; within one, a seeded order of its own rows (not of the pool: a lazy screen sees less)."""
    src_rank = {src: k for k, src in enumerate(source_order(o.source_ids, o.seed))}
    src = [str(s) for s in o.source_ids]
    order = sorted(
        range(len(o.rewards)),
        key=lambda i: (
            src_rank[src[i]],
            stable_seed(o.seed, "row", src[i], int(o.prompt_ids[i]), int(o.sample_indices[i])),
            i,
        ),
    )
    return list(range(len(o.rewards))), order


def source_order(sources: Iterable[Any], seed: int) -> list[str]:
    """The seeded order in which ``peer_sample`` takes sources: names sorted by ``stable_seed(seed, "source",
    name)`` (ties by name). It depends on the names and the seed only, so a worker can follow it before screening."""
    return sorted({str(s) for s in sources}, key=lambda s: (stable_seed(seed, "source", s), s))


def select_rollouts(
    foreign: Sequence[Any],
    own: Sequence[Any],
    rule: str,
    budget: int | None,
    budget_multiple: float | None,
    seed: int,
    split: str = "pooled",
) -> tuple[list[Any], dict[str, float]]:
    """The worker's hook: the screened foreign rollouts (``.reward``, ``.prompt_id``, ``.org_id``,
    ``.sample_index``) this learner trains on, in their arrival order, and the ``select/...`` counts. ``own``: the
    learner's own rows of the round (``.group`` = prompt id, ``.reward``); a ``budget_multiple`` counts them;
    ``split``: how the budget is divided among the sources (:func:`select_rows`).
    Rule ``all`` without a budget returns the rollouts unchanged."""
    limit = resolve_budget(budget, budget_multiple, len(own))
    own_rewards: dict[int, list[float]] = {}
    for row in own:
        own_rewards.setdefault(int(row.group), []).append(float(row.reward))
    sources = [r.org_id for r in foreign]
    picked = select_rows(
        [float(r.reward) for r in foreign],
        [int(r.prompt_id) for r in foreign],
        sources,
        [int(r.sample_index) for r in foreign],
        own_rewards,
        rule,
        limit,
        seed,
        split,
    )
    return [foreign[i] for i in picked.selected], picked.metrics(sources, limit)


RULES = tuple(SELECTION_RULES)  # the registered names, in registration order
