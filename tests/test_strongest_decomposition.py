"""The strongest org's update decomposed (hacrl_tools/bench/strongest.py): hand-computed groups."""

import math

import pytest
import torch

from hacrl_fed.algorithm.advantages import group_advantages
from hacrl_tools.bench.strongest import own_shift, prompt_outcomes, reference_ids, summarize

# prompt 1: own 1,0,0,0 and two foreign successes; prompt 2: own all wrong and one foreign success
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
GROUPS = [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]
OWN = [True] * 4 + [False] * 2 + [True] * 4 + [False]


def joint_adv():
    return group_advantages(torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(GROUPS), eps=0.0).tolist()


def test_reference_ids_chunk_own_rows_per_prompt():
    assert reference_ids([1, 1, 1, 1, 2], [True, True, False, True, True], 2) == [0, 0, -1, 1, 2]
    with pytest.raises(ValueError, match="ref_size"):
        reference_ids([1], [True], 0)


def test_own_shift_against_the_own_group():
    out = own_shift(REWARDS, GROUPS, OWN, joint_adv(), ref_size=4, eps=0.0)
    part, fail = out["partial"], out["fail"]
    # prompt 1 joint: mean 1/2, Bessel std sqrt(1.5/5); own alone: mean 1/4, std 1/2 -> right 1.5, wrong -0.5
    a = 0.5 / math.sqrt(0.3)
    assert part["rows"] == 4 and part["right"] == 1 and part["wrong"] == 3
    assert part["right_shrunk"] == 1 and part["wrong_pushed"] == 3  # 0.913 < 1.5 and -0.913 < -0.5
    assert part["sum_ref_right"] == pytest.approx(1.5) and part["sum_ref_wrong"] == pytest.approx(-1.5)
    assert part["sum_adv"] == pytest.approx(a - 3 * a)
    # prompt 2 joint: mean 1/5, std sqrt(0.8/4); own alone uniform -> reference 0
    b = -0.2 / math.sqrt(0.2)
    assert fail["rows"] == 4 and fail["wrong_pushed"] == 4 and fail["nonzero_ref"] == 0
    assert fail["sum_adv"] == pytest.approx(4 * b) and fail["sum_ref"] == 0.0
    s = summarize(out, prompt_outcomes(REWARDS, GROUPS, OWN, 4), {"num_cross": 3.0, "num_cross_grad": 1.0})
    assert s["mean_shift"] == pytest.approx((a - 3 * a + 4 * b) / 8)
    assert s["right_shrunk_share"] == 1.0 and s["nonzero_ref_share"] == 0.5
    assert s["foreign_grad_share"] == pytest.approx(1 / 3)


def test_prompt_outcomes_count_other_successes_per_reference_group():
    out = prompt_outcomes(REWARDS, GROUPS, OWN, 4)
    assert out["partial/other_success"] == 1 and out["fail/other_success"] == 1
    assert out["other_successes/partial"] == 2 and out["other_successes/fail"] == 1
    # GSPO x2: one prompt of 8 own rows, halves of 4: the first fails, the second has the success
    r, g, own = [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], [7] * 8, [True] * 8
    halves = prompt_outcomes(r, g, own, 4)
    assert halves["fail/other_success"] == 1 and halves["partial/no_other_success"] == 1
    shift = own_shift(r, g, own, group_advantages(torch.tensor(r), torch.tensor(g)).tolist(), 4)
    # 2G group: mean 1/8, std sqrt(1/8): right 2.47 (half alone: 1.5), wrong -0.354 (-0.5; 0 in the failed half)
    assert shift["fail"]["wrong_pushed"] == 4
    assert shift["partial"]["right_shrunk"] == 0 and shift["partial"]["wrong_pushed"] == 0


def test_own_shift_is_zero_when_the_joint_group_is_the_own_group():
    r, g, own = [1.0, 0.0, 1.0, 0.0], [3] * 4, [True] * 4
    adv = group_advantages(torch.tensor(r), torch.tensor(g)).tolist()
    out = own_shift(r, g, own, adv, 4)["partial"]
    assert out["right_shrunk"] == out["wrong_pushed"] == 0 and out["sum_adv"] == pytest.approx(out["sum_ref"])


def test_table_row_reads_the_summary():
    from hacrl_tools.bench.strongest import TABLE_HEAD, table_rows

    out = own_shift(REWARDS, GROUPS, OWN, joint_adv(), ref_size=4, eps=0.0)
    s = summarize(out, prompt_outcomes(REWARDS, GROUPS, OWN, 4), {"num_cross": 3.0, "num_cross_grad": 1.0})
    run = {
        "setting": "x",
        "method": "m",
        "rounds": 1,
        "orgs": {"a": {"accuracy_before": 0.5, "accuracy_after": 0.6, **s}},
    }
    (row,) = table_rows([run])
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == TABLE_HEAD.splitlines()[0].count("|") - 1
    assert cells[:4] == ["`x`", "m", "a", "0.500 → 0.600"]
    assert cells[6:8] == ["1.00", "1.00"] and cells[9] == "3, 0.33" and cells[10:] == ["0.50", "0.50", "0.00"]


def test_compare_rows_pair_each_method_with_gspo_x2_by_seed():
    from hacrl_tools.bench.strongest import compare_rows

    def run(method, seed, acc, rules=None):
        return {"setting": "s", "method": method, "seed": seed, "org_rules": rules or {},
                "orgs": {"a": {"accuracy_after": acc}}}  # fmt: skip

    runs = [run("gspo_x2", 0, 0.5), run("gspo_x2", 1, 0.6), run("d", 0, 0.52), run("d", 1, 0.6, {"a": "rescue"})]
    rows = compare_rows(runs)
    assert rows[0] == "| `s` | a | gspo_x2 | 2 | 0.550 (0.500, 0.600) | – |"
    assert rows[1] == "| `s` | a | d | 1 | 0.520 (0.520) | +2.0 |"
    assert rows[2] == "| `s` | a | d, a: rescue | 1 | 0.600 (0.600) | +0.0 |"
