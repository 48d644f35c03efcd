"""Exclusion with several plans in flight (issue 29, deliverable 4): under asynchronous rounds the trust guard's two
ways out of the pool (the coordinator's reward re-verification, the receivers' likelihood-screen reports) exclude a
source wherever its steps are, the others run on without it, and every batch of it still waiting for a learner is
refused ``source_excluded`` (counted, never dropped silently).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
from helpers_fake_workers import FakeTask, FakeWorker, fake_config

from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.coordinator.loop import Coordinator
from hacrl_fed.coordinator.virtual_clock import VirtualClock
from hacrl_fed.types import TrainReport, TrainRequest

SKILLS = {"a": 0.25, "b": 0.5, "c": 0.75}


def _trained_tags(worker: FakeWorker) -> list[tuple[str, int]]:
    """Every (source, round) a learner's train requests carried, its flat rows checked against its tags."""
    out = []
    for req in worker.train_requests:
        assert {(r.org_id, r.round) for r in req.foreign} == {(s, t) for s, t, _ in req.tags}
        out += [(s, t) for s, t, _ in req.tags]
    return out


@pytest.mark.parametrize("liar_step", [1.0, 4.0])  # the liar the fastest org, or 4x slower than the others
def test_a_reward_liar_is_excluded_at_its_first_batch_and_the_others_run_every_round(tmp_path, liar_step):
    steps = {"a": 1.0, "b": liar_step, "c": 2.0}
    cfg = fake_config(tuple(SKILLS), rounds=6, staleness=1)
    workers = {o: FakeWorker(o, s) for o, s in SKILLS.items()}
    workers["b"].lie_rewards = True  # reward 1 on every rollout: half of them contradicted by the verifier
    co = Coordinator(cfg, InProcessTransport(workers, clock=VirtualClock(steps)), tmp_path, task=FakeTask())
    summary = co.run()
    assert "b" in co.guard.excluded and "round 1" in co.guard.excluded["b"]
    assert [p.round for p in workers["b"].plans] == [1]  # no plan after the step that published its batch
    drv = co.async_driver
    assert not [tag for _, tag in drv.published if tag.source == "b"]  # never in the pool
    for org in ("a", "c"):
        assert all(s != "b" for s, _ in _trained_tags(workers[org]))
        assert [req.round for req in workers[org].train_requests] == list(range(1, 7))  # held back by nobody
        assert ("c" if org == "a" else "a", 6) in _trained_tags(workers[org]) or drv.refused[org]
    assert summary.rounds_completed == 6


@dataclass
class ScreeningWorker(FakeWorker):
    """A learner whose likelihood screen drops every row of ``distrusted`` it is offered (its report's counters)."""

    distrusted: str = "b"

    def train(self, request: TrainRequest) -> TrainReport:
        report = super().train(request)
        n = float(sum(1 for r in request.foreign if r.org_id == self.distrusted))
        if n:
            report.metrics[f"screen/{self.distrusted}/checked"] = n
            report.metrics[f"screen/{self.distrusted}/dropped_low_likelihood"] = n
        return report


def test_a_source_the_receivers_screens_reject_is_excluded_and_its_waiting_batches_are_refused(tmp_path):
    """b is the fastest org (K = 2, so it has batches waiting for the slow learners); the receivers' screens drop
    all of its rows: once the drop rate is counted b is excluded, stops stepping, and each batch of b a learner has
    not taken yet is refused ``source_excluded``, so (taken + refused) still covers every batch b published."""
    steps = {"a": 3.0, "b": 1.0, "c": 3.0}
    security = {"max_screen_drop_rate": 0.5, "screen_min_rows": 12}  # one batch of b checked can exclude it
    cfg = fake_config(tuple(SKILLS), security=security, rounds=8, staleness=2)
    workers = {o: ScreeningWorker(o, s) for o, s in SKILLS.items()}
    co = Coordinator(cfg, InProcessTransport(workers, clock=VirtualClock(steps)), tmp_path, task=FakeTask())
    co.run()
    drv = co.async_driver
    assert "b" in co.guard.excluded and "likelihood screens" in co.guard.excluded["b"]
    published_b = [tag for _, tag in drv.published if tag.source == "b"]
    assert 1 < len(published_b) < 8  # b published a few rounds, then stopped
    assert len(workers["b"].plans) == len(published_b)  # no plan after the exclusion
    for org in ("a", "c"):
        taken_b = [t for s, t in _trained_tags(workers[org]) if s == "b"]
        assert len(taken_b) + drv.refused[org]["source_excluded"] + drv.refused[org]["beyond_window"] == len(
            published_b
        )
        assert [req.round for req in workers[org].train_requests] == list(range(1, 9))
    assert drv.refused["a"]["source_excluded"] + drv.refused["c"]["source_excluded"] > 0


def test_the_pool_forgets_the_rows_no_learner_can_take_and_nothing_else_changes(tmp_path, monkeypatch):
    """30 rounds, K = 2 (window 3), b 4x slower: the coordinator keeps the rows of at most orgs x (W + K + 2)
    batches at any time (not one per org and round), and every learner gets exactly the requests, and every pair
    exactly the refusals, of the same run that keeps everything."""
    from hacrl_fed.coordinator.async_driver import AsyncDriver

    steps = {"a": 1.0, "b": 4.0, "c": 1.0}

    def run(path, forget):
        cfg = fake_config(tuple(SKILLS), rounds=30, staleness=2)
        workers = {o: FakeWorker(o, s) for o, s in SKILLS.items()}
        co = Coordinator(cfg, InProcessTransport(workers, clock=VirtualClock(steps)), path, task=FakeTask())
        co.run()
        return co.async_driver, workers

    held: list[int] = []
    real = AsyncDriver.forget_spent

    def counting(self):
        real(self)
        held.append(len(self.held))

    monkeypatch.setattr(AsyncDriver, "forget_spent", counting)
    drv, workers = run(tmp_path / "forget", True)
    monkeypatch.setattr(AsyncDriver, "forget_spent", lambda self: None)
    kept, kept_workers = run(tmp_path / "keep", False)
    assert max(held) <= 3 * (3 + 2 + 2) < len(kept.pool) == 90
    assert sum(1 for rows in drv.pool.values() if rows) == len(drv.held) and len(drv.pool) == 90
    for org in SKILLS:  # the run id differs between the two runs (it names the run's directory)
        mine, theirs = (
            [dataclasses.replace(r, run_id="") for r in w[org].train_requests] for w in (workers, kept_workers)
        )
        assert mine == theirs and len(mine) == 30
    assert drv.refused == kept.refused and drv.steps == kept.steps
