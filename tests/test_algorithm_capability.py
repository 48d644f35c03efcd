"""CapabilityTracker: window, floor, clamp, warm-up, absent agents, state round trip."""

import pytest

from hacrl_fed.algorithm import CapabilityTracker


def test_unseen_agent_has_capability_one():
    t = CapabilityTracker()
    assert t.capability("x") == 1.0 and t.ratio("x", "y") == 1.0


def test_window_mean_of_last_k_including_current():
    t = CapabilityTracker(window=3)
    for acc in [0.1, 0.2, 0.3, 0.4]:
        t.update({"a": acc})
    assert t.capability("a") == pytest.approx((0.2 + 0.3 + 0.4) / 3)
    t2 = CapabilityTracker()  # default window 5
    t2.update({"a": 0.5})
    assert t2.capability("a") == 0.5


def test_floor_and_ratio_clamp():
    t = CapabilityTracker()
    t.update({"a": 0.0, "b": 0.9, "c": 0.5, "d": 0.8})
    assert t.capability("a") == 1e-8
    assert t.ratio("b", "a") == 10.0 and t.ratio("a", "b") == 0.1
    assert t.ratio("c", "d") == pytest.approx(0.625) and t.ratio("c", "c") == 1.0
    narrow = CapabilityTracker(ratio_min=0.5, ratio_max=2.0, floor=0.01)
    narrow.update({"a": 0.0, "b": 0.9})
    assert narrow.capability("a") == 0.01 and narrow.ratio("b", "a") == 2.0


def test_absent_agent_keeps_history():
    t = CapabilityTracker(window=2)
    t.update({"a": 0.2, "b": 0.4})
    t.update({"a": 0.6})
    t.update({"a": 1.0})
    assert t.capability("b") == 0.4 and t.history("b") == [0.4]
    assert t.capability("a") == pytest.approx(0.8)


def test_warmup_forces_unit_ratios_then_releases():
    t = CapabilityTracker(warmup_rounds=2)
    t.update({"a": 0.1, "b": 0.9})
    assert t.in_warmup and t.ratio("a", "b") == 1.0 and t.effective_capabilities(["a", "b"]) == [1.0, 1.0]
    t.update({"a": 0.1, "b": 0.9})
    assert t.ratio("b", "a") == 1.0
    t.update({"a": 0.1, "b": 0.9})
    assert not t.in_warmup and t.ratio("b", "a") == pytest.approx(9.0)
    assert t.effective_capabilities(["a", "b"]) == pytest.approx([0.1, 0.9])
    assert t.capability("a") == pytest.approx(0.1)  # capability itself is never masked


def test_state_round_trip():
    t = CapabilityTracker(window=3, floor=1e-4, ratio_min=0.2, ratio_max=5.0, warmup_rounds=1)
    for i in range(7):
        t.update({"a": i / 10, "b": 1 - i / 10} if i % 2 else {"a": i / 10})
    u = CapabilityTracker()
    u.load_state_dict(t.state_dict())
    assert u.state_dict() == t.state_dict()
    assert u.table() == t.table() and u.ratio("a", "b") == t.ratio("a", "b") and u.window == 3
    u.update({"a": 0.5})
    t.update({"a": 0.5})
    assert u.table() == t.table()


def test_bad_values():
    with pytest.raises(ValueError, match="window"):
        CapabilityTracker(window=0)
    with pytest.raises(ValueError, match="ratio_min"):
        CapabilityTracker(ratio_min=2.0, ratio_max=1.0)
    t = CapabilityTracker()
    with pytest.raises(ValueError, match="finite"):
        t.update({"a": float("nan")})
    assert t.rounds_seen == 0  # a rejected update changes nothing
    bad = t.state_dict()
    bad["history"] = {"a": [float("inf")]}
    with pytest.raises(ValueError):
        t.load_state_dict(bad)
