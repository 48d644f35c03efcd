"""PromptSampler: deterministic from (seed, round) alone, distinct ids, huge sizes, fixed held-out set."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hacrl_fed.plan.sampler import PromptSampler, eval_ids
from hacrl_fed.seeding import stable_seed


def test_same_seed_and_round_give_same_ids_across_instances():
    a, b = PromptSampler(1000, seed=7), PromptSampler(1000, seed=7)
    assert a.round_ids(3, 16) == b.round_ids(3, 16)


def test_resume_equivalence_needs_no_state():
    """Asking for round 5 first (a resumed run) gives what an uninterrupted sampler gives at round 5."""
    full = PromptSampler(500, seed=1)
    sequence = [full.round_ids(t, 8) for t in range(1, 8)]
    resumed = PromptSampler(500, seed=1)
    assert [resumed.round_ids(t, 8) for t in range(5, 8)] == sequence[4:]


def test_rounds_and_seeds_differ():
    s = PromptSampler(10_000, seed=0)
    assert s.round_ids(1, 16) != s.round_ids(2, 16)
    assert s.round_ids(1, 16) != PromptSampler(10_000, seed=1).round_ids(1, 16)


def test_ids_distinct_and_in_range():
    s = PromptSampler(20, seed=3)
    for t in range(1, 50):
        ids = s.round_ids(t, 20)
        assert sorted(ids) == list(range(20))
    ids = s.round_ids(1, 7)
    assert len(set(ids)) == 7 and all(0 <= i < 20 for i in ids)


def test_huge_task_size_is_fast_and_valid():
    s = PromptSampler(10**12, seed=0)
    ids = s.round_ids(1, 128)
    assert len(set(ids)) == 128 and all(0 <= i < 10**12 for i in ids)


def test_stable_across_processes():
    """String hashing is salted per process; the sampler must not depend on it."""
    code = ("from hacrl_fed.plan.sampler import PromptSampler;"
            "print(PromptSampler(10**6, seed=42).round_ids(9, 5))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123"}).stdout.strip()
    assert out == str(PromptSampler(10**6, seed=42).round_ids(9, 5))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="task_size"):
        PromptSampler(0, seed=0)
    with pytest.raises(ValueError, match="cannot draw 11"):
        PromptSampler(10, seed=0).round_ids(1, 11)
    with pytest.raises(ValueError):
        PromptSampler(10, seed=0).round_ids(1, 0)


def test_eval_ids_first_n_clamped():
    assert eval_ids(100, 5) == [0, 1, 2, 3, 4]
    assert eval_ids(3, 5) == [0, 1, 2]
    with pytest.raises(ValueError):
        eval_ids(10, -1)


def test_stable_seed_is_63_bit_and_part_sensitive():
    assert 0 <= stable_seed(1, 2) < 2**63
    assert stable_seed(1, 2) != stable_seed(2, 1)
    assert stable_seed("a", 1) == stable_seed("a", 1)


def test_one_stable_seed_with_pinned_values():
    """Pinned: a change of the hash would change every sampled prompt and rollout of every run."""
    import hacrl_fed.seeding as seeding

    assert seeding.stable_seed("prompts", 0, 1) == 6433457419991822746
    assert seeding.stable_seed("sampling", 0, 3) == 2327693840640352191
    assert seeding.stable_seed(0, "org", "acme") == 6295138495604665783
    assert seeding.stable_seed(7, 11) == 7864071676595667506
    assert seeding.stable_seed(1) != seeding.stable_seed("1")  # repr keeps types apart
    assert PromptSampler(1_000_000, 0).round_ids(1, 4) == [770923, 556230, 824198, 74130]
    assert PromptSampler(1000, 3).round_ids(2, 3) == [988, 393, 344]


def test_no_other_stable_seed_definition():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "hacrl_fed"
    defs = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if "def stable_seed(" in p.read_text()]
    assert defs == ["seeding.py"]
