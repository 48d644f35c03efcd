"""A budget per source (hacrl_fed/algorithm/budget_split.py, ``trainer.selection.budget_split``): the shares by hand,
every budgeted rule under ``per_source``, a property test that no source takes more than its share whatever the
others offer (a squatter offering many rows included), the counters, the config, and the intake: a doctoring
source whose rows the likelihood screen drops crowds an honest source out of a pooled budget, not of its share."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hacrl_fed.algorithm.budget_split import share_level, share_metrics, source_shares, take_shares
from hacrl_fed.algorithm.selection import RULES, select_rollouts, select_rows
from hacrl_fed.config import ConfigError, SelectionConfig, load_config
from hacrl_fed.trainer import TrainRow
from hacrl_fed.types import ChatMessage, Prompt, Rollout, TrainRequest
from hacrl_fed.worker.intake import Intake, OwnRound, Scoring
from tests.helpers_scripts import load_script
from tests.helpers_tiny import tiny_char_tokenizer

BUDGETED = [r for r in RULES if r not in ("all", "peer_sample")]  # every rule a per-source budget applies to


# ---------------------------------------------------------------------------------------------- shares by hand


def test_share_level_is_the_highest_level_that_fits():
    assert share_level([2, 10, 10], 12) == 5  # 2 + 5 + 5 = 12; 2 + 6 + 6 = 14 > 12
    assert share_level([10, 10, 10], 10) == 3  # 9 <= 10 < 12
    assert share_level([1, 2], 50) == 2  # everything fits: the largest demand
    assert share_level([], 5) == share_level([4, 4], 0) == 0
    with pytest.raises(ValueError, match=">= 0"):
        share_level([1, -1], 3)


def test_shares_fill_short_sources_and_split_the_rest_evenly():
    # a wants 2 (below its third of 12): it gets 2, and b and c share the 10 left
    assert source_shares({"a": 2, "b": 10, "c": 10}, 12, seed=0) == {"a": 2, "b": 5, "c": 5}
    assert source_shares({"a": 0, "b": 100, "c": 100}, 60, seed=0) == {"a": 0, "b": 30, "c": 30}
    assert source_shares({"a": 1, "b": 3}, 50, seed=0) == {"a": 1, "b": 3}  # everything fits
    assert source_shares({"a": 7, "b": 7}, 0, seed=0) == {"a": 0, "b": 0}


def test_the_remainder_goes_one_each_to_sources_in_a_seeded_order():
    # 10 over three sources of 10: level 3, one slot left, which source gets it is the seed's
    got = [source_shares({"a": 10, "b": 10, "c": 10}, 10, seed=s) for s in range(20)]
    assert all(sorted(g.values()) == [3, 3, 4] for g in got)
    assert {max(g, key=g.__getitem__) for g in got} == {"a", "b", "c"}
    assert source_shares({"a": 10, "b": 10, "c": 10}, 10, seed=3) == got[3]
    # a source at its demand never takes a remainder slot: a (3) is full, b and c share 8 + 1
    assert sorted(source_shares({"a": 3, "b": 10, "c": 10}, 12, seed=1).items())[0] == ("a", 3)


def test_take_shares_takes_each_sources_first_rows_in_order():
    sources = ["b", "b", "c", "b", "c", "c"]
    assert take_shares([5, 0, 1, 2, 3, 4], sources, {"b": 2, "c": 1}) == [5, 0, 1]
    assert take_shares([0, 1, 2], sources, {}) == []


# ------------------------------------------------------------------------------------- rules under per_source

# idx: (reward, prompt, source, sample); b has four successes, c one, s (a squatter) eight
POOL = [
    (1.0, 1, "b", 0),
    (1.0, 1, "b", 1),
    (0.0, 1, "b", 2),
    (0.0, 1, "c", 0),  # 0-3
    (1.0, 2, "b", 0),
    (1.0, 2, "c", 0),
    (0.0, 3, "b", 0),
    (0.0, 3, "c", 0),
    (1.0, 4, "b", 0),  # 4-8
    *[(1.0, p, "s", j) for p in (1, 2, 3, 4) for j in range(2)],  # 9-16
]
OWN = {1: [1.0, 0.0, 0.0, 0.0], 2: [1.0, 1.0], 3: [0.0, 0.0], 4: [0.0, 0.0]}


def pick(rule, budget, split, seed=0, pool=POOL, own=OWN):
    r, p, s, j = ([row[k] for row in pool] for k in range(4))
    return select_rows(r, p, s, j, own, rule, budget, seed, split)


def per_source_counts(sel, pool=POOL):
    out: dict[str, int] = {}
    for i in sel.selected:
        out[pool[i][2]] = out.get(pool[i][2], 0) + 1
    return out


def test_successes_per_source_gives_the_one_row_source_its_row():
    # eligible: b 4, c 1, s 8; budget 6: level 2 (2 + 1 + 2 = 5), one slot left for b or s
    for seed in range(10):
        sel = pick("successes", 6, "per_source", seed)
        counts = per_source_counts(sel)
        assert 5 in sel.selected and counts["c"] == 1 and sorted((counts["b"], counts["s"])) == [2, 3]
        assert sel.shares is not None and sum(sel.shares.values()) == 6
    # pooled: a uniform 6 of the 13 successes; c's one success is left out for some seeds
    assert any(5 not in pick("successes", 6, "pooled", seed).selected for seed in range(10))


@pytest.mark.parametrize("rule", BUDGETED)
def test_with_one_foreign_source_per_source_is_pooled(rule):
    # the default split (issue 27) changes nothing where one peer sends rows: its share is the whole budget
    only_b = [row for row in POOL if row[2] == "b"]
    for budget in range(len(only_b) + 2):
        for seed in range(3):
            split = pick(rule, budget, "per_source", seed, pool=only_b)
            assert split.selected == pick(rule, budget, "pooled", seed, pool=only_b).selected
            assert split.shares is not None and set(split.shares) == {"b"}


def test_a_source_that_sends_nothing_has_no_share_and_takes_none_from_the_others():
    # a round where s (the squatter) sends nothing: b and c divide the budget as if s were not in the federation,
    # and a source with rows but no eligible row (demand 0) leaves its part to the others
    without_s = [row for row in POOL if row[2] != "s"]
    sel = pick("successes", 4, "per_source", pool=without_s)
    assert sel.shares == {"b": 3, "c": 1} and per_source_counts(sel, without_s) == {"b": 3, "c": 1}
    no_success_c = [row for row in without_s if not (row[2] == "c" and row[0] > 0)]
    sel = pick("successes", 4, "per_source", pool=no_success_c)
    assert sel.shares == {"b": 4, "c": 0} and per_source_counts(sel, no_success_c) == {"b": 4}


def test_per_source_is_refused_by_a_source_ordered_rule_and_an_unknown_split():
    with pytest.raises(ValueError, match="budget_split per_source needs a rule that looks at every source"):
        pick("peer_sample", 4, "per_source")
    with pytest.raises(ValueError, match="budget_split must be one of pooled, per_source"):
        pick("successes", 4, "shared")


# --------------------------------------------------------------------------------------------- the property

ROW = st.tuples(st.sampled_from([0.0, 0.5, 1.0]), st.integers(1, 4), st.sampled_from(["h1", "h2", "h3"]))


def offered(honest, squat_rows):
    """The honest rows plus a squatter ``sq`` offering ``squat_rows`` successes spread over the prompts."""
    pool = [(r, p, s, j) for j, (r, p, s) in enumerate(honest)]
    pool += [(1.0, 1 + j % 4, "sq", j) for j in range(squat_rows)]
    return pool


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    honest=st.lists(ROW, max_size=30),
    squat=st.integers(0, 40),
    budget=st.integers(0, 24),
    rule=st.sampled_from(BUDGETED),
    seed=st.integers(0, 2**31),
)
def test_no_source_exceeds_its_share_and_each_keeps_its_floor_whatever_the_others_offer(
    honest, squat, budget, rule, seed
):
    pool = offered(honest, squat)
    sel = pick(rule, budget, "per_source", seed, pool=pool, own=OWN)
    counts, shares = per_source_counts(sel, pool), dict(sel.shares or {})
    assert sum(shares.values()) <= budget and len(sel.selected) <= budget
    demand = _demand(rule, sel, pool)
    for src, share in shares.items():
        assert counts.get(src, 0) <= share <= demand[src]  # never beyond its share (nor its rows)
    active = [s for s in demand if demand[s] > 0]
    for src in active:  # its floor: min(demand, budget // sources with a demand), whatever the others offer
        assert counts.get(src, 0) >= min(demand[src], budget // len(active))
        for other in active:  # max-min fair: nobody is more than one row above a source left wanting
            if counts.get(other, 0) < demand[other]:
                assert counts.get(src, 0) <= counts.get(other, 0) + 1
    metrics = sel.metrics([s for _, _, s, _ in pool], budget)
    assert all(metrics[f"select/{s}/over_share"] == 0 for s in demand)
    # a squatter offering three times the rows changes no honest source's share once it already wants more
    if squat >= budget:
        more = pick(rule, budget, "per_source", seed, pool=offered(honest, 3 * squat + 1), own=OWN)
        assert {s: n for s, n in (more.shares or {}).items() if s != "sq"} == {
            s: n for s, n in shares.items() if s != "sq"
        }


def _demand(rule, sel, pool):
    """Per source, its eligible rows."""
    out = {s: 0 for _, _, s, _ in pool}
    for i in sel.eligible:
        out[pool[i][2]] += 1
    return out


# ------------------------------------------------------------------------------------------------ counters


def test_pooled_counts_what_a_source_took_beyond_its_share_and_per_source_none():
    sources = [s for _, _, s, _ in POOL]
    pooled = [pick("successes", 3, "pooled", seed) for seed in range(10)]
    assert any(p.metrics(sources, 3)["select/s/over_share"] > 0 for p in pooled)  # the squatter took c's or b's
    for seed in range(10):
        m = pick("successes", 3, "per_source", seed).metrics(sources, 3)
        assert m["select/b/share"] + m["select/c/share"] + m["select/s/share"] == 3 and m["select/c/share"] == 1
        assert m["select/b/over_share"] == m["select/c/over_share"] == m["select/s/over_share"] == 0
    assert "select/b/share" not in pick("successes", None, "per_source").metrics(sources)
    assert share_metrics(["b", "b", "c"], [0, 1], {"b": 1}) == {
        "select/b/share": 1.0,
        "select/b/over_share": 1.0,
        "select/c/share": 0.0,
        "select/c/over_share": 0.0,
    }


def test_select_rollouts_passes_the_split_on():
    foreign = [SimpleNamespace(reward=r, prompt_id=p, org_id=s, sample_index=j) for r, p, s, j in POOL]
    own = [SimpleNamespace(group=p, reward=r) for p, rs in OWN.items() for r in rs]  # 10 own rows
    kept, m = select_rollouts(foreign, own, "successes", None, 0.3, seed=2, split="per_source")
    assert m["select/budget"] == 3 and m["select/c/selected"] == 1 and len(kept) == 3
    assert [foreign.index(r) for r in kept] == sorted(foreign.index(r) for r in kept)  # arrival order


# --------------------------------------------------------------------------------------------------- config

ORGS = [{"id": "a", "model": {"zoo": "micro-qwen-char"}}, {"id": "b", "model": {"zoo": "micro-gpt2-bpe"}}]


@pytest.mark.parametrize(
    ("given", "budget_multiple", "split"),
    [
        ({}, 0.5, "per_source"),  # the defaults since issue 27
        ({"rule": "all"}, None, "pooled"),  # keeps every row: no budget, nothing to divide
        ({"budget_multiple": None}, None, "pooled"),  # the defaults before issue 27
        ({"budget": None}, None, "pooled"),  # a budget field named: the section chose its budget
        ({"rule": "successes", "budget": 3}, None, "per_source"),
        ({"rule": "peer_sample"}, 0.5, "pooled"),  # takes whole sources: per_source refused
        ({"budget_multiple": 1.0, "budget_split": "pooled"}, 1.0, "pooled"),  # named: kept as named
        ({"rule": "all", "budget_split": "per_source"}, None, "per_source"),
    ],
)
def test_config_the_default_budget_is_half_own_rows_per_source_where_the_section_leaves_it_out(
    given, budget_multiple, split
):
    sel = SelectionConfig(**given)
    assert (sel.budget_multiple, sel.budget_split) == (budget_multiple, split)
    assert SelectionConfig(**sel.model_dump()) == sel  # a resolved dump (a run dir, a worker's config) reloads as is


def test_config_budget_split_is_validated_naming_the_field():
    cfg = load_config(
        {
            "name": "x",
            "orgs": ORGS,
            "trainer": {"selection": {"rule": "successes", "budget_multiple": 1.0, "budget_split": "per_source"}},
        }
    )
    assert cfg.trainer.selection.budget_split == "per_source"
    with pytest.raises(ConfigError, match=r"trainer\.selection\.budget_split: Input should be 'pooled' or"):
        load_config({"name": "x", "orgs": ORGS, "trainer": {"selection": {"budget_split": "shared"}}})
    with pytest.raises(ConfigError, match="trainer.selection: budget_split per_source needs a rule"):
        load_config(
            {
                "name": "x",
                "orgs": ORGS,
                "trainer": {"selection": {"rule": "peer_sample", "budget": 4, "budget_split": "per_source"}},
            }
        )


def test_config_describe_lists_budget_split(capsys):
    from hacrl_fed.cli import main

    assert main(["config", "--describe"]) == 0
    out = capsys.readouterr().out
    assert "trainer.selection.budget_split  (pooled | per_source)  default per_source" in out
    assert "trainer.selection.budget_multiple  (float | null, >= 0)  default 0.5" in out


# ------------------------------------------------------------------------------------------------- the intake

G, MAX_NEW, ROUND, BUDGET = 4, 16, 3, 4
PROMPTS = tuple(Prompt(pid, (ChatMessage("user", f"{pid}+0"),), str(pid)) for pid in (10, 20))


class Task:
    """The learner's verifier: a text holding "wrong" is wrong, anything else right."""

    name = "arithmetic"

    @staticmethod
    def verify(text: str, reference: str) -> float:
        return 0.0 if "wrong" in text else 1.0


def _request():
    """``honest`` solves one sample of each prompt (2 successes), ``doctor`` every one (8 doctored successes)."""
    rows = []
    for p in PROMPTS:
        for j in range(G):
            ok = j == 0
            rows.append(Rollout("honest", ROUND, p.prompt_id, j, "ok" if ok else "wrong", "stop", float(ok), -2.0, 4))
            rows.append(Rollout("doctor", ROUND, p.prompt_id, j, "ok!!", "stop", 1.0, -2.0, 4))
    return TrainRequest("run", ROUND, "me", PROMPTS, tuple(rows), {})


def _admit(split, seed):
    orgs = [{"id": o, "model": {"zoo": "micro-qwen-char"}} for o in ("me", "honest", "doctor")]
    cfg = load_config(
        {
            "name": "squat",
            "seed": 0,
            "orgs": orgs,
            "algorithm": {"name": "hacpo"},
            "generation": {"num_samples": G, "max_new_tokens": MAX_NEW, "eval_max_new_tokens": MAX_NEW},
            "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
            "federation": {"prompts_per_round": len(PROMPTS)},
            "security": {"signing": False},
            "trainer": {"selection": {"rule": "successes", "budget": BUDGET, "budget_split": split}},
        }
    )
    tok = tiny_char_tokenizer()
    ids = {p.prompt_id: tok(p.messages[0].content, add_special_tokens=False)["input_ids"] for p in PROMPTS}
    own = [
        TrainRow(list(ids[p.prompt_id]), [7, 8, 9, 10], float(j % 2), p.prompt_id, 0, True, -0.5, [-0.5] * 4, n_bytes=4)
        for p in PROMPTS
        for j in range(G)
    ]
    door = Intake(
        cfg,
        "me",
        selection=cfg.trainer.selection,
        screen=cfg.trainer.likelihood_screen,
        uses_cross=True,
        task=Task(),
        tokenizer=tok,
        eos_id=tok.eos_token_id,
    )
    agents = ["doctor", "honest", "me"]

    def score(rows):  # the doctored text is far less likely under the learner than its own: the screen drops it
        return [-1000.0 if agents[r.source] == "doctor" else -0.5 * len(r.response_ids) for r in rows]

    request = _request()
    admitted = door.admit(
        request,
        OwnRound("run", ROUND, "arithmetic", PROMPTS, MAX_NEW, ids, own),
        seed=seed,
        opener=None,
        scoring=Scoring(score, 60, {}),
    )
    trained = [agents[r.source] for r in admitted.rows if not r.is_self and r.response_ids]
    return trained, {**admitted.metrics(request), **admitted.update_metrics({})}


def test_a_doctoring_source_crowds_an_honest_one_out_of_a_pooled_budget_not_out_of_its_share():
    seeds = range(8)
    pooled = [_admit("pooled", s) for s in seeds]
    split = [_admit("per_source", s) for s in seeds]
    for trained, m in split:  # per source: the honest source's 2 successes fill its share of 4, every round
        assert trained == ["honest", "honest"] and m["select/honest/selected"] == 2
        assert m["select/doctor/selected"] == 2 and m["screen/doctor/dropped_low_likelihood"] == 2
        assert m["select/doctor/over_share"] == m["select/honest/over_share"] == 0
        assert m["trust/doctor/accepted"] == 8  # every doctored row passed the reward screen: only scoring drops it
    # pooled: a uniform 4 of the 10 successes, the doctor's 8 take most of the budget, the screen then drops them
    honest_pooled = [t.count("honest") for t, _ in pooled]
    assert all(t.count("doctor") == 0 for t, _ in pooled) and sum(honest_pooled) < 2 * len(seeds)
    crowded = [m for (t, m) in pooled if not t]
    assert crowded
    assert all(m["select/doctor/selected"] == BUDGET and m["select/doctor/over_share"] == 2 for m in crowded)


def test_train_cost_script_averages_each_orgs_train_rounds_after_the_first(tmp_path):
    import json

    mod = load_script("train_cost")
    rounds = [{"round": 0, "eval/a/accuracy": 0.5}]  # an eval-only row: no train call
    rounds += [{"round": r, "a/cpu/train": float(r), "a/select/selected": 2.0 * r} for r in (1, 2, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rounds) + "\n")
    got = mod.per_org(tmp_path)
    assert got["a"]["cpu_train"] == 3.0 and got["a"]["selected"] == 6.0 and got["a"]["rounds"] == 2.0
