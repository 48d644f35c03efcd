"""The staleness histogram of the foreign rows a learner trains on (hacrl_fed/worker/row_ages.py): hand-computed
counts, which rows count, and its keys in an asynchronous run on tiny models (every algorithm that trains on foreign
rows, not only one loss)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from hacrl_fed.worker.row_ages import staleness_histogram, trained_row_ages


def test_a_hand_computed_histogram():
    # five rows: ages 0, 1, 1, 2, 1 from b, b, c, c, c -> age1: 3 rows (b 1, c 2); mean (0+1+1+2+1)/5 = 1.0
    out = staleness_histogram([0, 1, 1, 2, 1], ["b", "b", "c", "c", "c"])
    assert out == {
        "staleness/age0/rows/b": 1.0,
        "staleness/age1/rows/b": 1.0,
        "staleness/age1/rows/c": 2.0,
        "staleness/age2/rows/c": 1.0,
        "staleness/age0/rows": 1.0,
        "staleness/age1/rows": 3.0,
        "staleness/age2/rows": 1.0,
        "staleness/rows": 5.0,
        "staleness/age_mean": 1.0,
        "staleness/age_max": 2.0,
    }
    assert staleness_histogram([3, 0], ["x", "x"])["staleness/age_mean"] == 1.5
    assert staleness_histogram([], []) == {}  # no rows: no mean of nothing


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="same length"):
        staleness_histogram([0, 1], ["b"])
    with pytest.raises(ValueError, match=">= 0"):
        staleness_histogram([-1], ["b"])


def test_only_foreign_rows_with_tokens_count():
    """Own rows are not foreign; a row the context fit emptied is not trained on."""
    row = lambda is_self, age, source, tokens: SimpleNamespace(  # noqa: E731
        is_self=is_self, age=age, source=source, response_ids=[7] * tokens
    )
    rows = [row(True, 0, 0, 3), row(False, 1, 1, 3), row(False, 2, 2, 0), row(False, 1, 2, 2)]
    out = trained_row_ages(rows, ["me", "b", "c"])
    assert out["staleness/rows"] == 2.0 and out["staleness/age1/rows"] == 2.0
    assert out["staleness/age1/rows/b"] == out["staleness/age1/rows/c"] == 1.0 and "staleness/age2/rows" not in out


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["hacpo", "naive"])
def test_an_async_run_logs_the_histogram_of_what_each_learner_trained_on(tmp_path, algorithm):
    """globex 4x slower on the virtual clock, K = 1: acme trains each round on globex's batch of the round before
    (age 1), globex on acme's current one (age 0); the histogram counts exactly the foreign rows trained on."""
    from tests.test_async_driver import _tiny_cfg, _tiny_run

    cfg = _tiny_cfg(staleness=1)
    cfg.algorithm.baseline_rows = "in_band" if algorithm == "hacpo" else "joint"  # in_band is HACPO's only
    cfg.algorithm.name = algorithm
    _, _, summary, records = _tiny_run(tmp_path, cfg, {"acme": 1.0, "globex": 4.0})
    assert summary.rounds_completed == 4
    trained = [r for r in records[1:] if r.get("acme/train/num_cross", 0) > 0]
    assert trained, "acme trained on no foreign row"
    for rec in trained:
        n = rec["acme/train/num_cross"]
        assert rec["acme/staleness/age1/rows/globex"] == rec["acme/staleness/age1/rows"] == n
        assert rec["acme/staleness/rows"] == n and rec["acme/staleness/age_mean"] == rec["acme/staleness/age_max"] == 1
    assert any(rec.get("globex/staleness/age0/rows/acme", 0) > 0 for rec in records)
    ages = {k.split("/")[2] for rec in records for k in rec if re.fullmatch(r"[^/]+/staleness/age\d+/rows(/[^/]+)?", k)}
    assert ages == {"age0", "age1"}  # K = 1: no row older than one round


def test_every_staleness_key_is_documented():
    from tests.test_docs import documented_keys, key_pattern, undocumented

    keys = {f"acme/{k}" for k in staleness_histogram([0, 2], ["globex", "initech"])}
    assert undocumented(keys, [key_pattern(k) for k in documented_keys()]) == []
