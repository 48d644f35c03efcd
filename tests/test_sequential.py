"""The guard's sequential test (hacrl_fed/algorithm/sequential.py): conditional power by hand, and how many prompts a
check reads."""

import math

import pytest

from hacrl_fed.algorithm.sequential import conditional_power, prompts_read


def phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def test_conditional_power_by_hand():
    # 2 lost, 3 gained in 100 of 400: mu = -0.01, var = 6/100 - 0.0001 = 0.0599, bar = 2.5 * sqrt(6 * 4) = 12.247,
    # projected S = -1 + 300 * -0.01 = -4, sd = sqrt(300 * 0.0599) = 4.239: CP = Phi(-16.247 / 4.239) = Phi(-3.833)
    assert conditional_power(2, 3, 100, 400, 2.5, 2) == pytest.approx(phi(-3.833), rel=1e-3)
    assert conditional_power(2, 3, 100, 400, 2.5, 2) < 1e-4
    # 10 lost, 2 gained: mu = 0.08, var = 13/100 - 0.0064 = 0.1236, bar = 2.5 * sqrt(13 * 4) = 18.03, projected
    # S = 8 + 24 = 32, sd = sqrt(300 * 0.1236) = 6.089: CP = Phi(13.97 / 6.089) = Phi(2.294) = 0.989
    assert conditional_power(10, 2, 100, 400, 2.5, 2) == pytest.approx(phi(2.294), rel=1e-3)
    # nothing discordant in 50 of 400: var = 1/50, bar = 2.5 * sqrt(8) = 7.071, sd = sqrt(350 / 50) = 2.646
    assert conditional_power(0, 0, 50, 400, 2.5, 2) == pytest.approx(phi(-7.071 / 2.646), rel=1e-3)
    # the margin is the bar where z * sqrt(...) is below it: bar = max(0.5 * sqrt(8), 5) = 5
    assert conditional_power(0, 0, 50, 400, 0.5, 5) == pytest.approx(phi(-5 / 2.646), rel=1e-3)
    # at the budget: the test itself (20 > 2.5 * sqrt(20) = 11.18 passes; 5 < 2.5 * sqrt(5) = 5.59 does not)
    assert conditional_power(20, 0, 400, 400, 2.5, 2) == 1.0
    assert conditional_power(5, 0, 400, 400, 2.5, 2) == 0.0


def _pairs(lost_every: int, gained_every: int, size: int = 400):
    """Reference all right but every ``lost_every``-th prompt lost; current gains every ``gained_every``-th of the
    others (made wrong in the reference)."""
    ref = [True] * size
    cur = [True] * size
    for i in range(size):
        if lost_every and i % lost_every == 0:
            cur[i] = False
        elif gained_every and i % gained_every == 1:
            ref[i] = False
    calls = []

    def pairs(n):
        calls.append(n)
        return ref[:n], cur[:n]

    return pairs, calls


def test_a_clear_check_stops_early_and_a_harmful_one_reads_the_budget():
    pairs, calls = _pairs(0, 0)  # the same answers: futile at the first look (CP 0.0038 < 0.01)
    assert prompts_read(pairs, budget=400, look=50, z=2.5, margin=2, futility=0.01) == 50 and calls == [50]
    pairs, calls = _pairs(0, 0)
    assert prompts_read(pairs, budget=400, look=50, z=2.5, margin=2, futility=0.0) == 400  # 0: always all of it
    assert calls == [50, 100, 150, 200, 250, 300, 350, 400]
    pairs, calls = _pairs(10, 0)  # 10 % lost, nothing gained: the bar stays in reach, read to the budget
    assert prompts_read(pairs, budget=400, look=50, z=2.5, margin=2, futility=0.01) == 400
    pairs, calls = _pairs(20, 10)  # gains outnumber losses: futile at the first look
    assert prompts_read(pairs, budget=400, look=50, z=2.5, margin=2, futility=0.01) == 50
    pairs, calls = _pairs(0, 0, size=30)  # a split smaller than a look: one look, the whole split
    assert prompts_read(pairs, budget=30, look=50, z=2.5, margin=2, futility=0.01) == 30 and calls == [30]
