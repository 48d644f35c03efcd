"""The capability table per (org, round): figures of each row's round; K = 0 is the tracker bit for bit."""

import random

import pytest
import torch

from hacrl_fed.algorithm import CapabilityTracker, capability_coefficients, capability_ratios, hacpo_advantages
from hacrl_fed.algorithm.capability_rounds import RoundCapabilities

ORGS = ["acme", "globex", "initech"]


def _rounds(n=12, seed=0):
    """Per round the accuracies of the orgs that replied (one absent now and then; a 0.0 to hit the floor)."""
    rng = random.Random(seed)
    out = []
    for t in range(1, n + 1):
        accs = {org: rng.choice([0.0, rng.random()]) if t == 3 else rng.random() for org in ORGS}
        if t % 4 == 2:
            accs.pop(rng.choice(ORGS))
        out.append(accs)
    return out


def _joint_groups(seed):
    g = torch.Generator().manual_seed(seed)
    n = 36
    rewards = (torch.rand(n, generator=g) < 0.5).double()
    return rewards, torch.arange(n) % 6, torch.arange(n) % 3


@pytest.mark.parametrize("warmup", [0, 2])
@pytest.mark.parametrize("window", [1, 3, 5])
def test_rows_of_the_current_round_give_the_tracker_s_numbers_bit_for_bit(window, warmup):
    """K = 0: every row from the round just recorded; the advantages and coefficients equal today's exactly."""
    tracker = CapabilityTracker(window=window, warmup_rounds=warmup)
    table = RoundCapabilities(window=window, warmup_rounds=warmup)
    for t, accs in enumerate(_rounds(), start=1):
        tracker.update(accs)
        table.record(t, accs)
        cap = tracker.effective_capabilities(ORGS)
        assert table.table(t, ORGS) == dict(zip(ORGS, cap))
        rewards, groups, sources = _joint_groups(t)
        for learner, name in enumerate(ORGS):
            lc, sc = table.row_figures(name, [(ORGS[j], t) for j in sources.tolist()])
            for calibrate in (True, False):
                today = hacpo_advantages(rewards, groups, sources, learner, cap, calibrate=calibrate)
                at_rounds = hacpo_advantages(rewards, groups, sources, learner, (lc, sc), calibrate=calibrate)
                assert torch.equal(today, at_rounds)
            v_today = capability_coefficients(cap, learner, sources)
            assert torch.equal(v_today, capability_coefficients((lc, sc), learner, sources))


def test_a_row_uses_the_figures_of_its_own_round():
    table = RoundCapabilities(window=2)
    table.record(1, {"acme": 0.2, "globex": 0.8})
    table.record(2, {"acme": 0.4, "globex": 0.4})
    table.record(3, {"acme": 0.6, "globex": 0.1})
    assert table.capability("acme", 1) == 0.2 and table.capability("acme", 3) == pytest.approx(0.5)
    assert table.capability("globex", 2) == pytest.approx(0.6) and table.capability("globex", 3) == pytest.approx(0.25)
    assert table.capability("initech", 3) == 1.0  # never recorded
    # learner acme now at round 3; rows from globex of round 1 and of round 3, and one own row of round 3
    lc, sc = table.row_figures("acme", [("globex", 1), ("globex", 3), ("acme", 3)])
    assert lc == pytest.approx([0.2, 0.5, 0.5]) and sc == pytest.approx([0.8, 0.25, 0.5])
    own = torch.tensor([False, False, True])
    w = capability_ratios((lc, sc), 0, torch.tensor([1, 1, 0]))  # own: source 0, the learner
    assert w.tolist() == pytest.approx([0.25, 2.0, 1.0])
    v = capability_coefficients((lc, sc), 0, torch.tensor([1, 1, 0]))
    assert v.tolist() == pytest.approx([4.0, 0.5, 1.0])
    # one joint group: mu = mean(w * R) = (0.25 * 1 + 2.0 * 1 + 1 * 0) / 3 = 0.75; std of (1, 1, 0) = 0.57735
    adv = hacpo_advantages(torch.tensor([1.0, 1.0, 0.0]), torch.zeros(3), torch.tensor([1, 1, 0]), 0, (lc, sc))
    std = (1 / 3) ** 0.5
    assert adv.tolist() == pytest.approx([(1 - 0.75) / (std + 1e-6)] * 2 + [(0 - 0.75) / (std + 1e-6)])


def test_recording_order_does_not_matter_and_state_round_trips():
    rounds = _rounds(seed=4)
    in_order, shuffled = RoundCapabilities(window=3, warmup_rounds=1), RoundCapabilities(window=3, warmup_rounds=1)
    for t, accs in enumerate(rounds, start=1):
        in_order.record(t, accs)
    pairs = [(t, org, acc) for t, accs in enumerate(rounds, start=1) for org, acc in accs.items()]
    random.Random(1).shuffle(pairs)  # a slow org's round 3 may be recorded after a fast org's round 5
    for t, org, acc in pairs:
        shuffled.record(t, {org: acc})
    restored = RoundCapabilities()
    restored.load_state_dict(in_order.state_dict())
    for t in range(0, len(rounds) + 2):
        expect = in_order.table(t, ORGS + ["nobody"])
        assert shuffled.table(t, ORGS + ["nobody"]) == expect and restored.table(t, ORGS + ["nobody"]) == expect
    assert in_order.in_warmup(1) and not in_order.in_warmup(2) and in_order.in_warmup(0)


def test_bad_records_are_refused():
    table = RoundCapabilities()
    table.record(1, {"acme": 0.5})
    with pytest.raises(ValueError, match="already recorded"):
        table.record(1, {"acme": 0.6})
    with pytest.raises(ValueError, match="round"):
        table.record(0, {"acme": 0.5})
    with pytest.raises(ValueError, match="finite"):
        table.record(2, {"acme": float("nan")})
    with pytest.raises(ValueError, match="window"):
        RoundCapabilities(window=0)
    with pytest.raises(ValueError, match="finite and > 0"):
        capability_ratios(([0.5], [0.0]), 0, torch.tensor([1]))
    assert table.capability("acme", 5) == 0.5 and table.capability("acme", 2) == 0.5


@pytest.mark.parametrize(
    ("rewards", "groups", "sources", "message"),
    [
        ([1.0, 0.0], [0, 0, 0], [0, 1], "same length, got 2, 3"),
        ([1.0, 0.0], [0, 0], [0, 1, 1], "same length, got 2, 2, 3"),
        ([[1.0, 0.0]], [0], [0], "rewards must be 1-D"),
        ([1.0, 0.0], [[0, 0]], [0, 1], "group_ids must be 1-D"),
        ([1.0, float("inf")], [0, 0], [0, 1], "rewards must be finite"),
    ],
)
def test_both_entry_points_refuse_bad_rows_with_the_same_message(rewards, groups, sources, message):
    """One rule for the row inputs: the per-round entry point refuses what the lock-step one does, in its words."""
    args = (torch.tensor(rewards), torch.tensor(groups), torch.tensor(sources), 0)
    errors = []
    for call in (lambda: hacpo_advantages(*args, [1.0, 1.0]), lambda: hacpo_advantages(*args, ([1.0], [1.0]))):
        with pytest.raises(ValueError, match=message) as caught:
            call()
        errors.append(str(caught.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("dtype", [torch.long, torch.float16, torch.float64])
def test_both_entry_points_give_the_same_dtype_and_empty_rows(dtype):
    """Integer rewards give float32, float ones their own dtype; no rows give an empty tensor of that dtype."""
    want = dtype if dtype.is_floating_point else torch.float32
    rows = (torch.tensor([1, 0, 1], dtype=dtype), torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 1]), 0)
    lc, sc = [1.0, 1.0, 1.0], [1.0, 0.5, 0.5]
    today = hacpo_advantages(*rows, [1.0, 0.5])
    assert today.dtype == want and torch.equal(today, hacpo_advantages(*rows, (lc, sc)))
    empty = (torch.tensor([], dtype=dtype), torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), 0)
    for got in (hacpo_advantages(*empty, [1.0]), hacpo_advantages(*empty, ([], []))):
        assert got.dtype == want and got.shape == (0,)


def test_revise_replaces_a_recorded_round_and_records_a_missing_one():
    """Blind asynchronous rounds: a proven accusation replaces the claimed P_x(t) by the coordinator's own count."""
    caps = RoundCapabilities(window=2, floor=0.05, warmup_rounds=0)
    caps.record(1, {"a": 1.0})
    caps.record(2, {"a": 0.5})
    caps.revise(1, "a", 0.25)
    assert caps.capability("a", 2) == (0.25 + 0.5) / 2 and caps.capability("a", 1) == 0.25
    caps.revise(3, "b", 0.0)
    assert caps.capability("b", 3) == 0.05  # floored
    with pytest.raises(ValueError):
        caps.revise(0, "a", 0.5)
    with pytest.raises(ValueError):
        caps.revise(2, "a", -0.5)
