"""Foreign-row selection (hacrl_fed/algorithm/selection.py): which rows each rule picks on a hand-made pool, budgets,
ties, determinism, the per-source counts, and the config's validation."""

from types import SimpleNamespace

import pytest

from hacrl_fed.algorithm.selection import NEEDS_BUDGET, RULES, resolve_budget, select_rollouts, select_rows, source_order
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


def test_nonzero_advantage_drops_rows_at_their_joint_group_mean():
    # prompt 1: pool 1,0,0,0 + 1,1,0,0 has mean 3/8, every reward differs from it; prompts 2 and 3 are uniform
    # (own + offered all 1 / all 0): advantage 0; prompt 4: pool 0,0 + 1,0 has mean 1/4
    assert pick("nonzero_advantage").selected == (0, 1, 2, 3, 8, 9)


def test_nonzero_advantage_with_non_binary_rewards_keeps_only_rows_off_the_mean():
    pool = [(0.5, 7, "b", 0), (0.25, 7, "b", 1), (0.75, 7, "c", 0)]
    # own 0.5, 0.5 + offered 0.5, 0.25, 0.75: mean exactly 0.5 -> the 0.5 row has advantage 0
    assert pick("nonzero_advantage", pool=pool, own={7: [0.5, 0.5]}).selected == (1, 2)


def test_successes_keeps_positive_rewards_only():
    assert pick("successes").selected == (0, 1, 4, 5, 8)


def test_learner_failed_keeps_prompts_where_the_learner_is_below_the_pools_best():
    # prompt 1: own mean 1/4 < 1; prompt 4: own mean 0 < 1 (b solved it); prompt 2: own all 1 (nothing to gain);
    # prompt 3: nobody solved it
    sel = pick("learner_failed")
    assert sel.eligible == sel.selected == (0, 1, 2, 3, 8, 9)


def test_learner_failed_budget_takes_the_lowest_own_mean_first():
    # prompt 4 (own mean 0) before prompt 1 (own mean 1/4)
    assert pick("learner_failed", budget=2).selected == (8, 9)
    three = pick("learner_failed", budget=3).selected
    assert set(three) > {8, 9} and len(set(three) & {0, 1, 2, 3}) == 1
    assert pick("learner_failed", budget=1).selected in ((8,), (9,))


def test_learner_failed_breaks_ties_between_prompts_by_seed():
    # prompts 3 and 4 both have own mean 0 and a foreign success: which one a budget of 1 serves is the seed's
    pool = [(1.0, 3, "b", 0), (1.0, 4, "b", 0)]
    own = {3: [0.0, 0.0], 4: [0.0, 0.0]}
    picks = {pick("learner_failed", budget=1, seed=s, pool=pool, own=own).selected for s in range(12)}
    assert picks == {(0,), (1,)}
    assert pick("learner_failed", budget=1, seed=4, pool=pool, own=own) == pick(
        "learner_failed", budget=1, seed=4, pool=pool, own=own)


def test_learner_failed_counts_a_prompt_without_own_rows_as_failed():
    pool = [(1.0, 5, "b", 0), (0.0, 5, "b", 1)]
    assert pick("learner_failed", pool=pool, own={}).selected == (0, 1)


def test_max_variance_one_row_per_prompt_picks_what_spreads_each_joint_group():
    sel = pick("max_variance", budget=4)  # one slot per prompt
    chosen = set(sel.selected)
    assert len(chosen) == 4
    assert len(chosen & {0, 1}) == 1  # prompt 1: own 1,0,0,0 + a success (var 0.24) beats + a failure (0.16)
    assert 8 in chosen  # prompt 4: own 0,0 + the success
    assert len(chosen & {4, 5}) == 1 and len(chosen & {6, 7}) == 1  # uniform prompts: any one row
    assert sel.eligible == tuple(range(10))  # no filter: everything left out is the budget's


def test_max_variance_two_per_prompt():
    # budget 8 over prompts of 4, 2, 2, 2 rows: 2 slots each; prompt 1 keeps both successes (own + 1,1: p = 1/2)
    assert pick("max_variance", budget=8).selected == (0, 1, 4, 5, 6, 7, 8, 9)


def test_max_variance_picks_failures_when_the_learner_solved_everything():
    pool = [(1.0, 1, "b", 0), (1.0, 1, "b", 1), (0.0, 1, "b", 2), (0.0, 1, "b", 3)]
    assert pick("max_variance", budget=2, pool=pool, own={1: [1.0] * 4}).selected == (2, 3)


def test_max_variance_without_own_rows_is_pods_top_and_bottom():
    pool = [(r, 1, "b", j) for j, r in enumerate([0.125, 0.5, 0.875, 0.25, 0.75])]
    assert pick("max_variance", budget=2, pool=pool, own={}).selected == (0, 2)  # 0.125 and 0.875
    # size 3: {0.875, 0.75, 0.125} and {0.875, 0.125, 0.25} tie exactly; the tie keeps more high rewards
    assert pick("max_variance", budget=3, pool=pool, own={}).selected == (0, 2, 4)


def test_max_variance_shares_the_budget_round_robin_across_prompts_with_rows_left():
    # prompt 1 has 4 rows, prompt 2 one: a budget of 4 gives prompt 2 its one row and prompt 1 three
    pool = [(1.0, 1, "b", 0), (0.0, 1, "b", 1), (1.0, 1, "b", 2), (0.0, 1, "b", 3), (1.0, 2, "b", 0)]
    sel = pick("max_variance", budget=4, pool=pool, own={}).selected
    assert 4 in sel and len(sel) == 4


@pytest.mark.parametrize("rule", [r for r in RULES if r != "all"])
def test_budget_zero_keeps_nothing_and_a_large_budget_keeps_every_eligible_row(rule):
    assert pick(rule, budget=0).selected == ()
    assert pick(rule, budget=1000).selected == pick(rule, budget=1000).eligible
    if rule not in NEEDS_BUDGET:
        assert pick(rule, budget=1000).selected == pick(rule).selected
    one = pick(rule, budget=1).selected
    assert len(one) == 1 and set(one) <= set(pick(rule, budget=1).eligible)


def test_uniform_is_deterministic_for_a_seed_and_differs_between_seeds():
    first = pick("uniform", budget=3, seed=5)
    assert first == pick("uniform", budget=3, seed=5) and len(first.selected) == 3
    assert len({pick("uniform", budget=3, seed=s).selected for s in range(10)}) > 1


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
    half, m = select_rollouts(foreign, own, "uniform", None, 0.5, seed=0)
    assert len(half) == 5 and m["select/budget"] == 5 and m["select/dropped_budget"] == 5
    assert [foreign.index(r) for r in half] == sorted(foreign.index(r) for r in half)


def test_bad_arguments():
    with pytest.raises(ValueError, match="needs a budget"):
        pick("uniform")
    with pytest.raises(ValueError, match="needs a budget"):
        pick("max_variance")
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
        ({"rule": "uniform", "budget": 3, "budget_multiple": 1}, "trainer.selection: budget and budget_multiple"),
        ({"rule": "all", "budget": 3}, "trainer.selection: rule all keeps every foreign row"),
        # a rule that needs a budget, with the default budget turned off (left out, it gets 0.5x own rows)
        ({"rule": "uniform", "budget_multiple": None}, "trainer.selection: rule uniform picks a subset"),
        ({"rule": "max_variance", "budget": None}, "trainer.selection: rule max_variance picks a subset"),
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
    with pytest.raises(ValidationError, match="Input should be 'all', 'uniform', .* or 'peer_sample'"):
        SelectionConfig(rule="best")


def test_config_per_org_override():
    orgs = [ORGS[0], {**ORGS[1], "trainer": {"selection": {"rule": "uniform", "budget_multiple": 1.0}}}]
    cfg = load_config({"name": "x", "orgs": orgs})
    from hacrl_fed.config import org_trainer

    assert org_trainer(cfg, "a").selection.rule == "successes" and org_trainer(cfg, "b").selection.budget_multiple == 1.0
    bad = [ORGS[0], {**ORGS[1], "trainer": {"selection": {"rule": "max_variance", "budget_multiple": None}}}]
    with pytest.raises(ConfigError, match=r"orgs\[b\]\.trainer\.selection: rule max_variance"):
        load_config({"name": "x", "orgs": bad})
    # an org's fields apply on top of the run's resolved section: the run's default budget stays unless the org
    # turns it off, and the error says how
    paper = [ORGS[0], {**ORGS[1], "trainer": {"selection": {"rule": "all"}}}]
    with pytest.raises(ConfigError, match=r"orgs\[b\]\.trainer\.selection: rule all .* set budget_multiple: null"):
        load_config({"name": "x", "orgs": paper})
    paper[1]["trainer"]["selection"]["budget_multiple"] = None
    assert org_trainer(load_config({"name": "x", "orgs": paper}), "b").selection.budget_multiple is None
