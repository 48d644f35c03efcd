"""Foreign-row selection (hacrl_fed/algorithm/selection.py): which rows each rule picks on a hand-made pool, budgets,
ties, determinism, the per-source counts, and the config's validation."""

from types import SimpleNamespace

import pytest

from hacrl_fed.algorithm.selection import SELECTION_RULES, RULES, resolve_budget, select_rollouts, select_rows, source_order
from hacrl_fed.config import ConfigError, load_config

# idx: (reward, prompt, source, sample)
POOL = [
    (1.0, 1, "b", 0),  # 0
    (1.0, 1, "b", 1),  # 1
    (0.0, 1, "b", 2),  # 2
    (0.0, 1, "c", 0),  # 3
    (1.0, 2, "b", 0),  # 4
    (1.0, 2, "c", 0),  # 5
    (0.0, 3, "b", 0),  # 6
    (0.0, 3, "c", 0),  # 7
    (1.0, 4, "b", 0),  # 8
    (0.0, 4, "c", 0),  # 9
]
# the learner's own rewards: prompt 1 mean 1/4, prompt 2 all solved, prompt 3 all failed, prompt 4 all failed
OWN = {1: [1.0, 0.0, 0.0, 0.0], 2: [1.0, 1.0], 3: [0.0, 0.0], 4: [0.0, 0.0]}


def pick(rule, budget=None, seed=0, pool=POOL, own=OWN):
    r, p, s, j = (list(c) for c in zip(*pool))
    return select_rows(r, p, s, j, own, rule, budget, seed)


def test_all_is_the_identity():
    sel = pick("all")
    assert sel.selected == sel.eligible == tuple(range(10))


def test_successes_keeps_positive_rewards_only():
    assert pick("successes").selected == (0, 1, 4, 5, 8)


@pytest.mark.parametrize("rule", [r for r in RULES if r != "all"])
def test_budget_zero_keeps_nothing_and_a_large_budget_keeps_every_eligible_row(rule):
    assert pick(rule, budget=0).selected == ()
    assert pick(rule, budget=1000).selected == pick(rule, budget=1000).eligible
    if not SELECTION_RULES[rule].needs_budget:
        assert pick(rule, budget=1000).selected == pick(rule).selected
    one = pick(rule, budget=1).selected
    assert len(one) == 1 and set(one) <= set(pick(rule, budget=1).eligible)


@pytest.mark.parametrize("rule", RULES)
def test_selection_does_not_depend_on_arrival_order(rule):
    budget = None if rule == "all" else 4
    order = [7, 2, 9, 0, 4, 1, 8, 3, 6, 5]
    shuffled = [POOL[i] for i in order]
    a = {POOL[i] for i in pick(rule, budget, seed=3).selected}
    b = {shuffled[i] for i in pick(rule, budget, seed=3, pool=shuffled).selected}
    assert a == b


def test_peer_sample_takes_whole_sources_in_the_seeded_source_order():
    # POOL: source b holds rows 0, 1, 2, 4, 6, 8; source c rows 3, 5, 7, 9
    assert source_order(["b", "c"], 0) == ["b", "c"] and source_order(["c", "b"], 1) == ["c", "b"]
    assert pick("peer_sample", budget=4, seed=1).selected == (3, 5, 7, 9)  # c first: all of c
    assert pick("peer_sample", budget=6, seed=0).selected == (0, 1, 2, 4, 6, 8)  # b first: all of b
    five = pick("peer_sample", budget=5, seed=1).selected  # all of c, then one of b's rows
    assert set(five) >= {3, 5, 7, 9} and len(set(five) - {3, 5, 7, 9}) == 1
    four_of_b = pick("peer_sample", budget=4, seed=0).selected
    assert len(four_of_b) == 4 and set(four_of_b) <= {0, 1, 2, 4, 6, 8}
    assert pick("peer_sample", budget=4, seed=0).eligible == tuple(range(10))  # no filter: the budget drops the rest


def test_source_order_depends_on_names_and_seed_only():
    names = [f"org{i}" for i in range(8)]
    assert source_order(names, 7) == source_order(list(reversed(names)), 7) == source_order(set(names), 7)
    assert sorted(source_order(names, 7)) == names
    assert len({tuple(source_order(names, s)) for s in range(10)}) > 1


def test_counts_per_source_and_totals():
    sel = pick("successes", budget=3, seed=1)
    m = sel.metrics([s for _, _, s, _ in POOL], 3)
    for src, offered in (("b", 6), ("c", 4)):
        c = {k: m[f"select/{src}/{k}"] for k in ("offered", "selected", "dropped_rule", "dropped_budget")}
        assert c["offered"] == offered and c["selected"] + c["dropped_rule"] + c["dropped_budget"] == offered
    assert m["select/b/dropped_rule"] == 2 and m["select/c/dropped_rule"] == 3  # the failures
    assert m["select/selected"] == 3 and m["select/dropped_budget"] == 2 and m["select/offered"] == 10
    assert m["select/budget"] == 3
    assert "select/budget" not in pick("all").metrics([s for _, _, s, _ in POOL])


def test_resolve_budget_absolute_or_multiple_of_own_rows():
    assert resolve_budget(None, None, 16) is None
    assert resolve_budget(5, None, 16) == 5 and resolve_budget(None, 1.0, 16) == 16
    assert resolve_budget(None, 0.5, 7) == 3 and resolve_budget(None, 0.0, 16) == 0
    for bad in ((1, 1.0), (-1, None), (None, -0.5)):
        with pytest.raises(ValueError):
            resolve_budget(*bad, 16)


def test_select_rollouts_keeps_arrival_order_and_counts_own_rows_for_a_multiple():
    foreign = [SimpleNamespace(reward=r, prompt_id=p, org_id=s, sample_index=j) for r, p, s, j in POOL]
    own = [SimpleNamespace(group=p, reward=r) for p, rs in OWN.items() for r in rs]  # 10 own rows
    same, m = select_rollouts(foreign, own, "all", None, None, seed=0)
    assert same == foreign and m["select/selected"] == 10 and m["select/dropped_rule"] == 0
    half, m = select_rollouts(foreign, own, "peer_sample", None, 0.5, seed=0)
    assert len(half) == 5 and m["select/budget"] == 5 and m["select/dropped_budget"] == 5
    assert [foreign.index(r) for r in half] == sorted(foreign.index(r) for r in half)


def test_bad_arguments():
    with pytest.raises(ValueError, match="needs a budget"):
        pick("peer_sample")
    with pytest.raises(ValueError, match="all keeps every row"):
        pick("all", budget=3)
    with pytest.raises(ValueError, match="unknown selection rule"):
        pick("best")
    with pytest.raises(ValueError, match="same length"):
        select_rows([1.0], [1, 2], ["b"], [0], {}, "successes", None, 0)
    with pytest.raises(ValueError, match="finite"):
        select_rows([float("nan")], [1], ["b"], [0], {}, "successes", None, 0)


ORGS = [{"id": "a", "model": {"zoo": "micro-qwen-char"}}, {"id": "b", "model": {"zoo": "micro-gpt2-bpe"}}]


@pytest.mark.parametrize(
    ("selection", "message"),
    [
        ({"rule": "successes", "budget": 3, "budget_multiple": 1}, "trainer.selection: budget and budget_multiple"),
        ({"rule": "all", "budget": 3}, "trainer.selection: rule all keeps every foreign row"),
        # a rule that needs a budget, with the default budget turned off (left out, it gets 0.5x own rows)
        # a rule the benchmarks rejected is gone (issue 42): the error names the field and the rules left
        ({"rule": "uniform", "budget": 3}, "trainer.selection.rule: Input should be 'all', 'successes' or 'peer_"),
        ({"rule": "rescue"}, "trainer.selection.rule: Input should be 'all', 'successes' or 'peer_sample'"),
        ({"rule": "peer_sample", "budget_multiple": None}, "trainer.selection: rule peer_sample picks a subset"),
        ({"rule": "successes", "budget": -1}, "trainer.selection.budget: Input should be greater than or equal"),
        ({"rule": "successes", "budget_multiple": -0.5}, "trainer.selection.budget_multiple: Input should be"),
        ({"rule": "best"}, "trainer.selection.rule: Input should be 'all'"),
        ({"rule": "successes", "budgets": 3}, "trainer.selection.budgets: Extra inputs"),
    ],
)
def test_config_validation_names_the_field(selection, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config({"name": "x", "orgs": ORGS, "trainer": {"selection": selection}})


def test_config_rules_are_the_selection_modules_rules():
    from pydantic import ValidationError

    from hacrl_fed.config import SelectionConfig

    for rule in RULES:  # the config accepts exactly the registered names (a budget where the rule needs one)
        assert SelectionConfig(rule=rule, budget=None if rule == "all" else 1).rule == rule
    with pytest.raises(ValidationError, match="Input should be 'all', 'successes' or 'peer_sample'"):
        SelectionConfig(rule="best")


def test_config_per_org_override():
    orgs = [ORGS[0], {**ORGS[1], "trainer": {"selection": {"budget_multiple": 1.0}}}]
    cfg = load_config({"name": "x", "orgs": orgs})
    from hacrl_fed.config import org_trainer

    assert org_trainer(cfg, "a").selection.rule == "successes" and org_trainer(cfg, "b").selection.budget_multiple == 1.0
    bad = [ORGS[0], {**ORGS[1], "trainer": {"selection": {"rule": "peer_sample", "budget_multiple": None}}}]
    with pytest.raises(ConfigError, match=r"orgs\[b\]\.trainer\.selection: rule peer_sample"):
        load_config({"name": "x", "orgs": bad})
    # an org's fields apply on top of the run's resolved section: the run's default budget stays unless the org
    # turns it off, and the error says how
    paper = [ORGS[0], {**ORGS[1], "trainer": {"selection": {"rule": "all"}}}]
    with pytest.raises(ConfigError, match=r"orgs\[b\]\.trainer\.selection: rule all .* set budget_multiple: null"):
        load_config({"name": "x", "orgs": paper})
    paper[1]["trainer"]["selection"]["budget_multiple"] = None
    assert org_trainer(load_config({"name": "x", "orgs": paper}), "b").selection.budget_multiple is None
