"""Run isolation: long-lived workers serve run after run, each from the right starting point.

Real micro agents in long-lived policy workers served over gRPC (in this process), driven by ``hacrl-fed run
--worker ORG=ADDRESS`` three times (one config, the same config again, another config) and once more resuming the
first run: every new run has its own id and starts from the configured initial weights (identical round-0
accuracy, weights equal to a fresh worker's before round 1; the repeated config repeats the first run exactly),
checkpoints are kept per run, and a resumed run continues from its own checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch
import yaml

from hacrl_fed import cli
from hacrl_fed.config import load_config
from hacrl_fed.run_files import STATE_FILE
from hacrl_fed.security.identity import IDENTITY_DIR, provision
from hacrl_fed.types import EvalRequest, RoundPlan, SamplingParams, TrainRequest
from hacrl_fed.wire.grpc_server import serve_worker
from hacrl_fed.worker import build_worker
from hacrl_fed.worker.guard import RequestRefused
from hacrl_fed.worker.guard import StaleRoundError

ORGS = {"acme": "qwen-char", "globex": "gpt2-bpe"}


def write_config(tmp_path: Path) -> Path:
    roster = provision(tmp_path / "ids", list(ORGS))  # long-lived workers and every coordinator: one roster
    data = {"name": "iso", "seed": 4, "orgs": [{"id": o, "model": {"zoo": z}} for o, z in ORGS.items()],
            "trainer": {"lr": 1e-4, "minibatch_size": 32, "micro_batch_size": 32},
            "generation": {"num_samples": 4, "max_new_tokens": 24, "eval_max_new_tokens": 24},
            "task": {"name": "arithmetic", "params": {"difficulty": 2}, "eval_size": 16},
            "federation": {"rounds": 2, "prompts_per_round": 2, "eval_every": 0, "checkpoint_every": 1},
            "security": {"roster_file": str(roster),
                         "identity_file": str(tmp_path / "ids" / IDENTITY_DIR / "{org}.key")}}
    path = tmp_path / "iso.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class Recording:
    """A long-lived worker that also keeps its weights as they were right after each round-0 evaluation.

    Both orgs' workers live in this one process and would sample concurrently from torch's one global RNG (real
    workers are separate processes): one lock makes them take turns, so a run is exactly reproducible.
    """

    turn = threading.Lock()

    def __init__(self, worker):
        self.worker, self.org_id, self.at_start = worker, worker.org_id, []

    def _call(self, name, request):
        with self.turn:
            return getattr(self.worker, name)(request)

    def generate(self, plan):
        return self._call("generate", plan)

    def train(self, request):
        return self._call("train", request)

    def step(self, request):
        return self._call("step", request)

    def evaluate(self, request):
        with self.turn:
            report = self.worker.evaluate(request)
            if request.round == 0:
                self.at_start.append(weights(self.worker.model))
        return report

    def __getattr__(self, name):
        return getattr(self.worker, name)


def records(run_dir: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["round"], {}).update(rec)
    return out


def learning(rec: dict) -> dict:
    """What depends on weights and data: no timings, sizes, throughput or memory."""
    return {k: v for k, v in rec.items()
            if k != "wall_time" and not {"time", "cpu", "bytes", "perf"} & set(k.split("/"))}


@pytest.mark.timeout(300)
def test_three_runs_through_the_same_long_lived_workers_each_start_from_the_initial_weights(tmp_path, capsys):
    config = write_config(tmp_path)
    cfg = load_config(config)
    workers = {org: Recording(build_worker(cfg, org, run_dir=tmp_path / "workers")) for org in ORGS}
    initial = {org: weights(w.worker.model) for org, w in workers.items()}
    servers = {org: serve_worker(w, "127.0.0.1:0") for org, w in workers.items()}
    flags = [a for org, s in servers.items() for a in ("--worker", f"{org}={s.address}")]

    def run(name: str, *extra: str) -> Path:
        run_dir = tmp_path / name
        rc = cli.main(["run", str(config), "--run-dir", str(run_dir), "--no-progress", *flags, *extra])
        assert rc == 0, capsys.readouterr().err[-3000:]
        return run_dir

    try:
        first = run("first")
        trained = {org: weights(w.worker.model) for org, w in workers.items()}
        again = run("again")  # the same config: refused as stale before runs had their own ids
        other = run("other", "--set", "federation.rounds=3", "federation.prompts_per_round=1")
        resumed = run("first", "--resume", "--set", "federation.rounds=3")  # back to run 1, from its checkpoint
    finally:
        for s in servers.values():
            s.stop(0)

    ids = {name: json.loads((d / STATE_FILE).read_text())["run_id"] for name, d in
           (("first", first), ("again", again), ("other", other))}
    assert len(set(ids.values())) == 3
    assert ids["first"].rsplit("-", 1)[0] == ids["again"].rsplit("-", 1)[0] != ids["other"].rsplit("-", 1)[0]

    fresh = {org: weights(build_worker(cfg, org, run_dir=tmp_path / "fresh").model) for org in ORGS}
    for org, w in workers.items():
        assert same(initial[org], fresh[org])
        assert not same(trained[org], fresh[org])  # run 1 moved the weights ...
        assert len(w.at_start) == 3 and all(same(x, fresh[org]) for x in w.at_start)  # ... each run started fresh

    rec = {name: records(d) for name, d in (("first", first), ("again", again), ("other", other))}
    for org in ORGS:
        start = {name: r[0][f"eval/{org}/accuracy"] for name, r in rec.items()}
        assert len(set(start.values())) == 1, start
        assert all(rec[name][t][f"round/{org}/failed"] == 0.0 for name in rec for t in sorted(rec[name]) if t)
    # the same config through the same workers repeats the first run exactly (same samples, losses, accuracies)
    for t in (0, 1, 2):
        a, b = learning(rec["again"][t]), learning(rec["first"][t])
        assert a == b, (t, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})

    resumed_rec = records(resumed)
    assert sorted(resumed_rec) == [0, 1, 2, 3] and json.loads((resumed / STATE_FILE).read_text())["round"] == 3
    assert resumed_rec[3]["round/acme/failed"] == 0.0 and resumed_rec[3]["round/acme/train_failed"] == 0.0
    for org, w in workers.items():
        assert w.worker.run_id == ids["first"] and w.worker.last_round == 3
        runs = sorted(p.name for p in (tmp_path / "workers" / "orgs" / org / "checkpoints").iterdir())
        assert runs == sorted(ids.values())
        latest = {rid: (tmp_path / "workers" / "orgs" / org / "checkpoints" / rid / "LATEST").read_text().strip()
                  for rid in runs}
        assert latest == {ids["first"]: "round-000003", ids["again"]: "round-000002",
                          ids["other"]: "round-000003"}


def _plan(worker, run_id: str, round_: int) -> RoundPlan:
    prompts = tuple(worker.task.prompts("train", [round_, round_ + 50]))
    return RoundPlan(run_id, round_, "arithmetic", prompts, SamplingParams(num_samples=2, max_new_tokens=8, seed=3))


def _train(worker, run_id: str, round_: int):
    plan = _plan(worker, run_id, round_)
    batch = worker.generate(plan)
    foreign = tuple(type(r)(**{**r.__dict__, "org_id": "b", "reward": float(i % 2)})
                    for i, r in enumerate(batch.rollouts))
    return worker.train(TrainRequest(run_id, round_, "a", plan.prompts, foreign, {"a": 0.5, "b": 0.5}))


def test_switching_runs_in_one_worker_follows_the_rules(tmp_path):
    cfg = load_config({"name": "sw", "seed": 1, "orgs": [{"id": "a", "model": {"zoo": "micro-qwen-char"}},
                                                           {"id": "b", "model": {"zoo": "micro-gpt2-bpe"}}],
                       "trainer": {"lr": 1e-2, "minibatch_size": 16, "micro_batch_size": 16},
                       "generation": {"num_samples": 2, "max_new_tokens": 8, "eval_max_new_tokens": 8},
                       "task": {"name": "arithmetic", "eval_size": 4},
                       "security": {"signing": False, "reverify_rewards": False}})
    w = build_worker(cfg, "a", run_dir=tmp_path)
    initial = weights(w.model)
    evals = EvalRequest("r1", 0, "arithmetic", tuple(w.task.prompts("test", range(4))), max_new_tokens=8)
    w.evaluate(evals)  # a worker that served no run joins at once
    _train(w, "r1", 1)
    _train(w, "r1", 2)
    w.checkpoint(2)
    after_r1 = weights(w.model)
    assert not same(after_r1, initial) and w.trainer.optimizer.state

    with pytest.raises(RequestRefused, match="wrong_run.*got a plan for round 2"):  # not its first request
        w.generate(_plan(w, "r2", 2))
    with pytest.raises(RequestRefused, match="wrong_run.*evaluation at round 5"):
        w.evaluate(EvalRequest("r2", 5, "arithmetic", evals.prompts, max_new_tokens=8))
    with pytest.raises(RequestRefused, match="over_limit"):  # a refused plan changes nothing, even for round 1
        w.generate(dataclasses.replace(_plan(w, "r2", 1), sampling=SamplingParams(num_samples=99)))
    assert w.run_id == "r1" and same(weights(w.model), after_r1)

    w.evaluate(EvalRequest("r2", 0, "arithmetic", evals.prompts, max_new_tokens=8))  # r2 starts fresh
    assert w.run_id == "r2" and w.last_round == 0 and same(weights(w.model), initial)
    assert not w.trainer.optimizer.state  # a fresh optimizer
    _train(w, "r2", 1)  # r2 trained, never checkpointed

    w.generate(_plan(w, "r1", 3))  # back to r1: from its own round-2 checkpoint
    assert w.run_id == "r1" and w.last_round == 2 and same(weights(w.model), after_r1)
    with pytest.raises(StaleRoundError):
        w.generate(_plan(w, "r1", 2))
    with pytest.raises(RequestRefused, match="wrong_run.*without a checkpoint"):  # r2's state is gone
        w.generate(_plan(w, "r2", 2))
    with pytest.raises(RequestRefused, match="wrong_run.*without a checkpoint"):  # nor can it restart r2
        w.generate(_plan(w, "r2", 1))
    with pytest.raises(RequestRefused, match="wrong_run"):  # train / checkpoint only for the run generated
        w.train(TrainRequest("r2", 3, "a", _plan(w, "r1", 3).prompts, (), {}))

    resumed = build_worker(cfg, "a", run_dir=tmp_path, resume=True)  # --resume: the run checkpointed last
    assert resumed.run_id == "r1" and resumed.last_round == 2 and same(weights(resumed.model), after_r1)
