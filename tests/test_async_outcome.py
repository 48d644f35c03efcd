"""The outcome guard with asynchronous rounds (trainer.outcome_guard, federation.staleness >= 1): the learner's
quarantine covers a source's rows of every round of its window (late rows too), a rollback keeps the worker's own
update count (the version its batches sign), and the validation schedule ends at the org's own last round."""

from __future__ import annotations

from hacrl_fed.config import load_config
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.coordinator.loop import Coordinator
from hacrl_fed.coordinator.virtual_clock import VirtualClock
from hacrl_fed.metrics import RunLogger, read_metrics
from hacrl_fed.worker import build_worker
from hacrl_fed.worker.shadow import Shadow

ORGS = [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}, {"id": "globex", "model": {"zoo": "micro-qwen-char"}}]


def _cfg(**federation):
    return load_config({
        "name": "outcome-async", "seed": 0, "orgs": ORGS, "algorithm": {"name": "hacpo"},
        "trainer": {"lr": 1e-2, "minibatch_size": 64, "micro_batch_size": 32, "selection": {"rule": "all"},
                    "likelihood_screen": {"enabled": False},
                    "outcome_guard": {"enabled": True, "every": 1, "val_size": 8, "probation": 2,
                                      "final_size": 8}},  # the last round's choice on 8 (stubbed) prompts
        "generation": {"num_samples": 4, "max_new_tokens": 12, "eval_max_new_tokens": 12},
        "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
        "federation": {"rounds": 5, "prompts_per_round": 4, "eval_every": 0, "min_orgs": 1, "staleness": 1,
                       **federation},
    })


def test_a_regression_quarantines_the_source_s_late_rows_and_keeps_the_version(tmp_path, monkeypatch):
    """acme fast, globex 2x slower (K = 1: acme trains each globex batch one round late). acme's validation after
    round 2 regresses: it rolls back and quarantines globex for 2 rounds, so globex's late batches its next steps
    carry are left out (counted), later ones are trained on again; no batch is refused for its version. (Round 1
    trains no foreign row at acme, K = 1's first step: the regression comes after round 2.)"""
    cfg = _cfg()
    workers = {o: build_worker(cfg, o, run_dir=tmp_path) for o in ("acme", "globex")}
    acme = workers["acme"]
    answers = iter([[True] * 8, [True] * 8, [False] * 8] + [[True] * 8] * 8)  # initial, 1, 2 (regressed), fine
    monkeypatch.setattr(acme.outcome, "validate",  # the final split (the last round's choice): all right
                        lambda engine, context, prompts=None: next(answers) if prompts is None else [True] * 8)
    # the shadows (the counterfactual, on with the guard) generate and train for real; their validation says all
    # right: the regression is significant against the shadow too, so it rolls back and strikes, and
    # no org is worse than its shadow otherwise, so none adopts it and the rollback above is the only verdict
    monkeypatch.setattr(Shadow, "validate", lambda self, worker, validate: [True] * 8)
    with RunLogger(tmp_path, tensorboard=False) as logger:
        clock = VirtualClock({"globex": 2.0})
        co = Coordinator(cfg, InProcessTransport(workers, clock=clock), tmp_path, logger=logger)
        summary = co.run()
    records = {int(r["round"]): r for r in read_metrics(tmp_path)}
    assert summary.rounds_completed == 5
    r2 = records[2]
    assert r2["acme/train/num_cross"] > 0  # it trained on globex's (late) batch, then regressed
    assert r2["acme/outcome/rollback"] == 1.0 and r2["acme/outcome/globex/quarantined_until"] == 4.0
    assert [records[t]["acme/outcome/globex/quarantined"] for t in (3, 4, 5)] == [1.0, 1.0, 0.0]
    left_out = sum(records[t].get("acme/outcome/globex/dropped_quarantine", 0.0) for t in (3, 4))
    assert left_out > 0 and all(records[t].get("acme/train/num_cross", 0.0) == 0.0 for t in (3, 4))
    assert records[5].get("acme/train/num_cross", 0.0) > 0  # out of quarantine: globex's rows again
    late = [s for s in co.async_driver.steps if s.org == "acme" and s.foreign]
    assert late and all(age >= 1 for s in late for age in s.ages())  # every globex batch acme got was late
    assert not any("version_mismatch" in k for rec in records.values() for k in rec)
    assert records[5]["async/acme/version"] == 5.0  # a rollback keeps the worker's count of its updates
    assert "acme/outcome/validated" in records[5] and records[5]["acme/outcome/validated"] == 1.0  # its last round
