"""Resuming an asynchronous run (``federation.staleness >= 1``; hacrl_fed/coordinator/async_state.py,
hacrl_fed/worker/async_checkpoint.py, docs/ALGORITHM.md "Resuming").

Two micro orgs in process on the virtual clock, ``b`` twice as slow as ``a`` (so ``a`` trains on ``b``'s batches one
round late), ``K = 1``, checkpoints every round. The coordinator process is "killed" (KeyboardInterrupt out of the
transport, as in tests/test_faults.py) after a number of steps, between a step's start and the next quiescent
state; the workers went on past that state (newer checkpoints). The resume (workers' checkpoints aligned to the
state, then rebuilt from them, and a new coordinator) must finish with the uninterrupted run's metrics, every key
but timings and sizes, and log every round once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_faults import by_round, learning_metrics, micro_cfg

from hacrl_fed.coordinator.async_state import ASYNC_KEY, align_checkpoints
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.coordinator.loop import Coordinator
from hacrl_fed.coordinator.virtual_clock import VirtualClock
from hacrl_fed.metrics import RunLogger, read_metrics
from hacrl_fed.run_files import STATE_FILE

STEPS = {"a": 1.0, "b": 2.0}


class Killed(InProcessTransport):
    """In-process transport on the virtual clock that raises KeyboardInterrupt (a killed coordinator) when step call
    number ``kill_at`` (1-based) comes back; the worker did that step (and its checkpoint)."""

    def __init__(self, workers, kill_at=None):
        super().__init__(workers, clock=VirtualClock(STEPS))
        self.kill_at, self.calls = kill_at, 0

    def step(self, requests, timeout_s):
        out = super().step(requests, timeout_s)
        self.calls += 1
        if self.calls == self.kill_at:
            raise KeyboardInterrupt(f"coordinator killed after step call {self.calls}")
        return out


def run_async(cfg, run_dir: Path, *, resume=False, kill_at=None):
    from hacrl_fed.worker import build_worker

    if resume:
        align_checkpoints(run_dir)  # before the workers are built: back to the state's checkpoints
    workers = {o.id: build_worker(cfg, o.id, run_dir=run_dir, resume=resume) for o in cfg.orgs}
    with RunLogger(run_dir, tensorboard=False) as logger:
        co = Coordinator(cfg, Killed(workers, kill_at), run_dir, logger=logger, resume=resume)
        try:
            co.run()
        except KeyboardInterrupt:
            pass
    return co


def comparable(run_dir: Path) -> dict[int, dict]:
    """:func:`learning_metrics` less the wall seconds of each step call (``async/<org>/step_s``)."""
    return {
        t: {k: v for k, v in rec.items() if not k.endswith("/step_s")} for t, rec in learning_metrics(run_dir).items()
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async_ref")
    co = run_async(async_cfg(tmp), tmp / "run")
    return {"metrics": comparable(tmp / "run"), "steps": co.async_driver.steps, "records": read_metrics(tmp / "run")}


def async_cfg(tmp: Path):
    return micro_cfg(tmp, rounds=4, staleness=1, checkpoint_every=1)


@pytest.mark.slow
def test_the_reference_trains_on_late_batches(reference):
    """The uninterrupted run is a real asynchronous one: a trains on b's batches one round late."""
    late = [s for s in reference["steps"] if s.org == "a" and s.foreign and s.ages() != (0,) * len(s.foreign)]
    assert late, reference["steps"]
    assert sorted(reference["metrics"]) == [0, 1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kill_at", "saved_at"), [(3, 0.0), (7, 4.0), (9, 6.0)])
def test_an_async_run_killed_mid_way_resumes_to_the_uninterrupted_metrics(tmp_path, reference, kill_at, saved_at):
    """Killed at step call ``kill_at``: the last quiescent state is that of virtual second ``saved_at`` (0: before
    any step; 4 and 6: both orgs trained and checkpointed, a's step started after it wrote a newer checkpoint)."""
    cfg, run_dir = async_cfg(tmp_path), tmp_path / "run"
    first = run_async(cfg, run_dir, kill_at=kill_at)
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert state[ASYNC_KEY]["now"] == saved_at
    assert first.async_driver.steps != reference["steps"]  # it did stop mid-way
    co = run_async(cfg, run_dir, resume=True)
    assert co.async_driver.steps == reference["steps"]  # the same schedule, every step once
    rounds = [rec["round"] for rec in read_metrics(run_dir)]
    assert rounds == [0, 1, 2, 3, 4]  # every round logged once: none lost, none twice
    got = comparable(run_dir)
    diff = {
        (t, k): (got[t].get(k), reference["metrics"][t].get(k))
        for t in got
        for k in set(got[t]) | set(reference["metrics"][t])
        if got[t].get(k) != reference["metrics"][t].get(k)
    }
    assert not diff, "\n".join(f"{k}: {v}" for k, v in sorted(diff.items()))
    assert ASYNC_KEY not in json.loads((run_dir / STATE_FILE).read_text())  # finished: nothing left to resume
    assert by_round(run_dir)[4]["round"] == 4


# -- coordinator-blind mode: an accusation about a batch published before the resume is proven after it ----------

BLIND_ORGS = ("acme", "globex", "initech")
SLOW_GLOBEX = {"acme": 1.0, "globex": 4.0, "initech": 1.0}


def blind_cfg():
    from test_security_edges import _blind_cfg

    from hacrl_fed.config import load_config

    data = _blind_cfg(BLIND_ORGS).model_dump()
    data["federation"].update(rounds=4, staleness=1, checkpoint_every=1)
    return load_config(data)


def run_blind(run_dir: Path, *, resume=False, kill_at=None):
    """globex (4x slower) claims reward 1 on every sealed rollout from its round-2 batch on; K = 1."""
    from test_security_attacks import Hostile
    from test_security_edges import _sealed_lie

    from hacrl_fed.worker import build_worker

    cfg = blind_cfg()
    if resume:
        align_checkpoints(run_dir)
    workers = {}
    for org in BLIND_ORGS:
        worker = build_worker(cfg, org, run_dir=run_dir, resume=resume)
        lie = (lambda b: _sealed_lie(b, run_dir, BLIND_ORGS) if b.round >= 2 else b) if org == "globex" else None
        workers[org] = Hostile(worker, lie or (lambda b: b))
    transport = Killed(workers, kill_at)
    transport.clock = VirtualClock(SLOW_GLOBEX)
    with RunLogger(run_dir, tensorboard=False) as logger:
        co = Coordinator(cfg, transport, run_dir, logger=logger, resume=resume)
        try:
            co.run()
        except KeyboardInterrupt:
            pass
    return co


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_blind_async_resume_proves_the_accusation_about_a_batch_kept_across_it(tmp_path):
    """globex's lying round-2 batch is published at virtual second 8 (a quiescent state: every org trained and
    checkpointed); the coordinator is killed right after the steps that carry it to acme and initech went out, so
    their accusations arrive after the resume: the kept envelope and plan (in the state) prove them, and the run
    is the uninterrupted one, globex excluded in the same round for the same reason."""
    ref = run_blind(tmp_path / "ref")
    why = f"reward mismatch {16}/{16} in round 2, re-verified by the coordinator"
    assert ref.guard.excluded == {"globex": why}
    run_dir = tmp_path / "run"
    run_blind(run_dir, kill_at=9)
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert state[ASYNC_KEY]["now"] == 8.0 and "globex" not in state["trust"]["excluded"]
    assert [t for t, _ in state[ASYNC_KEY]["envelopes"] if t[:2] == ["globex", 2]]  # the lying batch, kept
    co = run_blind(run_dir, resume=True)
    assert co.guard.excluded == {"globex": why}
    assert co.async_driver.steps == ref.async_driver.steps
    assert [rec["round"] for rec in read_metrics(run_dir)] == [0, 1, 2, 3, 4]
    assert comparable(run_dir) == comparable(tmp_path / "ref")


def test_the_trust_guards_kept_batches_survive_its_state_in_blind_mode_only():
    """Lock-step rounds: the batches kept to judge accusations (each accepted batch verbatim and its plan) are in
    the guard's state in blind mode, so a resume keeps them; with the text readable they are not kept there."""
    from helpers_fake_workers import fake_config

    from hacrl_fed.coordinator.trust import PoolGuard
    from hacrl_fed.types import ChatMessage, Prompt, Rollout, RolloutBatch, RoundPlan, SamplingParams

    prompt = Prompt(3, (ChatMessage("user", "1+1?"),), "2")
    plan = RoundPlan("run", 2, "fake", (prompt,), SamplingParams(num_samples=1), {"a": b"\x01" * 16})
    rollout = Rollout("b", 2, 3, 0, "", "stop", 1.0, -3.5, 4, sealed_response=b"\x07" * 40)
    batch = RolloutBatch("run", 2, "b", (rollout,), 1.0, signature=b"s" * 64, plan_digest=b"d" * 32)
    for encrypt in (True, False):
        cfg = fake_config(("a", "b"), security={"encrypt": encrypt, "signing": encrypt})
        guard = PoolGuard(cfg, None, lambda text, ref: 0.0)
        guard.signed, guard.plans = {2: {"b": batch}}, {2: {"b": plan}}
        back = PoolGuard(cfg, None, lambda text, ref: 0.0)
        back.load_state_dict(json.loads(json.dumps(guard.state_dict())))
        if encrypt:
            assert (back.signed, back.plans) == ({2: {"b": batch}}, {2: {"b": plan}})
        else:
            assert (back.signed, back.plans) == ({}, {})


def test_a_fork_of_an_asynchronous_run_is_refused_with_one_line(tmp_path):
    import yaml
    from helpers_fake_workers import fake_config

    from hacrl_fed.config import ConfigError
    from hacrl_fed.fork import prepare_fork
    from hacrl_fed.run_files import CONFIG_FILE

    cfg = fake_config(("a", "b"), staleness=1)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / CONFIG_FILE).write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    with pytest.raises(ConfigError, match="federation.staleness=1: an asynchronous run resumes, it is not forked"):
        prepare_fork(cfg, tmp_path / "src", 2, tmp_path / "new", "fork-id")
    assert not (tmp_path / "new").exists()
