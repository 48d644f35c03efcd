"""Advantage estimators: hand-computed cases, n = 1..4 agents, and a plain-Python loop reference."""

import math
import random

import pytest
import torch

from hacrl_fed.algorithm import (
    advantage_metrics, capability_ratios, capability_coefficients, get_advantage_estimator, group_advantages,
    hacpo_advantages,
)


def ref_hacpo(rewards, groups, sources, learner, cap, reward_max=1.0, rmin=0.1, rmax=10.0, eps=1e-6):
    """Loop reference straight from docs/ALGORITHM.md (capability-aware advantage)."""
    out = [0.0] * len(rewards)
    for g in set(groups):
        rows = [i for i, x in enumerate(groups) if x == g]
        rs = [rewards[i] for i in rows]
        if max(rs) == min(rs):
            continue
        def w(j):
            return 1.0 if j == learner else min(rmax, max(rmin, cap[learner] / cap[j]))
        mu = sum(w(sources[i]) * rewards[i] for i in rows) / len(rows)
        if mu > reward_max:
            own = [rewards[i] for i in rows if sources[i] == learner]
            mu = sum(own) / len(own) if own else sum(rs) / len(rs)
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (len(rs) - 1))
        for i in rows:
            out[i] = (rewards[i] - mu) / (std + eps)
    return out


def test_hand_computed_two_agents():
    r = torch.tensor([1.0, 0, 1, 1, 0, 0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    s = torch.tensor([0, 1, 1, 0, 0, 1])
    adv = hacpo_advantages(r, g, s, 0, [0.5, 0.25])
    # group 0: w(0,1)=2, mu=(1 + 0 + 2)/3 = 1 (not > 1), std=sqrt(1/3)
    # group 1: mu=(1 + 0 + 0)/3, same std
    sd = math.sqrt(1 / 3) + 1e-6
    expected = [0.0, -1 / sd, 0.0, (2 / 3) / sd, -(1 / 3) / sd, -(1 / 3) / sd]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)


def test_baseline_guard_falls_back_to_own_mean():
    # learner 0 is 10x stronger: w(0,1)=10, mu = (0 + 10 + 10) / 3 > 1 -> own mean = 0
    r = torch.tensor([0.0, 1.0, 1.0])
    adv = hacpo_advantages(r, torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 1]), 0, [1.0, 0.1])
    sd = math.sqrt(1 / 3) + 1e-6
    assert torch.allclose(adv, torch.tensor([0.0, 1 / sd, 1 / sd]), atol=1e-6)


def test_baseline_guard_plain_mean_when_learner_absent_from_group():
    r = torch.tensor([0.0, 1.0, 1.0])
    adv = hacpo_advantages(r, torch.zeros(3, dtype=torch.long), torch.tensor([1, 1, 2]), 0, [1.0, 0.1, 0.1])
    sd = math.sqrt(1 / 3) + 1e-6
    assert torch.allclose(adv, (r - 2 / 3) / sd, atol=1e-6)


def test_uniform_group_is_zero_and_size_one_group_is_zero():
    r = torch.tensor([1.0, 1.0, 1.0, 0.5])
    adv = hacpo_advantages(r, torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 1, 0]), 1, [0.3, 0.9])
    assert torch.equal(adv, torch.zeros(4))


def test_equal_capability_reduces_to_group_normalisation():
    torch.manual_seed(0)
    r = torch.rand(24)
    g = torch.arange(24) // 8
    s = torch.arange(24) % 3
    a = hacpo_advantages(r, g, s, 2, [0.4, 0.4, 0.4])
    assert torch.allclose(a, group_advantages(r, g), atol=1e-6)


def test_capability_ratio_clamped_and_self_is_one():
    w = capability_ratios([1.0, 1e-8, 1e3], 0, torch.tensor([0, 1, 2]))
    assert w.tolist() == [1.0, 10.0, 0.1]
    v = capability_coefficients([1.0, 1e-8, 1e3, 0.5], 0, torch.tensor([0, 1, 2, 3]))
    assert torch.allclose(v, torch.tensor([1.0, 0.1, 10.0, 0.5]))


@pytest.mark.parametrize("n_agents", [1, 2, 3, 4])
@pytest.mark.parametrize("binary", [True, False])
def test_vectorised_equals_loop_reference(n_agents, binary):
    rng = random.Random(1000 * n_agents + binary)
    for trial in range(25):
        rows, groups, sources = [], [], []
        for g in range(rng.randint(1, 6)):
            for j in range(n_agents):
                for _ in range(rng.randint(0, 5)):  # unequal (even zero) counts per source
                    groups.append(g * 7 + 3)  # non-dense group ids
                    sources.append(j)
                    rows.append(float(rng.random() < 0.5) if binary else rng.choice([0.0, 0.25, rng.random(), 1.0]))
        if not rows:
            continue
        cap = [rng.choice([1e-8, 0.05, rng.random(), 1.0]) for _ in range(n_agents)]
        learner = rng.randrange(n_agents)
        got = hacpo_advantages(torch.tensor(rows, dtype=torch.float64), torch.tensor(groups), torch.tensor(sources),
                               learner, cap)
        want = ref_hacpo(rows, groups, sources, learner, cap)
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-9), (trial, cap, learner)


def test_dtype_and_bad_inputs():
    assert hacpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), torch.tensor([0, 0]), 0, [1.0]).dtype == \
        torch.float32
    assert hacpo_advantages(torch.tensor([]), torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long),
                            0, [1.0]).numel() == 0
    with pytest.raises(ValueError, match="same length"):
        hacpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0]), torch.tensor([0, 0]), 0, [1.0])
    with pytest.raises(ValueError, match="agent indices"):
        hacpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([0, 2]), 0, [1.0, 1.0])
    with pytest.raises(ValueError, match="learner"):
        hacpo_advantages(torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0]), 3, [1.0])
    with pytest.raises(ValueError, match="> 0"):
        hacpo_advantages(torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0]), 0, [0.0])
    with pytest.raises(ValueError, match="finite"):
        hacpo_advantages(torch.tensor([float("nan")]), torch.tensor([0]), torch.tensor([0]), 0, [1.0])


def test_registry_and_metrics():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 0, 0])
    s = torch.tensor([0, 0, 1, 1])
    assert torch.allclose(get_advantage_estimator("group")(r, g, s, 0, [1.0, 1.0]), group_advantages(r, g))
    assert torch.allclose(get_advantage_estimator("hacpo")(r, g, s, 0, [0.5, 0.5]),
                          hacpo_advantages(r, g, s, 0, [0.5, 0.5]))
    m = advantage_metrics(torch.tensor([1.0, 3.0, -1.0, -1.0]), s, ["a", "b", "c"])
    assert m == {"hacpo/adv_mean/a": 2.0, "hacpo/adv_mean/b": -1.0}
    with pytest.raises(KeyError, match="registered"):
        get_advantage_estimator("nope")


def test_hacpo_advantages_without_calibration_is_the_plain_group_advantage():
    """advantage_calibration false (w = 1): the joint-group baseline whatever the capability."""
    torch.manual_seed(0)
    rewards = (torch.rand(24) > 0.5).double()
    groups, sources = torch.arange(24) % 4, torch.arange(24) % 3
    for cap in ([0.2, 0.9, 0.5], [1.0, 1.0, 1.0], [0.05, 0.5, 0.99]):
        a = hacpo_advantages(rewards, groups, sources, 0, cap, calibrate=False)
        assert torch.allclose(a, group_advantages(rewards, groups))
    assert not torch.allclose(hacpo_advantages(rewards, groups, sources, 0, [0.2, 0.9, 0.5]),
                              group_advantages(rewards, groups))
