"""Which screened foreign rows a learner trains on: a rule and a budget (docs/ALGORITHM.md "Selecting foreign rows").

Pure functions of rewards and groups alone (no torch, no I/O, no text): they run in the worker after screening and
before re-tokenization and scoring, so a row left out is never tokenized, scored or trained on. ``N`` offered
foreign rows, each with a reward, a prompt id (its joint group), a source (the org that produced it) and a sample
index; the learner's own rewards per prompt; a rule; a budget (``None``: none); a seed.

Rules (``trainer.selection.rule``); each is a *filter* (which rows are eligible) and an *order* (which eligible rows a
budget keeps first):

- ``all``: every row, no budget (the paper's HACPO; the identity).
- ``uniform``: every row eligible; a budget keeps a seeded uniform sample of that size.
- ``nonzero_advantage``: rows whose reward differs from the mean reward of their joint group over the learner's own
  rows and *all* offered foreign rows of that prompt (exact arithmetic): the rows whose plain joint-group advantage is
  not zero. A uniform group drops all its foreign rows. Budget: seeded uniform sample of the eligible.
- ``successes``: rows with reward > 0. Budget: seeded uniform sample of the eligible.
- ``learner_failed``: rows of the prompts where the learner's own mean reward is below the best reward in that
  prompt's pool (own + offered): the learner has room to improve there and the pool shows it. A prompt the learner
  has no own rows for counts as own mean 0. Budget: prompts by own mean reward, lowest first (ties in a seeded
  order), the rows of a prompt in a seeded order.
- ``max_variance`` (PODS, arXiv 2504.13818): needs a budget. The budget is shared between prompts round-robin (each
  prompt in a seeded order takes one slot while it has rows left: as even as the rows allow), and each prompt keeps
  the subset of its offered rows of that size that maximizes the reward variance of its joint group as trained (own
  rows + kept foreign rows). As in PODS, a maximizing subset is always the ``i`` highest and ``q - i`` lowest rewards
  for some ``i`` (a kept row strictly between two left-out ones can be swapped for one of them without lowering the
  variance, which is convex in each reward), so the ``q + 1`` splits are compared exactly; ties keep more high
  rewards. It has no filter: every row it leaves out counts under the budget.
- ``rescue`` (its own module, :mod:`hacrl_fed.algorithm.rescue`): rows with reward > 0 on the prompts where every
  own row of the learner has reward 0. Budget: seeded uniform sample of the eligible.
- ``peer_sample``: needs a budget. Every row eligible; the budget takes whole sources in a seeded order of the
  sources (:func:`source_order`), the last one's rows in a seeded order of that source's rows (``stable_seed(seed,
  "row", source, prompt id, sample index)``, which depends on no other row): the learner trains on a few random
  peers a round, as many as its budget holds. The order depends on the source names and the seed alone, not on
  the rows, so the worker can screen the sources lazily in that order and stop once the budget is full
  (:func:`hacrl_fed.worker.intake.screen_sources`): a source it never reaches is never authenticated, checked or
  re-verified, and the selection is the same as if every source had been screened.

Budget split (``trainer.selection.budget_split``, :mod:`hacrl_fed.algorithm.budget_split`): ``pooled`` takes the
first ``budget`` rows of the rule's order over every source's rows; ``per_source`` gives each source a max-min
fair share of the budget, filled from its own rows only (the first rows of that source in the rule's order; a rule
that spends the budget itself, ``max_variance``, runs on the source's rows with its share), so no source spends
another's share. Not with a source-ordered rule.

Determinism: the seeded order of the rows is their canonical order (by source, prompt id, sample index) shuffled by
``random.Random(seed)``; a seeded order of prompts sorts them by ``stable_seed(seed, "prompt", prompt_id)``
(:mod:`hacrl_fed.seeding`). A selection depends on the seed and the rows, not on their arrival order.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from hacrl_fed.algorithm.budget_split import BUDGET_SPLITS, share_metrics, source_shares, take_shares
from hacrl_fed.algorithm.rescue import rescue_rows
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
    (``allows_budget`` False), whether its budget takes whole sources in :func:`source_order`
    (``source_ordered``: the worker can then screen sources lazily), and whether its function spends the budget
    itself (``picks_within_budget``: its order is already the budget's choice, so a per-source split runs it once
    per source with that source's share)."""

    pick: RuleFn
    needs_budget: bool = False
    allows_budget: bool = True
    source_ordered: bool = False
    picks_within_budget: bool = False


SELECTION_RULES: dict[str, SelectionRule] = {}


def register_selection_rule(
    name: str,
    *,
    needs_budget: bool = False,
    allows_budget: bool = True,
    source_ordered: bool = False,
    picks_within_budget: bool = False,
) -> Callable[[RuleFn], RuleFn]:
    """Register a rule under ``name`` (``trainer.selection.rule``); the config accepts exactly the registered names."""

    def deco(fn: RuleFn) -> RuleFn:
        if name in SELECTION_RULES:
            raise ValueError(f"selection rule {name!r} is already registered")
        SELECTION_RULES[name] = SelectionRule(fn, needs_budget, allows_budget, source_ordered, picks_within_budget)
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
    budget; required by ``uniform`` and ``max_variance``, refused by ``all``); ``seed``: any int; ``split``:
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
    shares = None if spec.source_ordered else source_shares(_demands(spec, offer, order), budget, seed)
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


def _demands(spec: SelectionRule, offer: Offer, order: Sequence[int]) -> dict[str, int]:
    """Per source, the rows the rule could take (budget_split module docstring): those in its order (its eligible
    rows), or every offered row for a rule that spends the budget itself (``max_variance``, no filter)."""
    rows = range(len(offer.rewards)) if spec.picks_within_budget else order
    demands = dict.fromkeys((str(s) for s in offer.source_ids), 0)
    for i in rows:
        demands[str(offer.source_ids[i])] += 1
    return demands


def _per_source(spec: SelectionRule, offer: Offer, budget: int) -> Selection:
    """``budget_split: per_source``: each source's share (:func:`~hacrl_fed.algorithm.budget_split.source_shares`)
    filled from its own rows: the first rows of the rule's order over the whole pool (its filter and order see
    every source), or, for a rule that spends the budget itself, the rule run on that source's rows alone with the
    share as its budget."""
    sources = [str(s) for s in offer.source_ids]
    if not spec.picks_within_budget:
        eligible, order = spec.pick(offer)
        shares = source_shares(_demands(spec, offer, order), budget, offer.seed)
        return Selection(tuple(eligible), tuple(sorted(take_shares(order, sources, shares))), shares)
    shares = source_shares(_demands(spec, offer, ()), budget, offer.seed)
    chosen: list[int] = []
    for src, share in shares.items():
        rows = [i for i in range(len(sources)) if sources[i] == src]
        _, order = spec.pick(_restricted(offer, rows, share))
        chosen += [rows[k] for k in order[:share]]
    return Selection(tuple(range(len(sources))), tuple(sorted(chosen)), shares)


def _restricted(offer: Offer, rows: Sequence[int], budget: int) -> Offer:
    """``offer`` with only ``rows`` (re-indexed 0..len-1, the seeded order kept) and ``budget``."""
    local = {i: k for k, i in enumerate(rows)}
    return Offer(
        [offer.rewards[i] for i in rows],
        [offer.prompt_ids[i] for i in rows],
        [offer.source_ids[i] for i in rows],
        [offer.sample_indices[i] for i in rows],
        offer.own_rewards,
        budget,
        offer.seed,
        [local[i] for i in offer.by_key if i in local],
        [offer.keys[i] for i in rows],
    )


def selection_budget_problem(rule: str, budgeted: bool) -> str | None:
    """Why rule ``rule`` cannot run with (``budgeted``) or without a budget, or None when it can."""
    spec = get_selection_rule(rule)
    if budgeted and not spec.allows_budget:
        return (
            f"rule {rule} keeps every foreign row: a budget needs another rule (uniform samples one), or set "
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


@register_selection_rule("uniform", needs_budget=True)
def _uniform(o: Offer) -> tuple[list[int], list[int]]:
    return list(range(len(o.rewards))), o.by_key


@register_selection_rule("nonzero_advantage")
def _nonzero(o: Offer) -> tuple[list[int], list[int]]:
    keep = _nonzero_advantage(o.rewards, o.prompt_ids, o.own_rewards)
    return [i for i in range(len(o.rewards)) if keep[i]], [i for i in o.by_key if keep[i]]


@register_selection_rule("successes")
def _successes(o: Offer) -> tuple[list[int], list[int]]:
    return [i for i in range(len(o.rewards)) if o.rewards[i] > 0], [i for i in o.by_key if o.rewards[i] > 0]


@register_selection_rule("learner_failed")
def _failed(o: Offer) -> tuple[list[int], list[int]]:
    return _learner_failed(o.rewards, o.prompt_ids, o.own_rewards, o.seed, o.by_key)


@register_selection_rule("max_variance", needs_budget=True, picks_within_budget=True)
def _variance(o: Offer) -> tuple[list[int], list[int]]:
    assert o.budget is not None
    return list(range(len(o.rewards))), _max_variance(o.rewards, o.prompt_ids, o.own_rewards, o.budget, o.seed, o.keys)


@register_selection_rule("rescue")  # its own module: hacrl_fed/algorithm/rescue.py
def _rescue(o: Offer) -> tuple[list[int], list[int]]:
    return rescue_rows(o.rewards, o.prompt_ids, o.own_rewards, o.by_key)


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


def _groups(prompt_ids: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, p in enumerate(prompt_ids):
        out.setdefault(int(p), []).append(i)
    return out


def _exact_sum(values: Iterable[float]) -> Fraction:
    """The exact sum of floats (each distinct value converted to a Fraction once: rewards take few values)."""
    counts: dict[float, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return sum((Fraction(v) * c for v, c in counts.items()), Fraction(0))


def _nonzero_advantage(
    rewards: Sequence[float], prompt_ids: Sequence[int], own_rewards: Mapping[int, Sequence[float]]
) -> list[bool]:
    """Per row: its reward differs from the exact mean over own + offered rows of its prompt (``R·n != Σ R``)."""
    keep = [False] * len(rewards)
    for p, rows in _groups(prompt_ids).items():
        own = own_rewards.get(p, ())
        total, size = _exact_sum([*own, *(rewards[i] for i in rows)]), len(own) + len(rows)
        off_mean = {v: Fraction(v) * size != total for v in {rewards[i] for i in rows}}
        for i in rows:
            keep[i] = off_mean[rewards[i]]
    return keep


def _learner_failed(
    rewards: Sequence[float],
    prompt_ids: Sequence[int],
    own_rewards: Mapping[int, Sequence[float]],
    seed: int,
    by_key: list[int],
) -> tuple[list[int], list[int]]:
    """Eligible rows (prompts where the learner's own mean is below the pool's best reward) and their order
    (own mean ascending, ties by a seeded prompt order; within a prompt the seeded row order)."""
    groups = _groups(prompt_ids)
    own_mean: dict[int, Fraction] = {}
    for p, rows in groups.items():
        own = own_rewards.get(p, ())
        mean = _exact_sum(own) / len(own) if own else Fraction(0)
        best = max([*own, *(rewards[i] for i in rows)])  # a float max is exact
        if mean < Fraction(best):
            own_mean[p] = mean
    prompts = sorted(own_mean, key=lambda p: (own_mean[p], stable_seed(seed, "prompt", p), p))
    rank = {p: k for k, p in enumerate(prompts)}
    eligible = [i for i in range(len(rewards)) if int(prompt_ids[i]) in rank]
    position = {i: k for k, i in enumerate(by_key)}
    order = sorted(eligible, key=lambda i: (rank[int(prompt_ids[i])], position[i]))
    return eligible, order


def _quotas(sizes: Mapping[int, int], budget: int, seed: int) -> dict[int, int]:
    """Share ``budget`` between prompts round-robin (a seeded prompt order, one slot per prompt per pass while it
    has rows left)."""
    order = sorted(sizes, key=lambda p: (stable_seed(seed, "prompt", p), p))
    quota = dict.fromkeys(order, 0)
    left = min(budget, sum(sizes.values()))
    while left > 0:
        for p in order:
            if left > 0 and quota[p] < sizes[p]:
                quota[p] += 1
                left -= 1
    return quota


def _prefix_sums(values: Sequence[Fraction]) -> tuple[list[Fraction], list[Fraction]]:
    """``(sums, sums of squares)`` of the first ``k`` values, ``k = 0..len(values)``."""
    sums, squares = [Fraction(0)], [Fraction(0)]
    for v in values:
        sums.append(sums[-1] + v)
        squares.append(squares[-1] + v * v)
    return sums, squares


def _max_variance(
    rewards: Sequence[float],
    prompt_ids: Sequence[int],
    own_rewards: Mapping[int, Sequence[float]],
    budget: int,
    seed: int,
    keys: Sequence[int],
) -> list[int]:
    """Per prompt, the ``q`` offered rows (its quota) maximizing the variance of own + kept rewards."""
    groups = _groups(prompt_ids)
    quota = _quotas({p: len(rows) for p, rows in groups.items()}, budget, seed)
    chosen: list[int] = []
    for p, rows in groups.items():
        q = quota[p]
        if q == 0:
            continue
        if q >= len(rows):
            chosen += rows
            continue
        ranked = sorted(rows, key=lambda i: (-rewards[i], keys[i], i))  # high to low; equal rewards: seeded
        exact = {v: Fraction(v) for v in {rewards[i] for i in ranked}}
        top_s, top_q = _prefix_sums([exact[rewards[i]] for i in ranked[:q]])  # the i highest, i = 0..q
        bot_s, bot_q = _prefix_sums([exact[rewards[i]] for i in reversed(ranked[-q:])])  # the k lowest
        own_s = _exact_sum(own_rewards.get(p, ()))
        own_q = sum((Fraction(r) ** 2 for r in own_rewards.get(p, ())), Fraction(0))
        size = len(own_rewards.get(p, ())) + q
        best_i, best = q, None
        for i in range(q, -1, -1):  # i highest + (q - i) lowest; ties keep more high rewards (the first found)
            total = own_s + top_s[i] + bot_s[q - i]
            spread = size * (own_q + top_q[i] + bot_q[q - i]) - total * total  # size² × population variance
            if best is None or spread > best:
                best_i, best = i, spread
        chosen += ranked[:best_i] + ranked[len(ranked) - (q - best_i) :]
    return chosen


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
NEEDS_BUDGET = tuple(n for n, r in SELECTION_RULES.items() if r.needs_budget)
SOURCE_ORDERED = tuple(n for n, r in SELECTION_RULES.items() if r.source_ordered)
